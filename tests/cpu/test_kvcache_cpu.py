"""flash_attn_with_kvcache on the CPU: argument validation, the in-place append, the mapping onto the
kernels' arguments (the common case - entry b on cache row b from position 0 - the batched kernel over
the cache itself with seqused_k = cache_seqlens + s_new; with cache_batch_idx or cache_leftpad the varlen
kernel with cu_seqlens_k = cache row start + leftpad, seqused_k = cache_seqlens + s_new - leftpad, the
packed cache passed without a copy), the op's fake implementation and torch.compile.

The kernels are torch stand-ins with the real call convention: the unsplit one is test_ops.torch_kernel
(attention_ref over keys [cu_seqlens_k[b], cu_seqlens_k[b] + seqused_k[b]) of the packed tensor, as
seqlen.SeqlenInfo reads them, or the first seqused_k[b] keys of batch entry b), the split one below reads
the same keys, the combine one is test_splitkv_cpu's. What they cannot show is the kernels' numerics:
tests/gpu/test_kvcache.py."""

from __future__ import annotations

import pytest
import torch

from flash_attn4 import compile_cache, device_info, dispatch, flash_attn_with_kvcache, ops, validate
from flash_attn4._ops import add_op_namespace_prefix
from flash_attn4.fa4_kernels.arch import Arch
from tests.reference import attention_ref, partial_attention_ref, random_pages, rotary_ref, unpage

BF16 = torch.bfloat16
H200_SMS = 132


def _clone(t):
    return None if t is None else t.clone()


