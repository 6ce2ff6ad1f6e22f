"""Key rows inside the tensor but past a sequence's keys hold NaN (issue 21, fa4_kernels/kv_tail.py): a
freshly allocated or recycled cache. The last KV tile of a sequence reads them (one TMA tile) and the
mask gives them P = 0, but 0 * NaN = NaN: the kernel must zero V's rows there, or every row of the
output is NaN. Each test fills every key row outside the sequences' keys, K and V, with NaN (or +inf)
and checks the output against tests/reference.py on the used keys alone (test_fwd.check, which also
fails on any NaN). Covered: flash_attn_varlen_func with seqused_k (packed slots), a paged cache (the rest
of the last page and the unused pages; also through flash_attn_with_kvcache), a padded batch (batched tensors with seqused_k), each unsplit
and split (num_splits 1 and 3: only the split holding a sequence's last block reads the tail).
test_kvcache.test_nan_outside_the_key_range covers flash_attn_with_kvcache (cache_seqlens, leftpad).

Lengths put the key end just inside, at and just past a 128-key tile edge (127, 128, 129), at one key,
and deep in a tile; one sequence has no key at all.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from flash_attn4 import flash_attn_varlen_func, flash_attn_with_kvcache
from flash_attn4.fa4_kernels.sm90 import bwd as sm90_bwd
from tests.gpu.helpers import DEVICE, rand
from tests.gpu.test_fwd import check
from tests.reference import random_pages, unpage

pytestmark = pytest.mark.gpu

from tests.gpu.test_fwd import poison_outputs, seed  # noqa: E402,F401

RATIOS = {1: (4, 4), 4: (8, 2), 7: (14, 2)}  # GQA ratio -> (hq, hk); 7 runs unpacked


def i32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def cumulative(lengths):
    return [0] + list(itertools.accumulate(lengths))


@pytest.mark.parametrize("d,ratio,causal,num_splits,tail", [
    (128, 4, True, 1, float("nan")), (128, 4, True, 3, float("nan")), (128, 1, False, 1, float("nan")),
    (64, 7, False, 3, float("nan")), (128, 4, False, 1, float("inf")),
])
def test_varlen_seqused_k_with_nan_past_the_used_keys(seed, d, ratio, causal, num_splits, tail):
    """Packed slots of cu_seqlens_k, each sequence using the first seqused_k[b] keys of its slot: the
    rest of every slot (and the last slot's rows to the tensor's end) is NaN."""
    hq, hk = RATIOS[ratio]
    lens_q = [3, 1, 64, 17, 2, 5]
    used_k = [127, 1, 129, 300, 0, 128]
    slots_k = [n + slack for n, slack in zip(used_k, [5, 126, 127, 40, 3, 1])]
    cu_q, cu_slot = cumulative(lens_q), cumulative(slots_k)
    q = rand(cu_q[-1], hq, d)
    k, v = rand(cu_slot[-1], hk, d), rand(cu_slot[-1], hk, d)
    used = torch.zeros(cu_slot[-1], dtype=torch.bool, device=DEVICE)
    for start, n in zip(cu_slot, used_k):
        used[start:start + n] = True
    k[~used], v[~used] = tail, tail
    out, lse = flash_attn_varlen_func(q, k, v, i32(cu_q), i32(cu_slot), max_seqlen_q=max(lens_q),
                                      max_seqlen_k=max(slots_k), seqused_k=i32(used_k), causal=causal,
                                      num_splits=num_splits, return_lse=True)
    check(out, lse, q, k[used], v[used], cu_seqlens_q=i32(cu_q), cu_seqlens_k=i32(cumulative(used_k)),
          causal=causal)


PAGED_LENS_K = [300, 17, 129, 1, 127]


def nan_tailed_pages(lens_k, page_size, hk, d):
    """(page_table on the GPU, k_pages, v_pages) of sequences of lens_k keys in shuffled pages, NaN in
    every row no sequence's keys use: the rest of each last page and the unused pages."""
    table, num_pages = random_pages(lens_k, page_size)
    k_pages, v_pages = rand(num_pages, page_size, hk, d), rand(num_pages, page_size, hk, d)
    used = torch.zeros(num_pages, page_size, dtype=torch.bool, device=DEVICE)
    for b, n in enumerate(lens_k):
        for i in range(-(-n // page_size)):
            used[int(table[b, i]), :min(page_size, n - i * page_size)] = True
    k_pages[~used], v_pages[~used] = float("nan"), float("nan")
    return table.to(DEVICE), k_pages, v_pages


@pytest.mark.parametrize("page_size,num_splits", [(64, 1), (64, 3), (256, 1), (256, 3)])
def test_paged_cache_with_nan_in_the_rest_of_the_last_page(seed, page_size, num_splits):
    """A paged cache whose last page of each sequence is NaN past the sequence's keys, as are the unused
    pages: 64-key pages (a 128-key tile is two page boxes, the one past the end reads no page) and
    256-key pages (a tile lies inside one page, the rows past the keys are that page's)."""
    hq, hk, d = 16, 2, 128
    lens_q, lens_k = [5, 1, 64, 3, 2], PAGED_LENS_K
    cu_q = i32(cumulative(lens_q))
    table, k_pages, v_pages = nan_tailed_pages(lens_k, page_size, hk, d)
    q = rand(sum(lens_q), hq, d)
    out, lse = flash_attn_varlen_func(q, k_pages, v_pages, cu_q, None,
                                      max_seqlen_q=max(lens_q), seqused_k=i32(lens_k), page_table=table,
                                      causal=True, num_splits=num_splits, return_lse=True)
    k, v, cu_k = unpage(k_pages, v_pages, table, lens_k)
    assert not (k.isnan().any() or v.isnan().any()), "the reference's keys are the used rows only"
    check(out, lse, q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)


@pytest.mark.parametrize("page_size,num_splits", [(64, 1), (256, 3)])
def test_paged_kvcache_with_nan_in_the_rest_of_the_last_page(seed, page_size, num_splits):
    """The same NaN-tailed pages through flash_attn_with_kvcache: the batched kernel over pages, three
    queries per sequence (O stored by TMA on sm90)."""
    hq, hk, d, sq = 16, 2, 128, 3
    table, k_pages, v_pages = nan_tailed_pages(PAGED_LENS_K, page_size, hk, d)
    q = rand(len(PAGED_LENS_K), sq, hq, d)
    out, lse = flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=i32(PAGED_LENS_K), page_table=table,
                                       causal=True, num_splits=num_splits, return_softmax_lse=True)
    k, v, cu_k = unpage(k_pages, v_pages, table, PAGED_LENS_K)
    for i in range(len(PAGED_LENS_K)):
        keys = slice(int(cu_k[i]), int(cu_k[i + 1]))
        check(out[i:i + 1], lse[i:i + 1], q[i:i + 1], k[None, keys], v[None, keys], causal=True)


@pytest.mark.parametrize("causal,num_splits", [(True, 1), (True, 3), (False, 1)])
def test_padded_batch_with_nan_past_seqused_k(seed, causal, num_splits):
    """Batched (b, s, h, d) tensors with seqused_k: the rows past each sequence's keys are inside the
    tensor (the last tile of a short sequence), NaN here."""
    hq, hk = RATIOS[4]
    b, sq, sk, d = 4, 9, 300, 128
    used_k = [129, 1, 300, 127]
    q, k, v = rand(b, sq, hq, d), rand(b, sk, hk, d), rand(b, sk, hk, d)
    for i, n in enumerate(used_k):
        k[i, n:], v[i, n:] = float("nan"), float("nan")
    out, lse = flash_attn_varlen_func(q, k, v, None, None, seqused_k=i32(used_k), causal=causal,
                                      num_splits=num_splits, return_lse=True)
    for i, n in enumerate(used_k):
        check(out[i:i + 1], lse[i:i + 1], q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n], causal=causal)


