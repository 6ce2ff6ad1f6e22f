"""Split-KV forward and the combine kernel on a real GPU, against tests/reference.py under
FlashAttention's accuracy rule (the check of test_fwd.py: out within twice the input-precision error
plus the output's own rounding, lse within 2e-3, -inf exactly where the reference has it, masked rows
exactly 0).

Outputs and the split kernel's float32 partials are poisoned (NaN / +inf) right after allocation, so
an element the split kernel or the combine forgets to write fails. Inputs are fresh random tensors;
the seed is printed.

The main grid covers every pair of num_splits {1, 2, 3, 7, 64, more than the KV blocks} and seqlen_k
{1, 127, 128, 129, 1000} three times, the other dimensions (causal, GQA ratio 1/4/8, d 64/128,
batched/varlen, 1/3/70 queries) cycling through the cases so that each combination of them occurs.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from flash_attn4 import (compile_cache, device_info, dispatch, flash_attn_combine, flash_attn_func,
                         flash_attn_varlen_func, flash_attn_with_kvcache, ops)
from flash_attn4.fa4_kernels.arch import Arch
from tests.gpu.helpers import DEVICE, rand, random_lengths, seed_from_urandom
from tests.gpu.test_fwd import check
from tests.reference import combine_ref, max_abs_diff, split_kv_workspace_views

pytestmark = pytest.mark.gpu

TILE_N = 128  # the sm90 KV block at d = 64 and 128 (sm90/tiles.py)
RATIOS = {1: (4, 4), 4: (8, 2), 8: (16, 2)}  # GQA ratio -> (hq, hk)
MORE = "more"  # more splits than the longest sequence has KV blocks


# The forward grid's fixtures: outputs poisoned before every launch, a fresh printed seed.
from tests.gpu.test_fwd import poison_outputs, seed  # noqa: E402,F401


def grid_cases():
    cases = []
    pairs = list(itertools.product([1, 2, 3, 7, 64, MORE], [1, 127, 128, 129, 1000]))
    for i, (splits, sk) in enumerate(pairs):
        for j in range(3):
            n = 3 * i + j
            cases.append(dict(num_splits=splits, sk=sk, causal=bool(n % 2), ratio=(1, 4, 8)[(n // 2) % 3],
                              d=(64, 128)[(n // 6) % 2], varlen=bool((n // 12) % 2), sq=(1, 3, 70)[(n // 5) % 3]))
    return cases


def case_id(c):
    return (f"splits{c['num_splits']}-sk{c['sk']}-sq{c['sq']}-{'causal' if c['causal'] else 'full'}-"
            f"r{c['ratio']}-d{c['d']}-{'varlen' if c['varlen'] else 'batched'}")


def run_case(num_splits, sk, sq, causal, ratio, d, varlen, window_size=(-1, -1), seqused=False):
    hq, hk = RATIOS[ratio]
    if num_splits == MORE:
        num_splits = -(-sk // TILE_N) + 3
    if not varlen:
        q, k, v = rand(2, sq, hq, d), rand(2, sk, hk, d), rand(2, sk, hk, d)
        out, lse = flash_attn_func(q, k, v, causal=causal, window_size=window_size, num_splits=num_splits,
                                   return_lse=True)
        check(out, lse, q, k, v, causal=causal, window_size=window_size)
        return
    # Three sequences: the longest has sk keys, the others random lengths up to it.
    lens_k = [sk] + torch.randint(1, sk + 1, (2,)).tolist()
    lens_q = [sq] + torch.randint(1, sq + 1, (2,)).tolist()
    cu_q, cu_k = (torch.tensor([0] + list(itertools.accumulate(x)), dtype=torch.int32, device=DEVICE)
                  for x in (lens_q, lens_k))
    q, k, v = rand(sum(lens_q), hq, d), rand(sum(lens_k), hk, d), rand(sum(lens_k), hk, d)
    seqused_k = None
    if seqused:
        seqused_k = torch.tensor([max(n - 5, 0) for n in lens_k], dtype=torch.int32, device=DEVICE)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), seqused_k=seqused_k,
                                      causal=causal, window_size=window_size, num_splits=num_splits,
                                      return_lse=True)
    check(out, lse, q, k, v, causal=causal, window_size=window_size, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
          seqused_k=seqused_k)


@pytest.mark.parametrize("case", grid_cases(), ids=case_id)
def test_split_forward(seed, case):
    run_case(**case)


@pytest.mark.parametrize("num_splits", [0, 9])
def test_split_forward_100k_keys(seed, num_splits):
    run_case(num_splits=num_splits, sk=100_000, sq=1, causal=False, ratio=4, d=128, varlen=False)


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("num_splits", [2, 5])
def test_split_forward_local_window_and_seqused_k(seed, varlen, num_splits):
    run_case(num_splits=num_splits, sk=1000, sq=70, causal=False, ratio=4, d=64, varlen=varlen,
             window_size=(300, 20), seqused=varlen)


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("num_splits", [3, 0])
def test_split_forward_with_sink(seed, varlen, num_splits):
    """The splits leave the learnable sink out and the combine kernel adds it once; rows without keys
    (causal, sq > sk) give out 0 and lse = the sink logit."""
    hq, hk = RATIOS[4]
    sink = torch.randn(hq, device=DEVICE, dtype=torch.float32) * 3
    if not varlen:
        q, k, v = rand(1, 300, hq, 64), rand(1, 2000, hk, 64), rand(1, 2000, hk, 64)
        out, lse = flash_attn_func(q, k, v, learnable_sink=sink, num_splits=num_splits, return_lse=True)
        check(out, lse, q, k, v, learnable_sink=sink)
        return
    lens_q, lens_k = [1, 200, 7], [3000, 100, 1500]
    cu_q, cu_k = (torch.tensor([0] + list(itertools.accumulate(x)), dtype=torch.int32, device=DEVICE)
                  for x in (lens_q, lens_k))
    q, k, v = rand(sum(lens_q), hq, 128), rand(sum(lens_k), hk, 128), rand(sum(lens_k), hk, 128)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                      learnable_sink=sink, num_splits=num_splits, return_lse=True)
    check(out, lse, q, k, v, causal=True, learnable_sink=sink, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    masked = out[1:101]  # sequence 2's first 100 queries see no key
    assert (masked == 0).all() and torch.allclose(lse[:, 1:101], sink[:, None].expand(hq, 100))


@pytest.mark.parametrize("varlen", [False, True])
def test_pipeline_is_the_split_kernel_then_the_combine(seed, varlen):
    """The split-KV pipeline (one host call, fa4_kernels/split_kv.py) runs exactly the split kernel
    and the combine that separate launches run: its workspace holds the same float32 partials, bit
    for bit, where split_kv_workspace_views says, and out and lse are those of the combine over
    them. Padded GQA groups (7 query heads per KV head), seqused_k and a sink; 5 splits, some of
    them empty for the short sequences; workspaces and outputs poisoned first."""
    hq, hk, d, splits = 14, 2, 128, 5
    sink = torch.randn(hq, device=DEVICE, dtype=torch.float32) * 3
    lens_q, lens_k = [1, 3, 1], [2000, 130, 1]
    if varlen:
        cu_q, cu_k = (torch.tensor([0] + list(itertools.accumulate(x)), dtype=torch.int32, device=DEVICE)
                      for x in (lens_q, lens_k))
        q, k, v = rand(sum(lens_q), hq, d), rand(sum(lens_k), hk, d), rand(sum(lens_k), hk, d)
        max_seqlen_q = max(lens_q)
    else:
        cu_q = cu_k = None
        q, k, v = rand(3, 3, hq, d), rand(3, 2000, hk, d), rand(3, 2000, hk, d)
        max_seqlen_q = 3
    seqused_k = torch.tensor(lens_k, dtype=torch.int32, device=DEVICE)
    flags = dict(causal=True, local=False, has_softcap=False, varlen=varlen, has_seqused_k=True,
                 qhead_per_kvhead=hq // hk, pack_group=dispatch.padded_pack(dispatch.arch_for_device(q.device), d, d,
                                                                            varlen, hq // hk, max_seqlen_q))
    cfg = dispatch.split_kv_config(dispatch.arch_for_device(q.device), "bfloat16", d, d, has_sink=True, **flags)
    out_shape, lse_shape = ops._output_shapes(q, v, varlen)
    scalars = (d ** -0.5, 0.0, -1, 0, max_seqlen_q)

    def poisoned(shape, dtype=torch.float32, value=float("nan")):
        return torch.full(shape, value, dtype=dtype, device=DEVICE)

    workspace = poisoned(cfg.workspace_shape(splits, torch.Size(out_shape[:-1]).numel()))
    out, lse = poisoned(out_shape, torch.bfloat16), poisoned(lse_shape, value=float("inf"))
    ops._launch_forward(compile_cache.get_split_kv_kernel(cfg), q, k, v, out, lse, cu_q, cu_k, seqused_k, sink,
                        *scalars, workspace=workspace)
    out_p, lse_p = poisoned((splits, *out_shape)), poisoned((splits, *lse_shape), value=float("inf"))
    ops._launch_forward(compile_cache.get_forward_kernel(cfg.forward), q, k, v, out_p, lse_p, cu_q, cu_k, seqused_k,
                        None, *scalars)
    out_2, lse_2 = poisoned(out_shape, torch.bfloat16), poisoned(lse_shape, value=float("inf"))
    unit = (lambda t, dim: t.unsqueeze(dim)) if varlen else (lambda t, dim: t)
    compile_cache.get_combine_kernel(cfg.combine)(unit(out_p, 1), unit(lse_p, 1), unit(out_2, 0), unit(lse_2, 0),
                                                  sink)
    in_workspace = split_kv_workspace_views(workspace, out_shape, lse_shape)
    for mine, theirs in zip(in_workspace + (out, lse), (out_p, lse_p, out_2, lse_2)):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0, equal_nan=True)
    assert not torch.isnan(out).any() and not torch.isinf(lse).any()
    check(out, lse, q, k, v, causal=True, learnable_sink=sink, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
          seqused_k=seqused_k)


@pytest.mark.parametrize("path", ["func", "varlen", "kvcache"])
def test_a_dropped_lse_in_the_workspace(seed, monkeypatch, path):
    """A split-KV call whose caller drops the LSE has the combine write it into the workspace's
    spare room (ops._Plan.lse_view): the real kernels leave that room to it, so the LSE written
    there equals the one a return_lse call gets, bit for bit, as does out (poisoned workspaces,
    7 query heads per KV head, 100 to 5000 keys)."""
    launched = []
    real_launch = ops._launch

    def record(kernel, q, k, v, out, lse, *rest):
        real_launch(kernel, q, k, v, out, lse, *rest)
        launched.append((lse, rest[-1]))  # the workspace is the last argument

    monkeypatch.setattr(ops, "_launch", record)
    hq, hk, d = 14, 2, 128
    lens = [5000, 100]
    q, k, v = rand(2, 2, hq, d), rand(2, 5000, hk, d), rand(2, 5000, hk, d)
    if path == "func":
        def call(keep):
            return flash_attn_func(q, k, v, causal=True, num_splits=4, return_lse=keep)
    elif path == "varlen":
        cu_q = torch.tensor([0, 2, 4], dtype=torch.int32, device=DEVICE)
        cu_k = torch.tensor([0, 5000, 5100], dtype=torch.int32, device=DEVICE)

        def call(keep):
            return flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, 2, 5000,
                                          causal=True, num_splits=5, return_lse=keep)
    else:
        cache_seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)

        def call(keep):
            return flash_attn_with_kvcache(q, k, v, cache_seqlens=cache_seqlens, causal=True, num_splits=4,
                                           return_softmax_lse=keep)
    dropped = call(False)
    kept, lse = call(True)
    (lse_in_workspace, workspace), (lse_own, _) = launched[-2:]  # after any first-use self-check's launches
    assert workspace is not None
    assert lse_in_workspace.untyped_storage().data_ptr() == workspace.untyped_storage().data_ptr()
    assert lse_own.untyped_storage().data_ptr() != workspace.untyped_storage().data_ptr()
    torch.testing.assert_close(dropped, kept, rtol=0, atol=0)
    torch.testing.assert_close(lse_in_workspace, lse_own, rtol=0, atol=0)
    assert lse is lse_own and torch.isfinite(lse).all()


@pytest.mark.parametrize("num_splits", [3, 64])
def test_fully_masked_rows_batched(seed, num_splits):
    """sq > sk, causal (bottom-right): the first sq - sk rows see no key in any split."""
    hq, hk = RATIOS[4]
    q, k, v = rand(2, 300, hq, 128), rand(2, 100, hk, 128), rand(2, 100, hk, 128)
    out, lse = flash_attn_func(q, k, v, causal=True, num_splits=num_splits, return_lse=True)
    assert torch.isneginf(lse[:, :, :200]).all() and (out[:, :200] == 0).all()
    check(out, lse, q, k, v, causal=True)


@pytest.mark.parametrize("num_splits", [4, 0])
def test_fully_masked_rows_varlen(seed, num_splits):
    """An empty sequence and one whose queries have no keys (random_lengths), among long ones."""
    hq, hk = RATIOS[8]
    lens_q, lens_k = random_lengths(5, 40)
    lens_k = [n * 40 for n in lens_k]  # long key sequences: several KV blocks per split
    cu_q, cu_k = (torch.tensor([0] + list(itertools.accumulate(x)), dtype=torch.int32, device=DEVICE)
                  for x in (lens_q, lens_k))
    q, k, v = rand(sum(lens_q), hq, 64), rand(sum(lens_k), hk, 64), rand(sum(lens_k), hk, 64)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), num_splits=num_splits,
                                      return_lse=True)
    check(out, lse, q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


@pytest.mark.parametrize("b,sq,sk,ratio,d,causal", [(1, 1, 8192, 4, 128, False), (1, 1, 20000, 8, 64, True),
                                                   (2, 4, 5000, 1, 128, True), (1, 70, 3000, 4, 64, False)])
def test_num_splits_0_matches_1(seed, b, sq, sk, ratio, d, causal):
    """The automatic choice splits these (checked against the heuristic with this GPU's SM count)
    and gives the unsplit result up to the output's rounding."""
    hq, hk = RATIOS[ratio]
    q, k, v = rand(b, sq, hq, d), rand(b, sk, hk, d), rand(b, sk, hk, d)
    cfg = dispatch.forward_config(Arch.SM90, "bfloat16", d, d, causal=causal, local=False, has_softcap=False,
                                  varlen=False, has_seqused_k=False, has_sink=False, qhead_per_kvhead=ratio)
    chosen = dispatch.num_splits_heuristic(batch=b, num_heads=hq, num_heads_kv=hk, seqlen_q=sq, seqlen_k=sk,
                                           tile_m=cfg.tile_m, tile_n=cfg.tile_n, pack_gqa=cfg.pack_gqa,
                                           num_sms=device_info.get_device_info(q.device).sm_count)
    assert chosen > 1, "the automatic choice should split this problem"
    out1, lse1 = flash_attn_func(q, k, v, causal=causal, num_splits=1, return_lse=True)
    out0, lse0 = flash_attn_func(q, k, v, causal=causal, num_splits=0, return_lse=True)
    check(out0, lse0, q, k, v, causal=causal)
    # Both round float32 results that differ in summation order to bf16: at most a step or two apart.
    ulp = out1.float().abs().max().item() * 2 ** -7  # one bf16 step at the largest output, or more
    assert max_abs_diff(out0, out1) <= 2 * ulp, "split and unsplit outputs differ beyond rounding"
    assert max_abs_diff(lse0, lse1) <= 1e-4


@pytest.mark.parametrize("causal", [False, True])
def test_split_forward_backward_equals_unsplit(seed, causal):
    """A split call's gradients come from the usual backward of the combined output."""
    hq, hk = RATIOS[4]
    q, k, v = rand(1, 3, hq, 128), rand(1, 2000, hk, 128), rand(1, 2000, hk, 128)
    dout = rand(1, 3, hq, 128)
    grads = []
    for num_splits in (1, 5):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        flash_attn_func(qq, kk, vv, causal=causal, num_splits=num_splits).backward(dout)
        grads.append((qq.grad, kk.grad, vv.grad))
    for name, g1, g5 in zip("qkv", *grads):
        scale = g1.float().abs().max().item()
        assert max_abs_diff(g1, g5) <= 2e-2 * scale + 1e-4, f"d{name} differs between 1 and 5 splits"


@pytest.mark.parametrize("splits,b,sq,h,dv,out_dtype", [
    (1, 2, 3, 4, 64, None), (5, 2, 37, 8, 128, torch.bfloat16), (100, 1, 1, 32, 128, torch.float16),
    (3, 3, 130, 6, 200, None), (7, 1, 500, 2, 8, torch.bfloat16), (2, 4, 1, 64, 256, torch.float16),
])
def test_flash_attn_combine_matches_torch(seed, splits, b, sq, h, dv, out_dtype):
    out_partial = torch.randn(splits, b, sq, h, dv, device=DEVICE)
    lse_partial = torch.randn(splits, b, h, sq, device=DEVICE) * 5
    lse_partial[torch.rand(lse_partial.shape, device=DEVICE) < 0.2] = float("-inf")  # empty splits
    lse_partial[:, 0, 0, 0] = float("-inf")  # a row no split saw
    empty = torch.isneginf(lse_partial).transpose(-1, -2)[..., None].expand_as(out_partial)
    out_partial = out_partial.masked_fill(empty, float("nan"))  # an empty split's partial is not read
    out, lse = flash_attn_combine(out_partial, lse_partial, out_dtype=out_dtype)
    ref_out, ref_lse = combine_ref(out_partial, lse_partial)
    assert out.dtype == (out_dtype or torch.float32) and out.shape == (b, sq, h, dv) and lse.shape == (b, h, sq)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)) and torch.isneginf(lse[0, 0, 0])
    assert (out[0, 0, 0] == 0).all()
    finite = torch.isfinite(ref_lse)
    assert max_abs_diff(lse[finite], ref_lse[finite]) <= 1e-5 * (1 + ref_lse[finite].abs().max().item())
    tolerance = 2e-6 * (1 + ref_out.abs().max().item())
    if out.dtype != torch.float32:
        tolerance += 2 * max_abs_diff(ref_out.to(out.dtype), ref_out)
    assert max_abs_diff(out, ref_out) <= tolerance


def test_flash_attn_combine_strided_inputs(seed):
    """Partials that are views (every other split, a transposed LSE) are read correctly."""
    out_partial = torch.randn(8, 2, 5, 4, 64, device=DEVICE)[::2]
    lse_partial = torch.randn(8, 2, 5, 4, device=DEVICE)[::2].transpose(-1, -2)
    out, lse = flash_attn_combine(out_partial, lse_partial, out_dtype=torch.bfloat16)
    ref_out, ref_lse = combine_ref(out_partial, lse_partial)
    assert max_abs_diff(lse, ref_lse) <= 1e-5 * 10
    assert max_abs_diff(out, ref_out) <= 2 * max_abs_diff(ref_out.to(torch.bfloat16), ref_out) + 1e-5
