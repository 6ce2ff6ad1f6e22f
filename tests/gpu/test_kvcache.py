"""flash_attn_with_kvcache on a real GPU: the in-place append (the caches afterwards equal a plain-indexing
append, bit for bit) and the attention against tests/reference.py's float32 attention over each batch
entry's gathered keys, under FlashAttention's accuracy rule (test_fwd.check: out within twice the
input-precision error plus the output's own rounding, lse within 2e-3, -inf exactly where the reference
has it, fully masked rows exactly 0).

Outputs (and split-KV partials) are poisoned (NaN / +inf) right after allocation. Inputs are fresh random
tensors (the seed is printed); every cache position holds a finite random value, also past the lengths.

The main grid covers every pair of query length {1, 3, 17} and key length {1, 127, 128, 129, 1000} (the
longest batch entry's cache_seqlens + s_new) three times, with the GQA ratio {1, 4, 8}, num_splits
{0, 1, 3}, causal, s_new {0, 1, sq}, d {64, 128} and the cache's slack past the longest entry cycling.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from flash_attn4 import compile_cache, flash_attn_with_kvcache, ops
from tests.gpu.helpers import DEVICE, rand
from tests.gpu.test_fwd import check

pytestmark = pytest.mark.gpu

RATIOS = {1: (4, 4), 4: (8, 2), 8: (16, 2), 3: (6, 2), 5: (10, 2), 7: (14, 2), 12: (24, 2)}  # ratio -> (hq, hk)


# The forward grid's fixtures: outputs poisoned before every launch, a fresh printed seed.
from tests.gpu.test_fwd import poison_outputs, seed  # noqa: E402,F401


def i32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def same_bits(a, b):
    """Bitwise equality (NaN positions included)."""
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def appended(k_cache, v_cache, k, v, seqlens, rows):
    """The caches after the append, by plain indexing (the expected result of the in-place write)."""
    kc, vc = k_cache.clone(), v_cache.clone()
    if k is not None:
        for i, (row, n) in enumerate(zip(rows, seqlens)):
            kc[row, n:n + k.shape[1]] = k[i]
            vc[row, n:n + k.shape[1]] = v[i]
    return kc, vc


def check_against_gathered(out, lse, q, kc, vc, seqlens, s_new, rows, pads, **opts):
    """test_fwd.check on the packed form: batch entry i's keys are positions [pads[i], seqlens[i] + s_new)
    of cache row rows[i], gathered into a varlen batch."""
    b, sq, hq, _ = q.shape
    keys = [(row, pad, n + s_new) for row, pad, n in zip(rows, pads, seqlens)]
    k_packed = torch.cat([kc[row, lo:hi] for row, lo, hi in keys])
    v_packed = torch.cat([vc[row, lo:hi] for row, lo, hi in keys])
    cu_k = i32([0] + list(itertools.accumulate(hi - lo for _, lo, hi in keys)))
    cu_q = i32([i * sq for i in range(b + 1)])
    out_p = out.reshape(b * sq, hq, out.shape[-1])
    lse_p = lse.transpose(0, 1).reshape(hq, b * sq)
    check(out_p, lse_p, q.reshape(b * sq, hq, q.shape[-1]), k_packed, v_packed, cu_seqlens_q=cu_q,
          cu_seqlens_k=cu_k, **opts)


def run_kvcache(seqlens, *, sq, s_new, ratio=4, d=128, s_cache=None, b_cache=None, batch_idx=None, leftpad=None,
                causal=False, num_splits=0, dtype=torch.bfloat16, int_seqlens=False, tail=None, **opts):
    """One call with random q, caches and new k/v; checks the caches after it and the output.
    seqlens: cache_seqlens per batch entry (before the append); leftpad: per entry or None."""
    b = len(seqlens)
    hq, hk = RATIOS[ratio]
    s_cache = max(seqlens) + s_new if s_cache is None else s_cache
    b_cache = b if b_cache is None else b_cache
    rows = list(range(b)) if batch_idx is None else list(batch_idx)
    pads = [0] * b if leftpad is None else list(leftpad)
    q = rand(b, sq, hq, d, dtype=dtype)
    k_cache, v_cache = rand(b_cache, s_cache, hk, d, dtype=dtype), rand(b_cache, s_cache, hk, d, dtype=dtype)
    if tail is not None:  # positions outside every entry's key range
        used = torch.zeros(b_cache, s_cache, dtype=torch.bool, device=DEVICE)
        for row, pad, n in zip(rows, pads, seqlens):
            used[row, pad:n + s_new] = True
        k_cache[~used], v_cache[~used] = tail, tail
    k = rand(b, s_new, hk, d, dtype=dtype) if s_new else None
    v = rand(b, s_new, hk, d, dtype=dtype) if s_new else None
    expected_k, expected_v = appended(k_cache, v_cache, k, v, seqlens, rows)
    cache_seqlens = seqlens[0] if int_seqlens else i32(seqlens)
    out, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
        cache_batch_idx=None if batch_idx is None else i32(batch_idx),
        cache_leftpad=None if leftpad is None else i32(leftpad), causal=causal, num_splits=num_splits,
        return_softmax_lse=True, **opts)
    assert same_bits(k_cache, expected_k) and same_bits(v_cache, expected_v), "the append"
    assert out.shape == (b, sq, hq, d) and lse.shape == (b, hq, sq) and lse.is_contiguous()
    check_against_gathered(out, lse, q, expected_k, expected_v, seqlens, s_new, rows, pads, causal=causal, **opts)
    return out, lse


def grid_cases():
    cases = []
    for i, (sq, n_keys) in enumerate(itertools.product([1, 3, 17], [1, 127, 128, 129, 1000])):
        for j in range(3):
            n = 3 * i + j
            s_new = min((0, 1, sq)[(n // 9) % 3], n_keys)
            cases.append(dict(sq=sq, n_keys=n_keys, s_new=s_new, ratio=(1, 4, 8)[n % 3],
                              num_splits=(0, 1, 3)[(n // 3) % 3], causal=bool((n // 2) % 2), d=(128, 64)[(n // 5) % 2],
                              slack=(0, 37)[(n // 7) % 2]))
    return cases


def case_id(c):
    return (f"sq{c['sq']}-keys{c['n_keys']}-new{c['s_new']}-r{c['ratio']}-splits{c['num_splits']}-"
            f"{'causal' if c['causal'] else 'full'}-d{c['d']}-slack{c['slack']}")


@pytest.mark.parametrize("case", grid_cases(), ids=case_id)
def test_kvcache_grid(seed, case):
    """Two batch entries: the first has exactly n_keys keys (cache_seqlens + s_new), the second a random
    number in [s_new, n_keys]."""
    n_keys, s_new = case["n_keys"], case["s_new"]
    other = int(torch.randint(s_new, n_keys + 1, ()))
    run_kvcache([n_keys - s_new, other - s_new], sq=case["sq"], s_new=s_new, ratio=case["ratio"], d=case["d"],
                s_cache=n_keys + case["slack"], causal=case["causal"], num_splits=case["num_splits"])


@pytest.mark.parametrize("sq,num_splits", [(1, 0), (4, 0), (1, 3)])
def test_kvcache_100k(seed, sq, num_splits):
    """A 100k-token cache (decode and 4 speculative tokens, causal): split-KV territory."""
    run_kvcache([100_000 - sq], sq=sq, s_new=sq, ratio=4, s_cache=100_003, causal=True, num_splits=num_splits)


@pytest.mark.parametrize("sq,num_splits", [(1, 0), (3, 1), (3, 3)])
def test_cache_batch_idx(seed, sq, num_splits):
    """q batch entry i reads and appends to cache row cache_batch_idx[i] (a permutation of some rows of a
    bigger cache); the other rows stay untouched (the append check covers the whole cache)."""
    rows = torch.randperm(6)[:4].tolist()
    run_kvcache([700, 0, 1000, 129], sq=sq, s_new=2, ratio=8, s_cache=1100, b_cache=6, batch_idx=rows, causal=True,
                num_splits=num_splits)


@pytest.mark.parametrize("num_splits,batch_idx,dtype", [(1, False, torch.bfloat16), (3, True, torch.float16),
                                                         (0, False, torch.float16)])
def test_cache_leftpad(seed, num_splits, batch_idx, dtype):
    """Keys start at cache_leftpad[i] (left-padded prompts): positions before it are not attended."""
    seqlens, pads = [500, 130, 77, 5], [0, 129, 30, 5]  # the last entry: only its new tokens
    rows = [3, 0, 2, 1] if batch_idx else None
    run_kvcache(seqlens, sq=3, s_new=3, ratio=4, s_cache=600, batch_idx=rows, leftpad=pads, causal=True,
                num_splits=num_splits, dtype=dtype)


@pytest.mark.parametrize("num_splits", [0, 1, 3])
def test_fully_masked_rows(seed, num_splits):
    """An empty cache and no new tokens: out 0, lse -inf (not +inf, not NaN); next to a non-empty entry, and
    causal rows with no key (more queries than keys)."""
    out, lse = run_kvcache([0, 0], sq=1, s_new=0, s_cache=300, num_splits=num_splits)
    assert (out == 0).all() and torch.isneginf(lse).all()
    out, lse = run_kvcache([0, 200], sq=3, s_new=0, s_cache=300, num_splits=num_splits, causal=True)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all() and torch.isfinite(lse[1]).all()
    out, lse = run_kvcache([1, 2], sq=4, s_new=1, s_cache=300, num_splits=num_splits, causal=True)
    assert torch.isneginf(lse[0, :, :2]).all() and torch.isfinite(lse[0, :, 2:]).all()


@pytest.mark.parametrize("num_splits", [1, 0])
def test_window_softcap_sink(seed, num_splits):
    hq, _ = RATIOS[4]
    sink = torch.randn(hq, device=DEVICE) * 2
    run_kvcache([900, 37], sq=3, s_new=1, s_cache=1000, causal=True, window_size=(100, 0), softcap=20.0,
                learnable_sink=sink, num_splits=num_splits)


def test_int_cache_seqlens_and_out_only(seed):
    run_kvcache([300, 300], sq=2, s_new=2, s_cache=400, causal=True, int_seqlens=True)
    q, kc, vc = rand(2, 1, 8, 128), rand(2, 64, 2, 128), rand(2, 64, 2, 128)
    out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=i32([10, 64]))
    assert isinstance(out, torch.Tensor) and out.shape == (2, 1, 8, 128)


@pytest.mark.parametrize("interleaved,causal", [(True, True), (False, True), (False, False)])
def test_rotary(seed, interleaved, causal):
    """rotary_cos/sin (rotary_dim 64 of 128): the cache holds the rotated new keys and the output equals
    attention of the rotated q (positions cache_seqlens + i when causal, else cache_seqlens) - both
    rotated here by an independent formulation (tests/reference.rotary_ref, float64)."""
    from tests.reference import rotary_ref

    b, sq, s_new, hq, hk, d, s_cache = 2, 3, 3, 8, 2, 128, 600
    seqlens = [500, 17]
    q, kc, vc = rand(b, sq, hq, d), rand(b, s_cache, hk, d), rand(b, s_cache, hk, d)
    k, v = rand(b, s_new, hk, d), rand(b, s_new, hk, d)
    angle = torch.rand(s_cache, 32, device=DEVICE) * 2 * torch.pi
    k_cache, v_cache = kc.clone(), vc.clone()
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=angle.cos(), rotary_sin=angle.sin(),
                                       cache_seqlens=i32(seqlens), causal=causal, rotary_interleaved=interleaved,
                                       return_softmax_lse=True)
    start = i32(seqlens).long()[:, None]
    k_pos = start + torch.arange(s_new, device=DEVICE)
    q_pos = start + torch.arange(sq, device=DEVICE) if causal else start.expand(b, sq)
    q_rot, k_rot = rotary_ref(q, angle, q_pos, interleaved), rotary_ref(k, angle, k_pos, interleaved)
    expected_k, expected_v = appended(kc, vc, k_rot, v, seqlens, [0, 1])
    assert (k_cache.float() - expected_k.float()).abs().max() <= 2 ** -7 * k_rot.float().abs().max()
    assert same_bits(v_cache, expected_v)
    # the attention is checked on the library's own rotated q and cached keys (float32 rotation, rounded
    # once), which the lines above and below hold within one bf16 step of the float64 rotation
    q_lib = ops._rotary(q, angle.cos(), angle.sin(), q_pos, interleaved)
    assert (q_lib.float() - q_rot.float()).abs().max() <= 2 ** -7 * q_rot.float().abs().max()
    check_against_gathered(out, lse, q_lib, k_cache, v_cache, seqlens, s_new, [0, 1], [0, 0], causal=causal)


def test_whole_cache_and_a_sliced_cache(seed):
    """cache_seqlens=None attends to the whole cache (no append); a cache that is a slice of a longer
    buffer (batch stride != s_cache rows) is read through a copy and appended to in place, in the buffer."""
    q, kc, vc = rand(2, 3, 8, 128), rand(2, 300, 2, 128), rand(2, 300, 2, 128)
    out, lse = flash_attn_with_kvcache(q, kc, vc, causal=True, return_softmax_lse=True)
    check_against_gathered(out, lse, q, kc, vc, [300, 300], 0, [0, 1], [0, 0], causal=True)
    full_k, full_v = rand(2, 512, 2, 128), rand(2, 512, 2, 128)
    before_k, before_v = full_k.clone(), full_v.clone()
    k, v = rand(2, 2, 2, 128), rand(2, 2, 2, 128)
    out, lse = flash_attn_with_kvcache(q, full_k[:, :300], full_v[:, :300], k, v, cache_seqlens=i32([298, 40]),
                                       causal=True, num_splits=3, return_softmax_lse=True)
    expected_k, expected_v = appended(before_k, before_v, k, v, [298, 40], [0, 1])
    assert same_bits(full_k, expected_k) and same_bits(full_v, expected_v)
    check_against_gathered(out, lse, q, expected_k, expected_v, [298, 40], 2, [0, 1], [0, 0], causal=True)


def test_nan_outside_the_key_range(seed):
    """Cache positions outside every entry's keys hold NaN (a freshly allocated or recycled cache): they
    must not leak into the output (0 * NaN). The keys next to a row's last key are read by the last
    tile and masked, and its V rows there are zeroed by the kernel before P @ V (issue 21,
    fa4_kernels/kv_tail.py); unsplit and split (only the last split reads the tail).
    tests/gpu/test_nan_tail.py covers flash_attn_varlen_func with seqused_k, pages and padded batches."""
    run_kvcache([100, 5, 250], sq=2, s_new=1, s_cache=300, leftpad=[0, 3, 0], causal=True, num_splits=1,
                tail=float("nan"))
    run_kvcache([100, 5, 250], sq=2, s_new=1, s_cache=300, causal=True, num_splits=3, tail=float("nan"))


# ---- CUDA graphs and torch.compile ----


@pytest.mark.parametrize("b", [1, 2])
@pytest.mark.parametrize("num_splits", [0, 1])
def test_cuda_graph_replay_with_changing_cache_seqlens(seed, num_splits, b):
    """Captured once, replayed with new cache_seqlens, q and new k/v copied into the captured tensors: each
    replay appends at the new positions and equals an eager call bit for bit; no kernel is compiled after
    the warm-up (the automatic split count depends on s_cache, not the fill). One sequence appends along
    the cache's positions, two through the rows view (ops._append_to_cache)."""
    s_cache, hq, hk, d = 4096, 8, 2, 128
    base_k, base_v = rand(b, s_cache, hk, d), rand(b, s_cache, hk, d)
    k_cache, v_cache = base_k.clone(), base_v.clone()
    q, k, v = rand(b, 1, hq, d), rand(b, 1, hk, d), rand(b, 1, hk, d)
    seqlens = i32([100, 7][:b])

    def step():
        return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, causal=True,
                                       num_splits=num_splits, return_softmax_lse=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    compiled_before = compile_cache.stats()["compiled"]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g, lse_g = step()
    for lens in ([0, 4095], [2048, 1], [4000, 129]):
        lens = lens[:b]
        k_cache.copy_(base_k)
        v_cache.copy_(base_v)
        seqlens.copy_(i32(lens))
        for dst in (q, k, v):
            dst.copy_(rand(*dst.shape))
        graph.replay()
        torch.cuda.synchronize()
        graph_k, graph_v = k_cache.clone(), v_cache.clone()
        eager_k, eager_v = base_k.clone(), base_v.clone()
        out_e, lse_e = flash_attn_with_kvcache(q, eager_k, eager_v, k, v, cache_seqlens=seqlens, causal=True,
                                               num_splits=num_splits, return_softmax_lse=True)
        assert torch.equal(graph_k, eager_k) and torch.equal(graph_v, eager_v)
        assert torch.equal(out_g, out_e) and torch.equal(lse_g, lse_e)
        check_against_gathered(out_g, lse_g, q, graph_k, graph_v, lens, 1, [0, 1][:b], [0, 0][:b], causal=True)
    assert compile_cache.stats()["compiled"] == compiled_before


