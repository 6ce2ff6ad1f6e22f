"""The sm90 backward's float32 dQ accumulator, kept in the WGMMA accumulator's register order.

Every KV tile adds its share of dQ for a query block, in two parts, one per consumer warpgroup;
a part is one WGMMA accumulator, ``values`` floats in each of 128 threads. In (row, column) order
a thread's values come in pairs of columns (rows, for dQ^T), so staging a part for the TMA took a
64-bit (32-bit) shared-memory store per pair. In register order -- values 4j..4j+3 of thread t at
j * 512 + t * 4 -- it takes one 128-bit store per 4 values, each warp writing 512 contiguous bytes
(d = 64: 8 stores instead of 16; d = 128 at 80-query blocks: 10 instead of 40).

dq_accum keeps that order in global memory: per (batch, head), query block after query block, each
block its parts one after the other, a part ``values`` rows of 128 floats (the TMA box of its
reduce-add). The postprocessing kernel (bwd_postprocess.py) puts dQ back in (row, column) order
when it converts it. Varlen: sequence b's blocks start at block ``block_offset(cu_seqlens_q[b], b)``.

``block_order`` is the same mapping in plain Python (from the WGMMA accumulator layout), for the
torch layer's reference of the postprocessing; the GPU tests check the kernels against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import OperandMajorMode

from ..seqlen import head_rows
from .wgmma import WARPGROUP_THREADS

ROW = 128  # floats per row of dq_accum: the TMA box's inner extent
NUM_PARTS = 2  # one per consumer warpgroup of the backward kernel


@dataclass(frozen=True)
class DqTiling:
    """How a query block's dQ (tile_m x head_dim) is split between the consumer warpgroups: by rows
    (128-query blocks: 64 each), else by head-dim halves; a query block that is no multiple of 64
    rows (80) is computed transposed, dQ^T = K^T dS^T, the head dim as the WGMMA's M."""

    tile_m: int
    head_dim: int
    row: ClassVar[int] = ROW  # what the registry's dq_accum_layout promises (arch.py)

    @property
    def transposed(self) -> bool:
        return self.tile_m % 64 != 0

    @property
    def parts_m(self) -> int:
        """Parts along the query rows (the rest split the head dim)."""
        return 1 if self.transposed else self.tile_m // 64

    @property
    def parts_n(self) -> int:
        return NUM_PARTS // self.parts_m

    @property
    def part(self) -> tuple[int, int]:
        """(rows, cols) of one part, in dQ's orientation."""
        return self.tile_m // self.parts_m, self.head_dim // self.parts_n

    @property
    def values(self) -> int:
        """Accumulator values per thread; also the rows of 128 floats a part takes in dq_accum."""
        rows, cols = self.part
        return rows * cols // WARPGROUP_THREADS

    @property
    def rows_per_block(self) -> int:
        return NUM_PARTS * self.values

    def block_offset(self, token_offset, batch):
        """``block_offset`` at this tiling's query blocks."""
        return block_offset(token_offset, batch, self.tile_m)

    def block_order(self) -> list[int]:
        """For each float of a query block in dq_accum, in order, its position row * head_dim + col
        in the block's (tile_m, head_dim) dQ. The WGMMA accumulator of an M=64 x N tile gives thread
        t's value v = v0 + 2 v1 + 4 v2 the element (M, N) = ((t % 32) // 4 + 16 (t // 32) + 8 v1,
        2 (t % 4) + v0 + 8 v2); a part adds its warpgroup's offset along M or N."""
        rows, cols = self.part
        mma_n = rows if self.transposed else cols  # the WGMMA's N: queries for dQ^T
        order = []
        for part in range(NUM_PARTS):
            for j in range(self.values // 4):
                for t in range(WARPGROUP_THREADS):
                    for i in range(4):
                        v = 4 * j + i
                        m = (t % 32) // 4 + 16 * (t // 32) + 8 * ((v // 2) % 2)
                        n = 2 * (t % 4) + v % 2 + 8 * (v // 4)
                        assert n < mma_n
                        if self.transposed:  # M is the head dim, split between the parts
                            row, col = n, m + 64 * part
                        else:
                            row, col = m + rows * (part // self.parts_n), n + cols * (part % self.parts_n)
                        order.append(row * self.head_dim + col)
        return order


def block_offset(token_offset, batch, tile_m: int):
    """The first query block of the varlen sequence ``batch`` (tokens from ``token_offset``) in
    dq_accum: sequences take whole blocks, so each starts at most one block later than its tokens
    would; ``block_offset(total_q, batch_size)`` blocks hold them all. Plain arithmetic, shared by the
    kernels (DSL Int32) and the torch layer (ints and int64 tensors)."""
    return token_offset // tile_m + batch


def accum_layout(cfg) -> DqTiling:
    """The dQ accumulator's layout for a BackwardConfig or PostprocessConfig (the registry's
    dq_accum_layout, arch.py): what the torch layer allocates and reorders by."""
    return DqTiling(cfg.tile_m, cfg.head_dim)


def part_tile(mAccum: cute.Tensor, tiling: DqTiling, offset_q, head, batch, varlen: bool, m_block, part):
    """The (values, 128) rows of dq_accum (sequence first: (rows, 128, head[, batch])) that hold part
    ``part`` of query block ``m_block``: query block after query block, a varlen sequence's from its
    first block, ``block_offset``, on. The main kernel reduce-adds there, the postprocessing reads."""
    first_row = block_offset(offset_q, batch, tiling.tile_m) * tiling.rows_per_block if varlen else Int32(0)
    return cute.local_tile(head_rows(mAccum, first_row, head, batch, varlen), (tiling.values, ROW),
                           (m_block * NUM_PARTS + part, 0))


def dq_tiled_mma(dtype, tiling: DqTiling):
    """The dQ WGMMA of both consumer warpgroups (dQ = dS K, or dQ^T = K^T dS^T), operands read
    MN-major from shared memory; its accumulator layout is what register order refers to."""
    mn_major = OperandMajorMode.MN
    if tiling.transposed:
        return sm90_utils.make_trivial_tiled_mma(dtype, dtype, mn_major, mn_major, Float32,
                                                 atom_layout_mnk=(NUM_PARTS, 1, 1), tiler_mn=(64, tiling.tile_m))
    return sm90_utils.make_trivial_tiled_mma(dtype, dtype, mn_major, mn_major, Float32,
                                             atom_layout_mnk=(tiling.parts_m, tiling.parts_n, 1),
                                             tiler_mn=(64, tiling.part[1]))


def register_order(acc_shape, thread_in_part, base):
    """The tensor at ``base`` (a part of dq_accum or of its staging buffer) that holds one thread's
    accumulator values in register order, shaped like the accumulator (``acc_shape``): value v at
    (v // 4) * 512 + thread_in_part * 4 + v % 4, so that four consecutive values are one 16-byte
    access."""
    values = cute.size(acc_shape)
    part = cute.make_tensor(base, cute.make_layout((4, WARPGROUP_THREADS, values // 4),
                                                   stride=(1, 4, 4 * WARPGROUP_THREADS)))
    mine = part[None, thread_in_part, None]
    return cute.make_tensor(mine.iterator, cute.composition(mine.layout, cute.make_layout(acc_shape)))
