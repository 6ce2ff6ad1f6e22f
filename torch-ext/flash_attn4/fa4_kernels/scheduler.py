"""Tile schedulers: which (m_block, head, batch) tiles a CTA works on (the backward's tiles are KV
blocks: n_block in the place of m_block).

One CTA per output tile, or (``num_ctas``) a persistent grid whose CTAs stride through the same
order. Without masks every tile costs the same, and the launch order
(m_block fastest, then head, then batch) keeps the CTAs of one wave on few heads, whose K and V
then stay in L2 for all their query tiles.

With causal or local masks tiles differ in cost (the last query tiles see the most keys), so
tiles are issued longest-processing-time-first: the most expensive tiles start in the first waves
and the cheap ones fill the tail. Doing that over all heads at once would spread a wave's K/V
working set over every head and thrash L2, so heads are taken in groups whose K and V fit in the
arch's L2 budget (``l2_budget_bytes``, a device fact of the arch's rules: sm90 takes about half of
Hopper's 50 MB L2), and the longest-first order runs within each group.

Where the heads do not divide into whole groups, the partial group goes first. Last, its few long
tiles would start when every other tile has been handed out and run on while most SMs idle; first,
the final group is a whole one, whose many short tiles fill the tail. A model of the tail
(scripts/schedule_model.py: greedy dispatch to 132 SMs, tile cost = its KV blocks + 1; d=256
causal, 128 x 80 tiles, 32 heads, 4k: groups of 6 heads, the last of 2) puts the SMs' busy share at
0.87 with the partial group last and 0.97 with it first (d=128 4k-16k: 0.96 -> 1.00); on the H200
the forward gained 11-13% at d=256 causal 4k and 8k, 2-4% at d=128 causal 8k and 16k
(docs/perf.md, 2026-12-03).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32


def longest_first_applies(cfg) -> bool:
    """Whether a kernel configuration's tiles differ in cost (causal or local masks) in a way the
    host can order: batched inputs, where every (head, batch) pair has the same blocks. Varlen
    tiles keep the launch order (their lengths are on the device)."""
    return (cfg.causal or cfg.local) and not cfg.varlen


@dataclass(frozen=True)
class TileScheduler:
    num_m_blocks: Int32
    num_heads: Int32
    num_head_batch: Int32  # heads * batch
    group_heads: Int32  # (head, batch) pairs per L2 group; used only when longest_first
    first_group_heads: Int32  # (head, batch) pairs of the first group: the remainder of the split
    longest_first: cutlass.Constexpr[bool]
    # 0: one CTA per tile. N > 0: at most N persistent CTAs; CTA i takes tiles i, i + grid, ... of
    # the same order (a static stride: with longest-first order the expensive tiles still go first).
    num_ctas: cutlass.Constexpr[int] = 0
    # Which end of a head's blocks costs most under a causal mask: the last query block (forward,
    # tiles of queries) or the first KV block (backward, tiles of keys).
    longest_block_last: cutlass.Constexpr[bool] = True
    # CTAs per tile along the grid's x (a cluster that shares the tile: CTA pairs of the sm100
    # forward): the grid holds cluster_m CTAs per tile (per persistent worker), and a CTA's tile is
    # that of block index x // cluster_m. num_ctas counts CTAs.
    cluster_m: cutlass.Constexpr[int] = 1
    # Heads of fewer blocks than this keep the launch order (create's min_blocks; 1: none do).
    min_blocks: cutlass.Constexpr[int] = 1

    @staticmethod
    def create(num_m_blocks: Int32, num_heads: Int32, num_batch: Int32, kv_bytes_per_head: Int32,
               longest_first: bool, num_ctas: int = 0, longest_block_last: bool = True, *,
               l2_budget_bytes: int, cluster_m: int = 1, min_group: int = 1,
               min_blocks: int = 1) -> "TileScheduler":
        """Host side. kv_bytes_per_head: the bytes one (head, batch) pair streams through L2 (K and V
        for the forward; Q and dO of its query heads for the backward); l2_budget_bytes: how much of
        the L2 a group of heads may fill (the arch's rules, e.g. sm90/tiles.py); min_group: groups of
        fewer heads than this become groups of one: each head's blocks in turn, the longest first
        (for the backward, whose longest blocks come first, the launch order itself); min_blocks:
        heads of fewer blocks than this keep the launch order (groups of one, each head's blocks
        from the first), a choice at run time."""
        num_head_batch = num_heads * num_batch
        group = Int32(1)
        if cutlass.const_expr(longest_first):
            group = cutlass.max(cutlass.min(l2_budget_bytes // cutlass.max(kv_bytes_per_head, 1), num_head_batch), 1)
            if cutlass.const_expr(min_group > 1):
                group = cutlass.select_(group >= min_group, group, Int32(1))
            if cutlass.const_expr(min_blocks > 1):
                group = cutlass.select_(Int32(num_m_blocks) >= min_blocks, group, Int32(1))
        first = num_head_batch - (num_head_batch - 1) // group * group  # 1..group
        return TileScheduler(num_m_blocks, num_heads, num_head_batch, group, first, longest_first, num_ctas,
                             longest_block_last, cluster_m, min_blocks if longest_first else 1)

    def num_tiles(self):
        return self.num_m_blocks * self.num_head_batch

    def grid(self):
        c = self.cluster_m
        if cutlass.const_expr(c > 1):  # whole clusters: the tile grid, its x scaled by c
            x, y, z = self.replace(cluster_m=1, num_ctas=self.num_ctas // c).grid()
            return (x * c, y, z)
        if cutlass.const_expr(self.num_ctas > 0):
            return (cutlass.min(self.num_tiles(), Int32(self.num_ctas)), 1, 1)
        if cutlass.const_expr(self.longest_first):
            return (self.num_tiles(), 1, 1)
        return (self.num_m_blocks, self.num_heads, self.num_head_batch // self.num_heads)

    @cute.jit
    def tile(self):
        """Device side, one CTA per tile: (m_block, head, batch) of this CTA."""
        bx, by, bz = cute.arch.block_idx()
        if cutlass.const_expr(self.cluster_m > 1):
            bx = bx // self.cluster_m
        m_block, head, batch = bx, by, bz
        if cutlass.const_expr(self.longest_first):
            m_block, head, batch = self.tile_at(bx)
        return m_block, head, batch

    def replace(self, **changes) -> "TileScheduler":
        return dataclasses.replace(self, **changes)

    @cute.jit
    def tile_range(self):
        """Device side, persistent CTAs: (first, end, step) of the tile indices this CTA walks (a
        cluster's CTAs walk the same tiles)."""
        first, step = cute.arch.block_idx()[0], cute.arch.grid_dim()[0]
        if cutlass.const_expr(self.cluster_m > 1):
            first, step = first // self.cluster_m, step // self.cluster_m
        return first, self.num_tiles(), step

    @cute.jit
    def tile_at(self, index: Int32):
        """(m_block, head, batch) of the tile at ``index`` of the launch order."""
        if cutlass.const_expr(self.longest_first):
            group_start, heads_here, rank = self.group_of(index)
            m_rev = rank // heads_here  # 0 for the longest blocks
            head_batch = group_start + (rank - m_rev * heads_here)
            m_block = m_rev
            if cutlass.const_expr(self.longest_block_last):
                m_block = self.num_m_blocks - 1 - m_rev
                if cutlass.const_expr(self.min_blocks > 1):  # short heads: the launch order
                    m_block = cutlass.select_(Int32(self.num_m_blocks) < self.min_blocks, m_rev, m_block)
        else:
            head_batch = index // self.num_m_blocks
            m_block = index - head_batch * self.num_m_blocks
        batch = head_batch // self.num_heads
        head = head_batch - batch * self.num_heads
        return m_block, head, batch

    def launch_order_divisors(self):
        """Host side: FastDivmod divisors of the launch order's two divisions (by num_m_blocks, then
        by num_heads), for tile_at_fast. A persistent CTA decodes a tile index per tile and role; a
        division by a runtime value costs ~30 SASS instructions there, a FastDivmod a multiply-high
        and a shift (its magic numbers computed once, on the host)."""
        # At least 1: a launch with no query block has no tile to decode, but its divisor is built
        # all the same (on the host, where a zero divisor would fault).
        return (cute.fast_divmod_create_divisor_v2(cutlass.max(self.num_m_blocks, 1)),
                cute.fast_divmod_create_divisor_v2(cutlass.max(self.num_heads, 1)))

    @cute.jit
    def tile_at_fast(self, index: Int32, divisors):
        """tile_at of the launch order (not longest_first) with launch_order_divisors()."""
        head_batch, m_block = divmod(index, divisors[0])
        batch, head = divmod(head_batch, divisors[1])
        return m_block, head, batch

    @cute.jit
    def group_of(self, index: Int32):
        """Longest-first order: the L2 group of tile ``index`` as its first (head, batch) pair and
        its number of pairs, and the tile's rank within the group."""
        # The remainder of the split first (first_group_heads pairs), then whole groups.
        group_tiles = self.group_heads * self.num_m_blocks
        first_tiles = self.first_group_heads * self.num_m_blocks
        group_start = Int32(0)
        heads_here = self.first_group_heads
        rank = index
        if index >= first_tiles:
            later = (index - first_tiles) // group_tiles
            rank = index - first_tiles - later * group_tiles
            group_start = self.first_group_heads + later * self.group_heads
            heads_here = self.group_heads
        return group_start, heads_here, rank


@dataclass(frozen=True)
class KVSplits:
    """Split-KV: ``num_splits`` CTAs share the KV blocks of every output tile, each writing a partial
    output that a combine kernel merges. The split index is folded into the scheduler's head mode
    (head * num_splits + split): the kernel creates its TileScheduler with ``fold(num_heads)`` heads,
    so that every order the scheduler knows serves, and ``unfold``s the head it is handed. The
    splits of a head are neighbours in the launch order; they read disjoint KV ranges."""

    num_splits: Int32

    def fold(self, num_heads: Int32) -> Int32:
        return num_heads * self.num_splits

    @cute.jit
    def unfold(self, head_split: Int32):
        """(head, split) of a folded head index."""
        head = head_split // self.num_splits
        return head, head_split - head * self.num_splits

    @cute.jit
    def block_range(self, n_block_min: Int32, n_block_max: Int32, split: Int32):
        """Split ``split``'s share [lo, hi) of a tile's KV blocks [n_block_min, n_block_max): ``per`` =
        ceil(blocks / num_splits) consecutive blocks each, so the last splits may get fewer or none
        (an empty range has hi == lo)."""
        blocks = cutlass.max(n_block_max - n_block_min, 0)
        per = (blocks + self.num_splits - 1) // self.num_splits
        lo = cutlass.min(n_block_min + split * per, n_block_min + blocks)
        hi = cutlass.min(lo + per, n_block_min + blocks)
        return lo, hi
