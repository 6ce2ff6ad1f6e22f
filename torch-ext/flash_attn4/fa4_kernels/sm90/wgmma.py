"""Hopper building blocks shared by the sm90 kernels: shared-memory layouts WGMMA and TMA agree on,
warpgroup indices, the asynchronous WGMMA issue. (Views, TMA partitions and pipeline steps that are
not Hopper's own live in fa4_kernels/layouts.py and pipelines.py.)"""

from __future__ import annotations

import enum
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup

WARPGROUP_THREADS = 128
# Rows of one WGMMA (its M): the query rows a consumer warpgroup owns in a tile.
WGMMA_M = 64


class WarpGroup(enum.IntEnum):
    """Warpgroup roles of the sm90 kernels (warpgroup index in the CTA): warpgroup 0 produces (TMA
    loads; the backward's dQ writer too), the consumers (MMAs, softmax, epilogue) follow it."""

    PRODUCER = 0
    FIRST_CONSUMER = 1


@cute.jit
def warpgroup_index(tidx):
    """``tidx``'s warpgroup, marked warp-uniform (ptxas cannot prove tidx // 128 is), so that what
    is derived from it lives in uniform registers: WGMMA shared-memory descriptors, buffer offsets,
    barrier ids. A per-thread warpgroup index made ptxas build every descriptor in ordinary
    registers and move it over (R2UR) before each WGMMA: about 200 integer instructions per
    backward step at d = 128."""
    return cute.arch.make_warp_uniform(tidx // WARPGROUP_THREADS)


@cute.jit
def warpgroup_slice_thread(tidx):
    """The first thread of ``tidx``'s warpgroup (warp-uniform): the index a WGMMA's get_slice takes."""
    return warpgroup_index(tidx) * WARPGROUP_THREADS


def mma_k_multiple(cols: int) -> int:
    """cols rounded up to the 16 columns one 16-bit WGMMA reduces at a time."""
    return -(-cols // 16) * 16


def smem_layout(dtype, rows: int, cols: int, stages: Optional[int] = None, *, split: int = 1):
    """K-major (row-major) shared-memory layout with the widest swizzle the row allows, as WGMMA
    and TMA expect; staged buffers stack along a third mode. ``split`` > 1: the columns are also used
    in ``split`` equal parts (one per warpgroup), so the swizzle atom must tile each part too."""
    kind = warpgroup.SmemLayoutAtomKind
    part = cols // split
    atom_kind = kind.K_INTER
    for candidate, atom_bits in ((kind.K_SW128, 1024), (kind.K_SW64, 512), (kind.K_SW32, 256)):
        atom_cols = atom_bits // dtype.width
        if cols % atom_cols == 0 and (part % atom_cols == 0 or atom_cols % part == 0):
            atom_kind = candidate
            break
    atom = warpgroup.make_smem_layout_atom(atom_kind, dtype)
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))


@cute.jit
def wgmma(tiled_mma: cute.TiledMma, acc: cute.Tensor, a: cute.Tensor, b: cute.Tensor,
          zero_init: cutlass.Constexpr[bool], whole_k: cutlass.Constexpr[bool] = False):
    """acc (+)= a @ b over the k slices of the fragments; issued asynchronously and committed as one
    group (the caller waits).

    One ``cute.gemm`` call per k slice, or with ``whole_k`` one call over all of them. The WGMMAs
    are the same; what differs is the IR, and so the compile time: each call loads and stores its
    whole accumulator around its WGMMAs, which for a wide accumulator (O at d_v = 256: 128 registers
    per thread) is much of what NVVM compiles. The whole-K lowering costs instructions instead: B's
    descriptors (and A's, from shared memory) are built per thread and moved to uniform registers
    (R2UR) before every WGMMA, so the kernels use it only off their hot loops. With ``zero_init``
    the whole-K lowering zeroes the accumulator at the first slice only, as the loop does."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    if cutlass.const_expr(whole_k):
        cute.gemm(atom, acc, a, b, acc)
    else:
        for k in cutlass.range_constexpr(cute.size(a.shape[2])):
            cute.gemm(atom, acc, a[None, None, k], b[None, None, k], acc)
            atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
