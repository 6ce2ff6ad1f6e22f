"""Element-wise attention masks on a (rows, cols) view of a score fragment.

Architecture-independent: a kernel passes its score fragment and the matching coordinate fragment
(an identity tensor partitioned like the scores), both viewed as (rows, cols); how the fragment is
laid out across threads is the kernel's business. Semantics: see ``block_range``.
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

    @cute.jit
    def apply(self, s_rows: cute.Tensor, coord_rows: cute.Tensor, seqlen: SeqlenInfo,
              m_block: Int32, n_block: Int32):
        """Set every score that row i may not see to -inf, in place."""
        offset = seqlen.diagonal_offset()
        for r in cutlass.range_constexpr(cute.size(s_rows, mode=[0])):
            row = coord_rows[r, 0][0] + m_block * self.tile_m
            hi = seqlen.seqlen_k  # exclusive
            lo = Int32(0)
            if cutlass.const_expr(self.causal):
                hi = cutlass.min(hi, row + offset + 1)
            if cutlass.const_expr(self.local):
                if self.window_right >= 0:
                    hi = cutlass.min(hi, row + offset + self.window_right + 1)
                if self.window_left >= 0:
                    lo = row + offset - self.window_left
            # Shift the bounds into the block's column frame once per row.
            hi = hi - n_block * self.tile_n
            lo = lo - n_block * self.tile_n
            for c in cutlass.range_constexpr(cute.size(s_rows, mode=[1])):
                col = coord_rows[0, c][1]
                if col >= hi or col < lo:
                    s_rows[r, c] = -Float32.inf
