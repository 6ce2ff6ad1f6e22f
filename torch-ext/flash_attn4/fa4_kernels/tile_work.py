"""What one CTA works on, as the kernels of every architecture describe it: the forward's output
tile (a query block and the KV blocks it sees) and the backward's KV tile (with the query blocks it
steps through). Built inside the kernels from the scheduler's coordinates, the sequence lengths
(seqlen.py) and the mask's block ranges (mask.py)."""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
from cutlass import Int32

from .mask import AttentionMask
from .seqlen import SeqlenInfo


@dataclass(frozen=True)
class OutputTile:
    """One (tile_m x head_dim_v) output tile: query block ``m_block`` of query head ``head`` (reading
    KV head ``head_kv``) in batch entry ``batch``, and the KV blocks [n_block_min, n_block_max) its
    rows see."""

    tile_m: cutlass.Constexpr[int]
    seqlen: SeqlenInfo
    mask: AttentionMask
    m_block: Int32
    head: Int32
    batch: Int32
    head_kv: Int32
    n_block_min: Int32
    n_block_max: Int32

    def in_sequence(self):
        """Whether the tile holds a query row (varlen grids are sized for the longest sequence)."""
        return self.m_block * self.tile_m < self.mask.rows(self.seqlen)


@dataclass(frozen=True)
class TileWork:
    """What one backward CTA does: KV tile ``n_block`` of KV head ``head_kv`` in batch entry
    ``batch``, over ``num_steps`` (query head, query block) steps."""

    seqlen: SeqlenInfo
    mask: AttentionMask
    blocks: "QueryBlocks"
    num_steps: Int32
    n_block: Int32
    head_kv: Int32
    batch: Int32


@dataclass(frozen=True)
class QueryBlocks:
    """The (query head, query block) steps of one KV tile: every query head sharing the KV head,
    each over the same range of query blocks."""

    first_head: Int32
    m_block_min: Int32
    per_head: Int32  # query blocks per head

    def at(self, step: Int32):
        return self.first_head + step // self.per_head, self.m_block_min + step % self.per_head