def test_torch_compile_decode_no_recompile(seed):
    """torch.compile(fullgraph) of a decode step: one graph for every fill level, the cache written in place
    (inductor re-inplaces the declared mutation), results equal eager's."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")

    def step(q, kc, vc, k, v, seqlens):
        return flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, causal=True, return_softmax_lse=True)

    compiled = torch.compile(step, fullgraph=True, backend=counter)
    kc, vc = rand(2, 2048, 2, 128), rand(2, 2048, 2, 128)
    for lens in ([5, 100], [6, 101], [2000, 0]):
        q, k, v = rand(2, 1, 8, 128), rand(2, 1, 2, 128), rand(2, 1, 2, 128)
        kc_c, vc_c, kc_e, vc_e = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        out_c, lse_c = compiled(q, kc_c, vc_c, k, v, i32(lens))
        out_e, lse_e = step(q, kc_e, vc_e, k, v, i32(lens))
        assert torch.equal(kc_c, kc_e) and torch.equal(vc_c, vc_e) and not torch.equal(kc_c, kc)
        assert torch.equal(out_c, out_e) and torch.equal(lse_c, lse_e)
    assert counter.frame_count == 1


@pytest.mark.parametrize("ratio,sq,num_splits", [(7, 1, 0), (5, 4, 1), (3, 1, 3), (12, 2, 0), (7, 65, 1)])
def test_unpackable_ratios(seed, ratio, sq, num_splits):
    """Head ratios that do not divide 64 (Qwen2.5's 7 and 5): packed with dummy heads for short
    queries (ForwardConfig.pack_gqa_heads), unpacked past dispatch.PAD_PACK_MAX_QUERIES."""
    run_kvcache([1000, 37], sq=sq, s_new=1, ratio=ratio, causal=True, num_splits=num_splits)


# ---- the append kernel (fa4_kernels/kv_append.py) against torch's index_put_ ----


@pytest.mark.parametrize("layout", ["rows", "batch_idx", "paged", "strided"])
@pytest.mark.parametrize("s_new", [1, 5])
def test_append_kernel_equals_index_put(seed, monkeypatch, layout, s_new):
    """ops._append_kv through the kernel writes the same caches, bit for bit, as its torch fallback
    (index_put_, APPEND_KERNEL_DEVICES emptied), and returns cache_seqlens + s_new. "strided": a cache
    whose head-dim stride is not 1 (a transposed view) takes the fallback in both runs. The paged table
    is shuffled; cache_batch_idx permutes the rows; the lengths put some tokens across a page boundary."""
    b, hk, d, dv, page = 3, 2, 128, 64, 16
    seqlens = i32([0, 15, 37])
    k, v = rand(b, s_new, hk, d), rand(b, s_new, hk, dv)
    rows, table = None, None
    if layout == "paged":
        from tests.reference import random_pages
        table, num_pages = random_pages((seqlens + s_new).tolist(), page)
        table = table.to(DEVICE)
        caches = rand(num_pages, page, hk, d), rand(num_pages, page, hk, dv)
    elif layout == "strided":
        caches = tuple(rand(b, dim, 64, hk).permute(0, 2, 3, 1) for dim in (d, dv))  # (b, 64, hk, dim), dim-stride 64
    else:
        caches = rand(b, 64, hk, d), rand(b, 64, hk, dv)
        rows = i32([2, 0, 1]) if layout == "batch_idx" else None

    def run():
        kc, vc = (c.clone() for c in caches)
        used = ops._append_kv(kc, vc, k, v, seqlens, rows, table)
        torch.cuda.synchronize()
        return kc, vc, used

    kernel_k, kernel_v, kernel_used = run()
    monkeypatch.setattr(ops, "APPEND_KERNEL_DEVICES", ())
    torch_k, torch_v, torch_used = run()
    assert same_bits(kernel_k, torch_k) and same_bits(kernel_v, torch_v)
    assert torch.equal(kernel_used, seqlens + s_new) and torch.equal(torch_used, seqlens + s_new)
    assert not same_bits(kernel_k, caches[0])  # something was written


def test_append_kernel_skips_positions_past_the_capacity(seed):
    """Without the opt-in value check (or under graph capture) a length past a sequence's capacity, a
    row out of range or a page past the table must not write anywhere: the kernel drops those tokens
    and writes the in-range ones."""
    b, s_cache, hk, d = 3, 32, 2, 64
    k, v = rand(b, 2, hk, d), rand(b, 2, hk, d)
    kc, vc = rand(b, s_cache, hk, d), rand(b, s_cache, hk, d)
    before_k, before_v = kc.clone(), vc.clone()
    seqlens = i32([31, 40, 3])  # entry 0: token 1 past the end; entry 1: both past; entry 2: inside
    rows = i32([0, 1, 7])  # entry 2's row does not exist: nothing of it is written
    ops._append_kv(kc, vc, k, v, seqlens, rows, None)
    torch.cuda.synchronize()
    expect_k, expect_v = before_k.clone(), before_v.clone()
    expect_k[0, 31], expect_v[0, 31] = k[0, 0], v[0, 0]
    assert same_bits(kc, expect_k) and same_bits(vc, expect_v)
