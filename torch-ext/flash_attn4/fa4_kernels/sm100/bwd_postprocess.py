"""The sm100 backward's postprocessing: dQ = dq_accum * softmax_scale in the input dtype, dq_accum's
chunk order (dq_accum.py) turned back into (row, column) order.

One CTA of tile_m threads per (query block, head, batch entry), thread = query row, as the main
kernel's dQ warpgroup staged it: each 16-byte load of a warp reads 512 contiguous bytes; each thread
stores its row VECTOR_OUT columns (16 bytes) at a time, rows inside the sequence only.

Call convention (TVM-FFI, current CUDA stream): fn(dq_accum, dq, cu_seqlens_q, softmax_scale,
max_seqlen_q). Batched: dq_accum (b, h, rows, 128) float32, dq (b, s, h, d), cu_seqlens_q None;
varlen: dq_accum (h, rows, 128), dq (total, h, d), cu_seqlens_q (b + 1,) int32. max_seqlen_q sizes
the grid.
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..config import PostprocessConfig
from ..dtypes import CUTLASS_DTYPES
from ..layouts import dq_sequence_first
from ..seqlen import SeqlenInfo, head_rows
from .dq_accum import ROW, VECTOR, DqChunks, chunk_tiles

VECTOR_OUT = 8  # 16-bit values per 16-byte store


class BackwardPostprocessSm100:
    def __init__(self, cfg: PostprocessConfig):
        # PostprocessConfig ran tiles.check_postprocess: tile_m 128, d in BWD_HEAD_DIMS.
        self.cfg = cfg
        self.dtype = CUTLASS_DTYPES[cfg.dtype]
        self.layout = DqChunks(cfg.tile_m, cfg.head_dim)

    @cute.jit
    def __call__(self, mAccum: cute.Tensor, mdQ: cute.Tensor, mCuSeqlensQ: Optional[cute.Tensor],
                 softmax_scale: Float32, max_seqlen_q: Int32, stream: cuda.CUstream):
        mAccum, mdQ, num_batch = dq_sequence_first(mAccum, mdQ, mCuSeqlensQ, self.cfg.varlen)
        tile_m = self.layout.tile_m
        self.kernel(mAccum, mdQ, mCuSeqlensQ, softmax_scale).launch(
            grid=((max_seqlen_q + tile_m - 1) // tile_m, mdQ.shape[2], num_batch), block=[tile_m, 1, 1],
            stream=stream)

    @cute.kernel
    def kernel(self, mAccum: cute.Tensor, mdQ: cute.Tensor, mCuSeqlensQ: Optional[cute.Tensor],
               softmax_scale: Float32):
        layout, varlen = self.layout, self.cfg.varlen
        row, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        seqlen = SeqlenInfo.create(batch, mdQ.shape[0], mdQ.shape[0], mCuSeqlensQ)
        token = m_block * layout.tile_m + row
        if token < seqlen.seqlen_q:
            # One chunk = rows_per_chunk rows of ROW floats; value 4j + i of row t at j * 4 tile_m + 4 t + i.
            blocks = chunk_tiles(mAccum, layout, seqlen.offset_q, head, batch, varlen)
            gRow = head_rows(mdQ, seqlen.offset_q, head, batch, varlen)[token, None]
            for c in cutlass.range_constexpr(layout.chunks):
                chunk = blocks[None, None, m_block * layout.chunks + c]
                for v in cutlass.range_constexpr(layout.chunk // VECTOR_OUT):
                    acc = cute.make_rmem_tensor(VECTOR_OUT, Float32)
                    for h in cutlass.range_constexpr(VECTOR_OUT // VECTOR):
                        j = v * (VECTOR_OUT // VECTOR) + h
                        flat = j * VECTOR * layout.tile_m + row * VECTOR  # within the chunk, rows of ROW
                        src = cute.local_tile(chunk, (1, VECTOR), (flat // ROW, flat % ROW // VECTOR))
                        src = cute.make_tensor(src.iterator, cute.make_layout(VECTOR))
                        cute.autovec_copy(src, cute.local_tile(acc, (VECTOR,), (h,)))
                    out = cute.make_rmem_tensor(VECTOR_OUT, self.dtype)
                    out.store((acc.load() * softmax_scale).to(self.dtype))
                    cute.autovec_copy(out, cute.local_tile(gRow, (VECTOR_OUT,), (c * (layout.chunk // VECTOR_OUT) + v,)))
