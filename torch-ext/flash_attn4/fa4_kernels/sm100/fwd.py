"""FlashAttention forward for Blackwell (sm_100a): tcgen05 MMAs with S, P and O in tensor memory.

A CTA owns ``query_tiles`` (tiles.query_tiles: two up to head_dim_v = 128, else one) tiles of 128
query rows of one head and walks the KV blocks they see from the last to the first. Warp roles:

    warps 0-3, 4-7   softmax     one warpgroup per query tile, one thread per row (= TMEM lane):
                                 S from TMEM, mask, online softmax, P back to TMEM (16-bit, over
                                 the upper half of S's columns), the row's rescale factor to the
                                 correction warps; at the end the row's LSE and 1 / rowsum
    warps 8-11       correction  O *= factor in TMEM when a row maximum moved (skipped when every
                                 factor of a warp is 1: the conditional rescale), then the
                                 epilogue: O / rowsum from TMEM to global memory
    warp 12          MMA         one thread issues every tcgen05 MMA: S_t = Q_t K_j^T and
                                 O_t += P_t V_j, and commits their completion to mbarriers
    warp 13          load        TMA: Q tiles once, then K and V blocks into one ring of stages
    warps 14-15      idle        (the register budget is set per warpgroup)

Per KV block j and query tile t the MMA warp waits until softmax t has written P_t(j-1) and the
correction warps have rescaled O_t, then issues O_t += P_t(j-1) V_(j-1) and S_t = Q_t K_j^T back to
back (tcgen05 MMAs of one thread run in order, so S_t's columns are overwritten only after P_t was
read) and commits S_t: softmax t runs on tile t's scores while the tensor cores work on the other
tile (the two tiles ping-pong without a barrier of their own).

Synchronisation (mbarrier pipelines, cutlass.pipeline; stage t of q, s, o is query tile t):
    q      TMA -> MMA        Q_t, once per tile
    kv     TMA -> MMA        the K/V ring, filled in the order the MMA warp consumes it:
                             K_0, K_1, V_0, K_2, V_1, ..., V_last (K and V tiles of a stage alias).
                             At least two stages: the MMA warp holds K_j while it waits for V_(j-1)
    s      MMA -> softmax t  "S_t full"; the way back ("P_t written, O_t rescaled") is the same
                             stage's empty barrier, released by softmax t and the correction warps
    stats  softmax t -> correction   each block's row factors (at the end 1 / rowsum) in shared
                             memory; two stages per tile, (block i, tile t) at (i * tiles + t) mod
                             (2 * tiles), so each softmax warpgroup walks its own stages
    o      MMA -> correction "O_t final" after the last P V
V's rows past the sequence's keys in the first block (rows of the tensor that hold anything,
fa4_kernels/kv_tail.py) are zeroed by the MMA warp itself between V_0's full barrier and its first
P V (zero_v_tail): one CTA only, not pairs.
tests/cpu/test_sm100_protocol.py replays these calls on the CPU (no deadlock, every hand-off sees
its producer) for one and two tiles, several ring depths and 0-7 KV blocks, and for persistent CTAs.

Persistent CTAs (``cfg.persistent_ctas`` = N > 0; sm100/tiles.forward_grid turns them on where
upstream runs its static persistent scheduler): the grid is min(tiles, N) CTAs and CTA i walks tiles
i, i + grid, ... of the scheduler's order (scheduler.TileScheduler.tile_at). Every role loops over
the same tiles and carries its pipeline states from tile to tile, so each tile must move every
state by the same number of stages on both sides: a tile without KV blocks moves none (the load and
MMA warps skip it, the correction does not wait for its O), and the MMA warp's last P V waits on s
without moving it on (the next tile's first S_t reuses that wait). TMEM is allocated once. The MMA
warp releases Q's stages after each tile's last Q K^T, so the load warp brings the next tile's Q and
first K while this tile's last P V, softmax and epilogue run; the next tile's S_t(0) is issued right
after this tile's last P V, and its first P V (which overwrites O_t) waits until the correction warps
have released that S_t, which they do after reading this tile's O_t out. The protocol replay covers
several tiles per CTA.

CTA pairs (``cfg.cluster_m`` = 2; sm100/tiles.pair_applies says where): a cluster of two CTAs
along M runs every MMA as one M = 256 tcgen05 MMA of cta_group::2, issued by the even CTA's MMA
warp (the odd CTA's MMA warp only takes part in the TMEM address hand-off). Each CTA keeps the
single-CTA roles for its own tile (query block 2 * pair block + rank; S, P and O in its own TMEM,
all 512 columns allocated with cta_group::2 by both CTAs and freed after a handshake) and loads its
own Q tiles and half of every K tile (64 keys) and V tile (64 of its columns) with 2-CTA TMA, whose
bytes count on the even CTA's full barriers (tx counts are the pair's). The MMA warp's commits
(q/kv stages free, S full, O full) reach both CTAs' barriers (multicast); both CTAs' softmax and
correction warps release S on the even CTA's empty barrier (its count is both CTAs' threads). Both
CTAs walk the pair's KV blocks even when the odd CTA's tile lies past the sequence's end (it stores
nothing). In a cluster launch the shared-memory base is a runtime value: the MMA warp makes its
descriptors and TMEM addresses afresh after each barrier wait (pair_operands) rather than holding
them across the KV loop. The protocol replay covers pairs.

Ordering of tensor-memory accesses across roles: every tcgen05.ld/st is followed by its wait
(tcgen05.wait::ld/st) before the thread arrives on a barrier that hands the columns on; MMA results
are read after a wait on the commit's barrier, directly (softmax: S; correction: the final O) or
through the softmax's stats barrier, which it arrives on after waiting for S_t(i) (correction: O_t
between blocks, as FA4's own kernel does).

Split-KV (``split_kv``): the scheduler's head mode holds head * num_splits + split
(scheduler.KVSplits); every role derives the same split from its tile, walks that split's share of
the KV blocks, and the CTA stores O normalised over those keys alone, in float32, with their LSE,
into the split's slice of the partial buffers (an empty share: O = 0, LSE = -inf, as a tile whose
rows see no key); fa4_kernels/combine.py merges them. Padded batches (``has_seqused_q``): a
sequence's query length is seqused_q[b]; rows past it are loaded with the tile but never stored.
GQA packing (``pack_gqa``, layouts.QueryPacking): a KV head's query heads are rows of its tiles
(row = token * g + head in group); a ratio r that does not divide 64 runs in padded groups of g rows
(``pack_gqa_heads`` = r): Q's TMA descriptor clips the head-in-group dimension to r, so the dummy
rows load as zeros, and the O and LSE stores skip them (they alias the next KV head's heads).
Paged KV caches (``page_size``, fa4_kernels/paged_kv.py; batched or varlen queries): a K or V tile arrives as
gcd(128, page_size)-row TMA boxes, each from the page the page table names, into the same ring
stage (kv_box_layouts: the MMA layouts' rows are 128-byte swizzled lines, so a box of whole rows is
a contiguous slice of them).

Tensor memory (512 columns, 32-bit each, lane = query row): S_t at t * 128, O_t after both S tiles;
P_t (two 16-bit values per column) over S_t's columns 64..127, which the softmax thread has read
into registers before it writes P.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from dataclasses import dataclass
from typing import NamedTuple, Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, tcgen05

from ..config import ForwardConfig
from ..dtypes import CUTLASS_DTYPES
from ..kv_tail import first_row_past_keys, tail_possible, zero_rows
from ..layouts import QueryPacking, last_mode_slice
from ..mask import AttentionMask
from ..paged_kv import PagedKV, kernel_view, rows_per_copy
from ..pipelines import advanced
from ..scheduler import KVSplits, TileScheduler, longest_first_applies
from ..seqlen import SeqlenInfo, head_rows
from ..softmax import OnlineSoftmax, score_scales
from ..tile_work import OutputTile
from .softmax_row import row_max, row_probabilities, row_sums_init, row_sums_total
from .tiles import L2_BUDGET_BYTES, SMEM_BYTES, TILE_M, TILE_N, query_tiles, shared_memory_bytes

WARP = 32
WARPGROUP = 128
WARPS_PER_GROUP = WARPGROUP // WARP
TMEM_COLUMNS = 512


class Warp(enum.IntEnum):
    """Warp roles (warp index in the CTA). Softmax warpgroups and the correction warpgroup start at
    multiples of 4: warp w may only touch TMEM lanes 32 * (w % 4) .. + 31."""

    SOFTMAX0 = 0  # warps 0-3 (query tile 0) and 4-7 (tile 1, or idle with one tile)
    CORRECTION = 8
    MMA = 12
    LOAD = 13  # warps 14-15 idle: the last warpgroup's register budget is shared


NUM_WARPS = 16


class Barrier(enum.IntEnum):
    """Named barrier ids (0 is __syncthreads)."""

    TMEM_ALLOC = 1  # the allocating warp published the TMEM address (MMA + softmax + correction warps)
    TMEM_FREE = 2  # every correction thread has read its last O columns


# setmaxnreg budgets (registers per thread) per warpgroup role, by query tiles per CTA: the four
# warpgroups share 512 x 128 registers. With one query tile the second softmax warpgroup has nothing
# to do, and its registers go to the correction warps (O of up to 256 columns) and the MMA/load warps
# (a 256-wide head dim doubles the MMA warp's descriptors, which ptxas hoists out of the persistent
# tile loop: at 136 registers ptxas 12.9 spilled them, at 152 neither ptxas does).
REGISTERS = {
    2: dict(softmax=192, idle=0, correction=80, other=48),
    1: dict(softmax=192, idle=24, correction=144, other=152),
}
LAUNCH_REGISTERS = 65536 // (NUM_WARPS * 32)

# Paged KV: K/V tiles of at most this many page boxes read their page-table entries before waiting
# for a free ring stage (load_kv).
PREFETCHED_PAGE_BOXES = 4
# Columns of P a softmax thread computes, converts and stores to TMEM at a time.
P_CHUNK = 32
# Columns of O a correction thread loads, scales and stores at a time.
O_CHUNK = 32


@cute.jit
def set_registers(count: cutlass.Constexpr[int]):
    """setmaxnreg for the calling warpgroup: up or down from the launch's even share."""
    if cutlass.const_expr(count > LAUNCH_REGISTERS):
        cute.arch.setmaxregister_increase(count)
    elif cutlass.const_expr(count < LAUNCH_REGISTERS):
        cute.arch.setmaxregister_decrease(count)


