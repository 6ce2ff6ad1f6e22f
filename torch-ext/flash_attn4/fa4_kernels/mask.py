"""Attention masks, shared by every architecture: which KV blocks a query tile visits, which of
them are full (need no element-wise mask), and the element-wise mask itself.

Semantics (FlashAttention's, aligned bottom-right): query row i sees key j iff
    i + (sk - sq) - window_left <= j <= i + (sk - sq) + window_right   and   0 <= j < sk,
with causal meaning window_right = 0, and a negative window meaning unbounded on that side.

The element-wise mask works on a fragment's scores as values (a list of rows, as the softmax takes
them) and the matching coordinate fragment (an identity tensor partitioned like the scores, viewed
as rows and columns); how a fragment is spread over threads is the kernel's business.
``key_bounds`` gives one query row's visible keys, for kernels that lay scores out otherwise (the
backward's keys x queries).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .seqlen import SeqlenInfo


@dataclass(frozen=True)
class AttentionMask:
    tile_m: cutlass.Constexpr[int]
    tile_n: cutlass.Constexpr[int]
    causal: cutlass.Constexpr[bool]
    local: cutlass.Constexpr[bool]
    window_left: Int32  # used only when local; negative = unbounded
    window_right: Int32
    # Tile rows per query token: g when the g query heads of a KV head share a tile (GQA packing,
    # row r = token r // g), else 1. Row bounds below are in rows, the mask itself in tokens.
    rows_per_query: cutlass.Constexpr[int] = 1

    def query(self, row):
        """The query token of tile row ``row`` (counted from the sequence's first row)."""
        if cutlass.const_expr(self.rows_per_query == 1):
            return row
        return row // self.rows_per_query

    def rows(self, seqlen: SeqlenInfo):
        """The sequence's rows: its query tokens times rows_per_query."""
        if cutlass.const_expr(self.rows_per_query == 1):
            return seqlen.seqlen_q
        return seqlen.seqlen_q * self.rows_per_query

    def rows_before(self, seqlen: SeqlenInfo):
        """Where the sequence's rows start among a varlen batch's (0 for batched inputs)."""
        if cutlass.const_expr(self.rows_per_query == 1):
            return seqlen.offset_q
        return seqlen.offset_q * self.rows_per_query

    @cute.jit
    def n_block_range(self, seqlen: SeqlenInfo, m_block: Int32):
        """[n_block_min, n_block_max) of KV blocks holding at least one key visible to the tile."""
        n_block_max = (seqlen.seqlen_k + self.tile_n - 1) // self.tile_n
        n_block_min = Int32(0)
        offset = seqlen.diagonal_offset()
        if cutlass.const_expr(self.causal or self.local):
            # The tile's last row (clipped to the sequence) sees the rightmost key.
            last_row = self.query(cutlass.min((m_block + 1) * self.tile_m, self.rows(seqlen)) - 1)
            right = Int32(0)
            if cutlass.const_expr(self.local):
                right = self.window_right
            hi = last_row + offset + right + 1  # exclusive bound on visible keys
            if cutlass.const_expr(self.local):
                if self.window_right < 0:
                    hi = seqlen.seqlen_k
            hi = cutlass.max(hi, 0)
            n_block_max = cutlass.min(n_block_max, (hi + self.tile_n - 1) // self.tile_n)
        if cutlass.const_expr(self.local):
            if self.window_left >= 0:
                lo = self.query(m_block * self.tile_m) + offset - self.window_left
                n_block_min = cutlass.max(lo, 0) // self.tile_n
        return n_block_min, n_block_max

    @cute.jit
    def n_block_max_full(self, seqlen: SeqlenInfo, m_block: Int32) -> Int32:
        """Blocks below this index have no key past the right mask edge (sequence end, causal
        diagonal or right window) for any row of the tile."""
        hi = seqlen.seqlen_k  # exclusive bound on keys every row sees on the right
        if cutlass.const_expr(self.causal or self.local):
            right = Int32(0)
            if cutlass.const_expr(self.local):
                right = self.window_right
            first_row_hi = self.query(m_block * self.tile_m) + seqlen.diagonal_offset() + right + 1
            if cutlass.const_expr(self.local):
                if self.window_right < 0:
                    first_row_hi = seqlen.seqlen_k
            hi = cutlass.min(hi, first_row_hi)
        return cutlass.max(hi, 0) // self.tile_n

    @cute.jit
    def n_block_min_full(self, seqlen: SeqlenInfo, m_block: Int32) -> Int32:
        """Blocks from this index on have no key before the left window edge for any row."""
        n_min = Int32(0)
        if cutlass.const_expr(self.local):
            if self.window_left >= 0:
                last_row_lo = (self.query((m_block + 1) * self.tile_m - 1) + seqlen.diagonal_offset()
                               - self.window_left)
                n_min = (cutlass.max(last_row_lo, 0) + self.tile_n - 1) // self.tile_n
        return n_min

    @cute.jit
    def block_is_full(self, seqlen: SeqlenInfo, m_block: Int32, n_block: Int32):
        """Whether every query row of the tile lies inside the sequence and sees every key of KV
        block ``n_block`` (a kernel may then skip the element-wise mask)."""
        rows_inside = (m_block + 1) * self.tile_m <= self.rows(seqlen)
        return (rows_inside and n_block < self.n_block_max_full(seqlen, m_block)
                and n_block >= self.n_block_min_full(seqlen, m_block))

    @cute.jit
    def m_block_range(self, seqlen: SeqlenInfo, n_block: Int32):
        """[m_block_min, m_block_max) of query blocks with at least one row that sees a key of KV
        block ``n_block`` (the backward pass walks query blocks for a fixed KV block; one row per
        query token)."""
        m_block_max = (seqlen.seqlen_q + self.tile_m - 1) // self.tile_m
        m_block_min = Int32(0)
        offset = seqlen.diagonal_offset()
        if cutlass.const_expr(self.causal or self.local):
            right = Int32(0)
            if cutlass.const_expr(self.local):
                right = self.window_right
            # Row i sees key j only if j <= i + offset + right: the block's first key bounds i below.
            lo = n_block * self.tile_n - offset - right
            if cutlass.const_expr(self.local):
                if self.window_right < 0:
                    lo = Int32(0)
            m_block_min = cutlass.max(lo, 0) // self.tile_m
        if cutlass.const_expr(self.local):
            if self.window_left >= 0:
                # Row i sees key j only if j >= i + offset - window_left: the block's last key bounds i.
                hi = (n_block + 1) * self.tile_n - 1 - offset + self.window_left + 1  # exclusive
                m_block_max = cutlass.min(m_block_max, (cutlass.max(hi, 0) + self.tile_m - 1) // self.tile_m)
        return m_block_min, m_block_max

    @cute.jit
    def key_bounds(self, seqlen: SeqlenInfo, row: Int32, n_block: Int32):
        """Keys query ``row`` sees, as [lo, hi) relative to the first key of KV block ``n_block``."""
        offset = seqlen.diagonal_offset()
        hi = seqlen.seqlen_k  # exclusive
        lo = Int32(0)
        if cutlass.const_expr(self.causal):
            hi = cutlass.min(hi, row + offset + 1)
        if cutlass.const_expr(self.local):
            if self.window_right >= 0:
                hi = cutlass.min(hi, row + offset + self.window_right + 1)
            if self.window_left >= 0:
                lo = row + offset - self.window_left
        hi = hi - n_block * self.tile_n
        lo = lo - n_block * self.tile_n
        return lo, hi

    @cute.jit
    def apply(self, scores: list, coord_rows: cute.Tensor, seqlen: SeqlenInfo,
              m_block: Int32, n_block: Int32) -> list:
        """The scores (rows of values) with every score that row i may not see set to -inf: one
        compare (two with a left window) and one select per score. A branch per score instead makes
        the compiler re-select every earlier score of the fragment at each join, quadratic in the
        fragment size (sm_90a SASS of the d=128 causal forward: 1072 FSEL with a branch per score,
        134 with selects)."""
        # Each column's key index, the same in every row: column 0's read from the coordinates, the
        # others a static offset from it (one add, where a coordinate read traces a dozen IR ops),
        # made in row 0 where they are first used, so that the generated code keeps its order.
        cols = []
        masked = []
        for r in cutlass.range_constexpr(len(scores)):
            lo, hi = self.key_bounds(seqlen, self.query(coord_rows[r, 0][0] + m_block * self.tile_m), n_block)
            row = []
            for c in cutlass.range_constexpr(len(scores[r])):
                if cutlass.const_expr(r == 0 and c == 0):
                    cols.append(coord_rows[0, 0][1])
                elif cutlass.const_expr(r == 0):
                    cols.append(cols[0] + cute.crd2idx((0, c), coord_rows.layout)[1])
                keep = cols[c] < hi
                if cutlass.const_expr(self.local):  # without a left window lo <= 0 <= col
                    keep = keep & (cols[c] >= lo)
                row.append(Float32(cutlass.select_(keep, scores[r][c], -Float32.inf)))
            masked.append(row)
        return masked