def split_stand_in(cfg, calls):
    """The split-KV kernel's call convention with seqused_k: varlen, sequence b's keys are [cu_k[b],
    cu_k[b] + seqused_k[b]) of the packed tensor (cu_k[b + 1] is not read); batched, the first
    seqused_k[b] keys of entry b (all of them without seqused_k); split s takes KV blocks
    [s * per, (s + 1) * per)."""

    def run(q, k, v, out_p, lse_p, cu_q, cu_k, seqused_q, seqused_k, page_table, sink, scale, softcap, left, right,
            max_seqlen_q):
        assert seqused_q is None
        if page_table is not None:
            k, v, cu_k = unpage(k, v, page_table, seqused_k, batched=not cfg.varlen)
        calls.append((cfg, dict(k=k, v=v, cu_q=_clone(cu_q), cu_k=_clone(cu_k), seqused_k=_clone(seqused_k),
                                max_seqlen_q=max_seqlen_q, page_table=page_table, splits=out_p.shape[0])))
        assert cfg.split_kv and sink is None
        assert (cu_q is not None) == cfg.varlen and (seqused_k is not None) == cfg.has_seqused_k
        window = (left, right) if cfg.local else (-1, -1)
        for b in range(cu_q.shape[0] - 1 if cfg.varlen else q.shape[0]):
            if cfg.varlen:
                rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
                start, n = int(cu_k[b]), int(seqused_k[b])
                qs, ks, vs = q[rows], k[start:start + n], v[start:start + n]
            else:
                assert max_seqlen_q == q.shape[1]
                n = k.shape[1] if seqused_k is None else int(seqused_k[b])
                qs, ks, vs = q[b], k[b, :n], v[b, :n]
            per = -(-(-(-n // cfg.tile_n)) // out_p.shape[0]) * cfg.tile_n
            pos = torch.arange(n)
            for s in range(out_p.shape[0]):
                o, lse = partial_attention_ref(qs, ks, vs, (pos >= s * per) & (pos < (s + 1) * per),
                                               softmax_scale=scale, causal=cfg.causal, window_size=window)
                if cfg.varlen:
                    out_p[s, rows], lse_p[s, :, rows] = o, lse
                else:
                    out_p[s, b], lse_p[s, b] = o, lse

    return run


def unsplit_stand_in(cfg, calls):
    from tests.cpu.test_ops import torch_kernel

    inner = torch_kernel(cfg, [])

    def run(q, k, v, out, lse, cu_q, cu_k, seqused_q, seqused_k, page_table, *rest):
        packed = (k, v, cu_k) if page_table is None else unpage(k, v, page_table, seqused_k, batched=not cfg.varlen)
        calls.append((cfg, dict(k=packed[0], v=packed[1], cu_q=_clone(cu_q), cu_k=_clone(packed[2]),
                                seqused_k=_clone(seqused_k), max_seqlen_q=rest[-1], page_table=page_table)))
        inner(q, k, v, out, lse, cu_q, cu_k, seqused_q, seqused_k, page_table, *rest)

    return run


@pytest.fixture
def kernels(monkeypatch):
    """CPU tensors pass validation, dispatch says sm90 with 132 SMs, compiling yields the stand-ins.
    Returns the list of (config, arguments) of the forward launches."""
    from tests.cpu.test_splitkv_cpu import combine_stand_in, pipeline_stand_in

    calls = []
    monkeypatch.setattr(validate, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(dispatch, "arch_for_device", lambda device, kernel="forward": Arch.SM90)
    monkeypatch.setattr(device_info, "get_device_info",
                        lambda device: device_info.DeviceInfo(0, "stand-in H200", (9, 0), H200_SMS))
    monkeypatch.setattr(compile_cache, "_compile_forward",
                        lambda cfg, **_: (split_stand_in if cfg.split_kv else unsplit_stand_in)(cfg, calls))
    monkeypatch.setattr(compile_cache, "_compile_combine", lambda cfg, **_: combine_stand_in(cfg, []))
    monkeypatch.setattr(compile_cache, "_compile_split_kv", lambda cfg, **_: pipeline_stand_in(
        cfg, split_stand_in(cfg.forward, calls), combine_stand_in(cfg.combine, [])))
    monkeypatch.setenv("FLASH_ATTN4_DISABLE_DISK_CACHE", "1")
    monkeypatch.delenv("FLASH_ATTN4_CHECK_CU_SEQLENS", raising=False)
    compile_cache.clear()
    yield calls
    compile_cache.clear()


def problem(b=3, sq=1, s_cache=300, hq=8, hk=2, d=64, dv=None, s_new=1, b_cache=None, seed=None):
    """Fresh random q, caches (every position filled, also past the lengths) and new k/v."""
    if seed is not None:
        torch.manual_seed(seed)
    dv = d if dv is None else dv
    b_cache = b if b_cache is None else b_cache
    q = torch.randn(b, sq, hq, d, dtype=BF16)
    k_cache = torch.randn(b_cache, s_cache, hk, d, dtype=BF16)
    v_cache = torch.randn(b_cache, s_cache, hk, dv, dtype=BF16)
    k = torch.randn(b, s_new, hk, d, dtype=BF16) if s_new else None
    v = torch.randn(b, s_new, hk, dv, dtype=BF16) if s_new else None
    return q, k_cache, v_cache, k, v


def reference(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx=None, cache_leftpad=None, **opts):
    """(expected k_cache, v_cache after the append, out, lse): the append done by plain indexing, then
    attention of each batch entry over its gathered keys [leftpad, cache_seqlens + s_new) of its row."""
    b, s_cache = q.shape[0], k_cache.shape[1]
    s_new = 0 if k is None else k.shape[1]
    rows = list(range(b)) if cache_batch_idx is None else [int(x) for x in cache_batch_idx]
    if cache_seqlens is None:
        lens = [s_cache] * b
    elif isinstance(cache_seqlens, int):
        lens = [cache_seqlens] * b
    else:
        lens = [int(x) for x in cache_seqlens]
    pads = [0] * b if cache_leftpad is None else [int(x) for x in cache_leftpad]
    kc, vc = k_cache.clone(), v_cache.clone()
    for i in range(b):
        if s_new:
            kc[rows[i], lens[i]:lens[i] + s_new] = k[i]
            vc[rows[i], lens[i]:lens[i] + s_new] = v[i]
    outs, lses = [], []
    for i in range(b):
        keys = slice(pads[i], lens[i] + s_new)
        o, l = attention_ref(q[i:i + 1], kc[rows[i], keys][None], vc[rows[i], keys][None], **opts)
        outs.append(o)
        lses.append(l)
    return kc, vc, torch.cat(outs), torch.cat(lses)


def assert_close(out, lse, ref_out, ref_lse):
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    if finite.any():
        assert (lse[finite] - ref_lse[finite]).abs().max() < 1e-3
    assert (out.float() - ref_out.float()).abs().max() < 2e-2  # bf16 output


def as_i32(values):
    return torch.tensor(values, dtype=torch.int32)


# ---- validation ----

def _bad_cases():
    q, kc, vc, k, v = problem(b=2, s_cache=16, s_new=2)
    seq = as_i32([3, 5])
    cases = {
        "q 3-D": (dict(q=q[0]), ValueError, "q must be 4-D"),
        "q float32": (dict(q=q.float()), ValueError, "q has dtype"),
        "cache dtype": (dict(k_cache=kc.half()), ValueError, "k_cache has dtype"),
        "v_cache heads": (dict(v_cache=vc[:, :, :1]), ValueError, "v_cache must match k_cache"),
        "head_dim": (dict(k_cache=kc[..., :32]), ValueError, "head_dim of q"),
        "head ratio": (dict(q=torch.randn(2, 1, 3, 64, dtype=BF16)), ValueError, "multiple of the number"),
        "k without v": (dict(v=None), ValueError, "k and v"),
        "k heads": (dict(k=k[:, :, :1], v=v[:, :, :1]), ValueError, "k must have shape"),
        "k batch": (dict(k=k[:1], v=v[:1]), ValueError, "k must have shape"),
        "v head dim": (dict(v=v[..., :32]), ValueError, "v must have shape"),
        "k dtype": (dict(k=k.half()), ValueError, "k has dtype"),
        "k/v new lengths": (dict(v=v[:, :1]), ValueError, "same number of new tokens"),
        "k without cache_seqlens": (dict(cache_seqlens=None), ValueError, "cache_seqlens is required"),
        "int cache_seqlens overflows": (dict(cache_seqlens=15), ValueError, r"cache_seqlens \(15\) \+ new"),
        "negative int cache_seqlens": (dict(cache_seqlens=-1), ValueError, "cache_seqlens"),
        "float cache_seqlens": (dict(cache_seqlens=2.0), ValueError, "cache_seqlens must be an int"),
        "int64 cache_seqlens": (dict(cache_seqlens=seq.long()), ValueError, "cache_seqlens must have dtype"),
        "cache_seqlens shape": (dict(cache_seqlens=seq[:1]), ValueError, r"cache_seqlens must have shape"),
        "cache batch": (dict(k_cache=kc[:1], v_cache=vc[:1]), ValueError, "pass cache_batch_idx"),
        "cache_batch_idx dtype": (dict(cache_batch_idx=seq.long()), ValueError, "cache_batch_idx must have dtype"),
        "cache_leftpad shape": (dict(cache_leftpad=as_i32([0])), ValueError, "cache_leftpad must have shape"),
        "num_splits": (dict(num_splits=-1), ValueError, "num_splits"),
        "window": (dict(window_size=(-2, 0)), ValueError, "window_size"),
        "softcap": (dict(softcap=-1.0), ValueError, "softcap"),
        "sink shape": (dict(learnable_sink=torch.randn(3)), ValueError, "learnable_sink"),
        "rotary cos only": (dict(rotary_cos=torch.randn(16, 16)), ValueError, "given together"),
        "rotary without k": (dict(k=None, v=None, rotary_cos=torch.randn(16, 16), rotary_sin=torch.randn(16, 16)),
                             ValueError, "need the new tokens"),
        "rotary_dim > d": (dict(rotary_cos=torch.randn(16, 33), rotary_sin=torch.randn(16, 33)), ValueError,
                           "rotary_dim"),
        "rotary 1-D": (dict(rotary_cos=torch.randn(16), rotary_sin=torch.randn(16)), ValueError, "2-D floating"),
        "rotary shapes": (dict(rotary_cos=torch.randn(16, 8), rotary_sin=torch.randn(15, 8)), ValueError,
                          "rotary_sin must have the shape"),
        "requires grad": (dict(q=q.clone().requires_grad_()), NotImplementedError, "no backward"),
    }
    base = dict(q=q, k_cache=kc, v_cache=vc, k=k, v=v, cache_seqlens=seq)
    return base, cases


_BASE, _CASES = _bad_cases()


@pytest.mark.parametrize("name", list(_CASES))
def test_bad_arguments_raise_before_any_launch(kernels, name):
    change, exc, match = _CASES[name]
    kwargs = dict(_BASE, **change)
    kc_before = kwargs["k_cache"].clone()
    with pytest.raises(exc, match=match):
        flash_attn_with_kvcache(**kwargs)
    assert kernels == [] and torch.equal(kwargs["k_cache"], kc_before)


def test_device_types_are_checked():
    """Without the test hook CPU tensors are rejected, naming the device."""
    q, kc, vc, k, v = problem(b=1, s_cache=8)
    with pytest.raises(ValueError, match="GPU only"):
        flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=1)


@pytest.mark.parametrize("change,match", [
    (dict(cache_seqlens=as_i32([3, 15])), "cache_seqlens \\+ 2 new tokens must be <= s_cache = 16"),
    (dict(cache_seqlens=as_i32([-1, 3])), "cache_seqlens must be >= 0"),
    (dict(cache_batch_idx=as_i32([0, 2])), r"cache_batch_idx must be in \[0, 2\)"),
    (dict(cache_leftpad=as_i32([4, 0])), "cache_leftpad must be in"),
    (dict(rotary_cos=torch.randn(6, 8), rotary_sin=torch.randn(6, 8)), "rotary positions must be <="),
])
def test_metadata_values_checked_on_request(kernels, monkeypatch, change, match):
    """FLASH_ATTN4_CHECK_CU_SEQLENS=1 checks the tensors' values (one sync) before the append."""
    kwargs = dict(_BASE, **change)
    before = kwargs["k_cache"].clone()
    monkeypatch.setenv("FLASH_ATTN4_CHECK_CU_SEQLENS", "1")
    with pytest.raises(ValueError, match=match):
        flash_attn_with_kvcache(**kwargs)
    assert kernels == [] and torch.equal(kwargs["k_cache"], before)


def test_metadata_value_check_accepts_valid_permuted_rows(kernels, monkeypatch):
    """The varlen value check (cu_seqlens_k non-decreasing) must not apply: permuted rows are legal."""
    monkeypatch.setenv("FLASH_ATTN4_CHECK_CU_SEQLENS", "1")
    q, kc, vc, k, v = problem(b=3, s_cache=20, s_new=2, seed=1)
    idx, seq = as_i32([2, 0, 1]), as_i32([5, 18, 0])
    out, lse = flash_attn_with_kvcache(q, kc.clone(), vc.clone(), k, v, cache_seqlens=seq, cache_batch_idx=idx,
                                       return_softmax_lse=True)
    _, _, ro, rl = reference(q, kc, vc, k, v, seq, idx)
    assert_close(out, lse, ro, rl)


# ---- the append and the attention, against the reference ----

CASES = [
    # (b, sq, s_new, hq, hk, causal, num_splits, batch_idx, leftpad, seqlens kind)
    (3, 1, 1, 8, 2, False, 1, False, False, "tensor"),
    (3, 1, 1, 8, 2, True, 0, False, False, "tensor"),
    (3, 1, 0, 8, 8, False, 1, False, False, "tensor"),
    (3, 3, 3, 8, 1, True, 1, False, False, "tensor"),
    (3, 3, 1, 4, 4, True, 3, False, False, "tensor"),  # chunked: more queries than new keys
    (2, 17, 17, 8, 2, True, 1, False, False, "tensor"),
    (3, 1, 2, 8, 2, False, 3, True, False, "tensor"),
    (3, 3, 2, 8, 2, True, 1, True, True, "tensor"),
    (3, 1, 1, 8, 2, True, 0, False, True, "tensor"),
    (2, 2, 2, 4, 2, True, 1, False, False, "int"),
    (2, 2, 0, 4, 2, True, 1, False, False, "none"),
    (2, 2, 0, 4, 2, False, 3, True, True, "none"),
    (1, 1, 1, 8, 2, False, 0, False, False, "tensor"),  # one sequence: the append indexes the positions
    (1, 4, 3, 8, 2, True, 1, False, False, "tensor"),
    (1, 2, 2, 4, 2, True, 3, True, False, "int"),
]


@pytest.mark.parametrize("b,sq,s_new,hq,hk,causal,num_splits,batch_idx,leftpad,kind", CASES)
def test_append_and_attention_match_the_reference(kernels, b, sq, s_new, hq, hk, causal, num_splits, batch_idx,
                                                  leftpad, kind):
    s_cache = 300
    b_cache = b + 2 if batch_idx else b
    q, kc, vc, k, v = problem(b=b, sq=sq, s_cache=s_cache, hq=hq, hk=hk, s_new=s_new, b_cache=b_cache)
    lens = torch.randint(0, s_cache - s_new + 1, (b,), dtype=torch.int32)
    lens[0] = s_cache - s_new  # one row filled to the end
    cache_seqlens = {"tensor": lens, "int": int(lens[-1]), "none": None}[kind]
    idx = torch.randperm(b_cache)[:b].to(torch.int32) if batch_idx else None
    end = lens if kind == "tensor" else torch.full((b,), s_cache if kind == "none" else int(lens[-1]))
    pad = torch.minimum((torch.rand(b) * (end.float() + 1)).floor(), end.float()).to(torch.int32) if leftpad else None
    k_cache, v_cache = kc.clone(), vc.clone()
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, cache_batch_idx=idx,
                                       cache_leftpad=pad, causal=causal, num_splits=num_splits,
                                       return_softmax_lse=True)
    ref_kc, ref_vc, ro, rl = reference(q, kc, vc, k, v, cache_seqlens, idx, pad, causal=causal)
    assert torch.equal(k_cache, ref_kc) and torch.equal(v_cache, ref_vc)  # the append, exactly, in place
    assert_close(out, lse, ro, rl)
    assert lse.is_contiguous() and lse.dtype == torch.float32 and out.shape == (b, sq, hq, 64)
    cfg, args = kernels[0]
    # the common case runs batched over the cache (seqused_k unless the whole cache is used), the others varlen
    assert cfg.varlen == (batch_idx or leftpad) and cfg.causal == causal
    assert cfg.has_seqused_k == (cfg.varlen or kind != "none")
    if num_splits != 0:
        assert cfg.split_kv == (num_splits > 1)


def test_argument_mapping_onto_the_varlen_kernel(kernels):
    """cu_seqlens_q = arange(b + 1) * sq; cu_seqlens_k[i] = row[i] * s_cache + leftpad[i] (the kernel
    reads only that entry, plus the packed total at the end); seqused_k = cache_seqlens + s_new - leftpad;
    max_seqlen_q = sq; k/v are the caller's cache storage itself, reshaped, not copied."""
    q, kc, vc, k, v = problem(b=3, sq=2, s_cache=40, s_new=2, b_cache=5, seed=2)
    idx, seq, pad = as_i32([4, 0, 2]), as_i32([10, 0, 38]), as_i32([3, 0, 38])
    flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seq, cache_batch_idx=idx, cache_leftpad=pad,
                            causal=True, num_splits=1)
    (cfg, args), = kernels
    assert args["cu_q"].tolist() == [0, 2, 4, 6] and args["max_seqlen_q"] == 2
    assert args["cu_k"].tolist() == [4 * 40 + 3, 0 * 40 + 0, 2 * 40 + 38, 5 * 40]
    assert args["seqused_k"].tolist() == [10 + 2 - 3, 0 + 2 - 0, 38 + 2 - 38]
    assert args["k"].shape == (5 * 40, 2, 64) and args["k"].data_ptr() == kc.data_ptr()
    assert args["v"].data_ptr() == vc.data_ptr()


@pytest.mark.parametrize("num_splits", [1, 3])
def test_argument_mapping_of_the_common_case_onto_the_batched_kernel(kernels, num_splits):
    """No cache_batch_idx, no cache_leftpad (so b_cache == b): the batched kernel over the caller's cache
    itself, seqused_k = cache_seqlens + s_new, max_seqlen_q = sq; no varlen metadata."""
    q, kc, vc, k, v = problem(b=2, sq=2, s_cache=40, s_new=2, seed=11)
    seq = torch.randint(0, 39, (2,), dtype=torch.int32)
    k_cache, v_cache = kc.clone(), vc.clone()
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seq, causal=True, num_splits=num_splits,
                                       return_softmax_lse=True)
    (cfg, args), = kernels
    assert not cfg.varlen and cfg.has_seqused_k and cfg.split_kv == (num_splits > 1)
    assert args["cu_q"] is None and args["cu_k"] is None and args["max_seqlen_q"] == 2
    assert args["seqused_k"].tolist() == (seq + 2).tolist() and args["seqused_k"].dtype == torch.int32
    assert args["k"].shape == (2, 40, 2, 64) and args["k"].data_ptr() == k_cache.data_ptr()
    assert args["v"].data_ptr() == v_cache.data_ptr()
    ref_kc, ref_vc, ro, rl = reference(q, kc, vc, k, v, seq, causal=True)
    assert torch.equal(k_cache, ref_kc) and torch.equal(v_cache, ref_vc)
    assert_close(out, lse, ro, rl)


