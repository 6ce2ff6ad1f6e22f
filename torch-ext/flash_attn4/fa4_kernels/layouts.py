"""Views of kernel tensors that no architecture owns: operands read transposed, TMA partitions of
tiles, query heads packed into the sequence mode (GQA packing)."""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
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


def pack_query_heads(t: cute.Tensor, g: int, head_mode: int, heads: int = 0, extent=None) -> cute.Tensor:
    """A kernel-layout tensor, sequence first and the query heads in mode ``head_mode`` ((seq, dim,
    hq[, batch]) or (seq, hq[, batch]); seq is the packed total with varlen), viewed with the g query
    heads of each KV head folded into the sequence mode as ((g, seq), ..., hq // g, ...), so that row
    r of a KV head is token r // g of its query head r % g, and row offsets are tokens times g.

    ``heads`` (QueryPacking.padded): each KV head has only that many real query heads, r < g; the
    KV-head mode then steps r heads and has hq // r entries, and the head-in-group mode's rows from r
    on alias the next KV head's heads or lie past the tensor (the caller never touches them), unless
    ``extent`` (the runtime r) replaces its extent g: a TMA descriptor made from that view clips to
    it (QueryPacking.tma_view)."""
    heads = heads or g
    shape, stride = list(t.layout.shape), list(t.layout.stride)
    shape[0], stride[0] = (g if extent is None else extent, shape[0]), (stride[head_mode], stride[0])
    shape[head_mode], stride[head_mode] = shape[head_mode] // heads, stride[head_mode] * heads
    return cute.make_tensor(t.iterator, cute.make_layout(tuple(shape), stride=tuple(stride)))


@dataclass(frozen=True)
class QueryPacking:
    """How a forward's tile rows hold query heads (ForwardConfig.pack_gqa / pack_gqa_heads): ``group``
    rows per query token (1: unpacked, one head per tile), of which the first ``heads`` are real
    query heads of the tile's KV head. ``heads < group`` (``padded``): a ratio the tiles cannot
    divide (7) runs in groups that they can (8); rows with head in group >= heads are dummies.
    Trace-time Python: every branch on it is resolved while the kernel is built."""

    group: int
    heads: int

    @staticmethod
    def of(cfg) -> "QueryPacking":
        return QueryPacking(cfg.pack_gqa, cfg.query_heads_per_group)

    @property
    def padded(self) -> bool:
        return self.heads < self.group

    def view(self, t: cute.Tensor, head_mode: int) -> cute.Tensor:
        """The packed view rows are indexed through (pack_query_heads; t itself when unpacked)."""
        if self.group == 1:
            return t
        return pack_query_heads(t, self.group, head_mode, self.heads)

    def tma_view(self, t: cute.Tensor, head_mode: int, heads_per_kv_head) -> cute.Tensor:
        """The view a TMA descriptor for Q or O is made from: ``view`` but, padded, with the
        head-in-group mode of extent ``heads_per_kv_head`` (the runtime hq // hk, equal to
        ``heads``): a box of ``group`` rows along it reads zeros into the dummy rows and stores
        nothing from them, and never reaches past the tensor (the last KV head's last token)."""
        if not self.padded:
            return self.view(t, head_mode)
        return pack_query_heads(t, self.group, head_mode, self.heads, extent=heads_per_kv_head)

    def tma_tiler(self, rows: int, cols: int):
        """The tiler of a (rows, cols) tile of a tma_view: padded, the rows as (group, tokens),
        head fastest, the order of the tile's rows."""
        if not self.padded:
            return (rows, cols)
        return ((self.group, rows // self.group), cols)

    def tma_tile(self, t: cute.Tensor, rows: int, cols: int, block) -> cute.Tensor:
        """Row block ``block`` of one head of a tma_view, (rows, cols) (padded: ((group, tokens), cols));
        ``block`` None: every row block, the tile index last."""
        if not self.padded:
            return cute.local_tile(t, (rows, cols), (block, 0))
        return cute.local_tile(t, self.tma_tiler(rows, cols), ((0, block), 0))

    def tma_window(self, t: cute.Tensor, rows: int, cols: int, first_row) -> cute.Tensor:
        """The (rows, cols) tile of one head of a tma_view whose first row is ``first_row`` (a
        multiple of ``group``; padded: ((group, tokens), cols), starting at token first_row // group):
        a tile not aligned to ``rows``, such as a CTA pair's M = 256 window over one CTA's rows."""
        if not self.padded:
            return cute.local_tile(cute.domain_offset((first_row, 0), t), (rows, cols), (0, 0))
        return cute.local_tile(cute.domain_offset(((0, first_row // self.group), 0), t),
                               self.tma_tiler(rows, cols), ((0, 0), 0))

    def tma_rows_before(self, mask, seqlen):
        """Where a varlen sequence starts in a tma_view's row mode: the mask's row count, or padded a
        (head, token) coordinate (a flat row count would be split by the extent-``heads`` mode)."""
        if not self.padded:
            return mask.rows_before(seqlen)
        return (0, seqlen.offset_q)

    def query_head(self, kv_head, row):
        """The query head of tile row ``row`` (of a tile of KV head ``kv_head`` whose first row
        starts a group), for what a row reads per head (a learnable sink): a padded group's dummy
        rows name its last real head (any would do: they are never stored)."""
        in_group = row % self.group
        if self.padded:
            in_group = cutlass.min(in_group, self.heads - 1)
        return kv_head * self.heads + in_group

    def real_row(self, row):
        """Whether tile row ``row`` (of a tile whose first row starts a group) holds a real query head:
        always, unless padded."""
        return row % self.group < self.heads


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
