"""Split-KV forward as one host function, for every architecture with a split-KV forward: the arch's
split kernel writes float32 partials into a workspace, then the combine (combine.py) merges them
into the caller's out and LSE, both launched from one compiled host function.

Why one function: decoding is host-bound. A step runs one attention call per layer between the
model's other ops, and each TVM-FFI call and each allocation is paid there on the CPU: one call and
one workspace instead of two of each took about a tenth off the host time of the transformers
adapter's decode call on the H200 (docs/perf.md, session 30). The kernels themselves are the ones
separate launches run (the combine still starts as a programmatic dependent of the split kernel).

The workspace, float32 (num_splits, per_split) row-major, holds each split's partials side by side:

    split s: [ O_s: rows x dv | LSE_s: rows | padding ],   rows = b * sq * hq (batched) or total_q * hq

with per_split >= rows * (dv + 1), a multiple of 8 (SplitKVConfig.workspace_shape), so that every
split's O starts 32-byte aligned. O_s is laid out like out (b, sq, hq, dv) or (total_q, hq, dv) and
LSE_s like lse (b, hq, sq) or (hq, total_q): the views the split kernel and the combine take
(ForwardConfig.split_kv and combine.py) are cut from it here, at no host cost. The kernels touch
only those rows * (dv + 1) elements of a split: a caller may keep its own data in the rest (ops
has the combine write an LSE that its caller drops there).

Call convention (TVM-FFI, current CUDA stream), ForwardConfig's with the workspace after lse:

    fn(q, k, v, out, lse, workspace, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table,
       learnable_sink, softmax_scale, softcap, window_left, window_right, max_seqlen_q)

out and lse are the caller's (the combine writes them whole); learnable_sink goes to the combine
(SplitKVConfig.combine.has_sink), never to the splits.
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from .arch import kernels_for
from .combine import SplitKVCombine
from .config import SplitKVConfig


class SplitKVForward:
    """The pipeline of a SplitKVConfig: its forward (the arch's kernel class, split_kv=True) and its
    combine, launched in that order on one stream by one host function."""

    def __init__(self, cfg: SplitKVConfig):
        self.cfg = cfg
        entry = kernels_for(cfg.forward.arch, "forward")
        self.forward = entry.load(entry.forward)(cfg.forward)
        self.combine = SplitKVCombine(cfg.combine)
        self.varlen = cfg.forward.varlen
        self.head_dim_v = cfg.forward.head_dim_v

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 mWork: cute.Tensor, mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor],
                 mSeqUsedQ: Optional[cute.Tensor], mSeqUsedK: Optional[cute.Tensor],
                 mPageTable: Optional[cute.Tensor], mSink: Optional[cute.Tensor], softmax_scale: Float32,
                 softcap: Float32, window_left: Int32, window_right: Int32, max_seqlen_q: Int32,
                 stream: cuda.CUstream):
        mOp, mLSEp = self.partials(mWork, mO)
        self.forward(mQ, mK, mV, mOp, mLSEp, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, mPageTable, None,
                     softmax_scale, softcap, window_left, window_right, max_seqlen_q, stream)
        if cutlass.const_expr(self.varlen):
            # combine.py takes the packed tokens as one batch entry: a unit batch mode on every view.
            self.combine(unit_mode(mOp, 1), unit_mode(mLSEp, 1), unit_mode(mO, 0), unit_mode(mLSE, 0), mSink,
                         stream)
        else:
            self.combine(mOp, mLSEp, mO, mLSE, mSink, stream)

    @cute.jit
    def partials(self, mWork: cute.Tensor, mO: cute.Tensor):
        """The split kernel's (num_splits, *out) partial outputs and (num_splits, *lse) partial LSEs,
        cut from the workspace (module docstring). Strides in 64 bits: a workspace may pass 2^31
        elements."""
        dv = self.head_dim_v
        per_split = mWork.stride[0]
        splits = mWork.shape[0]
        # Whole rows of dv: the divisibility the kernels' 16-byte accesses need, said explicitly (a
        # product of runtime sizes carries none).
        rows_of = lambda n: cute.assume(Int64(n) * dv, divby=dv)  # noqa: E731
        if cutlass.const_expr(self.varlen):
            total, heads = mO.shape[0], mO.shape[1]
            o_layout = cute.make_layout((splits, total, heads, dv), stride=(per_split, rows_of(heads), dv, 1))
            lse_layout = cute.make_layout((splits, heads, total), stride=(per_split, Int64(total), 1))
            rows = Int64(total) * heads
        else:
            batch, seqlen, heads = mO.shape[0], mO.shape[1], mO.shape[2]
            o_layout = cute.make_layout((splits, batch, seqlen, heads, dv),
                                        stride=(per_split, rows_of(Int64(seqlen) * heads), rows_of(heads), dv, 1))
            lse_layout = cute.make_layout((splits, batch, heads, seqlen),
                                          stride=(per_split, Int64(heads) * seqlen, Int64(seqlen), 1))
            rows = Int64(batch) * seqlen * heads
        # LSE_s right after O_s: rows * dv elements on, a multiple of 8 (dv is): 32-byte aligned.
        lse_start = cute.make_ptr(Float32, mWork.iterator.toint() + cute.assume(rows * dv * 4, divby=32),
                                  cute.AddressSpace.gmem, assumed_align=32)
        return cute.make_tensor(mWork.iterator, o_layout), cute.make_tensor(lse_start, lse_layout)


def unit_mode(t: cute.Tensor, mode: int) -> cute.Tensor:
    """``t`` with a size-1 mode inserted at ``mode`` (a batch entry of one)."""
    shape, stride = list(t.shape), list(t.stride)
    shape.insert(mode, 1)
    stride.insert(mode, 0)
    return cute.make_tensor(t.iterator, cute.make_layout(tuple(shape), stride=tuple(stride)))
