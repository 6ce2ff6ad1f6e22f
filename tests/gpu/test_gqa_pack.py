"""Head ratios that do not divide 64 (3, 5, 6, 7) with short queries, on a real GPU: the kernel packs
them in padded groups of the next ratio that divides 64 (4 or 8 rows per token, ForwardConfig
.pack_gqa_heads, sm90 and sm100 alike), against tests/reference.py under
FlashAttention's accuracy rule (test_fwd.check, LSE included).

Covered: batched and varlen, causal (bottom-right, s_q < s_k) and not, s_q in {1, 4, 17} (17 x 8 rows
spill into a second tile), split-KV (1 and several splits), paged caches (pages of 16 and 256) through
flash_attn_with_kvcache, learnable sinks; and that a padded group's dummy rows write nothing: the
kernel is launched into out and lse that are views inside larger random buffers, whose other
elements must keep their values. Outputs are
poisoned (test_fwd's fixture), so an unwritten real row fails too.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from flash_attn4 import compile_cache, dispatch, flash_attn_func, flash_attn_varlen_func, ops
from flash_attn4.fa4_kernels.tiles import has_padded_pack
from tests.gpu.helpers import DEVICE, rand
from tests.gpu.test_fwd import check
from tests.gpu.test_kvcache import i32
from tests.gpu.test_paged_kv import run_paged

pytestmark = pytest.mark.gpu

from tests.gpu.test_fwd import poison_outputs, seed  # noqa: E402,F401

# ratio -> (hq, hk): the last KV head's dummy rows are the ones that would reach past q and out.
HEADS = {3: (12, 4), 5: (10, 2), 6: (12, 2), 7: (28, 4)}
SEQLENS_Q = (1, 4, 17)


def arch():
    return dispatch.arch_for_device(torch.device(DEVICE))


def expect_kernel_packing(ratio: int, d: int, varlen: bool, sq: int) -> None:
    """The call takes the padded group (not the unpacked kernel)."""
    group = dispatch.padded_pack(arch(), d, d, varlen, ratio, sq)
    assert group > ratio and 64 % group == 0
    assert ops._padded_group(torch.empty(1, 1, ratio, d, device=DEVICE), torch.empty(1, 1, 1, d, device=DEVICE),
                             torch.empty(1, 1, 1, d, device=DEVICE), varlen, sq) == group


# (ratio, d, causal, varlen): every ratio, both head-dim classes (d=64: 3 consumer warpgroups), both
# layouts and both masks, without compiling the full product.
CASES = [(3, 64, True, False), (5, 128, True, True), (6, 128, False, False), (7, 128, True, False),
         (7, 128, False, True), (6, 64, True, True)]


@pytest.mark.parametrize("ratio,d,causal,varlen", CASES, ids=[f"r{r}-d{d}-{'causal' if c else 'full'}-"
                                                               f"{'varlen' if v else 'batched'}" for r, d, c, v in CASES])
def test_padded_groups_match_the_reference(seed, ratio, d, causal, varlen):
    hq, hk = HEADS[ratio]
    for sq in SEQLENS_Q:
        expect_kernel_packing(ratio, d, varlen, sq)
        sk = 700 + sq  # several KV blocks, the last partial; bottom-right causal
        if varlen:
            lens_q, lens_k = [sq, 1, sq, 0], [sk, 90, 5, 40]  # one short key range, one without queries
            cu_q, cu_k = (i32([0, *itertools.accumulate(lens)]) for lens in (lens_q, lens_k))
            q, k, v = rand(sum(lens_q), hq, d), rand(sum(lens_k), hk, d), rand(sum(lens_k), hk, d)
            out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_seqlen_q=sq, max_seqlen_k=max(lens_k),
                                              causal=causal, return_lse=True)
            check(out, lse, q, k, v, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        else:
            q, k, v = rand(3, sq, hq, d), rand(3, sk, hk, d), rand(3, sk, hk, d)
            out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
            check(out, lse, q, k, v, causal=causal)


@pytest.mark.parametrize("ratio", [3, 7])
@pytest.mark.parametrize("num_splits", [1, 3, 0])
def test_padded_groups_with_split_kv_and_a_sink(seed, ratio, num_splits):
    """Split-KV partials per real head, merged by the combine, which adds the sink once; unsplit the
    kernel adds each row's own query head's sink (dummy rows take a real one's, never stored)."""
    hq, hk = HEADS[ratio]
    sink = torch.randn(hq, device=DEVICE) * 2
    for sq in (1, 4):
        q, k, v = rand(2, sq, hq, 128), rand(2, 5000, hk, 128), rand(2, 5000, hk, 128)
        out, lse = flash_attn_func(q, k, v, causal=True, learnable_sink=sink, num_splits=num_splits,
                                   return_lse=True)
        check(out, lse, q, k, v, causal=True, learnable_sink=sink)


@pytest.mark.parametrize("page_size", [16, 256])
@pytest.mark.parametrize("num_splits", [1, 0])
def test_padded_groups_over_a_paged_cache(seed, page_size, num_splits):
    """flash_attn_with_kvcache over shuffled pages with an append of s_new = sq keys, ratio 7 (14/2
    heads) packed in groups of 8, with or without split-KV: bitwise the dense cache's result, and
    the reference's on the gathered keys (test_paged_kv.run_paged)."""
    for sq in (1, 4):
        expect_kernel_packing(7, 128, True, sq)
        run_paged([1000, 37, 513], page_size=page_size, sq=sq, s_new=sq, ratio=7, causal=True,
                  num_splits=num_splits)


def _view_inside(shape, dtype):
    """A view of ``shape`` starting at 1 on every mode but the last inside a random buffer 2 larger
    on those modes, and the mask of the view's elements in the buffer: everything around the view
    holds random data a stray write would change."""
    big_shape = tuple(n + 2 for n in shape[:-1]) + (shape[-1],)
    big = torch.randn(big_shape, device=DEVICE).to(dtype)
    index = tuple(slice(1, 1 + n) for n in shape[:-1])
    inside = torch.zeros(big_shape, dtype=torch.bool, device=DEVICE)
    inside[index] = True
    return big, big[index], inside


@pytest.mark.parametrize("varlen,split_kv", [(False, False), (True, False), (False, True)],
                         ids=["batched-tma-store", "varlen-thread-store", "split-partials"])
def test_dummy_rows_write_nothing(seed, varlen, split_kv):
    """The kernel itself (no torch-layer copies) with out and lse as views inside larger random
    buffers: only the real heads' elements change. Ratio 7 in groups of 8: the dummy row of every KV
    head but the last aliases the next KV head's first query head, the last KV head's lies past the
    views and past q, which is exactly its size (scripts/sanitize_calls.py has compute-sanitizer's
    memcheck look for reads past it, with the caching allocator off)."""
    if not has_padded_pack(arch()):
        pytest.skip(f"{arch().value} runs such ratios unpacked (no padded groups in its kernel)")
    ratio, d, sq, sk, b, splits = 7, 128, 5, 600, 2, 3
    hq, hk = HEADS[ratio]
    if varlen:
        q, k, v = rand(b * sq, hq, d), rand(b * sk, hk, d), rand(b * sk, hk, d)
        cu_q, cu_k = i32([0, sq, 2 * sq]), i32([0, sk, 2 * sk])
        out_shape, lse_shape = (b * sq, hq, d), (hq, b * sq)
    else:
        q, k, v = rand(b, sq, hq, d), rand(b, sk, hk, d), rand(b, sk, hk, d)
        cu_q = cu_k = None
        out_shape, lse_shape = (b, sq, hq, d), (b, hq, sq)
    lead = (splits,) if split_kv else ()
    big_o, out, inside_o = _view_inside(lead + out_shape, torch.float32 if split_kv else torch.bfloat16)
    big_l, lse, inside_l = _view_inside(lead + lse_shape, torch.float32)
    before_o, before_l = big_o.clone(), big_l.clone()
    # The bare kernel (with split_kv: the split kernel alone, its partials in out and lse; ops runs it
    # inside the split-KV pipeline, which carves the same partials out of its workspace).
    cfg = dispatch.forward_config(arch(), "bfloat16", d, d, causal=True, local=False, has_softcap=False, varlen=varlen,
                                  has_seqused_k=False, has_sink=False, qhead_per_kvhead=ratio, split_kv=split_kv,
                                  pack_group=dispatch.padded_pack(arch(), d, d, varlen, ratio, sq))
    assert cfg.pack_gqa_heads == ratio
    kernel = compile_cache.get_forward_kernel(cfg)
    ops._launch_forward(kernel, q, k, v, out, lse, cu_q, cu_k, None, None, d ** -0.5, 0.0, -1, -1, sq)
    torch.cuda.synchronize()
    assert torch.equal(big_o[~inside_o], before_o[~inside_o]), "a write outside out's view (a dummy row)"
    assert torch.equal(big_l[~inside_l], before_l[~inside_l]), "a write outside lse's view (a dummy row)"
    if split_kv:  # each split's partial is normalised over its own keys: merge them as the combine does
        weights = torch.softmax(lse, dim=0).transpose(-1, -2).unsqueeze(-1)  # (split, b, sq, hq, 1)
        out, lse = (weights * out).sum(0).to(q.dtype), torch.logsumexp(lse, dim=0)
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k) if varlen else {}
    check(out, lse, q, k, v, causal=True, **kw)
