"""Split-KV combine, for every architecture: the float32 partial outputs and LSEs of a split-KV
forward (ForwardConfig.split_kv), or of any attention computed over disjoint key sets (context
parallelism), merged into the output and its LSE.

Per row (one query token of one head), over the splits s:
    m = max_s LSE_s (0 where every LSE_s is -inf), sum = sum_s exp(LSE_s - m),
    LSE = log(sum) + m (-inf where every split is empty), O = sum_s exp(LSE_s - m) / sum * O_s,
in float32, O then cast to the output dtype. A split with LSE_s = -inf (it saw no key) adds
nothing: its partial output, read with the others, is selected away (whatever it holds). With a
learnable sink (``has_sink``) the sink logit of the row's head joins the maximum and the sum as one
more split without a value: the split-KV forward leaves it to the combine, so that it counts once.

Work split: a row's head-dim vectors (4 floats, 16 bytes) are spread over ``threads_per_row``
neighbouring lanes (32 at dv = 128: a warp reads a split's row in one 512-byte sweep); a CTA of
128 threads takes consecutive (token, head) rows of one batch entry, so that decoding (one token,
many heads) still fills whole CTAs. Each lane first reads every ``threads_per_row``-th split's LSE
for the row maximum and the sum (shuffle reductions over the row's lanes), then every split's
vectors it owns.

Call convention (TVM-FFI, current CUDA stream): fn(out_partial, lse_partial, out, lse, sink) with
out_partial (num_splits, b, s, h, dv) float32, lse_partial (num_splits, b, h, s) float32,
out (b, s, h, dv) in ``dtype``, lse (b, h, s) float32, sink float32 (h,) with ``has_sink``, else None.
A varlen (packed) batch is one long batch entry: (num_splits, 1, total, h, dv) and so on.
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .config import CombineConfig
from .dtypes import CUTLASS_DTYPES

THREADS = 128
VECTOR = 4  # float32 elements per 16-byte load
VECTORS_IN_FLIGHT = 16  # a lane's partial-row vectors loaded before any is used (64 registers)


def _fmax(a, b):
    return cute.arch.fmax(a, b)


def _add(a, b):
    return a + b


class SplitKVCombine:
    def __init__(self, cfg: CombineConfig):
        self.cfg = cfg
        self.dtype = Float32 if cfg.dtype == "float32" else CUTLASS_DTYPES[cfg.dtype]
        vectors = cfg.head_dim_v // VECTOR  # head dims are multiples of 8: at least 2 vectors
        # The lanes of a row split its vectors evenly: a power of two that divides 32.
        self.threads_per_row = max(t for t in (1, 2, 4, 8, 16, 32) if vectors % t == 0)
        self.vectors_per_thread = vectors // self.threads_per_row
        self.rows_per_cta = THREADS // self.threads_per_row
        self.splits_unroll = max(1, min(cfg.splits_in_flight, VECTORS_IN_FLIGHT // self.vectors_per_thread))

    @cute.jit
    def __call__(self, mOp: cute.Tensor, mLSEp: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 mSink: Optional[cute.Tensor], stream: cuda.CUstream):
        rows = mO.shape[1] * mO.shape[2]  # (token, head) pairs of a batch entry
        self.kernel(mOp, mLSEp, mO, mLSE, mSink).launch(
            grid=((rows + self.rows_per_cta - 1) // self.rows_per_cta, mO.shape[0], 1),
            block=[THREADS, 1, 1], stream=stream, use_pdl=self.cfg.pdl)

    @cute.kernel
    def kernel(self, mOp: cute.Tensor, mLSEp: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
               mSink: Optional[cute.Tensor]):
        # Launched as a programmatic dependent (PDL) of the kernel before it in the stream, the
        # split-KV forward, which lets it launch early: its CTAs start while the forward's last
        # CTAs run and wait here until that grid has finished and its partials are visible,
        # instead of a launch gap after it. Any other previous kernel is waited for the same way.
        if cutlass.const_expr(self.cfg.pdl):
            cute.arch.griddepcontrol_wait()
        tidx, _, _ = cute.arch.thread_idx()
        row_block, batch, _ = cute.arch.block_idx()
        tpr = self.threads_per_row
        num_heads = mO.shape[2]
        row = row_block * self.rows_per_cta + tidx // tpr
        lane = tidx % tpr
        token = row // num_heads
        head = row - token * num_heads
        inside = token < mO.shape[1]
        num_splits = mOp.shape[0]

        # The row's largest LSE, then the sum of exp(LSE_s - m): lane l takes splits l, l + tpr, ...
        # Every lane of a row joins the shuffles (rows past the end contribute -inf and 0).
        lse_max = -Float32.inf
        if inside:
            for s in cutlass.range(lane, num_splits, tpr, unroll=1):
                lse_max = cute.arch.fmax(lse_max, mLSEp[s, batch, head, token])
        lse_max = cute.arch.warp_reduction(lse_max, _fmax, threads_in_group=tpr)
        sink = -Float32.inf
        if cutlass.const_expr(self.cfg.has_sink):
            sink = mSink[head]  # every row has a head (rows past the end read head < num_heads too)
            lse_max = cute.arch.fmax(lse_max, sink)
        shift = lse_max
        if lse_max == -Float32.inf:
            shift = Float32(0.0)  # every split empty: exp(-inf - 0) = 0, not NaN
        total = Float32(0.0)
        if inside:
            for s in cutlass.range(lane, num_splits, tpr, unroll=1):
                total += cute.math.exp(mLSEp[s, batch, head, token] - shift)
        total = cute.arch.warp_reduction(total, _add, threads_in_group=tpr)
        if cutlass.const_expr(self.cfg.has_sink):
            total += cute.math.exp(sink - shift)  # a logit without a value: the sum, not O
        # total >= 1 whenever a split saw a key or there is a sink (the maximum contributes exp(0)).
        lse = -Float32.inf
        inv_total = Float32(0.0)
        if total > Float32(0.0):
            lse = cute.math.log(total) + shift
            inv_total = Float32(1.0) / total

        if inside:
            acc = cute.make_rmem_tensor((self.vectors_per_thread * VECTOR,), Float32)
            acc.fill(0.0)
            # Splits in groups of `unroll` (CombineConfig.splits_in_flight): all of a group's
            # partial rows are loaded into their own registers before any is used, so their loads
            # are in flight together (decoding combines a few rows over many splits, and one
            # dependent load after another was most of the kernel's time). A split past the end
            # loads nothing; an empty split's partial is read too. Both are selected away (an empty
            # split's partial may hold anything, NaN included; the other's registers were never
            # written), never multiplied.
            unroll = self.splits_unroll
            for first in cutlass.range(0, num_splits, unroll, unroll=1):
                parts = [[cute.make_rmem_tensor((VECTOR,), Float32) for _ in range(self.vectors_per_thread)]
                         for _ in range(unroll)]
                scales = cute.make_rmem_tensor((unroll,), Float32)
                for j in cutlass.range_constexpr(unroll):
                    inside_splits = first + j < num_splits
                    s = cutlass.select_(inside_splits, first + j, num_splits - 1)
                    lse_s = mLSEp[s, batch, head, token]
                    scales[j] = cutlass.select_(inside_splits and lse_s != -Float32.inf,
                                                cute.math.exp(lse_s - shift) * inv_total, Float32(0.0))
                    # (dv,) -> (VECTOR, vectors): this lane takes vectors lane, lane + tpr, ...
                    o_row = cute.zipped_divide(mOp[s, batch, token, head, None], (VECTOR,))
                    if inside_splits:
                        for i in cutlass.range_constexpr(self.vectors_per_thread):
                            cute.autovec_copy(o_row[None, i * tpr + lane], parts[j][i])
                for j in cutlass.range_constexpr(unroll):
                    for i in cutlass.range_constexpr(self.vectors_per_thread):
                        for e in cutlass.range_constexpr(VECTOR):
                            acc[i * VECTOR + e] += cutlass.select_(scales[j] > Float32(0.0),
                                                                   scales[j] * parts[j][i][e], Float32(0.0))
            out_row = cute.zipped_divide(mO[batch, token, head, None], (VECTOR,))
            converted = cute.make_rmem_tensor((VECTOR,), self.dtype)
            for i in cutlass.range_constexpr(self.vectors_per_thread):
                for e in cutlass.range_constexpr(VECTOR):
                    converted[e] = acc[i * VECTOR + e].to(self.dtype)
                cute.autovec_copy(converted, out_row[None, i * tpr + lane])
            if lane == 0:
                mLSE[batch, head, token] = lse
