"""The KV-cache append of flash_attn_with_kvcache, for every architecture: the new tokens' keys and
values written into the caches in place, in one launch, with the lengths the attention then reads.

Token t of batch entry b goes to position p = cache_seqlens[b] + t of its cache sequence: row
rows[b] (cache_batch_idx; b without it) of a contiguous-rows cache (b_cache, s_cache, hk, d), or
with a paged cache (num_pages, page_size, hk, d) page page_table[b, p // page_size], slot
p % page_size. A position past the sequence's capacity (s_cache, or max_pages * page_size), or a
row or page out of range, is not written: the host checks the metadata where it may sync
(validate.check_kvcache_values, opt-in), and without that check (or under CUDA-graph capture) bad
metadata must not become a write into another sequence's or another tensor's memory.
The same kernel writes seqused_k[b] = cache_seqlens[b] + s_new, the key count the forward reads,
which would otherwise be one more launch per call.

Why a kernel: decoding appends one token per layer and step, and the torch ops it replaces (index
arithmetic, then an index_copy_ or index_put_ per cache) were three to eight launches, each a few
microseconds of host time at every layer of every step.

Work split: one CTA per (new token, batch entry); its 128 threads copy the token's rows of all KV
heads, K then V, in 16-byte vectors (the head dims are multiples of 8 elements).

Call convention (TVM-FFI, current CUDA stream): fn(k, v, k_cache, v_cache, cache_seqlens, rows,
page_table, seqused_k) with k (b, s_new, hk, d), v (b, s_new, hk, dv), the caches as above (any
strides in multiples of 8 elements but a unit head-dim stride), cache_seqlens int32 (b,), rows int32
(b,) with ``has_rows`` else None, page_table int32 (b, max_pages) with ``paged`` else None,
seqused_k int32 (b,) written.
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .config import AppendConfig
from .dtypes import CUTLASS_DTYPES

THREADS = 128
VECTOR = 8  # 16-bit elements per 16-byte access


class KVAppend:
    def __init__(self, cfg: AppendConfig):
        self.cfg = cfg
        self.dtype = CUTLASS_DTYPES[cfg.dtype]

    @cute.jit
    def __call__(self, mK: cute.Tensor, mV: cute.Tensor, mKCache: cute.Tensor, mVCache: cute.Tensor,
                 mCacheSeqlens: cute.Tensor, mRows: Optional[cute.Tensor], mPageTable: Optional[cute.Tensor],
                 mSeqUsedK: cute.Tensor, stream: cuda.CUstream):
        self.kernel(mK, mV, mKCache, mVCache, mCacheSeqlens, mRows, mPageTable, mSeqUsedK).launch(
            grid=(mK.shape[1], mK.shape[0], 1), block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mK: cute.Tensor, mV: cute.Tensor, mKCache: cute.Tensor, mVCache: cute.Tensor,
               mCacheSeqlens: cute.Tensor, mRows: Optional[cute.Tensor], mPageTable: Optional[cute.Tensor],
               mSeqUsedK: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        token, batch, _ = cute.arch.block_idx()
        s_new = mK.shape[1]
        cached = mCacheSeqlens[batch]
        position = cached + token
        if cutlass.const_expr(self.cfg.paged):
            page_size = mKCache.shape[1]
            row, slot = Int32(-1), Int32(0)
            if position < mPageTable.shape[1] * page_size:
                row, slot = mPageTable[batch, position // page_size], position % page_size
        else:
            row, slot = (mRows[batch] if cutlass.const_expr(self.cfg.has_rows) else batch), position
        if row >= 0 and row < mKCache.shape[0] and slot >= 0 and slot < mKCache.shape[1]:
            self.copy_heads(mK[batch, token, None, None], mKCache[row, slot, None, None], tidx)
            self.copy_heads(mV[batch, token, None, None], mVCache[row, slot, None, None], tidx)
        if token == 0 and tidx == 0:
            mSeqUsedK[batch] = cached + s_new

    @cute.jit
    def copy_heads(self, src: cute.Tensor, dst: cute.Tensor, tidx: Int32):
        """One token's (hk, dim) rows, vector i of the token (head i // vectors) by thread i % THREADS."""
        vectors = cute.size(src, mode=[1]) // VECTOR
        src_vectors = cute.zipped_divide(src, (1, VECTOR))  # ((1, VECTOR), (hk, vectors))
        dst_vectors = cute.zipped_divide(dst, (1, VECTOR))
        staged = cute.make_rmem_tensor((1, VECTOR), self.dtype)
        for i in cutlass.range(tidx, src.shape[0] * vectors, THREADS):
            head, vector = i // vectors, i % vectors
            cute.autovec_copy(src_vectors[None, (head, vector)], staged)
            cute.autovec_copy(staged, dst_vectors[None, (head, vector)])
