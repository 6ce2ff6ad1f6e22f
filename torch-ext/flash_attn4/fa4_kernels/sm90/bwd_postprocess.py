"""The sm90 backward's postprocessing: dQ = dq_accum * softmax_scale in the input dtype, dq_accum's
register order (dq_accum.py) turned back into (row, column) order.

One CTA per (query block, head, batch entry), one thread per thread of the main kernel's dQ
accumulator (two parts of 128). Each thread reads its values with 16-byte loads (a warp reads 512
contiguous bytes), scales and converts them, and writes them into a shared-memory tile through the
partition of the main kernel's own dQ WGMMA, so that the two orders agree by construction; the tile's
rows inside the sequence then leave with 16-byte stores.

Call convention (TVM-FFI, current CUDA stream): fn(dq_accum, dq, cu_seqlens_q, softmax_scale,
max_seqlen_q). Batched: dq_accum (b, h, rows, 128) float32 as the main kernel left it, dq (b, s, h, d);
varlen: dq_accum (h, rows, 128), dq (total, h, d), cu_seqlens_q (b + 1,) int32 (else None).
max_seqlen_q sizes the grid (for batched inputs it is s).
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass import Float32, Int32

from ..config import PostprocessConfig
from ..dtypes import CUTLASS_DTYPES
from ..seqlen import SeqlenInfo, head_rows
from ..layouts import dq_sequence_first, transpose_view
from .dq_accum import NUM_PARTS, DqTiling, dq_tiled_mma, part_tile, register_order
from .wgmma import WARPGROUP_THREADS

THREADS = NUM_PARTS * WARPGROUP_THREADS
VECTOR = 8  # elements of a 16-byte store of 16-bit values
# Padding of the tile's rows: 16-byte aligned rows whose starts fall on different banks.
ROW_PAD = 8


class BackwardPostprocessSm90:
    def __init__(self, cfg: PostprocessConfig):
        self.cfg = cfg
        self.dtype = CUTLASS_DTYPES[cfg.dtype]
        self.tiling = DqTiling(cfg.tile_m, cfg.head_dim)

    @cute.jit
    def __call__(self, mAccum: cute.Tensor, mdQ: cute.Tensor, mCuSeqlensQ: Optional[cute.Tensor],
                 softmax_scale: Float32, max_seqlen_q: Int32, stream: cuda.CUstream):
        mAccum, mdQ, num_batch = dq_sequence_first(mAccum, mdQ, mCuSeqlensQ, self.cfg.varlen)
        tile_m, d = self.tiling.tile_m, self.tiling.head_dim
        sdQ_layout = cute.make_layout((tile_m, d), stride=(d + ROW_PAD, 1))
        self.kernel(mAccum, mdQ, mCuSeqlensQ, softmax_scale, sdQ_layout, dq_tiled_mma(self.dtype, self.tiling)).launch(
            grid=((max_seqlen_q + tile_m - 1) // tile_m, mdQ.shape[2], num_batch), block=[THREADS, 1, 1],
            stream=stream)

    @cute.kernel
    def kernel(self, mAccum: cute.Tensor, mdQ: cute.Tensor, mCuSeqlensQ: Optional[cute.Tensor],
               softmax_scale: Float32, sdQ_layout: cute.Layout, tiled_mma_dq: cute.TiledMma):
        tiling, varlen = self.tiling, self.cfg.varlen
        tile_m, d = tiling.tile_m, tiling.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        seqlen = SeqlenInfo.create(batch, mdQ.shape[0], mdQ.shape[0], mCuSeqlensQ)
        rows_left = seqlen.seqlen_q - m_block * tile_m
        if rows_left > 0:
            sdQ = cutlass.memory.SmemAllocator().allocate_tensor(self.dtype, sdQ_layout, byte_alignment=16)
            # This thread's values of its part, in register order, scaled and converted...
            gAccum = part_tile(mAccum, tiling, seqlen.offset_q, head, batch, varlen, m_block, tidx // WARPGROUP_THREADS)
            thr = tiled_mma_dq.get_slice(tidx)
            block = transpose_view(sdQ) if cutlass.const_expr(tiling.transposed) else sdQ
            tdQsdQ = thr.partition_C(block)
            acc = register_order(tdQsdQ.shape, tidx % WARPGROUP_THREADS, gAccum.iterator).load()
            # ...into the tile, where the main kernel's dQ WGMMA had them.
            tdQsdQ.store((acc * softmax_scale).to(self.dtype))
            cute.arch.sync_threads()

            # The rows inside the sequence, 16 bytes per store.
            gdQ = cute.local_tile(head_rows(mdQ, seqlen.offset_q, head, batch, varlen), (tile_m, d), (m_block, 0))
            per_row = d // VECTOR
            for k in cutlass.range_constexpr(-(-tile_m * per_row // THREADS)):
                index = tidx + k * THREADS
                row, col = index // per_row, index % per_row
                if index < tile_m * per_row and row < rows_left:
                    cute.autovec_copy(cute.local_tile(sdQ, (1, VECTOR), (row, col)),
                                      cute.local_tile(gdQ, (1, VECTOR), (row, col)))