def test_fully_masked_rows_give_zero_and_minus_inf(kernels):
    """An empty cache row and no new tokens: the row sees no key (out 0, lse -inf); causal with more
    queries than keys: the first rows see none."""
    q, kc, vc, _, _ = problem(b=2, sq=3, s_cache=50, s_new=0, seed=3)
    seq = as_i32([0, 1])
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seq, causal=True, return_softmax_lse=True)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()
    assert (out[1, :2] == 0).all() and torch.isneginf(lse[1, :, :2]).all() and torch.isfinite(lse[1, :, 2]).all()
    _, _, ro, rl = reference(q, kc, vc, None, None, seq, causal=True)
    assert_close(out, lse, ro, rl)


def test_window_softcap_sink_pass_through(kernels):
    q, kc, vc, k, v = problem(b=2, sq=3, s_cache=200, s_new=3, seed=4)
    seq = as_i32([150, 40])
    sink = torch.randn(8)
    kwargs = dict(causal=True, window_size=(20, 0), softcap=3.0, softmax_scale=0.2)
    out, lse = flash_attn_with_kvcache(q, kc.clone(), vc.clone(), k, v, cache_seqlens=seq, learnable_sink=sink,
                                       return_softmax_lse=True, num_splits=1, **kwargs)
    _, _, ro, rl = reference(q, kc, vc, k, v, seq, learnable_sink=sink, **kwargs)
    assert_close(out, lse, ro, rl)


