"""Views of kernel tensors that no architecture owns: operands read transposed, TMA partitions of
tiles, query heads packed into the sequence mode (GQA packing)."""

from __future__ import annotations

import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync


def transpose_view(t: cute.Tensor) -> cute.Tensor:
    """Swap the first two modes of a shared-memory tensor: a row-major (k, n) tile read as the
    N-major B operand (n, k) of an MMA."""
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


def tma_partition_tile(atom: cute.CopyAtom, smem: cute.Tensor, gmem: cute.Tensor, box_rank: int = 2):
    """(smem, gmem) partitions for a TMA copy of (rows, cols[, ...]) tiles without multicast: the first
    ``box_rank`` modes form the TMA box, the rest (stages, tile index) stay addressable."""
    return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(smem, 0, box_rank),
                                 cute.group_modes(gmem, 0, box_rank))


def pack_query_heads(t: cute.Tensor, g: int, head_mode: int) -> cute.Tensor:
    """A kernel-layout tensor, sequence first and the query heads in mode ``head_mode`` ((seq, dim,
    hq[, batch]) or (seq, hq[, batch]); seq is the packed total with varlen), viewed with the g query
    heads of each KV head folded into the sequence mode as ((g, seq), ..., hq // g, ...), so that row
    r of a KV head is token r // g of its query head r % g, and row offsets are tokens times g."""
    shape, stride = list(t.layout.shape), list(t.layout.stride)
    shape[0], stride[0] = (g, shape[0]), (stride[head_mode], stride[0])
    shape[head_mode], stride[head_mode] = shape[head_mode] // g, stride[head_mode] * g
    return cute.make_tensor(t.iterator, cute.make_layout(tuple(shape), stride=tuple(stride)))


def last_mode_slice(t: cute.Tensor, index) -> cute.Tensor:
    """``t`` at ``index`` of its last mode, every other mode whole (nested modes, such as packed
    query heads, stay as they are): one split's partial output of a split-KV kernel."""
    return t[(None,) * (cute.rank(t) - 1) + (index,)]


def dq_sequence_first(mAccum: cute.Tensor, mdQ: cute.Tensor, mCuSeqlensQ, varlen: bool):
    """The dQ postprocessing's views, sequence first as in the backward's main kernel: the float32
    accumulator as (rows, 128, head[, batch]) and dQ as (seq, d, head[, batch]) (varlen: the packed
    sequences are one), with the number of sequences. Trace-time Python: ``varlen`` is a constant."""
    if varlen:
        mAccum = cute.make_tensor(mAccum.iterator, cute.select(mAccum.layout, mode=[1, 2, 0]))
        mdQ = cute.make_tensor(mdQ.iterator, cute.select(mdQ.layout, mode=[0, 2, 1]))
        return mAccum, mdQ, mCuSeqlensQ.shape[0] - 1
    mAccum = cute.make_tensor(mAccum.iterator, cute.select(mAccum.layout, mode=[2, 3, 1, 0]))
    mdQ = cute.make_tensor(mdQ.iterator, cute.select(mdQ.layout, mode=[1, 3, 2, 0]))
    return mAccum, mdQ, mdQ.shape[3]
