"""The backward's preprocessing, for every architecture: per (batch, head, query row) the row sum
D = rowsum(dO * O) in float32 and the forward's LSE in log2 units (+inf where the row saw no key, so
that the backward's P = exp2(S * scale_log2 - LSE) is 0 there), written into the row-padded buffers
the backward kernel reads by TMA (padding rows hold 0).

One pass over O and dO (16-byte loads, float32 products, a shuffle reduction over the threads that
share a row) instead of the several full-size float32 temporaries the same math costs in torch.

Call convention (TVM-FFI, current CUDA stream): fn(out, dout, lse, dpsum, lse_log2) with out and dout
(b, s, h, dv) in ``dtype`` (varlen: the packed (total, h, dv) viewed as (1, total, h, dv)), lse (b, h, s)
float32, dpsum and lse_log2 (b, h, s_pad) float32 with s_pad >= s.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .config import PreprocessConfig
from .dtypes import CUTLASS_DTYPES
from .softmax import LOG2_E

THREADS = 128
VECTOR = 8  # 16-bit elements per 16-byte load


class BackwardPreprocess:
    def __init__(self, cfg: PreprocessConfig):
        self.cfg = cfg
        self.dtype = CUTLASS_DTYPES[cfg.dtype]
        vectors = cfg.head_dim_v // VECTOR
        # The threads of a row split its vectors evenly; a power of two that divides 32.
        self.threads_per_row = max(t for t in (1, 2, 4, 8, 16, 32) if vectors % t == 0)
        self.vectors_per_thread = vectors // self.threads_per_row
        self.rows_per_cta = THREADS // self.threads_per_row

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mdPsum: cute.Tensor,
                 mLSElog2: cute.Tensor, stream: cuda.CUstream):
        padded_rows = mdPsum.shape[2]
        self.kernel(mO, mdO, mLSE, mdPsum, mLSElog2).launch(
            grid=((padded_rows + self.rows_per_cta - 1) // self.rows_per_cta, mO.shape[2], mO.shape[0]),
            block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mdPsum: cute.Tensor,
               mLSElog2: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        row_block, head, batch = cute.arch.block_idx()
        row = row_block * self.rows_per_cta + tidx // self.threads_per_row
        lane = tidx % self.threads_per_row
        seqlen = mO.shape[1]

        dot = Float32(0.0)
        if row < seqlen:
            # (dv,) -> (VECTOR, vectors): this thread takes vectors lane, lane + threads_per_row, ...
            o_row = cute.zipped_divide(mO[batch, row, head, None], (VECTOR,))
            do_row = cute.zipped_divide(mdO[batch, row, head, None], (VECTOR,))
            o = cute.make_rmem_tensor((VECTOR,), self.dtype)
            do = cute.make_rmem_tensor((VECTOR,), self.dtype)
            of = cute.make_rmem_tensor((VECTOR,), Float32)
            dof = cute.make_rmem_tensor((VECTOR,), Float32)
            for i in cutlass.range_constexpr(self.vectors_per_thread):
                vector = i * self.threads_per_row + lane
                cute.autovec_copy(o_row[None, vector], o)
                cute.autovec_copy(do_row[None, vector], do)
                of.store(o.load().to(Float32))
                dof.store(do.load().to(Float32))
                for e in cutlass.range_constexpr(VECTOR):
                    dot += of[e] * dof[e]
        dot = cute.arch.warp_reduction(dot, lambda a, b: a + b, threads_in_group=self.threads_per_row)

        if lane == 0 and row < mdPsum.shape[2]:
            lse_log2 = Float32(0.0)  # padding rows
            if row < seqlen:
                lse = mLSE[batch, head, row]
                lse_log2 = lse * LOG2_E
                if lse == -Float32.inf:
                    lse_log2 = Float32.inf
            mdPsum[batch, head, row] = dot
            mLSElog2[batch, head, row] = lse_log2