@pytest.mark.parametrize("b", [1, 2])
@pytest.mark.parametrize("batch_idx", [False, True])
def test_cache_that_is_a_slice_of_a_bigger_buffer(kernels, batch_idx, b):
    """A cache whose batch stride is not s_cache rows (a slice of a longer buffer): the append writes the
    caller's tensor (so the buffer); the batched kernel (the common case) reads the slice in place, the
    varlen one (cache_batch_idx) a packed copy (of more than one row); both right."""
    q, kc_full, vc_full, k, v = problem(b=b, sq=1, s_cache=64, s_new=1, seed=5)
    kc, vc = kc_full[:, :40], vc_full[:, :40]
    before = kc_full.clone()
    seq = as_i32([7, 39][:b])
    idx = as_i32([1, 0][2 - b:]) if batch_idx else None
    out, lse = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seq, cache_batch_idx=idx,
                                       return_softmax_lse=True)
    ref_kc, _, ro, rl = reference(q, before[:, :40], vc_full[:, :40].clone(), k, v, seq, idx)
    assert torch.equal(kc_full[:, :40], ref_kc) and torch.equal(kc_full[:, 40:], before[:, 40:])
    assert_close(out, lse, ro, rl)
    (cfg, args), = kernels
    assert cfg.varlen == batch_idx and (args["k"].data_ptr() == kc_full.data_ptr()) == (not batch_idx or b == 1)


