"""Views of Hopper WGMMA register fragments.

A WGMMA accumulator (m64nNk16, fp32) gives each thread of a warpgroup a fragment shaped
((2, 2, N/8), MMA_M, MMA_N): 2 adjacent columns, 2 rows 8 apart, N/8 column groups. The shared
softmax and mask code works on (rows, cols) views; P@V needs the same registers, converted to 16 bits,
as the A operand, which WGMMA reads as ((2, 2, 2), MMA_M, MMA_K) per k16 slice.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

# Lanes that share an accumulator row (a quad).
THREADS_PER_ROW = 4


def acc_rows_view(acc: cute.Tensor) -> cute.Tensor:
    """((2, 2, V), M, N) accumulator -> ((2, M), (2, V, N)) = (rows, cols)."""
    flat = cute.make_layout(acc.shape)
    (s_col, s_row, s_grp), s_m, s_n = flat.shape
    (d_col, d_row, d_grp), d_m, d_n = flat.stride
    rows_cols = cute.make_layout(
        ((s_row, s_m), (s_col, s_grp, s_n)),
        stride=((d_row, d_m), (d_col, d_grp, d_n)),
    )
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, rows_cols))


def acc_as_a_operand(frag: cute.Tensor) -> cute.Tensor:
    """((2, 2, V), M, N) accumulator-shaped fragment -> ((2, 2, 2), M, (V/2, N)) A operand of the
    next WGMMA: two consecutive 8-column groups form one k16 slice."""
    flat = cute.make_layout(frag.shape)
    (s_col, s_row, s_grp), s_m, s_n = flat.shape
    (d_col, d_row, d_grp), d_m, d_n = flat.stride
    assert s_grp % 2 == 0, "P@V needs the KV tile to be a multiple of 16"
    a_view = cute.make_layout(
        ((s_col, s_row, 2), s_m, (s_grp // 2, s_n)),
        stride=((d_col, d_row, d_grp), d_m, (2 * d_grp, d_n)),
    )
    return cute.make_tensor(frag.iterator, cute.composition(frag.layout, a_view))


def stmatrix_copy(tiled_mma: cute.TiledMma, dtype) -> cute.TiledCopy:
    """A tiled copy that writes ``tiled_mma``'s accumulator layout, converted to 16-bit ``dtype``,
    to shared memory as 8x8 matrices (stmatrix.x4: 4 stores per 64 values per thread)."""
    atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), dtype)
    return cute.make_tiled_copy_C(atom, tiled_mma)


@cute.jit
def store_converted(dst: cute.Tensor, src: cute.Tensor):
    """dst = src converted to dst's element type (fp32 scores -> 16-bit P).

    One conversion of a whole fragment lowers to a vector truncation of the fragment's length.
    LLVM turns a power-of-two length into paired cvt.rn.bf16x2.f32, but splits other lengths (40
    at a KV tile of 80, 48 at 96) into scalar conversions, which then need packing moves between
    the P @ V WGMMAs, and ptxas injects a warpgroup.arrive before each of those WGMMAs (C7519).
    Those fragments are converted a pair at a time."""
    n = cute.size(src)
    if cutlass.const_expr(n & (n - 1) == 0):
        dst.store(src.load().to(dst.element_type))
    else:
        pair = cute.make_layout(2)
        src_pairs, dst_pairs = cute.logical_divide(src, pair), cute.logical_divide(dst, pair)
        for i in cutlass.range_constexpr(n // 2):
            dst_pairs[None, i].store(src_pairs[None, i].load().to(dst.element_type))


class QueryRowValues:
    """A per-query row of floats in shared memory (the backward's LSE or rowsum) at a thread's
    columns of an accumulator seen through acc_rows_view, whose columns are the queries. In the
    C fragment of wgmma.m64nNk16, column c of the thread with lane t holds query
    8 * (c // 2) + 2 * (t % 4) + c % 2. Read one of three ways:

    - ``per_column``: one register per column, loaded once (64-query blocks: 16 columns);
    - ``from_smem``: a shared-memory load at each use (lanes with the same t % 4 share the address);
    - ``by_shuffle`` (at most 128 queries): lane L holds queries 2L, 2L + 1, 64 + 2L and 65 + 2L,
      four loads per step, and each use fetches its value from the lane that holds it: query q
      sits in lane (q % 64) // 2, register 2 * (q // 64) + q % 2, which for column c is lane
      4 * (c // 2 % 8) + t % 4 and register 2 * (c // 16) + c % 2, the same on every lane, so that
      one warp shuffle serves the warp. Every lane must call ``at`` together."""

    def __init__(self, row: cute.Tensor, coords: cute.Tensor, regs=None, quad=None):
        self.row, self.coords, self.regs, self.quad = row, coords, regs, quad

    @staticmethod
    def per_column(row: cute.Tensor, coords: cute.Tensor) -> "QueryRowValues":
        regs = cute.make_rmem_tensor((cute.size(coords, mode=[1]),), cutlass.Float32)
        for c in range(cute.size(coords, mode=[1])):  # traced, not preprocessed: Python's range unrolls
            regs[c] = row[coords[0, c][1]]
        return QueryRowValues(row, coords, regs=regs)

    @staticmethod
    def from_smem(row: cute.Tensor, coords: cute.Tensor) -> "QueryRowValues":
        return QueryRowValues(row, coords)

    @staticmethod
    def by_shuffle(row: cute.Tensor, coords: cute.Tensor, queries: int) -> "QueryRowValues":
        assert 64 < queries <= 128 and queries % 16 == 0, f"by_shuffle holds 65 to 128 queries, not {queries}"
        lane = cute.arch.lane_idx()
        regs = cute.make_rmem_tensor((4,), cutlass.Float32)
        for register, query in enumerate(QueryRowValues.held_queries(lane, queries)):
            regs[register] = row[query]
        return QueryRowValues(row, coords, regs=regs, quad=lane % THREADS_PER_ROW)

    @staticmethod
    def held_queries(lane, queries: int) -> tuple:
        """by_shuffle: the queries whose values ``lane`` (an Int32 in the kernel, an int in tests)
        holds, by register."""
        second = 64 + 2 * lane
        if queries < 128:
            second = cutlass.min(second, queries - 2)  # lanes past the row hold a copy no column reads
        return 2 * lane, 2 * lane + 1, second, second + 1

    @staticmethod
    def shuffle_source(c: int) -> tuple[int, int]:
        """by_shuffle: column ``c``'s (register, source lane less t % 4)."""
        pair = c // 2
        return 2 * (pair // 8) + c % 2, 4 * (pair % 8)

    def at(self, c: int):
        """The value at the thread's column ``c`` (a compile-time index)."""
        if self.quad is not None:
            register, lane = QueryRowValues.shuffle_source(c)
            return cute.arch.shuffle_sync(self.regs[register], lane + self.quad)
        if self.regs is not None:
            return self.regs[c]
        return self.row[self.coords[0, c][1]]
