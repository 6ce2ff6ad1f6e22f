"""Tile schedulers: which (m_block, head, batch) tile a CTA works on.

A single-tile scheduler launches one CTA per tile. With causal or local masks tiles differ in cost
(the last query tiles see the most keys), so the grid's x index is reversed: CTAs that start first
take the longest tiles (longest-processing-time-first), which shortens the tail of the launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32


@dataclass(frozen=True)
class SingleTileScheduler:
    """Built on the device from the number of query tiles; the host launches ``grid(...)``."""

    num_m_blocks: Int32
    longest_first: cutlass.Constexpr[bool]

    @staticmethod
    def grid(num_m_blocks: Int32, num_heads: Int32, num_batch: Int32):
        return (num_m_blocks, num_heads, num_batch)

    @cute.jit
    def tile(self):
        """(m_block, head, batch) of this CTA."""
        bx, by, bz = cute.arch.block_idx()
        m_block = bx
        if cutlass.const_expr(self.longest_first):
            m_block = self.num_m_blocks - 1 - bx
        return m_block, by, bz