def _pad16(d: int) -> int:
    return -(-d // 16) * 16


class FlashAttentionForwardSm100:
    def __init__(self, cfg: ForwardConfig):
        self.cfg = cfg
        self.packing = QueryPacking.of(cfg)
        self.dtype = CUTLASS_DTYPES[cfg.dtype]
        # What O is stored as: the input dtype, or float32 split-KV partials.
        self.o_dtype = Float32 if cfg.split_kv else self.dtype
        self.hdim, self.hdim_v = cfg.head_dim, cfg.head_dim_v
        self.hdim_tile, self.hdim_v_tile = _pad16(cfg.head_dim), _pad16(cfg.head_dim_v)
        self.q_tiles = query_tiles(cfg.head_dim, cfg.head_dim_v)
        if cfg.tile_m != TILE_M * self.q_tiles or cfg.tile_n != TILE_N:
            raise ValueError(f"sm100 forward: tiles are {TILE_M * self.q_tiles} x {TILE_N} at head_dim_v "
                             f"{cfg.head_dim_v}, got {cfg.tile_m} x {cfg.tile_n}")
        if self.hdim_tile > 256 or self.hdim_v_tile > 256:
            raise ValueError("sm100 forward: head dims up to 256")
        self.kv_stages = cfg.num_stages
        self.persistent = cfg.persistent_ctas > 0
        # CTA pairs (cluster_m = 2): M = 256 MMAs of cta_group::2 over both CTAs' query tiles.
        self.pair = cfg.cluster_m == 2
        # The MMA warp zeroes V's rows past the keys (zero_v_tail). Not in a pair: half of each V
        # tile sits in the odd CTA's shared memory, which the even CTA's MMA warp does not write
        # (pairs run batched problems only; a padded batch with seqused_k there keeps the gap).
        self.zero_tail = tail_possible(cfg) and not self.pair
        self.cta_group = tcgen05.CtaGroup.TWO if self.pair else tcgen05.CtaGroup.ONE
        self.mma_m = TILE_M * cfg.cluster_m
        self.registers = REGISTERS[self.q_tiles]
        budget = self.registers
        softmax_groups = budget["softmax"] * self.q_tiles + budget["idle"] * (2 - self.q_tiles)
        warpgroups = NUM_WARPS // WARPS_PER_GROUP
        assert softmax_groups + budget["correction"] + budget["other"] == warpgroups * LAUNCH_REGISTERS
        # Tensor-memory plan (columns): S_t, then O_t, then P_t over the upper half of S_t.
        self.tmem_s = tuple(t * TILE_N for t in range(self.q_tiles))
        o_width = self.hdim_v_tile
        self.tmem_o = tuple(self.q_tiles * TILE_N + t * o_width for t in range(self.q_tiles))
        p_columns = TILE_N * self.dtype.width // 32
        self.tmem_p = tuple(s + TILE_N - p_columns for s in self.tmem_s)
        assert self.tmem_o[-1] + self.hdim_v_tile <= TMEM_COLUMNS

    # ------------------------------------------------------------------------------------------
    # Host side
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor],
                 mSeqUsedQ: Optional[cute.Tensor], mSeqUsedK: Optional[cute.Tensor],
                 mPageTable: Optional[cute.Tensor], mSink: Optional[cute.Tensor],
                 softmax_scale: Float32, softcap: Float32, window_left: Int32, window_right: Int32,
                 max_seqlen_q: Int32, stream: cuda.CUstream):
        cfg = self.cfg
        splits = None
        if cutlass.const_expr(cfg.split_kv):
            # Partials: the leading split mode moves last, where a CTA slices its split off; what
            # remains is laid out like the unsplit O and LSE.
            splits = KVSplits(mO.shape[0])
            mO = cute.make_tensor(mO.iterator, cute.select(mO.layout, mode=[*range(1, cute.rank(mO)), 0]))
            mLSE = cute.make_tensor(mLSE.iterator, cute.select(mLSE.layout, mode=[*range(1, cute.rank(mLSE)), 0]))
        split_mode = [cute.rank(mQ)] if cutlass.const_expr(cfg.split_kv) else []
        lse_split_mode = [m - 1 for m in split_mode]
        # (seq, dim, head[, batch]) for Q, K, O; V as (dim, seq, head[, batch]): the PV MMA reads
        # V^T (N = head_dim_v, K = keys) with the head dim contiguous. Split-KV partials: (..., split).
        # Paged: K and V as (page_size, dim, head, page) whatever the queries' layout, both loaded in
        # (keys, dim) boxes.
        paged = cfg.page_size > 0
        if cutlass.const_expr(cfg.varlen):
            mQ = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[0, 2, 1]))
            if cutlass.const_expr(not paged):
                mK = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[0, 2, 1]))
                mV = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[2, 0, 1]))
            mO = cute.make_tensor(mO.iterator, cute.select(mO.layout, mode=[0, 2, 1] + split_mode))
            mLSE = cute.make_tensor(mLSE.iterator, cute.select(mLSE.layout, mode=[1, 0] + lse_split_mode))
            num_batch = mCuSeqlensQ.shape[0] - 1
        else:
            mQ = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[1, 3, 2, 0]))
            if cutlass.const_expr(not paged):
                mK = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[1, 3, 2, 0]))
                mV = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[3, 1, 2, 0]))
            mO = cute.make_tensor(mO.iterator, cute.select(mO.layout, mode=[1, 3, 2, 0] + split_mode))
            mLSE = cute.make_tensor(mLSE.iterator, cute.select(mLSE.layout, mode=[2, 1, 0] + lse_split_mode))
            num_batch = mQ.shape[3]
        if cutlass.const_expr(paged):
            mK, mV = kernel_view(mK), kernel_view(mV)
        num_heads = mQ.shape[2]
        qhead_per_kvhead = num_heads // mK.shape[2]
        packing = self.packing
        if cutlass.const_expr(packing.group > 1):
            # Each KV head's query heads become rows: (token, head) -> row token * g + head, and the
            # grid walks KV heads. Q's TMA descriptor is made from the view that clips a padded
            # group's dummy heads (QueryPacking.tma_view); O and LSE leave through register stores
            # that skip those rows (they alias the next KV head's heads).
            mQ = packing.tma_view(mQ, 2, qhead_per_kvhead)
            mO = packing.view(mO, head_mode=2)
            mLSE = packing.view(mLSE, head_mode=1)
            num_heads, qhead_per_kvhead = mK.shape[2], 1
            max_seqlen_q = max_seqlen_q * packing.group

        major = cute.nvgpu.OperandMajorMode
        mma_qk = sm100_utils.make_trivial_tiled_mma(
            self.dtype, major.K, major.K, Float32, self.cta_group, (self.mma_m, TILE_N))
        mma_pv = sm100_utils.make_trivial_tiled_mma(
            self.dtype, major.K, major.MN, Float32, self.cta_group, (self.mma_m, self.hdim_v_tile),
            tcgen05.OperandSource.TMEM)
        # Per CTA (a pair's smem layouts below are each CTA's share: its own 128 query rows, half of
        # the keys of K and half of the columns of V).
        tiler_qk = (self.mma_m, TILE_N, self.hdim_tile)
        tiler_pv = (self.mma_m, self.hdim_v_tile, TILE_N)

        sQ_layout = sm100_utils.make_smem_layout_a(mma_qk, tiler_qk, self.dtype, self.q_tiles)
        # K and V share the ring: each stage is as large as the larger tile.
        sK_one = sm100_utils.make_smem_layout_b(mma_qk, tiler_qk, self.dtype, 1)
        sV_one = sm100_utils.make_smem_layout_b(mma_pv, tiler_pv, self.dtype, 1)
        stage_elems = max(cute.cosize(cute.select(sK_one, mode=[0, 1, 2])),
                          cute.cosize(cute.select(sV_one, mode=[0, 1, 2])))
        sK_layout = cute.append(cute.select(sK_one, mode=[0, 1, 2]),
                                cute.make_layout(self.kv_stages, stride=stage_elems))
        sV_layout = cute.append(cute.select(sV_one, mode=[0, 1, 2]),
                                cute.make_layout(self.kv_stages, stride=stage_elems))
        # P: the A operand of the PV MMA, read from tensor memory.
        tP_layout = sm100_utils.make_smem_layout_a(mma_pv, tiler_pv, self.dtype, 1)

        # A pair's loads are 2-CTA TMA: both CTAs' bytes land on the even CTA's barrier.
        tma_load = cpasync.CopyBulkTensorTileG2SOp(self.cta_group)
        cluster = self.cluster_layout_vmnk(mma_qk)
        # Padded packing: Q's M mode is tiled as (group, tokens), the box of a head-in-group
        # dimension whose extent is the real heads (QueryPacking.tma_tiler).
        q_rows_tiler, q_cols_tiler = packing.tma_tiler(self.mma_m, self.hdim_tile)
        tma_atom_Q, tma_Q = cute.nvgpu.make_tiled_tma_atom_A(
            tma_load, mQ, cute.select(sQ_layout, mode=[0, 1, 2]), (q_rows_tiler, TILE_N, q_cols_tiler), mma_qk,
            cluster.shape)
        if cutlass.const_expr(cfg.page_size > 0):
            rows = rows_per_copy(TILE_N, cfg.page_size)
            sK_box, _ = self.kv_box_layouts(sK_layout, self.hdim_tile, rows, stage_elems, keys_mode=0)
            sV_box, _ = self.kv_box_layouts(sV_layout, self.hdim_v_tile, rows, stage_elems, keys_mode=1)
            tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(tma_load, mK, sK_box, (rows, self.hdim_tile), 1)
            tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(tma_load, mV, sV_box, (rows, self.hdim_v_tile), 1)
        else:
            tma_atom_K, tma_K = cute.nvgpu.make_tiled_tma_atom_B(
                tma_load, mK, cute.select(sK_layout, mode=[0, 1, 2]), tiler_qk, mma_qk, cluster.shape)
            tma_atom_V, tma_V = cute.nvgpu.make_tiled_tma_atom_B(
                tma_load, mV, cute.select(sV_layout, mode=[0, 1, 2]), tiler_pv, mma_pv, cluster.shape)
        # Transaction bytes a full barrier waits for: a pair's loads all count on the even CTA's.
        self.tma_bytes_q, self.tma_bytes_k, self.tma_bytes_v = [
            cute.size_in_bytes(self.dtype, cute.select(layout, mode=[0, 1, 2])) * cfg.cluster_m
            for layout in (sQ_layout, sK_layout, sV_layout)]

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * self.q_tiles]
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2 * self.kv_stages]
            mbar_s: cute.struct.MemRange[cutlass.Int64, 2 * self.q_tiles]
            mbar_o: cute.struct.MemRange[cutlass.Int64, 2 * self.q_tiles]
            mbar_stats: cute.struct.MemRange[cutlass.Int64, 2 * 2 * self.q_tiles]
            tmem_address: Int32
            # A pair's TMEM dealloc handshake (TmemAllocator.free: each CTA waits for its peer).
            tmem_dealloc: cute.struct.MemRange[cutlass.Int64, 1]
            # Per query tile, two stages of one float32 per row: the rescale factors, then 1/rowsum.
            row_stats: cute.struct.MemRange[Float32, 2 * self.q_tiles * TILE_M]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[self.dtype, self.kv_stages * stage_elems], 1024]

        # The plan (tiles.shared_memory_bytes, which sized the K/V ring) bounds what is allocated:
        # the row statistics and barriers must fit its reserve.
        planned = shared_memory_bytes(self.hdim, self.hdim_v, self.kv_stages, self.dtype.width // 8, cfg.cluster_m)
        if cutlass.const_expr(SharedStorage.size_in_bytes() > planned or planned > SMEM_BYTES):
            raise ValueError(f"sm100 forward: {SharedStorage.size_in_bytes()} bytes of shared memory (plan "
                             f"{planned}, limit {SMEM_BYTES}) at head dims {self.hdim}/{self.hdim_v}")
        self.shared_storage = SharedStorage

        score_prescale, scale_log2 = score_scales(softmax_scale, softcap, cfg.has_softcap)

        # A pair's tile is both CTAs' query blocks (the scheduler's m_block is the pair's).
        pair_rows = cfg.tile_m * cfg.cluster_m
        num_m_blocks = (max_seqlen_q + pair_rows - 1) // pair_rows
        # (A paged sequence: as many keys as its row of the table holds.)
        kv_rows_per_head = mK.shape[0] if cutlass.const_expr(not paged) else mPageTable.shape[1] * cfg.page_size
        kv_bytes_per_head = kv_rows_per_head * (self.hdim + self.hdim_v) * (self.dtype.width // 8)
        # Split-KV folds the split into the head mode (KVSplits); its tiles keep the launch order.
        longest_first = cfg.longest_first and longest_first_applies(cfg) and not cfg.split_kv
        scheduler = TileScheduler.create(num_m_blocks, num_heads if splits is None else splits.fold(num_heads),
                                         num_batch, kv_bytes_per_head, longest_first=longest_first,
                                         min_blocks=cfg.longest_first_min_blocks,
                                         num_ctas=cfg.persistent_ctas, l2_budget_bytes=L2_BUDGET_BYTES,
                                         cluster_m=cfg.cluster_m)
        # Persistent CTAs decode a tile index per tile and role: the launch order's divisions (and
        # the query head's KV head, unless packed) by host-made FastDivmod divisors.
        divisors = None
        if cutlass.const_expr(self.persistent and not scheduler.longest_first):
            divisors = scheduler.launch_order_divisors()
            if cutlass.const_expr(cfg.pack_gqa == 1):
                divisors = divisors + (cute.fast_divmod_create_divisor_v2(qhead_per_kvhead),)
        self.kernel(
            tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V, mO, mLSE,
            mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, mPageTable, mSink, score_prescale, scale_log2,
            window_left, window_right, qhead_per_kvhead, sQ_layout, sK_layout, sV_layout, tP_layout, mma_qk, mma_pv,
            scheduler, divisors, splits, stage_elems,
        ).launch(grid=scheduler.grid(), block=[NUM_WARPS * WARP, 1, 1], stream=stream, min_blocks_per_mp=1,
                 **(dict(cluster=[cfg.cluster_m, 1, 1]) if self.pair else {}))

    def cluster_layout_vmnk(self, mma_qk):
        """The cluster as (V, M, N, K) CTAs: V = the CTAs of one MMA (2 for a pair), the rest 1."""
        return cute.tiled_divide(cute.make_layout((self.cfg.cluster_m, 1, 1)), (mma_qk.thr_id,))

    # ------------------------------------------------------------------------------------------
    # Device side: set-up, then one branch per warp role
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, tma_atom_Q: cute.CopyAtom, mQ: cute.Tensor, tma_atom_K: cute.CopyAtom, mK: cute.Tensor,
               tma_atom_V: cute.CopyAtom, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
               mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor],
               mSeqUsedQ: Optional[cute.Tensor], mSeqUsedK: Optional[cute.Tensor], mPageTable: Optional[cute.Tensor],
               mSink: Optional[cute.Tensor], score_prescale: Float32, scale_log2: Float32, window_left: Int32,
               window_right: Int32, qhead_per_kvhead: Int32, sQ_layout: cute.ComposedLayout,
               sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout, tP_layout: cute.ComposedLayout,
               mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, scheduler: TileScheduler, divisors: Optional[tuple],
               splits: Optional[KVSplits], stage_elems: cutlass.Constexpr[int]):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp == Warp.LOAD:
            for atom in (tma_atom_Q, tma_atom_K, tma_atom_V):
                cpasync.prefetch_descriptor(atom)

        # The barriers are initialised here; each role makes its own views of shared memory
        # (role_shared) after its setmaxnreg. A pair's barriers receive the peer's arrivals, TMA
        # bytes and MMA commits: both CTAs initialise theirs before either goes on (a cluster
        # barrier in place of the CTA's).
        cluster = self.cluster_layout_vmnk(mma_qk)
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        barriers = self.make_pipelines(storage, cluster)
        if cutlass.const_expr(self.pair):
            self.tmem_allocator(storage, init=True)  # initialises the dealloc handshake's barrier
        cluster_mn = cute.make_layout((self.cfg.cluster_m, 1)) if self.pair else None
        pipeline.pipeline_init_arrive(cluster_mn, is_relaxed=True)

        # TMEM fragment layouts, taken before the MMA warp's branch sets the MMAs' accumulate flag
        # (a runtime value no other role may see).
        tmem_layouts = self.tmem_layouts(mma_qk, mma_pv, tP_layout)
        pipeline.pipeline_init_wait(cluster_mn)

        # Each role derives its tiles after its setmaxnreg: values live across the register-budget
        # change must fit the smallest budget (48), or ptxas spills them to local memory. With
        # persistent CTAs every role walks the same tiles (block index, + grid, ... of the
        # scheduler's order) and carries its pipeline states from one tile to the next; without,
        # the one tile of the block index, with no loop around it.
        tile_args = (scheduler, splits, mQ, mK, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, window_left,
                     window_right, qhead_per_kvhead, divisors)
        producer, consumer = pipeline.PipelineUserType.Producer, pipeline.PipelineUserType.Consumer
        if warp >= Warp.MMA:
            set_registers(self.registers["other"])
            storage, sQ, sK, sV, row_stats, pipes, tmem = self.role_shared(barriers, sQ_layout, sK_layout, sV_layout)
            tile = None
            if cutlass.const_expr(not self.persistent):  # one tile, derived once for both warps
                tile, _ = self.output_tile(None, *tile_args)
            if warp == Warp.LOAD:
                loads = (tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mV, mPageTable, storage, sQ, sK, sV, sK_layout,
                         sV_layout, stage_elems, mma_qk, mma_pv, pipes, tile_args)
                states = (pipeline.make_pipeline_state(producer, self.q_tiles),
                          pipeline.make_pipeline_state(producer, self.kv_stages))
                if cutlass.const_expr(self.persistent):
                    first, end, step = scheduler.tile_range()
                    for index in cutlass.range(first, end, step, unroll=1):
                        states = self.load_tile(index, self.output_tile(index, *tile_args)[0], states, *loads)
                else:
                    states = self.load_tile(None, tile, states, *loads)
                # Wait until the MMA warp has released every stage: its releases are tcgen05 commits,
                # which must not arrive after the CTA has exited.
                pipes.kv.producer_tail(states[1])
                if cutlass.const_expr(self.persistent):
                    pipes.q.producer_tail(states[0])
            if warp == Warp.MMA:
                tmem.wait_for_alloc()
                v_rows = None
                if cutlass.const_expr(self.zero_tail):
                    # The V ring in (key, column) coordinates: ((key, column), 1, stage).
                    _, ring = self.kv_box_layouts(sV_layout, self.hdim_v_tile, TILE_N, stage_elems, keys_mode=1)
                    v_rows = storage.sKV.get_tensor(ring.outer, swizzle=ring.inner)
                mma_args = (tmem, sQ, sK, sV, tmem_layouts, mma_qk, mma_pv, pipes, tile_args, scheduler, tile, v_rows)
                if cutlass.const_expr(self.pair):
                    if self.pair_rank() == 0:  # the even CTA issues the pair's MMAs
                        self.mma_warp(*mma_args)
                else:
                    self.mma_warp(*mma_args)
        elif warp >= Warp.CORRECTION:
            set_registers(self.registers["correction"])
            storage, sQ, sK, sV, row_stats, pipes, tmem = self.role_shared(barriers, sQ_layout, sK_layout, sV_layout)
            tmem.allocate(TMEM_COLUMNS)
            tmem.relinquish_alloc_permit()
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            corrections = (tmem_ptr, tmem_layouts, pipes, row_stats, mO, tile_args)
            states = (pipeline.make_pipeline_state(consumer, 2 * self.q_tiles),
                      pipeline.make_pipeline_state(consumer, self.q_tiles),
                      pipeline.make_pipeline_state(consumer, self.q_tiles))
            if cutlass.const_expr(self.persistent):
                first, end, step = scheduler.tile_range()
                for index in cutlass.range(first, end, step, unroll=1):
                    states = self.correction_tile(index, states, *corrections)
            else:
                self.correction_tile(None, states, *corrections)
            pipeline.NamedBarrier(barrier_id=int(Barrier.TMEM_FREE), num_threads=WARPGROUP).arrive_and_wait()
            tmem.free(tmem_ptr)  # a pair's two CTAs free together (the handshake in TmemAllocator.free)
        elif warp < Warp.SOFTMAX0 + WARPS_PER_GROUP * self.q_tiles:
            set_registers(self.registers["softmax"])
            storage, sQ, sK, sV, row_stats, pipes, tmem = self.role_shared(barriers, sQ_layout, sK_layout, sV_layout)
            tmem.wait_for_alloc()
            q_tile = warp // WARPS_PER_GROUP
            softmaxes = (tmem, q_tile, tmem_layouts, pipes, row_stats, mLSE, mSink,
                         score_prescale, scale_log2, tile_args)
            # Tile t uses stage t of s (one per tile) and stages t, t + q_tiles, ... of stats.
            states = (pipeline.PipelineState(self.q_tiles, Int32(0), q_tile, Int32(0)),
                      pipeline.PipelineState(2 * self.q_tiles, Int32(0), q_tile, Int32(1)))
            if cutlass.const_expr(self.persistent):
                first, end, step = scheduler.tile_range()
                for index in cutlass.range(first, end, step, unroll=1):
                    states = self.softmax_tile(index, states, *softmaxes)
            else:
                self.softmax_tile(None, states, *softmaxes)
        elif cutlass.const_expr(self.q_tiles == 1):  # the second softmax warpgroup: idle
            set_registers(self.registers["idle"])

    def role_shared(self, pipes, sQ_layout, sK_layout, sV_layout):
        """A role's views of shared memory, made after its setmaxnreg: (storage, sQ, sK, sV,
        row_stats, pipelines over the storage's barriers, TMEM allocator). The base address of
        dynamic shared memory is a warp shuffle (which ptxas cannot recompute): taken once at kernel
        entry it stays live into every role, and ptxas 12.9 spilled it (one STL, 46 LDL at d = 128)."""
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sKV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = cute.make_tensor(cute.recast_ptr(sK.iterator, sV_layout.inner, dtype=self.dtype), sV_layout.outer)
        row_stats = storage.row_stats.get_tensor(cute.make_layout((TILE_M, 2 * self.q_tiles)))
        pair_rank = self.pair_rank() if self.pair else None
        return storage, sQ, sK, sV, row_stats, rebased(pipes, storage, pair_rank), self.tmem_allocator(storage)

    def tmem_allocator(self, storage, init: bool = False):
        """The TMEM allocator (the correction warpgroup's first warp allocates all 512 columns, for
        both CTAs of a pair with cta_group::2). ``init``: initialise a pair's dealloc barrier (once,
        at kernel entry, with the other barriers)."""
        return cutlass.memory.TmemAllocator(
            storage.tmem_address.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(
                barrier_id=int(Barrier.TMEM_ALLOC),
                num_threads=WARP * (1 + WARPS_PER_GROUP * self.q_tiles + WARPS_PER_GROUP)),
            allocator_warp_id=int(Warp.CORRECTION), is_two_cta=self.pair,
            two_cta_tmem_dealloc_mbar_ptr=storage.tmem_dealloc.data_ptr() if self.pair else None,
            initialize_mbarrier=init)

    def pair_rank(self):
        """This CTA's rank in its pair (0: the even CTA, which issues the MMAs); 0 without pairs."""
        if cutlass.const_expr(self.pair):
            return cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        return 0

    @cute.jit
    def mma_warp(self, tmem, sQ, sK, sV, tmem_layouts, mma_qk, mma_pv, pipes, tile_args, scheduler, tile, v_rows):
        """The MMA warp's tiles (of a pair: the even CTA's, for both CTAs)."""
        # The MMAs' negate flags are kernel arguments (TiledMma fields) loaded at entry; as
        # constants they need no registers across the tile loop (ptxas spilled them there).
        for tiled_mma in (mma_qk, mma_pv):
            tiled_mma.set(tcgen05.Field.NEGATE_A, False)
            tiled_mma.set(tcgen05.Field.NEGATE_B, False)
        mmas = (tmem, sQ, sK, sV, tmem_layouts, mma_qk, mma_pv, pipes, tile_args, v_rows)
        consumer, producer = pipeline.PipelineUserType.Consumer, pipeline.PipelineUserType.Producer
        states = (pipeline.make_pipeline_state(consumer, self.q_tiles),
                  pipeline.make_pipeline_state(consumer, self.kv_stages),
                  pipeline.make_pipeline_state(producer, self.q_tiles),
                  pipeline.make_pipeline_state(producer, self.q_tiles))
        if cutlass.const_expr(self.persistent):
            first, end, step = scheduler.tile_range()
            for index in cutlass.range(first, end, step, unroll=1):
                states = self.mma_tile(index, self.output_tile(index, *tile_args)[0], states, *mmas)
        else:
            self.mma_tile(None, tile, states, *mmas)

    # One tile of each role: ``index`` is the tile's index in the scheduler's order (None: the tile
    # of the block index, one CTA per tile); ``states`` the role's pipeline states, returned past it;
    # ``tile`` (load and MMA warps) the tile itself.
    @cute.jit
    def load_tile(self, index, tile, states, tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mV, mPageTable, storage, sQ,
                  sK, sV, sK_layout, sV_layout, stage_elems: cutlass.Constexpr[int], mma_qk, mma_pv, pipes, tile_args):
        paged = None
        if cutlass.const_expr(self.cfg.page_size > 0):
            paged = self.paged_kv_sources(tma_atom_K, mK, tma_atom_V, mV, mPageTable, storage, sK_layout, sV_layout,
                                          stage_elems, tile)
        return self.load(tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mV, sQ, sK, sV, mma_qk, mma_pv, pipes, tile,
                         states, paged)

    @cute.jit
    def mma_tile(self, index, tile, states, tmem, sQ, sK, sV, tmem_layouts, mma_qk, mma_pv, pipes, tile_args,
                 v_rows):
        # (A pair's operands are made afresh in each phase of the tile instead: pair_operands.)
        if cutlass.const_expr(index is not None and self.registers["other"] < 64 and not self.pair):
            sQ, sK, sV = [self.tile_variant(x, index) for x in (sQ, sK, sV)]
        tail = None
        if cutlass.const_expr(self.zero_tail):
            tail = (v_rows, first_row_past_keys(tile.seqlen.seqlen_k, tile.n_block_max - 1, TILE_N))
        return self.mma(tmem, sQ, sK, sV, tmem_layouts, mma_qk, mma_pv, pipes, self.num_blocks(tile), states, tail)

    @staticmethod
    def tile_variant(smem: cute.Tensor, index: Int32) -> cute.Tensor:
        """``smem`` itself, at an address the compiler cannot prove invariant across tiles (offset by
        min(index, 0) = 0 whole 1024-byte blocks): otherwise it hoists every shared-memory MMA
        descriptor out of the persistent tile loop, past the MMA warp's 48 registers (with one
        query tile the warp has 136 and the hoisted descriptors cost less than the per-tile
        recomputation: ptxas 13.4 spilled at d = 256 with the offset)."""
        zero = cutlass.min(index, 0) * (1024 * 8 // smem.element_type.width)
        return cute.make_tensor(smem.iterator + zero, smem.layout)

    @cute.jit
    def correction_tile(self, index, states, tmem_ptr, tmem_layouts, pipes, row_stats, mO, tile_args):
        tile, split = self.output_tile(index, *tile_args)
        return self.correction(tmem_ptr, tmem_layouts, pipes, row_stats, self.split_slice(mO, split), tile, states)

    @cute.jit
    def softmax_tile(self, index, states, tmem, q_tile, tmem_layouts, pipes, row_stats, mLSE, mSink,
                     score_prescale, scale_log2, tile_args):
        tile, split = self.output_tile(index, *tile_args)
        # The TMEM address is read after the tile's coordinates, rather than kept live across them
        # (a shared-memory load; the softmax's register budget has no room to spare).
        return self.softmax(tmem.retrieve_ptr(Float32), q_tile, tmem_layouts, pipes, row_stats, self.split_slice(mLSE, split), mSink,
                            tile, score_prescale, scale_log2, states)

    @cute.jit
    def output_tile(self, index: Int32, scheduler: TileScheduler, splits: Optional[KVSplits], mQ, mK, mCuSeqlensQ,
                    mCuSeqlensK, mSeqUsedQ, mSeqUsedK, window_left, window_right, qhead_per_kvhead, divisors):
        """(tile ``index`` of tiles(), its split): the query block, head and batch entry, their
        lengths and the KV blocks the tile's rows see (with split-KV, the split's share of them;
        split 0 without)."""
        cfg = self.cfg
        if cutlass.const_expr(index is None):
            m_block, head, batch = scheduler.tile()
        elif cutlass.const_expr(divisors is not None):
            m_block, head, batch = scheduler.tile_at_fast(index, divisors)
        else:
            m_block, head, batch = scheduler.tile_at(index)
        if cutlass.const_expr(self.pair):  # the scheduler's m_block is the pair's
            m_block = m_block * self.cfg.cluster_m + self.pair_rank()
        split = Int32(0)
        if cutlass.const_expr(splits is not None):
            head, split = splits.unfold(head)
        # With GQA packing Q's sequence mode is (query heads of the group, tokens).
        tokens_q = mQ.shape[0] if cutlass.const_expr(cfg.pack_gqa == 1) else mQ.shape[0][1]
        seqlen = SeqlenInfo.create(batch, tokens_q, mK.shape[0], mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mSeqUsedQ)
        mask = AttentionMask(cfg.tile_m, TILE_N, cfg.causal, cfg.local, window_left, window_right,
                             rows_per_query=cfg.pack_gqa)
        n_block_min, n_block_max = mask.n_block_range(seqlen, m_block)
        if cutlass.const_expr(splits is not None):
            n_block_min, n_block_max = splits.block_range(n_block_min, n_block_max, split)
        head_kv = head // qhead_per_kvhead
        if cutlass.const_expr(divisors is not None and len(divisors) > 2):
            head_kv = head // divisors[2]
        tile = OutputTile(cfg.tile_m, seqlen, mask, m_block, head, batch, head_kv, n_block_min, n_block_max)
        return tile, split

    def split_slice(self, t: cute.Tensor, split) -> cute.Tensor:
        """Split ``split``'s partial O or LSE (the whole tensor without split-KV)."""
        return last_mode_slice(t, split) if self.cfg.split_kv else t

    @cute.jit
    def num_blocks(self, tile: OutputTile) -> Int32:
        """KV blocks the tile walks: none for a tile past its sequence's end (varlen grids are sized
        for the longest) or whose rows see no key (it writes O = 0 and LSE = -inf)."""
        n = Int32(0)
        in_sequence = tile.in_sequence()
        if cutlass.const_expr(self.pair):
            # Both CTAs of a pair walk the pair's blocks (the MMAs are the pair's), which has rows
            # while its even CTA's tile has: the odd CTA's tile may lie past the sequence's end.
            in_sequence = tile.m_block // 2 * 2 * tile.tile_m < tile.mask.rows(tile.seqlen)
        if in_sequence:
            n = cutlass.max(tile.n_block_max - tile.n_block_min, 0)
        return n

    def make_pipelines(self, storage, cluster):
        """The pipelines over ``storage``'s barriers. A pair (``cluster``: the CTAs of one MMA):
        only the even CTA's full barriers of q and kv count (both CTAs' TMA bytes land there) and
        only its empty barriers of s and o (both CTAs' softmax and correction threads arrive there);
        the MMA warp's commits reach both CTAs (multicast)."""
        thread = pipeline.Agent.Thread
        one = pipeline.CooperativeGroup(thread)
        ctas = self.cfg.cluster_m
        layout = cluster if self.pair else None
        q = pipeline.PipelineTmaUmma.create(
            num_stages=self.q_tiles, producer_group=one, consumer_group=one, tx_count=self.tma_bytes_q,
            barrier_storage=storage.mbar_q.data_ptr(), cta_layout_vmnk=layout, defer_sync=True)
        kv = pipeline.PipelineTmaUmma.create(
            num_stages=self.kv_stages, producer_group=one, consumer_group=one, tx_count=self.tma_bytes_k,
            barrier_storage=storage.mbar_kv.data_ptr(), cta_layout_vmnk=layout, defer_sync=True)
        # Stage t of s, o: query tile t. S full: MMA -> softmax t; its empty barrier ("P written,
        # O rescaled") is released by softmax t and by the correction warpgroup (of both CTAs).
        s = pipeline.PipelineUmmaAsync.create(
            num_stages=self.q_tiles, producer_group=one,
            consumer_group=pipeline.CooperativeGroup(thread, 2 * WARPGROUP * ctas),
            barrier_storage=storage.mbar_s.data_ptr(), cta_layout_vmnk=layout, defer_sync=True)
        o = pipeline.PipelineUmmaAsync.create(
            num_stages=self.q_tiles, producer_group=one, consumer_group=pipeline.CooperativeGroup(thread, WARPGROUP * ctas),
            barrier_storage=storage.mbar_o.data_ptr(), cta_layout_vmnk=layout, defer_sync=True)
        warpgroup = pipeline.CooperativeGroup(thread, WARPGROUP)
        # Two stages per tile, in the order the correction warps read them: (block i, tile t) is
        # stage (i * q_tiles + t) mod (2 * q_tiles).
        stats = pipeline.PipelineAsync.create(
            num_stages=2 * self.q_tiles, producer_group=warpgroup, consumer_group=warpgroup,
            barrier_storage=storage.mbar_stats.data_ptr(), defer_sync=True)
        return Pipelines(q, kv, s, o, stats)

    # ---- load warp -------------------------------------------------------------------------------
    @cute.jit
    def load(self, tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mV, sQ, sK, sV, mma_qk, mma_pv, pipes,
             tile: OutputTile, states, paged: Optional[tuple] = None):
        """Q tiles, then K and V blocks in the order the MMA warp consumes them (K_0, K_1, V_0, K_2,
        V_1, ..., V_last), visiting KV blocks from n_block_max - 1 down. ``paged``: the (K, V)
        sources of a paged cache (paged_kv_sources), in place of mK and mV. ``states``: the q and kv
        producer states, returned advanced past this tile's loads (a tile without KV blocks loads
        nothing, and the MMA warp skips it alike)."""
        varlen = self.cfg.varlen
        seqlen, mask, head, batch, head_kv = tile.seqlen, tile.mask, tile.head, tile.batch, tile.head_kv
        m_block, n_block_max, num_blocks = tile.m_block, tile.n_block_max, self.num_blocks(tile)
        # A pair's CTA loads its half of each K and V tile: the MMA's slice of its rank.
        thr_qk, thr_pv = mma_qk.get_slice(self.pair_rank()), mma_pv.get_slice(self.pair_rank())
        q_rows = head_rows(mQ, self.packing.tma_rows_before(mask, seqlen), head, batch, varlen)
        if cutlass.const_expr(not self.pair):
            gQ = self.packing.tma_tile(q_rows, TILE_M, self.hdim_tile, None)
            tQsQ, tQgQ = self.tma_partition(tma_atom_Q, sQ, thr_qk.partition_A(gQ))
        if cutlass.const_expr(paged is None):
            gK = cute.local_tile(head_rows(mK, seqlen.offset_k, head_kv, batch, varlen),
                                 (TILE_N, self.hdim_tile), (None, 0))
            mV_head = self.head_cols(mV, seqlen.offset_k, head_kv, batch)
            gV = cute.local_tile(mV_head, (self.hdim_v_tile, TILE_N), (0, None))
            tKsK, tKgK = self.tma_partition(tma_atom_K, sK, thr_qk.partition_B(gK))
            tVsV, tVgV = self.tma_partition(tma_atom_V, sV, thr_pv.partition_B(gV))
            k_src, v_src = (tma_atom_K, tKgK, tKsK, None), (tma_atom_V, tVgV, tVsV, None)
        else:
            k_src, v_src = paged

        q_state, kv_state = states
        if num_blocks > 0:
            for t in cutlass.range_constexpr(self.q_tiles):
                pipes.q.producer_acquire(q_state)
                if cutlass.const_expr(self.pair):
                    pair_sQ, pair_gQ = self.pair_q_partition(tma_atom_Q, sQ, mma_qk, q_rows, m_block * self.q_tiles + t)
                    cute.copy(tma_atom_Q, pair_gQ, pair_sQ[None, q_state.index],
                              tma_bar_ptr=pipes.q.producer_get_barrier(q_state))
                else:
                    cute.copy(tma_atom_Q, tQgQ[None, m_block * self.q_tiles + t], tQsQ[None, q_state.index],
                              tma_bar_ptr=pipes.q.producer_get_barrier(q_state))
                q_state = advanced(q_state)
                if cutlass.const_expr(t == 0):
                    kv_state = self.load_kv(pipes.kv, kv_state, k_src, n_block_max - 1, self.tma_bytes_k, seqlen)
            for i in cutlass.range(1, num_blocks, unroll=1):
                kv_state = self.load_kv(pipes.kv, kv_state, k_src, n_block_max - 1 - i, self.tma_bytes_k, seqlen)
                kv_state = self.load_kv(pipes.kv, kv_state, v_src, n_block_max - i, self.tma_bytes_v, seqlen)
            kv_state = self.load_kv(pipes.kv, kv_state, v_src, n_block_max - num_blocks, self.tma_bytes_v, seqlen)
        return q_state, kv_state

    @cute.jit
    def load_kv(self, pipe, state, src, n_block, tx_bytes: cutlass.Constexpr[int], seqlen: SeqlenInfo):
        """One K or V tile into the ring's next stage: one TMA box, or with a paged cache
        PagedKV.copies boxes from the pages the page table names (zeros past the sequence's end)."""
        atom, gmem, smem, pages = src
        if cutlass.const_expr(pages is None):
            pipe.producer_acquire(state, expected_tx=tx_bytes)
            cute.copy(atom, gmem[None, n_block], smem[None, state.index],
                      tma_bar_ptr=pipe.producer_get_barrier(state))
        else:
            # Up to PREFETCHED_PAGE_BOXES boxes, the page-table reads go first, so that their latency
            # overlaps the wait for a free stage; more (small pages) would not fit the load warp's
            # 48 registers (ptxas spills at 8 boxes), so those are read box by box.
            early = pages.copies <= PREFETCHED_PAGE_BOXES
            sources = []
            if cutlass.const_expr(early):
                for box in cutlass.range_constexpr(pages.copies):
                    sources.append(pages.box_source(n_block, box, seqlen.seqlen_k, gmem.shape[2]))
            pipe.producer_acquire(state, expected_tx=tx_bytes)
            for box in cutlass.range_constexpr(pages.copies):
                if cutlass.const_expr(not early):
                    sources.append(pages.box_source(n_block, box, seqlen.seqlen_k, gmem.shape[2]))
                cute.copy(atom, gmem[None, sources[box][0], sources[box][1]], smem[None, box, state.index],
                          tma_bar_ptr=pipe.producer_get_barrier(state))
        return advanced(state)

    @cute.jit
    def paged_kv_sources(self, tma_atom_K, mK, tma_atom_V, mV, mPageTable, storage, sK_layout, sV_layout,
                         stage_elems: cutlass.Constexpr[int], tile: OutputTile):
        """The (atom, gmem boxes (TMA, box in page, page), smem boxes (TMA, box, stage), PagedKV) of
        K and of V for the load warp, over the ring's storage viewed as boxes of whole rows."""
        pages = PagedKV(self.cfg.page_size, TILE_N, mPageTable, tile.batch)
        sources = []
        for atom, mX, layout, cols, keys_mode in ((tma_atom_K, mK, sK_layout, self.hdim_tile, 0),
                                                  (tma_atom_V, mV, sV_layout, self.hdim_v_tile, 1)):
            _, ring = self.kv_box_layouts(layout, cols, pages.rows, stage_elems, keys_mode)
            s_boxes = storage.sKV.get_tensor(ring.outer, swizzle=ring.inner)  # ((rows, cols), box, stage)
            g_boxes = pages.head_boxes(mX, tile.head_kv, cols)  # (rows, cols, box in page, page)
            s_part, g_part = cpasync.tma_partition(atom, 0, cute.make_layout(1), s_boxes,
                                                   cute.group_modes(g_boxes, 0, 2))
            sources.append((atom, g_part, s_part, pages))
        return tuple(sources)

    def kv_box_layouts(self, layout: cute.ComposedLayout, cols: int, rows: int, stage_elems: int, keys_mode: int):
        """(one box, the ring as boxes) of a K (keys_mode 0) or V (keys_mode 1) ring stage whose MMA
        layout is ``layout``, in plain (key, column) coordinates: box layout (rows, cols) and ring
        ((rows, cols), box, stage). The MMA layouts keep each key's row as swizzle-atom lines ``w``
        columns wide, consecutive keys ``w`` apart and column chunks ``chunk`` apart; both are read
        off the layout and every (key, column) is checked against it here, at trace time, so a box
        lands exactly where the MMA reads (ValueError otherwise)."""
        outer = layout.outer

        def mma_offset(key, col):
            # K: ((key, col % 16), 0, col // 16, 0). V^T: ((col, key % 16), 0, key // 16, 0).
            if keys_mode == 0:
                return cute.crd2idx(((key, col % 16), 0, col // 16, 0), outer)
            return cute.crd2idx(((col, key % 16), 0, key // 16, 0), outer)

        w = mma_offset(1, 0)
        chunks = max(cols // w, 1)
        chunk = mma_offset(0, w) if chunks > 1 else w * TILE_N
        box = cute.make_layout((rows, (w, chunks)), stride=(w, (1, chunk)))
        for key in range(TILE_N):
            for col in sorted({0, 1, w - 1, min(w, cols - 1), cols - 1}) if key not in (0, 1, 63, 127) else range(cols):
                plain = key * w + (col % w) + (col // w) * chunk
                if mma_offset(key, col) != plain:
                    raise ValueError(f"sm100 forward: paged K/V boxes do not match the MMA's shared-memory layout at "
                                     f"key {key}, column {col} ({mma_offset(key, col)} vs {plain}; head dim {cols})")
        ring = cute.make_layout(((rows, (w, chunks)), TILE_N // rows, self.kv_stages),
                                stride=((w, (1, chunk)), rows * w, stage_elems))
        return (cute.make_composed_layout(layout.inner, 0, box), cute.make_composed_layout(layout.inner, 0, ring))

    def pair_q_partition(self, atom, sQ, mma_qk, q_rows, block):
        """(smem (TMA, stage), gmem (TMA,)) of query block ``block`` (TILE_M rows) for a CTA of a
        pair: the rows are this CTA's own, so they are taken as the first half (slice 0) of an
        M = 256 window that starts at them (the other half, the peer's, is never loaded from here)."""
        window = self.packing.tma_window(q_rows, self.mma_m, self.hdim_tile, block * TILE_M)
        tQsQ, tQgQ = self.tma_partition(atom, sQ, mma_qk.get_slice(0).partition_A(window))
        return tQsQ, tQgQ

    @staticmethod
    def tma_partition(atom, smem, gmem_mma):
        """(smem, gmem) TMA partitions of MMA-partitioned tiles (no multicast): (TMA, stage) and
        (TMA, tile index)."""
        return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(smem, 0, 3),
                                     cute.group_modes(gmem_mma, 0, 3))

    @cute.jit
    def head_cols(self, mV, offset, head, batch):
        """V's (dim, keys) view of one KV head (keys start at ``offset`` in a varlen batch)."""
        if cutlass.const_expr(self.cfg.varlen):
            return cute.domain_offset((0, offset), mV[None, None, head])
        else:
            return mV[None, None, head, batch]

    # ---- MMA warp --------------------------------------------------------------------------------
    @cute.jit
    def mma(self, tmem, sQ, sK, sV, tmem_layouts, mma_qk, mma_pv, pipes, num_blocks, states, tail=None):
        """S_t(j) = Q_t K_j^T after O_t += P_t(j-1) V_(j-1), tile after tile; the last P V ends the
        tile. ``states``: the q, kv (consumer), s and o (producer) states, returned past this tile
        (unchanged for a tile without KV blocks, which the other roles skip alike). ``tail``
        (zero_tail): (the V ring in (key, column) coordinates, the first block's first row past
        the keys) for zero_v_tail."""
        views = (sQ, sK, sV, tmem_layouts, mma_qk, mma_pv)
        # Single CTAs: the operands once per tile. The TMEM address is read per tile (a shared-memory
        # load), so that the compiler does not hoist every MMA's TMEM operand address out of the
        # tile loop, past the 48 registers.
        tile_ops = None if self.pair else self.mma_operands(tmem.retrieve_ptr(Float32), *views)

        q_state, kv_state, s_state, o_state = states
        if num_blocks > 0:
            # Prologue: S_t(0) for every tile. (Q_t is in q stage t: each tile advances q by q_tiles.)
            q_first = q_state
            k_state = kv_state
            first = tile_ops if not self.pair else self.pair_operands(tmem, *views)
            for t in cutlass.range_constexpr(self.q_tiles):
                pipes.q.consumer_wait(q_state)
                if cutlass.const_expr(t == 0):
                    pipes.kv.consumer_wait(k_state)
                pipes.s.producer_acquire(s_state)
                mma_qk = gemm(mma_qk, first.s[t], first.q[None, None, None, t],
                              first.k[None, None, None, k_state.index], False)
                pipes.s.producer_commit(s_state)
                s_state = advanced(s_state)
                q_state = advanced(q_state)
            pipes.kv.consumer_release(k_state)
            kv_state = advanced(k_state)
            if cutlass.const_expr(tail is not None):
                self.zero_v_tail(pipes.kv, kv_state, num_blocks, *tail)
            for i in cutlass.range(1, num_blocks, unroll=1):
                k_state = kv_state
                v_state = advanced(k_state)
                pipes.kv.consumer_wait(k_state)
                block = tile_ops if not self.pair else self.pair_operands(tmem, *views)
                for t in cutlass.range_constexpr(self.q_tiles):
                    pipes.s.producer_acquire(s_state)
                    if cutlass.const_expr(t == 0):
                        pipes.kv.consumer_wait(v_state)
                    mma_pv = gemm(mma_pv, block.o[t], block.p[t], block.v[None, None, None, v_state.index], i > 1)
                    mma_qk = gemm(mma_qk, block.s[t], block.q[None, None, None, t],
                                  block.k[None, None, None, k_state.index], False)
                    pipes.s.producer_commit(s_state)
                    s_state = advanced(s_state)
                pipes.kv.consumer_release(k_state)
                pipes.kv.consumer_release(v_state)
                kv_state = advanced(v_state)
            if cutlass.const_expr(self.persistent):
                # Every Q K^T of the tile is issued: Q's stages go back to the load warp (when those
                # MMAs complete), which brings the next tile's Q under this tile's last P V.
                for t in cutlass.range_constexpr(self.q_tiles):
                    pipes.q.consumer_release(advanced(q_first, t))
            # The last block's P V completes O. Its wait on s does not move s on: S_t's columns
            # hold no new scores until the next tile's S_t(0), which the same wait covers (so each
            # tile advances s by one stage per S = Q K^T, as its consumers do).
            last = tile_ops if not self.pair else self.pair_operands(tmem, *views)
            for t in cutlass.range_constexpr(self.q_tiles):
                pipes.s.producer_acquire(advanced(s_state, t))
                if cutlass.const_expr(t == 0):
                    pipes.kv.consumer_wait(kv_state)
                mma_pv = gemm(mma_pv, last.o[t], last.p[t], last.v[None, None, None, kv_state.index], num_blocks > 1)
                pipes.o.producer_commit(o_state)
                o_state = advanced(o_state)
            pipes.kv.consumer_release(kv_state)
            kv_state = advanced(kv_state)
        return q_state, kv_state, s_state, o_state

    @cute.jit
    def zero_v_tail(self, pipe_kv, kv_state, num_blocks: Int32, v_rows: cute.Tensor, first_row: Int32):
        """Zero the first block's V rows past the sequence's keys before any P V reads them
        (fa4_kernels/kv_tail.py: 0 * NaN), by the MMA warp itself, so that no other role or barrier
        is involved: its 32 threads wait for V_0's TMA (the stage after K_1's, or right after K_0's
        with one block), zero the rows, fence the generic-proxy stores for the tensor cores (async
        proxy) and meet at a warp barrier before the first P V is issued. V_0's later wait returns
        at once; its release is unchanged. Runs while the softmax warps work on S(0), when the MMA
        warp would wait for P anyway; only where the block reaches past the keys."""
        if first_row < TILE_N:
            v_state = kv_state
            if num_blocks > 1:
                v_state = advanced(kv_state)
            pipe_kv.consumer_wait(v_state)
            stage = v_rows[None, 0, v_state.index]  # one mode, (key, column)
            stage = cute.make_tensor(stage.iterator, cute.get(stage.layout, mode=[0]))
            zero_rows(stage, first_row, cute.arch.lane_idx(), WARP)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_warp()

    def mma_operands(self, tmem_ptr, sQ, sK, sV, tmem_layouts, mma_qk, mma_pv) -> "MmaOperands":
        """The MMA warp's operands over tensor memory at ``tmem_ptr`` and the shared-memory views."""
        thr_qk, thr_pv = mma_qk.get_slice(0), mma_pv.get_slice(0)
        s_layout, o_layout, p_layout, _ = tmem_layouts
        return MmaOperands(
            s=[cute.make_tensor(tmem_ptr + c, s_layout) for c in self.tmem_s],
            o=[cute.make_tensor(tmem_ptr + c, o_layout) for c in self.tmem_o],
            p=[cute.make_tensor(cute.recast_ptr(tmem_ptr + c, dtype=self.dtype), p_layout) for c in self.tmem_p],
            q=thr_qk.make_fragment_A(sQ), k=thr_qk.make_fragment_B(sK), v=thr_pv.make_fragment_B(sV))

    def pair_operands(self, tmem, sQ, sK, sV, tmem_layouts, mma_qk, mma_pv) -> "MmaOperands":
        """A CTA pair's MMA operands, made afresh in each phase of a tile (its first Q K^T, each KV
        block, the last P V). In a cluster launch the base of shared memory is a runtime value, so
        each k-step's descriptor is that base plus a constant, and ptxas hoisted all of them out of
        the KV loop (at d = 192: 2 x 12 for Q, 12 for K, 8 for V, 64 bits each, beside 19 TMEM
        addresses) and spilled them at the MMA warp's 48 registers (13.4: 102 LDL / 86 STL). Here
        the TMEM address is loaded from shared memory in the phase, between barrier waits, which
        neither compiler moves a load across (so it stays in the loop), and the shared-memory views
        are offset by min(address, 0) whole 1024-byte blocks: 0, since a TMEM address is lane << 16
        | column with lane < 128, but not known to the compilers. Each descriptor and TMEM address is
        then derived next to its MMA (one add each) and nothing is held across the loop."""
        tmem_ptr = tmem.retrieve_ptr(Float32)
        zero = cutlass.min(tmem_ptr.toint(), 0)
        views = [cute.make_tensor(x.iterator + zero * (1024 * 8 // x.element_type.width), x.layout)
                 for x in (sQ, sK, sV)]
        return self.mma_operands(tmem_ptr, *views, tmem_layouts, mma_qk, mma_pv)

    def tmem_layouts(self, mma_qk, mma_pv, tP_layout):
        """Layouts of S (the QK MMA's accumulator), O (the PV MMA's) and P (the PV MMA's A operand,
        16-bit, over S's upper columns) in tensor memory, one tile each."""
        thr_qk, thr_pv = mma_qk.get_slice(0), mma_pv.get_slice(0)
        # (A pair's MMA tile is M = 256 rows; each CTA's TMEM holds its own 128 of them.)
        s_layout = thr_qk.make_fragment_C(thr_qk.partition_shape_C((self.mma_m, TILE_N))).layout
        o_layout = thr_pv.make_fragment_C(thr_pv.partition_shape_C((self.mma_m, self.hdim_v_tile))).layout
        p_layout = thr_pv.make_fragment_A(tP_layout.outer)[None, None, None, 0].layout
        # S's (row, key) coordinates in the accumulator's own shape, for register fragments.
        s_coords = thr_qk.partition_C(cute.make_identity_tensor((self.mma_m, TILE_N)))
        return s_layout, o_layout, p_layout, s_coords

    # ---- softmax warpgroups ----------------------------------------------------------------------
    @cute.jit
    def softmax(self, tmem_ptr, q_tile: Int32, tmem_layouts, pipes, row_stats, mLSE, mSink, tile: OutputTile,
                score_prescale: Float32, scale_log2: Float32, states):
        """Query tile ``q_tile``'s online softmax (both softmax warpgroups run this code, ``q_tile``
        is their warpgroup): thread = row = TMEM lane. ``states``: this warpgroup's s (consumer) and
        stats (producer) states, returned past the tile."""
        cfg = self.cfg
        seqlen, mask, m_block, head, batch = tile.seqlen, tile.mask, tile.m_block, tile.head, tile.batch
        n_block_max, num_blocks, in_sequence = tile.n_block_max, self.num_blocks(tile), tile.in_sequence()
        thread = cute.arch.thread_idx()[0] % WARPGROUP
        row = q_tile * TILE_M + thread  # within the CTA's tile
        tStS = cute.make_tensor(tmem_ptr + q_tile * TILE_N, tmem_layouts[0])
        load_s = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(32)), Float32), tStS).get_slice(thread)
        tSt = load_s.partition_S(tStS)
        s_registers = load_s.partition_D(tmem_layouts[3]).shape
        # P: the same lanes, TILE_N 16-bit values in TILE_N / 2 32-bit columns over S's upper half,
        # stored P_CHUNK columns (P_CHUNK / 2 words) at a time as they are computed, so that a
        # thread never holds the whole row of P beside its scores.
        p_words = TILE_N * self.dtype.width // 32
        chunk_words = P_CHUNK * self.dtype.width // 32
        tStP = cute.make_tensor(tmem_ptr + q_tile * TILE_N + (TILE_N - p_words), cute.composition(
            tStS.layout, cute.make_layout((TILE_M, p_words))))
        tStP = cute.flat_divide(tStP, (TILE_M, chunk_words))[None, None, 0, None]  # (TILE_M, words, chunks)
        store_p = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.St32x32bOp(tcgen05.Repetition(chunk_words)), Float32),
            tStP[None, None, 0]).get_slice(thread)
        tPt = store_p.partition_D(tStP)  # ((words, 1), 1, 1, chunks)
        p_registers = store_p.partition_S(cute.make_identity_tensor((TILE_M, chunk_words))).shape
        # This row's (row, key) coordinates, for the element-wise mask.
        coords = cute.local_tile(cute.make_identity_tensor((cfg.tile_m, TILE_N)), (1, TILE_N), (row, 0))

        softmax = OnlineSoftmax.create(scale_log2, num_rows=1, threads_per_row=1)
        row_scale = cute.make_rmem_tensor(1, Float32)
        s_state, stats_state = states
        # Blocks [full_lo, full_hi) need no element-wise mask (when the tile's rows all lie in the
        # sequence), fixed for the tile: three scalars in the loop rather than the mask arithmetic.
        full_lo = mask.n_block_min_full(seqlen, m_block)
        full_hi = mask.n_block_max_full(seqlen, m_block)
        if (m_block + 1) * cfg.tile_m > mask.rows(seqlen):
            full_hi = full_lo
        for i in cutlass.range(num_blocks, unroll=1):
            n_block = n_block_max - 1 - i
            step = (thread, load_s, tSt, s_registers, store_p, tPt, p_registers, coords, softmax, row_scale, pipes,
                    row_stats, s_state, stats_state, seqlen, mask, m_block, n_block, score_prescale)
            if n_block >= full_lo and n_block < full_hi:
                self.softmax_step(*step, masked=False)
            else:
                self.softmax_step(*step, masked=True)
            s_state = advanced(s_state, self.q_tiles)
            stats_state = advanced(stats_state, self.q_tiles)

        sink = None
        if cutlass.const_expr(cfg.has_sink):
            sink = self.sink_logit(mSink, head, m_block * cfg.tile_m + row)
        out_scale, lse = softmax.finalize(sink)
        pipes.stats.producer_acquire(stats_state)
        row_stats[thread, stats_state.index] = out_scale[0]
        pipes.stats.producer_commit(stats_state)
        if cutlass.const_expr(self.persistent):
            stats_state = advanced(stats_state, self.q_tiles)
        if in_sequence:
            inside = row < mask.rows(seqlen) - m_block * cfg.tile_m
            if cutlass.const_expr(self.packing.padded):
                inside = inside & self.packing.real_row(row)  # a dummy row aliases a real head
            if inside:
                gLSE = head_rows(mLSE, mask.rows_before(seqlen), head, batch, cfg.varlen)
                gLSE[m_block * cfg.tile_m + row] = lse[0]
        return s_state, stats_state

    @cute.jit
    def prescaled(self, s: Float32, score_prescale: Float32) -> Float32:
        if cutlass.const_expr(self.cfg.has_softcap):
            return cute.math.tanh(s * score_prescale, fastmath=True)
        return s

    @cute.jit
    def softmax_step(self, thread, load_s, tSt, s_registers, store_p, tPt, p_registers, coords,
                     softmax: OnlineSoftmax, row_scale, pipes, row_stats, s_state, stats_state, seqlen, mask,
                     m_block, n_block, score_prescale, masked: cutlass.Constexpr[bool]):
        """One KV block: S from TMEM, the mask (where the block crosses a mask edge), the new row
        maximum and its rescale factor (to the correction warps), P to TMEM (some exponentials on
        the FMA pipe, but only in blocks without -inf scores), the row sum."""
        pipes.s.consumer_wait(s_state)
        rS = cute.make_rmem_tensor(s_registers, Float32)
        cute.copy(load_s, tSt, rS)
        cute.arch.fence_view_async_tmem_load()
        scores = [[self.prescaled(rS[c], score_prescale) for c in range(cute.size(rS))]]
        if cutlass.const_expr(masked):
            scores = mask.apply(scores, coords, seqlen, m_block, n_block)
        shift = softmax.update_max(scores, row_scale, self.cfg.rescale_threshold, block_max=[row_max(scores[0])])
        pipes.stats.producer_acquire(stats_state)
        row_stats[thread, stats_state.index] = row_scale[0]
        pipes.stats.producer_commit(stats_state)
        sums = row_sums_init()
        for k in cutlass.range_constexpr(TILE_N // P_CHUNK):
            rP = cute.make_rmem_tensor(p_registers, Float32)
            sums = row_probabilities(scores[0], k * P_CHUNK, P_CHUNK, softmax.scale_log2, shift[0],
                                     cute.recast_tensor(rP, self.dtype), sums,
                                     0 if masked else self.cfg.exp2_emulated_eighths)
            cute.copy(store_p, rP, tPt[None, None, None, k])
        block_sum = row_sums_total(sums)
        cute.arch.fence_view_async_tmem_store()  # P is in TMEM before the MMA may read it
        pipes.s.consumer_release(s_state)
        softmax.update_sum(None, row_scale, block_sums=[block_sum])

    @cute.jit
    def sink_logit(self, mSink, head, row):
        """The learnable sink logit of tile row ``row``: the tile's head, or with GQA packing the
        row's own query head (head here is the KV head; QueryPacking.query_head)."""
        if cutlass.const_expr(self.packing.group == 1):
            return Float32(mSink[head])
        return Float32(mSink[self.packing.query_head(head, row)])

    # ---- correction warpgroup --------------------------------------------------------------------
    @cute.jit
    def correction(self, tmem_ptr, tmem_layouts, pipes, row_stats, mO, tile: OutputTile, states):
        """Rescale O_t whenever softmax t moved a row maximum, then write O / rowsum. ``states``:
        the stats, s and o consumer states, returned past the tile. The next tile's first P V
        overwrites O_t only after this warpgroup released that tile's first S_t, which it does
        after reading O_t here (tcgen05.wait::ld in store_o)."""
        num_blocks, in_sequence = self.num_blocks(tile), tile.in_sequence()
        thread = cute.arch.thread_idx()[0] % WARPGROUP
        tOtO = [cute.make_tensor(tmem_ptr + c, tmem_layouts[1]) for c in self.tmem_o]
        stats_state, s_state, o_state = states
        for i in cutlass.range(num_blocks, unroll=1):
            for t in cutlass.range_constexpr(self.q_tiles):
                pipes.stats.consumer_wait(stats_state)
                scale = row_stats[thread, stats_state.index]
                pipes.stats.consumer_release(stats_state)
                if i > 0:  # block 0's P V starts O afresh
                    self.rescale_o(tOtO[t], thread, scale)
                pipes.s.consumer_release(s_state)
                stats_state = advanced(stats_state)
                s_state = advanced(s_state)
        for t in cutlass.range_constexpr(self.q_tiles):
            pipes.stats.consumer_wait(stats_state)
            out_scale = row_stats[thread, stats_state.index]
            pipes.stats.consumer_release(stats_state)
            stats_state = advanced(stats_state)
            if cutlass.const_expr(self.pair):
                # The pair's O completes whether or not this CTA's tile has rows; a tile past the
                # sequence's end stores nothing (store_o's row predicate is false on every row).
                if num_blocks > 0:
                    pipes.o.consumer_wait(o_state)
                self.store_o(tOtO[t], thread, t, out_scale, num_blocks > 0, mO, tile)
            elif in_sequence:
                if num_blocks > 0:
                    pipes.o.consumer_wait(o_state)
                self.store_o(tOtO[t], thread, t, out_scale, num_blocks > 0, mO, tile)
            if cutlass.const_expr(self.persistent):
                # The MMA warp commits O only for a tile with KV blocks. (Without persistence the
                # state is dead here; ptxas 13.4 spills with the branch in the d = 128 kernel.)
                if num_blocks > 0:
                    o_state = advanced(o_state)
        return stats_state, s_state, o_state

    @cute.jit
    def rescale_o(self, tOtO, thread, scale: Float32):
        """O *= scale for this thread's row, in O_CHUNK-column chunks through registers. With the
        conditional rescale most factors are exactly 1: a warp whose rows all kept their maximum
        skips the round trip (a warp-uniform branch)."""
        moved = scale != Float32(1.0)
        if cutlass.const_expr(self.cfg.rescale_threshold == 0.0):
            moved = True
        if cute.arch.vote_any_sync(moved):
            load, store, chunks = self.o_chunk_copies(tOtO, thread)
            for c in cutlass.range_constexpr(cute.size(chunks[0], mode=[3])):
                r = cute.make_rmem_tensor(chunks[1], Float32)
                cute.copy(load, chunks[0][None, None, None, c], r)
                cute.arch.fence_view_async_tmem_load()
                for e in cutlass.range_constexpr(0, cute.size(r), 2):
                    r[e], r[e + 1] = cute.arch.mul_packed_f32x2((r[e], r[e + 1]), (scale, scale))
                cute.copy(store, r, chunks[2][None, None, None, c])
            cute.arch.fence_view_async_tmem_store()  # O is rescaled before the MMA adds to it

    def o_chunk_copies(self, tOtO, thread):
        """TMEM <-> register copies of O by O_CHUNK columns: (load, store, (TMEM source per chunk,
        register shape per chunk, TMEM destination per chunk))."""
        chunk = self.o_chunk()
        tO = cute.flat_divide(tOtO[(None, None), 0, 0], (TILE_M, chunk))  # (TILE_M, chunk, 1, chunks)
        tO = tO[None, None, 0, None]
        load = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(chunk)), Float32),
                                      tO[None, None, 0]).get_slice(thread)
        store = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.St32x32bOp(tcgen05.Repetition(chunk)), Float32),
                                       tO[None, None, 0]).get_slice(thread)
        src = load.partition_S(tO)  # ((chunk, 1), 1, 1, chunks)
        dst = store.partition_D(tO)
        registers = load.partition_D(cute.make_identity_tensor((TILE_M, chunk))).shape  # ((chunk, 1), 1, 1)
        return load, store, (src, registers, dst)

    @cute.jit
    def store_o(self, tOtO, thread, t: cutlass.Constexpr[int], out_scale: Float32, has_o, mO, tile: OutputTile):
        """O / rowsum of this thread's row into global memory (rows past the sequence are not
        written; a tile whose rows saw no key writes zeros). Every thread of the warpgroup loads its
        lane (tcgen05.ld is warp-collective); only the global stores are predicated."""
        cfg = self.cfg
        seqlen, mask, m_block, head, batch = tile.seqlen, tile.mask, tile.m_block, tile.head, tile.batch
        row = t * TILE_M + thread
        row_inside = row < mask.rows(seqlen) - m_block * cfg.tile_m
        if cutlass.const_expr(self.packing.padded):
            row_inside = row_inside & self.packing.real_row(row)  # a dummy row aliases a real head
        gO = cute.local_tile(head_rows(mO, mask.rows_before(seqlen), head, batch, cfg.varlen),
                             (cfg.tile_m, self.hdim_v_tile), (m_block, 0))
        load, _, chunks = self.o_chunk_copies(tOtO, thread)
        chunk = self.o_chunk()
        gO_row = cute.flat_divide(gO[row, None], (chunk,))  # (chunk, chunks)
        if has_o:
            for c in cutlass.range_constexpr(cute.size(chunks[0], mode=[3])):
                r = cute.make_rmem_tensor(chunks[1], Float32)
                cute.copy(load, chunks[0][None, None, None, c], r)
                cute.arch.fence_view_async_tmem_load()
                for e in cutlass.range_constexpr(0, chunk, 2):
                    r[e], r[e + 1] = cute.arch.mul_packed_f32x2((r[e], r[e + 1]), (out_scale, out_scale))
                rO = cute.make_rmem_tensor(chunk, self.o_dtype)
                rO.store(r.load().to(self.o_dtype))
                if row_inside:
                    self.store_o_chunk(rO, gO_row, c)
        else:  # no P V ran (no key for any row): O = 0 without reading TMEM
            rO = cute.make_rmem_tensor(chunk, self.o_dtype)
            rO.fill(0.0)
            if row_inside:
                for c in cutlass.range_constexpr(cute.size(chunks[0], mode=[3])):
                    self.store_o_chunk(rO, gO_row, c)

    @cute.jit
    def store_o_chunk(self, rO, gO_row, c: cutlass.Constexpr[int]):
        chunk = self.o_chunk()
        if cutlass.const_expr(self.hdim_v_tile == self.hdim_v):
            cute.autovec_copy(rO, gO_row[None, c])
        else:
            for e in cutlass.range_constexpr(chunk):
                if c * chunk + e < self.hdim_v:  # not a zero-padding column
                    gO_row[e, c] = rO[e]

    def o_chunk(self) -> int:
        return O_CHUNK if self.hdim_v_tile % O_CHUNK == 0 else 16