def _on_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.backward
@pytest.mark.xfail(_on_sm90() and not sm90_bwd.ZERO_KV_TAIL, strict=True,
                   reason="sm90/bwd.py ZERO_KV_TAIL off: the key/value rows past seqused_k are not zeroed, so "
                   "dS = P (dP - D) = 0 x NaN there reaches dQ")
@pytest.mark.parametrize("d", [64, 128])
def test_backward_with_nan_past_seqused_k(seed, d):
    """The backward over packed slots with seqused_k and NaN in every slot's rows past its keys: dQ,
    dK and dV of the used rows must be finite and equal to the same call's on zeroed tails (the
    sm90 and sm100 backwards' zero_kv_tail zeroes K's and V's tail rows in shared memory; on a B200
    d = 64 runs the sm100 1-CTA kernel and d = 128 the CTA pair, whose even CTA zeroes both CTAs'
    K, V and K^T rows, pair_zero_kv_tail: the 65-key slot's odd block lies wholly past its keys)."""
    hq, hk = RATIOS[4]
    lens, used_k = [65, 130], [65, 130]
    slots_k = [n + 50 for n in used_k]
    cu_q, cu_slot = i32(cumulative(lens)), i32(cumulative(slots_k))
    q = rand(sum(lens), hq, d)
    k, v = rand(sum(slots_k), hk, d), rand(sum(slots_k), hk, d)
    used = torch.zeros(sum(slots_k), dtype=torch.bool, device=DEVICE)
    for start, n in zip(cumulative(slots_k), used_k):
        used[start:start + n] = True
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[~used], v_nan[~used] = float("nan"), float("nan")
    k[~used], v[~used] = 0.0, 0.0
    dout, grads = rand(sum(lens), hq, d), []
    for kk, vv in ((k, v), (k_nan, v_nan)):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, kk, vv))
        out = flash_attn_varlen_func(qq, kk, vv, cu_q, cu_slot, max_seqlen_q=max(lens), max_seqlen_k=max(slots_k),
                                     seqused_k=i32(used_k), causal=True)
        out.backward(dout)
        grads.append((qq.grad, kk.grad[used], vv.grad[used]))
    for clean, poisoned in zip(*grads):
        assert torch.isfinite(poisoned).all()
        torch.testing.assert_close(poisoned, clean)
