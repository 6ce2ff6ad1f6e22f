"""The sm100 backward's float32 dQ accumulator: per (batch, head), query block after query block,
each block in the order the kernel's dQ warpgroup stages it for its TMA reduce-adds.

The dQ warpgroup reads a query block's dQ from tensor memory with one thread per query row (TMEM
lane) and BWD_DQ_CHUNK columns at a time. It stages each chunk in shared memory so that every
warp-wide 16-byte store covers 512 contiguous bytes (no bank conflicts): values 4j..4j+3 of the
chunk's columns of row t at j * 512 + t * 4. One TMA reduce-add then moves the whole chunk, a box
of (tile_m * chunk / 128) rows of 128 floats, into dq_accum, which therefore keeps that order:
block m's chunk c at rows (m * chunks + c) * rows_per_chunk. The postprocessing kernel
(bwd_postprocess.py) reads it back the same way. Varlen: sequence b's blocks start at block
``block_offset(cu_seqlens_q[b], b)`` (each sequence takes whole blocks). Not the sm90 order (which follows the WGMMA
accumulator's registers), hence this arch's own dq_accum_layout (arch.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import cutlass.cute as cute

from ..seqlen import head_rows
from .tiles import BWD_DQ_CHUNK

ROW = 128  # floats per row of dq_accum (what the torch layer allocates by)
VECTOR = 4  # floats per 16-byte shared-memory store


@dataclass(frozen=True)
class DqChunks:
    tile_m: int
    head_dim: int
    row: ClassVar[int] = ROW
    chunk: ClassVar[int] = BWD_DQ_CHUNK

    @property
    def chunks(self) -> int:
        return self.head_dim // self.chunk

    @property
    def rows_per_chunk(self) -> int:
        """Rows of ROW floats one chunk takes: the TMA box's outer extent."""
        return self.tile_m * self.chunk // ROW

    @property
    def rows_per_block(self) -> int:
        return self.chunks * self.rows_per_chunk

    def block_offset(self, token_offset, batch):
        """A varlen sequence's first query block (sequences take whole blocks); the sm90 rule."""
        return token_offset // self.tile_m + batch

    def block_order(self) -> list[int]:
        """For each float of a query block in dq_accum, in order, its row * head_dim + col in the
        block's (tile_m, head_dim) dQ."""
        order = []
        for c in range(self.chunks):
            for j in range(self.chunk // VECTOR):
                for t in range(self.tile_m):
                    for i in range(VECTOR):
                        order.append(t * self.head_dim + c * self.chunk + j * VECTOR + i)
        return order


def accum_layout(cfg) -> DqChunks:
    """The registry's dq_accum_layout (arch.py) for a BackwardConfig or PostprocessConfig."""
    return DqChunks(cfg.tile_m, cfg.head_dim)


def chunk_tiles(mAccum: cute.Tensor, layout: DqChunks, offset_q, head, batch, varlen: bool) -> cute.Tensor:
    """dq_accum (sequence first: (rows, ROW, head[, batch])) of one head and batch entry as its chunks,
    (rows_per_chunk, ROW, chunk index): chunk c of query block m at index m * chunks + c, a varlen
    sequence's from its first block, ``block_offset``, on. The main kernel reduce-adds there, the
    postprocessing reads."""
    first_row = layout.block_offset(offset_q, batch) * layout.rows_per_block if varlen else 0
    return cute.local_tile(head_rows(mAccum, first_row, head, batch, varlen), (layout.rows_per_chunk, ROW),
                           (None, 0))
