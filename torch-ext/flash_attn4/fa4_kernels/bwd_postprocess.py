"""The backward's postprocessing, for every architecture: dQ = dq_accum * softmax_scale in the input
dtype, from the float32 accumulator the backward kernel reduce-adds into.

One pass (two 16-byte float32 loads and one 16-byte store per 8 elements) instead of torch's multiply
and cast, which write and read a float32 temporary in between.

Call convention (TVM-FFI, current CUDA stream): fn(dq_accum, dq, softmax_scale) with dq_accum float32
and dq in ``dtype``, both contiguous, flattened to (n,) with n a multiple of 8 (every head dim is).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .config import PostprocessConfig
from .dtypes import CUTLASS_DTYPES

THREADS = 256
VECTOR = 8  # elements per thread: one 16-byte store of 16-bit values


class BackwardPostprocess:
    def __init__(self, cfg: PostprocessConfig):
        self.cfg = cfg
        self.dtype = CUTLASS_DTYPES[cfg.dtype]

    @cute.jit
    def __call__(self, mAccum: cute.Tensor, mOut: cute.Tensor, scale: Float32, stream: cuda.CUstream):
        vectors = cute.size(mAccum) // VECTOR
        self.kernel(cute.zipped_divide(mAccum, (VECTOR,)), cute.zipped_divide(mOut, (VECTOR,)), scale).launch(
            grid=((vectors + THREADS - 1) // THREADS, 1, 1), block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, gAccum: cute.Tensor, gOut: cute.Tensor, scale: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        vector = block * THREADS + tidx
        if vector < cute.size(gAccum, mode=[1]):
            acc = cute.make_rmem_tensor((VECTOR,), Float32)
            out = cute.make_rmem_tensor((VECTOR,), self.dtype)
            cute.autovec_copy(gAccum[None, vector], acc)
            out.store((acc.load() * scale).to(self.dtype))
            cute.autovec_copy(out, gOut[None, vector])