def test_out_only_unless_lse_asked(kernels):
    q, kc, vc, k, v = problem(b=2, s_cache=30, s_new=1, seed=6)
    out = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=as_i32([3, 4]))
    assert isinstance(out, torch.Tensor) and out.shape == (2, 1, 8, 64)


def test_automatic_splits_are_sized_by_the_cache_not_the_fill(kernels):
    """num_splits=0 picks the count from s_cache, so a CUDA graph / compiled graph stays valid as the cache
    fills: the same split kernel for a nearly empty and a nearly full cache."""
    q, kc, vc, k, v = problem(b=1, sq=1, s_cache=4000, hq=8, hk=2, s_new=1, seed=7)
    for n in (0, 3998):
        out, lse = flash_attn_with_kvcache(q, kc.clone(), vc.clone(), k, v, cache_seqlens=as_i32([n]),
                                           return_softmax_lse=True)
        _, _, ro, rl = reference(q, kc, vc, k, v, as_i32([n]))
        assert_close(out, lse, ro, rl)
    configs = [c for c, _ in kernels]
    assert len(configs) == 2 and all(c.split_kv for c in configs) and configs[0] == configs[1]


# ---- the op: schema, fake implementation, torch.compile ----

def _op():
    ns, name = add_op_namespace_prefix("fwd_kvcache").split("::")
    return getattr(getattr(torch.ops, ns), name).default


