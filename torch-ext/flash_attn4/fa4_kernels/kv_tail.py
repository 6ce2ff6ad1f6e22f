"""The K/V rows past a sequence's last key (issue 21, "NaN tail"), for the forwards and backwards.

The KV block that holds a sequence's last key is loaded whole, as one TMA tile. Its rows past the
key end are zeros only where they lie outside the tensor (a batched problem whose keys fill the
tensor: TMA fills out-of-bounds rows with zeros). Everywhere else they are rows of the tensor that
belong to no key of this sequence: the next sequence's keys (varlen), the unused rest of a cache
(seqused_k: a KV cache, a padded batch), the rest of the last page (paged). They may hold anything,
NaN and Inf included (a freshly allocated or recycled cache). The mask replaces those columns'
scores with -inf (a select, so a NaN score is dropped too) and P is 0 there, but the P @ V GEMM still
multiplies them: 0 * NaN = NaN, in every row of O. K's rows need nothing (their scores are
replaced); V's rows are zeroed in shared memory after TMA has written them and before the MMA reads
them. Only that one block per tile (the first the n-loop visits) can hold them.

The backward needs K's rows zeroed too: besides dP = dO V^T (V's rows), dQ = dS K multiplies K's
rows, and dS = P (dP - D) is 0 * NaN where dP is NaN. Its KV-stationary CTAs load their one K/V
tile once and zero both (sm90/bwd.py and sm100/bwd.py zero_kv_tail).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

# One shared-memory store writes this many bits (st.shared.v4: 16 bytes, a swizzle's unit, so each
# store stays contiguous in a swizzled tile).
STORE_BITS = 128


def tail_possible(cfg) -> bool:
    """Whether a ForwardConfig or BackwardConfig can have rows inside the tensor past a sequence's
    keys: with varlen keys, seqused_k or pages (forward only). Batched keys without seqused_k end at
    the tensor's end (TMA zero-fill), and their kernels are built without the zeroing."""
    return cfg.varlen or cfg.has_seqused_k or getattr(cfg, "page_size", 0) > 0


@cute.jit
def first_row_past_keys(seqlen_k: Int32, n_block: Int32, tile_n: cutlass.Constexpr[int]) -> Int32:
    """The first row of KV block ``n_block`` (``tile_n`` keys) past the sequence's keys: tile_n
    when the block lies inside them."""
    return cutlass.min(cutlass.max(seqlen_k - n_block * tile_n, 0), tile_n)


@cute.jit
def zero_rows(tile: cute.Tensor, first_row: Int32, thread: Int32, threads: cutlass.Constexpr[int]):
    """Zero rows ``first_row``.. of a (rows, cols) shared-memory tile in (row, column) coordinates
    (a swizzled tile is indexed through its own tensor, so each store lands where the MMA reads),
    16 bytes per store; the stores are dealt to ``threads`` threads round-robin (``thread`` in
    [0, threads)), so that consecutive threads write consecutive 16 bytes of a row. The caller
    orders the stores after the TMA (its full barrier) and before the MMA (a proxy fence and a
    barrier)."""
    vec = STORE_BITS // tile.element_type.width
    per_row = cute.size(tile, mode=[1]) // vec
    chunks = cute.zipped_divide(tile, (1, vec))  # ((1, vec), (rows, cols / vec))
    zeros = cute.make_rmem_tensor(vec, tile.element_type)
    zeros.fill(0)
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), tile.element_type, num_bits_per_copy=STORE_BITS)
    for i in cutlass.range(first_row * per_row + thread, cute.size(tile, mode=[0]) * per_row, threads, unroll=1):
        cute.copy(atom, zeros, chunks[None, (i // per_row, i % per_row)])
