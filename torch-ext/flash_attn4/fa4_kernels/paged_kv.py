"""Paged KV caches, for every architecture's forward: keys and values stored in fixed-size pages.

A paged cache is (num_pages, page_size, kv_heads, d) with a page table (batch, max_pages) int32:
sequence b's keys i * page_size .. (i + 1) * page_size - 1 live in page ``page_table[b, i]``, pages
in any order, shared by any number of sequences. Its length is ``seqused_k[b]``.

A kernel loads its (tile_n x d) K and V tiles as tile_n / rows_per_copy TMA boxes of
``rows_per_copy = gcd(tile_n, page_size)`` rows each: boxes aligned to multiples of rows_per_copy
never straddle a page boundary (page boundaries are multiples of it), so each box reads one page,
whatever the page size and the tile, and a tile of whole pages is one box per page.

A box past the sequence's end reads page ``num_pages``, outside the tensor: TMA fills it with zeros
without touching memory. So the page table is never read past the sequence's pages (its unused
entries may hold anything), and every box still delivers its bytes, which the stage's mbarrier
transaction count expects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32


def rows_per_copy(tile_n: int, page_size: int) -> int:
    """Rows of one TMA box of a paged K or V tile (plain Python; tests and kernels share it)."""
    return math.gcd(tile_n, page_size)


def kernel_view(t: cute.Tensor) -> cute.Tensor:
    """A paged cache (num_pages, page_size, h, d) as the kernels' (seq, dim, head, page) view."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))


@dataclass(frozen=True)
class PagedKV:
    """How one CTA addresses a paged cache: ``page_size`` and ``tile_n`` are compile-time, the
    page table and the batch entry runtime."""

    page_size: cutlass.Constexpr[int]
    tile_n: cutlass.Constexpr[int]
    page_table: cute.Tensor  # (batch, max_pages) int32
    batch: Int32

    @property
    def rows(self) -> int:
        return rows_per_copy(self.tile_n, self.page_size)

    @property
    def copies(self) -> int:
        """TMA boxes per K or V tile."""
        return self.tile_n // self.rows

    def head_boxes(self, t: cute.Tensor, head: Int32, cols: int) -> cute.Tensor:
        """Head ``head`` of a kernel_view'd cache as (rows, cols, boxes per page, page): the TMA
        source of every box (columns past the head dim are outside the tensor: zeros)."""
        boxes = cute.flat_divide(t[None, None, head, None], (self.rows, cols))  # (rows, cols, per_page, 1, page)
        return boxes[None, None, None, 0, None]

    def stage_boxes(self, s: cute.Tensor) -> cute.Tensor:
        """A (tile_n, cols, stage) shared-memory ring as (rows, cols, box, stage): each box's
        destination within its stage."""
        boxes = cute.flat_divide(s, (self.rows, s.shape[1]))  # (rows, cols, box, 1, stage)
        return boxes[None, None, None, 0, None]

    @cute.jit
    def box_source(self, n_block: Int32, box: int, seqlen_k: Int32, num_pages: Int32):
        """(box within its page, page) of box ``box`` of KV block ``n_block``: the page table's
        entry for keys inside the sequence, else page num_pages (zero fill)."""
        first = n_block * self.tile_n + box * self.rows
        page = num_pages
        if first < seqlen_k:
            page = self.page_table[self.batch, first // self.page_size]
        return (first % self.page_size) // self.rows, page
