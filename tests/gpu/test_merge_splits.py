"""Split-KV kernels that merge their own splits (ForwardConfig.merge_splits, dispatch.MERGE_SPLITS:
the last CTA of each output tile to finish merges the tile's partials; no combine kernel runs).

Every test here runs with the switch on and the combine kernel forbidden (its lookup raises): the
split-KV tests of the other modules imported below (the split grid, windows and seqused_k, fully
masked rows, the automatic split count, the backward after a split forward, KV caches dense and
paged, padded GQA groups, CUDA graph replays), then what only this path has: results bit for bit
those of the combine kernel (the same merge, RowMerge, in the same order), the per-tile counts left
at zero by every launch (repeated calls, two streams at once, a different grid on the same stream).
Tests with a learnable sink stay out: the combine adds a sink, so those splits never merge.
"""

from __future__ import annotations

import pytest
import torch

from flash_attn4 import dispatch, flash_attn_func, flash_attn_varlen_func, ops
from tests.gpu.helpers import DEVICE, rand
from tests.gpu.test_fwd import check, poison_outputs, seed  # noqa: F401 (fixtures)
from tests.gpu.test_gqa_pack import test_padded_groups_over_a_paged_cache  # noqa: F401
from tests.gpu.test_kvcache import (test_cache_batch_idx,  # noqa: F401
                                    test_cuda_graph_replay_with_changing_cache_seqlens, test_fully_masked_rows,
                                    test_kvcache_100k, test_unpackable_ratios)
from tests.gpu.test_paged_kv import (test_paged_100k, test_paged_cuda_graph_replay_with_changing_lengths,  # noqa: F401
                                     test_paged_many_queries)
from tests.gpu.test_splitkv import (test_fully_masked_rows_batched, test_fully_masked_rows_varlen,  # noqa: F401
                                    test_num_splits_0_matches_1, test_split_forward,
                                    test_split_forward_backward_equals_unsplit,
                                    test_split_forward_local_window_and_seqused_k)

pytestmark = pytest.mark.gpu


def _use_merging(on: bool) -> None:
    dispatch.MERGE_SPLITS = on
    dispatch.forward_config.cache_clear()  # it reads MERGE_SPLITS
    ops._PLANS.clear()


@pytest.fixture(autouse=True)
def merging(monkeypatch):
    """The switch on, and the combine kernel out of reach: a split call that still combines fails."""
    def no_combine(*args, **kwargs):
        raise AssertionError("a split-KV forward ran the combine kernel with MERGE_SPLITS on")

    monkeypatch.setattr(ops, "_combine_kernel", no_combine)
    _use_merging(True)
    yield
    _use_merging(False)


@pytest.mark.parametrize("b,sq,sk,hq,hk,d,num_splits", [
    (1, 1, 65536, 32, 8, 128, 0), (2, 1, 30000, 28, 4, 128, 0), (3, 4, 9000, 8, 8, 64, 5),
    (2, 70, 3000, 16, 2, 128, 7)])
def test_merged_equals_the_combine_kernel_bit_for_bit(seed, monkeypatch, b, sq, sk, hq, hk, d, num_splits):
    """The kernel's merge and the combine kernel run the same row merge over the same partials in the
    same order: equal outputs and LSEs, not just close ones (decode at 64k, a padded ratio, several
    query tiles per head)."""
    q, k, v = rand(b, sq, hq, d), rand(b, sk, hk, d), rand(b, sk, hk, d)
    merged = flash_attn_func(q, k, v, causal=True, num_splits=num_splits, return_lse=True)
    monkeypatch.undo()  # the combine kernel back
    _use_merging(False)
    combined = flash_attn_func(q, k, v, causal=True, num_splits=num_splits, return_lse=True)
    _use_merging(True)
    assert torch.equal(merged[0], combined[0]) and torch.equal(merged[1], combined[1])
    check(*merged, q, k, v, causal=True)


def test_counts_left_at_zero_by_every_launch(seed):
    """Repeated calls (every launch finds its tiles' counts at zero and leaves them so), then a
    larger grid and a smaller one on the same stream: all correct, the stream's counts zero after."""
    q, k, v = rand(2, 1, 16, 128), rand(2, 20000, 4, 128), rand(2, 20000, 4, 128)
    first = flash_attn_func(q, k, v, num_splits=6, return_lse=True)
    for _ in range(4):
        again = flash_attn_func(q, k, v, num_splits=6, return_lse=True)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    check(*first, q, k, v)
    q2, k2, v2 = rand(3, 200, 16, 64), rand(3, 5000, 16, 64), rand(3, 5000, 16, 64)
    check(*flash_attn_func(q2, k2, v2, causal=True, num_splits=3, return_lse=True), q2, k2, v2, causal=True)
    check(*flash_attn_func(q, k, v, num_splits=2, return_lse=True), q, k, v)
    torch.cuda.synchronize()
    counts = ops._TILE_COUNTS[(q.device, torch.cuda.current_stream().cuda_stream)]
    assert not counts.any()


def test_two_streams_at_once(seed):
    """Split forwards on two streams at the same time use two count buffers: both correct."""
    problems = [(rand(1, 1, 32, 128), rand(1, 60000, 8, 128), rand(1, 60000, 8, 128)),
                (rand(4, 1, 32, 128), rand(4, 30000, 8, 128), rand(4, 30000, 8, 128))]
    for q, k, v in problems:  # compile first: the race is the launches'
        flash_attn_func(q, k, v, num_splits=0)
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    results = [None, None]
    for _ in range(3):
        for i, ((q, k, v), stream) in enumerate(zip(problems, streams)):
            with torch.cuda.stream(stream):
                results[i] = flash_attn_func(q, k, v, num_splits=0, return_lse=True)
        torch.cuda.synchronize()
        for (q, k, v), (out, lse) in zip(problems, results):
            check(out, lse, q, k, v)


def test_varlen_decode_batch(seed):
    """A decode batch of packed sequences of different cache lengths (empty ones included): each
    sequence's tiles count their own splits."""
    lens_k = [5000, 1, 0, 12000, 129]
    cu_q = torch.arange(len(lens_k) + 1, dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    q, k, v = rand(len(lens_k), 32, 128), rand(sum(lens_k), 8, 128), rand(sum(lens_k), 8, 128)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 1, max(lens_k), num_splits=0, return_lse=True)
    check(out, lse, q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