class MmaOperands(NamedTuple):
    """The MMA warp's operands, one entry per query tile for s, o, p: S_t, O_t (float32) and P_t
    (16-bit) in tensor memory; the shared-memory descriptors of Q, K, V (MMA, M|N, K, stage)."""

    s: list
    o: list
    p: list
    q: cute.Tensor
    k: cute.Tensor
    v: cute.Tensor


@dataclass(frozen=True)
class Pipelines:
    """The kernel's mbarrier pipelines (see the module docstring); s, o and stats per query tile."""

    q: pipeline.PipelineTmaUmma
    kv: pipeline.PipelineTmaUmma
    s: pipeline.PipelineUmmaAsync
    o: pipeline.PipelineUmmaAsync
    stats: pipeline.PipelineAsync


# A pair's MMA commits reach both CTAs of the cluster (multicast mask over cluster ranks 0 and 1);
# its consumers' releases go to the even CTA (rank 0).
PAIR_MULTICAST = 0b11
PAIR_LEADER = 0


def rebased(pipes: Pipelines, storage, pair_rank=None) -> Pipelines:
    """``pipes`` over ``storage``'s barriers (the same shared memory reached from another base
    address value), without initialising them again. ``pair_rank``: a CTA pair's rank, read by the
    calling role: the pipelines' multicast masks, release targets and leader flag are remade from
    it (constants and this value) rather than carried from kernel entry, where they would stay
    live across every role's setmaxnreg (ptxas 12.9 spilled them)."""
    fields = {}
    for f in dataclasses.fields(pipes):
        pipe = getattr(pipes, f.name)
        base = getattr(storage, f"mbar_{f.name}").data_ptr().align(min_align=8)
        full, empty = copy.copy(pipe.sync_object_full), copy.copy(pipe.sync_object_empty)
        full.barrier_storage = full.mbarrier_base = base
        empty.barrier_storage = empty.mbarrier_base = base + pipe.num_stages
        moved = copy.copy(pipe)
        object.__setattr__(moved, "sync_object_full", full)
        object.__setattr__(moved, "sync_object_empty", empty)
        if pair_rank is not None and isinstance(pipe, pipeline.PipelineTmaUmma):
            object.__setattr__(moved, "consumer_mask", cutlass.Int16(PAIR_MULTICAST))
            object.__setattr__(moved, "producer_mask", cutlass.Int16(PAIR_MULTICAST))
            object.__setattr__(moved, "is_leader_cta", pair_rank == PAIR_LEADER)
        elif pair_rank is not None and isinstance(pipe, pipeline.PipelineUmmaAsync):
            object.__setattr__(moved, "producer_mask", cutlass.Int16(PAIR_MULTICAST))
            object.__setattr__(moved, "consumer_mask", Int32(PAIR_LEADER))
        fields[f.name] = moved
    return Pipelines(**fields)


@cute.jit
def gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, a: cute.Tensor, b: cute.Tensor, accumulate):
    """acc (+)= a @ b over the k slices, issued by the calling (MMA) warp; ``accumulate`` False
    starts the accumulator afresh at the first slice. Returns the MMA: its accumulate flag is a
    traced value, so the caller rebinds the MMA as a local variable (loop-carried where needed)."""
    for k in cutlass.range_constexpr(cute.size(a, mode=[2])):
        tiled_mma.set(tcgen05.Field.ACCUMULATE, accumulate or k != 0)
        cute.gemm(tiled_mma, acc, a[None, None, k], b[None, None, k], acc)
    return tiled_mma