def test_op_schema_declares_the_cache_mutation():
    schema = _op()._schema
    written = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert written == ["k_cache", "v_cache"]
    assert [r.type.kind() for r in schema.returns] == ["TensorType", "TensorType"]


def test_fake_shapes_match_real(kernels):
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, kc, vc, k, v = problem(b=2, sq=3, s_cache=40, s_new=2, hq=8, hk=2, d=64, dv=32, seed=8)
    seq = as_i32([5, 20])
    out, lse = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seq, causal=True, return_softmax_lse=True)
    with FakeTensorMode() as mode:
        fq, fkc, fvc, fk, fv, fseq = (mode.from_tensor(t) for t in (q, kc, vc, k, v, seq))
        out_f, lse_f = flash_attn_with_kvcache(fq, fkc, fvc, fk, fv, cache_seqlens=fseq, causal=True,
                                               return_softmax_lse=True)
        out_f2 = flash_attn_with_kvcache(fq, fkc, fvc, fk, fv, cache_seqlens=fseq)
    assert out_f.shape == out.shape == (2, 3, 8, 32) and out_f.stride() == out.stride() and out_f.dtype == BF16
    assert lse_f.shape == lse.shape == (2, 8, 3) and lse_f.stride() == lse.stride()
    assert lse_f.dtype == torch.float32 and out_f2.shape == out.shape


