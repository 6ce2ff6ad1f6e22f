"""Padded batches on a real GPU: seqused_q (each sequence uses the first seqused_q[b] queries of its
slot) in flash_attn_varlen_func, packed or batched without cu_seqlens (with seqused_k), against
tests/reference.py on each sequence's used rows (test_fwd.check), and the rows past them left as
allocated (poisoned: test_fwd's fixture fills new outputs with NaN / +inf)."""

from __future__ import annotations

import pytest
import torch

from flash_attn4 import flash_attn_varlen_func
from tests.gpu.helpers import DEVICE, rand
from tests.gpu.test_fwd import check

pytestmark = pytest.mark.gpu

from tests.gpu.test_fwd import poison_outputs, seed  # noqa: E402,F401

RATIOS = {1: (4, 4), 4: (8, 2), 7: (14, 2)}


def i32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("ratio,causal,num_splits,d", [(4, True, 1, 128), (1, False, 3, 64), (7, True, 0, 128),
                                                       (4, False, 1, 256)])
def test_varlen_seqused_q(seed, ratio, causal, num_splits, d):
    hq, hk = RATIOS[ratio]
    slots, used, lens_k = [7, 130, 1, 64], [3, 129, 0, 64], [500, 200, 9, 1]
    cu_q = i32([0] + torch.tensor(slots).cumsum(0).tolist())
    cu_k = i32([0] + torch.tensor(lens_k).cumsum(0).tolist())
    q = rand(sum(slots), hq, d)
    k, v = rand(sum(lens_k), hk, d), rand(sum(lens_k), hk, d)
    with torch.no_grad():
        out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_seqlen_q=max(slots), seqused_q=i32(used),
                                          causal=causal, num_splits=num_splits, return_lse=True)
    for b, n in enumerate(used):
        q0, k0, k1 = int(cu_q[b]), int(cu_k[b]), int(cu_k[b + 1])
        if n:
            check(out[None, q0:q0 + n], lse[None, :, q0:q0 + n], q[None, q0:q0 + n], k[None, k0:k1], v[None, k0:k1],
                  causal=causal)
        if num_splits == 1:  # the combine of a split run writes every row; unsplit, the rest stays poisoned
            assert out[q0 + n:q0 + slots[b]].isnan().all()


@pytest.mark.parametrize("ratio,causal,num_splits", [(4, True, 1), (7, True, 0), (1, False, 2)])
def test_padded_batch_without_cu_seqlens(seed, ratio, causal, num_splits):
    """Batched (b, s, h, d) tensors padded per sequence: a decode/prefill batch without repacking."""
    hq, hk = RATIOS[ratio]
    b, sq, sk, d = 3, 9, 300, 128
    q, k, v = rand(b, sq, hq, d), rand(b, sk, hk, d), rand(b, sk, hk, d)
    used_q, used_k = [9, 1, 4], [300, 17, 128]
    with torch.no_grad():
        out, lse = flash_attn_varlen_func(q, k, v, None, None, seqused_q=i32(used_q), seqused_k=i32(used_k),
                                          causal=causal, num_splits=num_splits, return_lse=True)
        out_k, lse_k = flash_attn_varlen_func(q, k, v, None, None, seqused_k=i32(used_k), causal=causal,
                                              num_splits=num_splits, return_lse=True)
    assert out.shape == (b, sq, hq, d) and lse.shape == (b, hq, sq)
    for i, (nq, nk) in enumerate(zip(used_q, used_k)):
        check(out[i:i + 1, :nq], lse[i:i + 1, :, :nq], q[i:i + 1, :nq], k[i:i + 1, :nk], v[i:i + 1, :nk],
              causal=causal)
        check(out_k[i:i + 1], lse_k[i:i + 1], q[i:i + 1], k[i:i + 1, :nk], v[i:i + 1, :nk], causal=causal)