def test_opcheck(kernels):
    """torch.library.opcheck: schema (the declared mutations and no others), fake vs real, AOT dispatch."""
    q, kc, vc, k, v = problem(b=2, sq=2, s_cache=40, s_new=2, seed=9)
    seq, idx, pad = as_i32([5, 30]), as_i32([1, 0]), as_i32([2, 0])
    torch.library.opcheck(_op(), (q, kc, vc, k, v, None, None, seq, idx, pad, None, None, 0.125, 0.0, True, -1, 0, 1,
                                  True, True))
    torch.library.opcheck(_op(), (q, kc, vc, None, None, None, None, seq, None, None, None, torch.randn(8), 0.125,
                                  2.0, False, 4, 3, 3, False, True))
    cos, sin = torch.randn(40, 16), torch.randn(40, 16)
    torch.library.opcheck(_op(), (q, kc, vc, k, v, cos, sin, seq, None, None, None, None, 0.125, 0.0, True, -1, 0, 1,
                                  True, False))
    # a paged cache: 5 pages of 16 tokens, two sequences in shuffled pages
    pages_k, pages_v = torch.randn(5, 16, 2, 64, dtype=BF16), torch.randn(5, 16, 2, 64, dtype=BF16)
    table = as_i32([[3, 0, 4], [1, 2, 10 ** 6]])
    torch.library.opcheck(_op(), (q, pages_k, pages_v, k, v, None, None, as_i32([20, 9]), None, None, table, None,
                                  0.125, 0.0, True, -1, 0, 3, True, True))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_fullgraph_appends_and_matches_eager(kernels, backend):
    """torch.compile (CPU, fullgraph) traces the op as one node; the cache mutation happens (the
    functionalised graph writes it back) and results equal eager's; a new fill level reuses the graph."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    q, kc, vc, k, v = problem(b=2, sq=1, s_cache=64, s_new=1, seed=10)
    counter = CompileCounter() if backend == "eager" else backend

    def step(q, kc, vc, k, v, seq):
        return flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seq, causal=True, return_softmax_lse=True)

    compiled = torch.compile(step, backend=counter, fullgraph=True)
    for seq in (as_i32([3, 9]), as_i32([4, 60])):
        kc_e, vc_e, kc_c, vc_c = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        out_e, lse_e = step(q, kc_e, vc_e, k, v, seq)
        out_c, lse_c = compiled(q, kc_c, vc_c, k, v, seq)
        assert torch.equal(kc_c, kc_e) and torch.equal(vc_c, vc_e) and not torch.equal(kc_c, kc)
        assert torch.equal(out_c, out_e) and torch.equal(lse_c, lse_e)
    if backend == "eager":
        assert counter.frame_count == 1


# ---- rotary embedding (torch, before the append) ----

@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)), (False, (50, 10))])
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rotary_matches_rotating_q_and_k_first(kernels, interleaved, causal, window, rotary_dim):
    """FlashAttention's rule: new keys at positions cache_seqlens + t (stored rotated in the cache), q at
    cache_seqlens + i when causal or windowed, else every query at cache_seqlens; dims past rotary_dim
    untouched. Same result as rotating by hand and calling without rotary."""
    q, kc, vc, k, v = problem(b=3, sq=3, s_cache=200, s_new=3)
    seq, pad, idx = as_i32([10, 0, 150]), as_i32([2, 0, 7]), as_i32([1, 2, 0])
    angle = torch.rand(200, rotary_dim // 2) * 2 * torch.pi
    cos, sin = angle.cos(), angle.sin()
    k_cache, v_cache = kc.clone(), vc.clone()
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seq,
                                       cache_leftpad=pad, cache_batch_idx=idx, causal=causal, window_size=window,
                                       rotary_interleaved=interleaved, return_softmax_lse=True)
    steps = torch.arange(3)
    k_pos = seq.long()[:, None] + steps
    q_pos = k_pos if (causal or window != (-1, -1)) else seq.long()[:, None].expand(3, 3)
    q_rot, k_rot = rotary_ref(q, angle, q_pos, interleaved), rotary_ref(k, angle, k_pos, interleaved)
    assert torch.equal(q_rot[..., rotary_dim:], q[..., rotary_dim:])
    ref_kc, ref_vc, ro, rl = reference(q_rot, kc, vc, k_rot, v, seq, idx, pad, causal=causal, window_size=window)
    # the library rotates in float32 (rounded once to bf16), the reference in float64: one bf16 step apart at most
    assert (k_cache.float() - ref_kc.float()).abs().max() <= 2 ** -7 * k_rot.float().abs().max()
    assert torch.equal(v_cache, ref_vc)
    assert_close(out, lse, ro, rl)
    # not a no-op: without rotary the answer differs
    plain = flash_attn_with_kvcache(q, kc.clone(), vc.clone(), k, v, cache_seqlens=seq, cache_leftpad=pad,
                                    cache_batch_idx=idx, causal=causal, window_size=window)
    assert (plain.float() - out.float()).abs().max() > 0.05


# ---- cached constants and CUDA graphs ----


class _Manager:
    def __init__(self, state):
        self.in_warmup, self.in_recording = state == "warmup", state == "recording"


@pytest.mark.parametrize("state,keep", [(None, True), ("idle", True), ("warmup", False), ("recording", False),
                                        ("broken", False)])
def test_cached_constants_are_not_kept_while_graph_trees_own_the_allocations(monkeypatch, state, keep):
    """torch.compile's CUDA-graph trees allocate into a private pool while they warm up or record,
    and fail on a live tensor there that is not a graph output: a KV-cache step's constant (row
    starts, lengths) first made then must not be cached. Outside those states it is."""
    import sys
    import types

    from flash_attn4 import ops

    def get_manager(index, create_if_none_exists=True):
        assert index == 3 and create_if_none_exists is False  # never creates a manager
        if state == "broken":
            raise AttributeError("moved")
        return None if state is None else _Manager(state)

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setitem(sys.modules, "torch._inductor.cudagraph_trees", types.SimpleNamespace(get_manager=get_manager))
    assert ops._keepable_now(torch.device("cuda", 3)) is keep
    assert ops._keepable_now(torch.device("cpu")) is True
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert ops._keepable_now(torch.device("cuda", 3)) is False


def test_graph_trees_api_the_constant_cache_reads_exists():
    """_keepable_now reads torch's private graph-trees state; this torch still has it by those names."""
    import inspect

    from torch._inductor import cudagraph_trees as trees

    assert "create_if_none_exists" in inspect.signature(trees.get_manager).parameters
    assert all(isinstance(getattr(trees.CUDAGraphTreeManager, name), property) for name in ("in_warmup", "in_recording"))


# ---- the append kernel's route (fa4_kernels/kv_append.py; its numerics: tests/gpu/test_kvcache.py) ----


def append_stand_in(cfg, calls):
    """The append kernel's call convention: token t of entry b at position cache_seqlens[b] + t of row
    rows[b] (b without rows) or of the page page_table names; out-of-range positions, rows or pages
    dropped; seqused_k written."""

    def run(k, v, k_cache, v_cache, cache_seqlens, rows, page_table, seqused_k):
        calls.append(cfg)
        assert (rows is not None) == cfg.has_rows and (page_table is not None) == cfg.paged
        assert (cfg.head_dim, cfg.head_dim_v) == (k.shape[-1], v.shape[-1])
        for b in range(k.shape[0]):
            for t in range(k.shape[1]):
                pos = int(cache_seqlens[b]) + t
                if cfg.paged:
                    page_size = k_cache.shape[1]
                    if pos >= page_table.shape[1] * page_size:
                        continue
                    row, slot = int(page_table[b, pos // page_size]), pos % page_size
                else:
                    row, slot = (int(rows[b]) if cfg.has_rows else b), pos
                if 0 <= row < k_cache.shape[0] and slot < k_cache.shape[1]:
                    k_cache[row, slot], v_cache[row, slot] = k[b, t], v[b, t]
        seqused_k.copy_(cache_seqlens + k.shape[1])

    return run


@pytest.fixture
def append_kernel(kernels, monkeypatch):
    """The KV-cache calls append through the (stand-in) append kernel, as on a GPU; returns its calls."""
    calls = []
    monkeypatch.setattr(ops, "APPEND_KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(compile_cache, "_compile_append", lambda cfg, **_: append_stand_in(cfg, calls))
    compile_cache.clear()
    return calls


@pytest.mark.parametrize("case", [c for c in CASES if c[2]], ids=str)  # the cases that append
def test_append_kernel_route_matches_the_reference(kernels, append_kernel, case):
    """The same cases as above through the append kernel: one launch per call with the config the
    caches ask for, the caches and the attention as the reference's (seqused_k comes from the kernel)."""
    test_append_and_attention_match_the_reference(kernels, *case)
    assert len(append_kernel) == 1
    assert append_kernel[0].has_rows == case[7] and not append_kernel[0].paged  # case[7]: batch_idx


def test_append_kernel_only_for_layouts_it_takes(kernels, append_kernel):
    """Contiguous (or any 16-byte-strided, unit head-dim stride) 16-byte aligned caches go to the kernel;
    a head-dim stride other than 1 or a misaligned cache keep torch's index_put_ (and stay correct)."""
    q, kc, vc, k, v = problem(b=2, s_cache=64, s_new=1)
    lens = torch.tensor([3, 9], dtype=torch.int32)
    transposed = vc.transpose(1, 3).contiguous().transpose(1, 3)  # same values, head-dim stride != 1
    misaligned = torch.empty(kc.numel() + 1, dtype=kc.dtype)[1:].view(kc.shape).copy_(kc)
    for k_cache, v_cache, kernel in ((kc.clone(), vc.clone(), True), (kc.clone(), transposed, False),
                                     (misaligned, vc.clone(), False)):
        append_kernel.clear()
        ref_k, ref_v = k_cache.clone(), v_cache.clone()
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens)
        for i, n in enumerate(lens.tolist()):
            ref_k[i, n], ref_v[i, n] = k[i, 0], v[i, 0]
        assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
        assert len(append_kernel) == int(kernel)


def test_append_config_refuses_rows_on_pages():
    with pytest.raises(ValueError, match="paged cache has no cache rows"):
        dispatch.append_config(Arch.SM90, "bfloat16", 128, 128, paged=True, has_rows=True)
