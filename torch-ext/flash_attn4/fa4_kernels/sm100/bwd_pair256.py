"""FlashAttention backward for Blackwell (sm_100a) at head_dim = head_dim_v = 256: a CTA pair with
64 keys per CTA (bwd_serial.py's design note, "d = dv = 256"), built on the d = 128 pair kernel
(bwd_pair.py: roles, barriers, dS across the pair, dQ by bulk reduce-adds, deterministic order).

Why one fused kernel and not upstream's split (a 2-CTA dK/dV kernel plus a dQ kernel recomputing S
and dP): the d = 128 pair kernel already has every piece the fused schedule needs (dS into the
partner's shared memory, the folded M = 128 dQ accumulator, its read-out and bulk reduce-adds, the
deterministic pair order) and a protocol replay; a split adds a second kernel with its own roles,
barriers, schedule and tests, and computes S and dP twice. What changes against the d = 128 pair:

A pair owns KV blocks 2p (rank 0) and 2p + 1 (rank 1) of BWD_PAIR256_KEYS = 64 keys, and walks the
(query head, 128-row query block) steps that see a key of either block. Every MMA is cta_group::2
with M = 128 (the pair's keys for S^T, dP^T, dK, dV; the block's queries for dQ). Such an
accumulator holds a CTA's 64 rows x N in 128 lanes x N / 2 columns: lane l row l % 64, column half
l // 64 (checked at trace time against the MMA's own layout, check_folded).

Warp roles and register budgets: the 1-CTA kernel's (bwd.Warp, bwd.REGISTERS), in each CTA:
    warps 0-3    dQ          setmaxnreg 64: this CTA's 64 dQ rows (folded: thread t row t % 64,
                             head-dim half t // 64, four 32-column loads), bulk reduce-adds
                             (bwd_pair.pair_reduce_dq, unchanged)
    warps 4-11   compute     setmaxnreg 160: thread t of warpgroup w reads lane t: key t % 64 of
                             this CTA, queries 64 (t // 64) + 32 w .. + 31 of the block (one
                             32-column chunk of S^T and of dP^T per step); P^T and dS^T into shared
                             memory, dS into the dQ operand of CTA t // 64; dK, dV out at the end
    warp 12      MMA         the even CTA's issues the pair's MMAs; the odd CTA's idles
    warp 13      load        TMA: K, V, K^T once; per step Q, dO (query halves), LSE, D, then
                             Q^T, dO^T (head-dim halves) into the same two buffers
    warps 14-15  idle
The kernel body that assigns these roles (TMEM allocation, cluster barrier init, tile work, the
hand-offs between roles) is bwd_pair's ``kernel``; this class supplies what each role does at this
head dim through its hooks: pair_shared_tiles, pair_tmem_layouts, pair_load, pair_mma, pair_compute
and pair_store_dkv.

Tensor memory (tiles.backward_pair256_tmem_columns; 512 columns allocated once, cta_group::2):
dK 0-127, dV 128-255, S^T 256-319, dP^T 320-383, dQ 384-511. Nothing aliases: P^T and dS^T cannot
be TMEM A operands in the folded layout, so they live in shared memory, and dQ has columns of its
own (the MMA warp waits for "dQ_(i-1) read out" only before dQ_i).

Shared memory per CTA (tiles.backward_pair256_shared_memory_bytes, 226 KiB): K, V 32 KiB each;
K^T's head-dim half over the pair's 128 keys 32 KiB; the Q buffer (Q's query half, 64 x 256, then
Q^T's head-dim half, 128 x 128) and the dO buffer likewise, 32 KiB each; P^T, dS^T (64 keys x 128
queries, the A of dV and dK) and dS (64 query rows x 128 keys, the A of dQ, half of it written by
the partner) 16 KiB each; dQ staging 2 x 8 KiB; LSE and D 1 KiB. Why dS has a buffer of its own
rather than reusing dS^T's (the dQ operand's rows are queries, contiguous like dS^T's, and a 64 x 64
block of each is the same bytes): a 2-CTA MMA reads its operands at the same shared-memory offsets in
both CTAs, and the dQ operand needs this CTA's own block at k-steps 0-3 in the even CTA but 4-7 in
the odd one, while dK needs both of its blocks in query order: no placement serves both CTAs.

Barriers: bwd_pair.make_pair_pipelines, unchanged (kv, qdo: TMA -> MMA, both CTAs' bytes on the even
CTA's barrier, released by multicast commits; rows: TMA -> compute, per CTA; sdp: "S/dP full" ->
"P^T, dS^T, dS written", 512 arrivals of both CTAs' compute threads at cluster scope; dq: "dQ full"
-> "dQ read out", both dQ warpgroups; dkv: "dK/dV final"), and bwd.Barrier's named barriers.
tests/cpu/test_sm100_bwd_pair256_protocol.py replays them with this schedule;
test_sm100_bwd_pair256.py checks the compiled kernel; test_bwd_pair256_emulation.py runs its thread
and fold indexing on the CPU against autograd.

Per step the even CTA's MMA warp issues, waiting where marked:
    [Q, dO query halves landed: qdo, first phase of the step]
    S^T = K Q^T, dP^T = V dO^T (16 k-steps each)   -> commit "S/dP full" and "Q/dO free"
    [P^T, dS^T, dS written by both CTAs' compute threads]   [Q^T, dO^T landed: second phase]
    dV += P^T dO, dK += dS^T Q (8 k-steps each; B read from the Q^T, dO^T halves)
                                                     -> commit "Q^T/dO^T free"
    [dQ_(i-1) read out]
    dQ_i = dS K (8 k-steps)                          -> commit "dQ full"
The two phases are two uses of the one-stage qdo ring (same transaction bytes: 2 x 32 KiB per CTA
each time), so the protocol is the pair kernel's with qdo advanced twice per step. tcgen05 MMAs of
one thread complete in issue order: "S/dP full" of step i + 1 implies dV_i, dK_i, dQ_i done, so the
compute threads overwrite P^T, dS^T and dS (here and in the partner) only after their readers.

Varlen (cu_seqlens) and seqused_k, as the d = 128 pair runs them and through its functions
(bwd_pair.py's docstring): a pair owns blocks 2p, 2p + 1 of 64 keys of ONE sequence (pair_tile_work
with CTA_KEYS = 64: both CTAs take the steps of the pair and its sequence; none past the sequence's
keys, grids being sized for the longest), every tensor is addressed at the sequence's offsets
(head_rows / head_columns; LSE / D rows and dq_accum in their packed varlen orders; deterministic
semaphores per sequence). With an odd number of 64-key blocks the odd CTA's block lies past the
keys: it runs the pair's steps masked (P^T = dS^T = 0) and stores no dK / dV row (pair_store_dkv's
guards; those rows are the next sequence's), but waits for "dK/dV final" since the pair's last MMAs
read its shared memory. Before the first MMA the even CTA's MMA warp zeroes both CTAs' K and V rows
past the keys (64 per CTA) and K^T's (each CTA's head-dim half over the pair's 128 keys) through
shared::cluster addresses (bwd_pair.pair_zero_kv_tail; the views checked at trace time by
check_pair_key_rows on 64-key blocks): those rows are the next sequence's keys or an unused cache's,
NaN possible, and 0 * NaN would reach dP^T, dS^T and dQ.

Not here: the 1-CTA kernel at this head dim (none exists; a pair that fails its first-use
self-check has no 1-CTA fallback, dispatch.self_check_fallback).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32
from cutlass._mlir.dialects import nvvm
from cutlass.cute.nvgpu import tcgen05

from ..config import BackwardConfig
from ..pipelines import advanced
from ..seqlen import head_rows
from ..softmax import BackwardScales
from ..tile_work import TileWork
from . import bwd_pair
from .bwd import COMPUTE_GROUPS, MMA_K, NUM_WARPS, FlashAttentionBackwardSm100, Pipelines, flat
from .bwd_pair import CTAS, FlashAttentionBackwardSm100Pair, PairLoads
from .dq_accum import VECTOR
from .fwd import PAIR_LEADER, FlashAttentionForwardSm100, TMEM_COLUMNS, WARP, WARPGROUP, gemm
from .tiles import (BWD_DQ_CHUNK, BWD_PAIR256_KEYS, BWD_PAIR_DQ_ROWS, BWD_TILE_M, backward_pair256,
                    backward_pair256_shared_memory_bytes, backward_pair256_tmem_columns)

KEYS = BWD_PAIR256_KEYS  # keys per CTA
PAIR_KEYS = CTAS * KEYS  # M of S^T, dP^T, dK, dV; K of dQ
LANES = 2 * KEYS  # a folded accumulator's lanes: 64 rows x 2 column halves
LANE = 1 << 16  # TMEM address step of one lane


def backward_kernel(cfg: BackwardConfig):
    """The registry's sm100 backward (arch.py): this kernel for a pair at d = dv = 256, else
    bwd_pair.backward_kernel's choice."""
    if cfg.cluster_m == CTAS and backward_pair256(cfg.head_dim, cfg.head_dim_v):
        return FlashAttentionBackwardSm100Pair256(cfg)
    return bwd_pair.backward_kernel(cfg)


def folded(row, col, cols: int) -> tuple:
    """(lane, column) of row ``row`` (of this CTA's 64) and column ``col`` (of ``cols``) in the
    accumulator of an M = 128 cta_group::2 MMA (check_folded proves the MMA's layout is this)."""
    half = cols // CTAS
    return row + KEYS * (col // half), col % half


def compute_lane(group, thread) -> tuple:
    """(key of this CTA, query half, first query of the block) that compute thread ``thread`` of
    warpgroup ``group`` works on: lane ``thread`` of S^T / dP^T, 32 columns from 32 ``group``
    (plain integer arithmetic: the kernel passes runtime values, tests/cpu Python ints)."""
    key, half = thread % KEYS, thread // KEYS
    return key, half, half * (BWD_TILE_M // 2) + group * BWD_DQ_CHUNK


def out_chunk_index(group, half, c, dim: int, loads: int):
    """Which 32-column chunk of a dK / dV row (``dim`` columns) load c of compute warpgroup ``group``
    holds for a thread of head-dim half ``half`` (pair_store_dkv)."""
    return half * (dim // CTAS // BWD_DQ_CHUNK) + group * loads + c


class FlashAttentionBackwardSm100Pair256(FlashAttentionBackwardSm100Pair):
    CTA_KEYS = KEYS  # bwd_pair's per-pair rules (pair_tile_work, pair_zero_kv_tail) on 64-key blocks

    def __init__(self, cfg: BackwardConfig):
        FlashAttentionBackwardSm100.__init__(self, cfg)
        assert cfg.cluster_m == CTAS and self.num_stages == 1 and backward_pair256(self.hdim, self.hdim_v)
        # dQ: this CTA's 64 rows folded into 128 lanes x d / 2 (read as bwd_pair.pair_reduce_dq does).
        self.dq_cols = self.hdim // CTAS
        self.dq_loads = self.dq_cols // BWD_DQ_CHUNK
        self.dq_runs = BWD_DQ_CHUNK // VECTOR
        # dK / dV out: a compute warpgroup's share of a lane's d / 2 columns, by 32-column loads.
        self.out_loads = self.hdim // CTAS // COMPUTE_GROUPS // BWD_DQ_CHUNK

    def plan_tmem(self):
        """Tensor-memory plan (module docstring; tiles.backward_pair256_tmem_columns)."""
        plan = backward_pair256_tmem_columns(self.hdim, self.hdim_v)
        self.tmem_dk, self.tmem_dv, self.tmem_s, self.tmem_dp, self.tmem_dq = (
            plan[name][0] for name in ("dk", "dv", "s", "dp", "dq"))
        self.dq_over_dp = False
        assert max(start + width for start, width in plan.values()) <= TMEM_COLUMNS

    # ------------------------------------------------------------------------------------------
    # Host side
    # ------------------------------------------------------------------------------------------
    def pair256_mmas(self) -> tuple:
        """(S^T / dP^T, dV, dK, dQ) MMAs of the pair, every operand from shared memory."""
        major, two, f32 = cute.nvgpu.OperandMajorMode, tcgen05.CtaGroup.TWO, Float32
        d, dv = self.hdim, self.hdim_v
        # S^T = K Q^T, dP^T = V dO^T: (keys, queries, d), both operands head-dim-contiguous.
        mma_s = sm100_utils.make_trivial_tiled_mma(self.dtype, major.K, major.K, f32, two, (PAIR_KEYS, BWD_TILE_M))
        # dV += P^T dO, dK += dS^T Q: A (keys, queries) queries-contiguous, B = dO^T / Q^T (dim, queries).
        mma_dv = sm100_utils.make_trivial_tiled_mma(self.dtype, major.K, major.MN, f32, two, (PAIR_KEYS, dv))
        mma_dk = sm100_utils.make_trivial_tiled_mma(self.dtype, major.K, major.MN, f32, two, (PAIR_KEYS, d))
        # dQ = dS K: A = dS (queries, keys) queries-contiguous, B = K^T (d, keys).
        mma_dq = sm100_utils.make_trivial_tiled_mma(self.dtype, major.MN, major.MN, f32, two, (BWD_TILE_M, d))
        return mma_s, mma_dv, mma_dk, mma_dq

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSE: cute.Tensor, mdPsum: cute.Tensor, mdQacc: cute.Tensor, mdK: cute.Tensor,
                 mdV: cute.Tensor, mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor],
                 mSeqUsedK: Optional[cute.Tensor], mSemaphore: Optional[cute.Tensor],
                 softmax_scale: Float32, softcap: Float32, window_left: Int32, window_right: Int32,
                 max_seqlen_k: Int32, stream: cuda.CUstream):
        d, dv = self.hdim, self.hdim_v
        mQ, mK, mV, mdO, mdK, mdV, mLSE, mdPsum, mdQacc, num_batch = self.sequence_first(
            mQ, mK, mV, mdO, mdK, mdV, mLSE, mdPsum, mdQacc, mCuSeqlensQ)
        num_heads_kv = mK.shape[2]
        qhead_per_kvhead = mQ.shape[2] // num_heads_kv

        mma_s, mma_dv, mma_dk, mma_dq = self.pair256_mmas()
        tilers = self.tilers(PAIR_KEYS)
        layouts = self.smem_layouts(mma_s, mma_dv, mma_dk, mma_dq, tilers)
        if cutlass.const_expr(self.zero_tail):
            bwd_pair.check_pair_key_rows(mma_s, mma_dq, layouts, d, dv, KEYS)
        sdQ_layout = cute.make_layout((BWD_PAIR_DQ_ROWS * BWD_DQ_CHUNK, CTAS))
        # The compute threads index P^T, dS^T by (key of this CTA, k-slice of queries) and dS by
        # (query of this CTA's half, k-slice of the pair's keys): each CTA's share of the M = 128 A.
        for name, layout, rows, slices in (("P^T", layouts.p, KEYS, BWD_TILE_M // MMA_K),
                                           ("dS^T", layouts.dst, KEYS, BWD_TILE_M // MMA_K),
                                           ("dS", layouts.ds, BWD_TILE_M // CTAS, PAIR_KEYS // MMA_K)):
            got = (cute.size(layout.outer, mode=[0, 0]), cute.size(layout.outer, mode=[0, 1]),
                   cute.size(layout.outer, mode=[1]), cute.size(layout.outer, mode=[2]),
                   cute.size(layout.outer, mode=[3]))
            if cutlass.const_expr(got != (rows, MMA_K, 1, slices, 1)):
                raise ValueError(f"sm100 backward d=256 pair: {name}'s shared-memory layout {layout.outer} is not "
                                 f"(({rows}, {MMA_K}), 1, {slices}, 1)")

        loads, cluster = self.pair_loads(mQ, mK, mV, mdO, mLSE, mdPsum, layouts, tilers,
                                         (mma_s, mma_dv, mma_dk, mma_dq))

        def pair_bytes(*names):
            return CTAS * sum(cute.size_in_bytes(self.dtype, cute.select(getattr(layouts, n), mode=[0, 1, 2]))
                              for n in names)

        # Both CTAs' 2-CTA TMA loads land on the even CTA's barrier. The two phases of a step on
        # the Q/dO buffers share one ring, so they must move the same bytes.
        self.tma_bytes_kv = pair_bytes("k", "v", "kt")
        self.tma_bytes_qdo = pair_bytes("q", "do")
        if cutlass.const_expr(pair_bytes("qt", "dot") != self.tma_bytes_qdo):
            raise ValueError(f"sm100 backward d=256 pair: Q/dO ({self.tma_bytes_qdo} B) and Q^T/dO^T "
                             f"({pair_bytes('qt', 'dot')} B) phases differ")
        self.tma_bytes_rows = 2 * BWD_TILE_M * 4
        q_elems = max(cute.cosize(layouts.q), cute.cosize(layouts.qt))
        do_elems = max(cute.cosize(layouts.do), cute.cosize(layouts.dot))

        @cute.struct
        class SharedStorage:
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_qdo: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_rows: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_sdp: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_dq: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_dkv: cute.struct.MemRange[cutlass.Int64, 2]
            tmem_dealloc: cute.struct.MemRange[cutlass.Int64, 1]
            tmem_address: Int32
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, BWD_TILE_M], 128]
            sdPsum: cute.struct.Align[cute.struct.MemRange[Float32, BWD_TILE_M], 128]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts.k)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts.v)], 1024]
            sKt: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts.kt)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, q_elems], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, do_elems], 1024]
            sPt: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts.p)], 1024]
            sdSt: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts.dst)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts.ds)], 1024]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sdQ_layout)], 1024]

        self.set_shared_storage(SharedStorage, backward_pair256_shared_memory_bytes(d, dv, self.dtype.width // 8),
                                "CTA pair, 64 keys per CTA")
        scales = BackwardScales.of(softmax_scale, softcap, cutlass.const_expr(self.cfg.has_softcap))
        scheduler = self.scheduler(max_seqlen_k, PAIR_KEYS, mQ, qhead_per_kvhead, num_heads_kv, num_batch,
                                   cluster_m=CTAS)
        self.kernel(loads, mdQacc, mdK, mdV, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mSemaphore, scales, qhead_per_kvhead,
                    window_left, window_right, layouts, sdQ_layout, mma_s, mma_dv, mma_dk, mma_dq, scheduler,
                    cluster).launch(
            grid=scheduler.grid(), block=[NUM_WARPS * WARP, 1, 1], cluster=[CTAS, 1, 1], stream=stream,
            min_blocks_per_mp=1)

    # ------------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------------
    def pair_shared_tiles(self, storage, layouts, sdQ_layout) -> "Pair256SharedTiles":
        """The shared-memory tensors; Q / Q^T and dO / dO^T are two views of one buffer each (the two
        TMA phases of a step), never live together."""
        def tile(buffer, layout):
            return buffer.get_tensor(layout.outer, swizzle=layout.inner)

        return Pair256SharedTiles(
            q=tile(storage.sQ, layouts.q), qt=tile(storage.sQ, layouts.qt), do=tile(storage.sdO, layouts.do),
            dot=tile(storage.sdO, layouts.dot), k=tile(storage.sK, layouts.k), v=tile(storage.sV, layouts.v),
            kt=tile(storage.sKt, layouts.kt), pt=tile(storage.sPt, layouts.p), dst=tile(storage.sdSt, layouts.dst),
            ds=tile(storage.sdS, layouts.ds),
            lse=storage.sLSE.get_tensor(cute.make_layout((BWD_TILE_M, 1))),
            dpsum=storage.sdPsum.get_tensor(cute.make_layout((BWD_TILE_M, 1))),
            dq=storage.sdQ.get_tensor(sdQ_layout))

    def pair_tmem_layouts(self, mma_s, mma_dv, mma_dk, mma_dq, layouts) -> "Pair256TmemLayouts":
        """The MMAs' accumulator layouts, each checked to be the fold the compute, dQ and epilogue
        threads read (row r of this CTA's 64 at lane r + 64 (c // (N / 2)), column c % (N / 2)).
        (``layouts``: the d = 128 pair's hook reads its TMEM operands' layouts there; none here.)"""
        del layouts
        thr_s, thr_dv, thr_dk, thr_dq = (m.get_slice(0) for m in (mma_s, mma_dv, mma_dk, mma_dq))
        s = thr_s.make_fragment_C(thr_s.partition_shape_C((PAIR_KEYS, BWD_TILE_M))).layout
        dv = thr_dv.make_fragment_C(thr_dv.partition_shape_C((PAIR_KEYS, self.hdim_v))).layout
        dk = thr_dk.make_fragment_C(thr_dk.partition_shape_C((PAIR_KEYS, self.hdim))).layout
        dq = thr_dq.make_fragment_C(thr_dq.partition_shape_C((BWD_TILE_M, self.hdim))).layout
        for name, layout, cols in (("S^T", s, BWD_TILE_M), ("dV", dv, self.hdim_v), ("dK", dk, self.hdim),
                                   ("dQ", dq, self.hdim)):
            check_folded(layout, cols, name)
        return Pair256TmemLayouts(s=s, dv=dv, dk=dk, dq=dq)

    # ---- load warp -------------------------------------------------------------------------------
    @cute.jit
    def pair_load(self, loads: PairLoads, smem: "Pair256SharedTiles", mma_s, mma_dv, mma_dk, mma_dq,
                pipes: Pipelines, work: TileWork, rank):
        """K, V, K^T once (this CTA's shares of the pair's tiles); per step Q, dO (query halves),
        LSE, D (all 128 rows, for this CTA's compute threads), then Q^T, dO^T (head-dim halves) into
        the Q and dO buffers once the S^T / dP^T MMAs are done with them."""
        batch = work.batch
        thr_s, thr_dv, thr_dk, thr_dq = (m.get_slice(rank) for m in (mma_s, mma_dv, mma_dk, mma_dq))
        self.pair_load_kv(loads, smem, thr_s, thr_dq, pipes, work)
        rows_offset = self.rows_offset(work)
        qdo_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        rows_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        for step in cutlass.range(work.num_steps, unroll=1):
            head, m_block = work.blocks.at(step)
            gQ, gdO, gQt, gdOt = self.query_tiles(loads, work, head)
            qdo_state = self.load_phase(((loads.atom_Q, smem.q, thr_s.partition_B(gQ)),
                                         (loads.atom_dO, smem.do, thr_s.partition_B(gdO))), pipes, qdo_state, m_block)
            rows_state = self.load_rows(loads, smem, pipes, rows_state, rows_offset, head, batch, m_block)
            qdo_state = self.load_phase(((loads.atom_Qt, smem.qt, thr_dk.partition_B(gQt)),
                                         (loads.atom_dOt, smem.dot, thr_dv.partition_B(gdOt))), pipes, qdo_state,
                                        m_block)
        if work.num_steps > 0:
            pipes.qdo.producer_tail(qdo_state)

    # ---- MMA warp (even CTA) -----------------------------------------------------------------------
    @cute.jit
    def pair_mma(self, tmem_ptr, tmem_address, smem: "Pair256SharedTiles", tl: "Pair256TmemLayouts", mmas: tuple,
               pipes: Pipelines, num_steps):
        """The pair's MMAs, step by step (module docstring). Operand fragments are made right before
        their MMAs from shared-memory addresses the compiler cannot hoist (tile_variant of the TMEM
        address read per phase): hoisted, 112 descriptors would not fit the warp's registers."""
        mma_s, mma_dv, mma_dk, mma_dq = mmas
        tStS = cute.make_tensor(tmem_ptr + self.tmem_s, tl.s)
        tdPtdP = cute.make_tensor(tmem_ptr + self.tmem_dp, tl.s)
        tdVtdV = cute.make_tensor(tmem_ptr + self.tmem_dv, tl.dv)
        tdKtdK = cute.make_tensor(tmem_ptr + self.tmem_dk, tl.dk)
        tdQtdQ = cute.make_tensor(tmem_ptr + self.tmem_dq, tl.dq)

        qdo_state, sdp_state, dq_state = self.mma_start(pipes, num_steps, 1)
        for i in cutlass.range(num_steps, unroll=1):
            k, v, q, do = self.opaque_tiles(tmem_address, (smem.k, smem.v, smem.q, smem.do))
            pipes.qdo.consumer_wait(qdo_state)  # Q, dO query halves
            mma_s = gemm(mma_s, tStS, mma_s.make_fragment_A(k)[None, None, None, 0],
                         mma_s.make_fragment_B(q)[None, None, None, 0], False)
            mma_s = gemm(mma_s, tdPtdP, mma_s.make_fragment_A(v)[None, None, None, 0],
                         mma_s.make_fragment_B(do)[None, None, None, 0], False)
            pipes.sdp.producer_commit(sdp_state)
            sdp_state = advanced(sdp_state)
            pipes.qdo.consumer_release(qdo_state)  # the buffers may take Q^T, dO^T
            qdo_state = advanced(qdo_state)

            pt, dst, qt, dot = self.opaque_tiles(tmem_address, (smem.pt, smem.dst, smem.qt, smem.dot))
            pipes.sdp.producer_acquire(sdp_state)  # P^T, dS^T, dS in shared memory (both CTAs)
            cute.arch.fence_acq_rel_cluster()  # the acquire side of the compute threads' cluster release
            pipes.qdo.consumer_wait(qdo_state)  # Q^T, dO^T head-dim halves
            mma_dv = gemm(mma_dv, tdVtdV, mma_dv.make_fragment_A(pt)[None, None, None, 0],
                          mma_dv.make_fragment_B(dot)[None, None, None, 0], i > 0)
            mma_dk = gemm(mma_dk, tdKtdK, mma_dk.make_fragment_A(dst)[None, None, None, 0],
                          mma_dk.make_fragment_B(qt)[None, None, None, 0], i > 0)
            pipes.qdo.consumer_release(qdo_state)
            qdo_state = advanced(qdo_state)

            ds, kt = self.opaque_tiles(tmem_address, (smem.ds, smem.kt))
            pipes.dq.producer_acquire(dq_state)  # dQ_(i-1) read out (both CTAs)
            mma_dq, dq_state = self.issue_dq(mma_dq, tdQtdQ, mma_dq.make_fragment_A(ds),
                                             mma_dq.make_fragment_B(kt), pipes, dq_state)
        self.mma_finish(pipes, num_steps)

    @cute.jit
    def opaque_tiles(self, tmem_address, tiles: tuple) -> tuple:
        """``tiles`` at addresses offset by min(TMEM address, 0) = 0 blocks, read from shared memory
        here: in a cluster launch shared-memory addresses are runtime values, and descriptors the
        compiler may hoist out of the step loop would spill."""
        opaque = cute.make_tensor(tmem_address, cute.make_layout(1))[0]
        return tuple(FlashAttentionForwardSm100.tile_variant(t, opaque) for t in tiles)

    # ---- compute warpgroups ----------------------------------------------------------------------
    @cute.jit
    def pair_compute(self, tmem_ptr, group, rank, smem: "Pair256SharedTiles", tl: "Pair256TmemLayouts",
                     pipes: Pipelines, work: TileWork, scales: BackwardScales):
        """Per step, thread t of warpgroup ``group`` (lane t: key t % 64 of this CTA, query half
        t // 64): its 32 query columns of S^T and dP^T, P^T and dS^T into this CTA's shared memory
        (dV's and dK's A), dS into the dQ operand of CTA t // 64 (this CTA's or the partner's)."""
        thread = cute.arch.thread_idx()[0] % WARPGROUP
        key, half, first_col = compute_lane(group, thread)
        load_s, tS, regs = self.lane_chunks(tmem_ptr + self.tmem_s, BWD_TILE_M // 2, thread)
        load_dp, tdP, _ = self.lane_chunks(tmem_ptr + self.tmem_dp, BWD_TILE_M // 2, thread)
        # P^T / dS^T rows of this key: (MMA_K queries, k-slices); the thread's are 2 of them.
        pt_row = smem.pt[((key, None), 0, None, 0)]
        dst_row = smem.dst[((key, None), 0, None, 0)]
        # dS of this key (the pair's key index) in CTA ``half``'s dQ operand: (64 queries,).
        pair_key = rank * KEYS + key
        ds_row = smem.ds[((None, pair_key % MMA_K), 0, pair_key // MMA_K, 0)]
        ds_row = cute.make_tensor(cute.arch.map_dsmem_ptr(ds_row.iterator, half), ds_row.layout)
        rows = (smem.lse[None, 0], smem.dpsum[None, 0])
        sdp_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        rows_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        for step in cutlass.range(work.num_steps, unroll=1):
            _, m_block = work.blocks.at(step)
            pipes.rows.consumer_wait(rows_state)
            pipes.sdp.consumer_wait(sdp_state)
            p = cute.make_rmem_tensor(regs, Float32)
            cute.copy(load_s, tS[None, None, None, group], p)
            dp = cute.make_rmem_tensor(regs, Float32)
            cute.copy(load_dp, tdP[None, None, None, group], dp)
            cute.arch.fence_view_async_tmem_load()  # S^T and dP^T in registers: the columns are free
            p16 = cute.make_rmem_tensor(BWD_DQ_CHUNK, self.dtype)
            ds = cute.make_rmem_tensor(BWD_DQ_CHUNK, self.dtype)
            if work.mask.block_is_full(work.seqlen, m_block, work.n_block):
                self.gradients256(p, dp, p16, ds, rows, first_col, scales, work, m_block, key, False)
            else:
                self.gradients256(p, dp, p16, ds, rows, first_col, scales, work, m_block, key, True)
            for s in cutlass.range_constexpr(BWD_DQ_CHUNK // MMA_K):
                slice_ = first_col // MMA_K + s
                cute.autovec_copy(cute.local_tile(p16, (MMA_K,), (s,)), pt_row[None, slice_])
                cute.autovec_copy(cute.local_tile(ds, (MMA_K,), (s,)), dst_row[None, slice_])
            cute.autovec_copy(ds, cute.local_tile(ds_row, (BWD_DQ_CHUNK,), (group,)))
            cute.arch.fence_proxy("async.shared", space="cluster")  # local and remote writes -> MMAs
            # "P^T, dS^T and dS written": an arrival at cluster scope on the even CTA's barrier
            # (it hands on shared-memory data written across CTAs).
            cute.arch.mbarrier_arrive(pipes.sdp.sync_object_empty.get_barrier(sdp_state.index), PAIR_LEADER,
                                      scope=nvvm.MemScopeKind.CLUSTER)
            pipes.rows.consumer_release(rows_state)
            sdp_state = advanced(sdp_state)
            rows_state = advanced(rows_state)

    @cute.jit
    def gradients256(self, p, dp, p16, ds, rows, first_col, scales: BackwardScales, work: TileWork, m_block, key,
                     masked: cutlass.Constexpr[bool]):
        """P (16-bit, dV's operand) and dS^T = P (dP^T - D) (16-bit; softcap: times 1 - tanh^2) of
        the thread's 32 query columns from its S^T and dP^T values (the 1-CTA kernel's formulas,
        FlashAttentionBackwardSm100.probabilities; ``key``: the thread's key in this CTA's block)."""
        sLSE, sdPsum = rows
        p, dp = flat(p), flat(dp)
        self.probabilities(p, p16, sLSE, first_col, scales, work, m_block, key, masked)
        for e in cutlass.range_constexpr(0, BWD_DQ_CHUNK, 2):  # packed f32x2: half the FADD/FMUL issues
            centred = cute.arch.sub_packed_f32x2((dp[e], dp[e + 1]), (sdPsum[first_col + e], sdPsum[first_col + e + 1]))
            ds0, ds1 = cute.arch.mul_packed_f32x2((p[e], p[e + 1]), centred)
            ds[e], ds[e + 1] = ds0.to(self.dtype), ds1.to(self.dtype)

    def lane_chunks(self, tmem_ptr, cols: int, thread):
        """A folded accumulator's ``cols`` columns from ``tmem_ptr``, all 128 lanes, read 32 columns
        at a time by the thread of its lane: (copy, source per chunk (..., chunk), register shape)."""
        t = cute.make_tensor(tmem_ptr, cute.make_layout((LANES, cols), stride=(LANE, 1)))
        t = cute.flat_divide(t, (LANES, BWD_DQ_CHUNK))[None, None, 0, None]  # (lanes, 32, chunks)
        load = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(BWD_DQ_CHUNK)), Float32),
            t[None, None, 0]).get_slice(thread)
        return load, load.partition_S(t), load.partition_D(cute.make_identity_tensor((LANES, BWD_DQ_CHUNK))).shape

    @cute.jit
    def pair_store_dkv(self, tmem_ptr, group, tl: "Pair256TmemLayouts", pipes: Pipelines, mdK, mdV, work: TileWork,
                       softmax_scale: Float32):
        """dK * softmax_scale and dV of this thread's key (lane t: key t % 64, head-dim half
        t // 64), warpgroup ``group``'s half of the lane's columns, in the input dtype (keys inside
        the sequence; zeros for a block no query sees). A CTA past the keys stores nothing but waits
        for the pair's last MMA, which reads its shared memory."""
        thread = cute.arch.thread_idx()[0] % WARPGROUP
        key, half, _ = compute_lane(group, thread)
        has_steps = work.num_steps > 0
        if work.n_block * KEYS < work.seqlen.seqlen_k:
            row = work.n_block * KEYS + key
            if has_steps:
                pipes.dkv.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))
            for column, scale, mOut, dim in ((self.tmem_dk, softmax_scale, mdK, self.hdim),
                                             (self.tmem_dv, Float32(1.0), mdV, self.hdim_v)):
                load, tX, regs = self.lane_chunks(tmem_ptr + column, dim // CTAS, thread)
                gRow = head_rows(mOut, work.seqlen.offset_k, work.head_kv, work.batch, self.cfg.varlen)[row, None]
                for c in cutlass.range_constexpr(self.out_loads):
                    chunk = group * self.out_loads + c  # of the lane's d / 2 columns in TMEM
                    out = cute.make_rmem_tensor(BWD_DQ_CHUNK, self.dtype)
                    if has_steps:
                        r = cute.make_rmem_tensor(regs, Float32)
                        cute.copy(load, tX[None, None, None, chunk], r)
                        cute.arch.fence_view_async_tmem_load()
                        r = flat(r)
                        for e in cutlass.range_constexpr(BWD_DQ_CHUNK):
                            out[e] = (r[e] * scale).to(self.dtype)
                    else:
                        out.fill(0.0)
                    if row < work.seqlen.seqlen_k:
                        cute.autovec_copy(out, cute.local_tile(
                            gRow, (BWD_DQ_CHUNK,), (out_chunk_index(group, half, c, dim, self.out_loads),)))
        elif has_steps:
            pipes.dkv.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))


def check_folded(layout: cute.Layout, cols: int, name: str) -> None:
    """ValueError unless the accumulator ``layout`` of an M = 128 cta_group::2 MMA (this CTA's 64
    rows x ``cols``) puts row r, column c at lane r + 64 (c // (cols / 2)), column c % (cols / 2):
    the fold every reader of it assumes (the pair kernel's dQ check, for any N)."""
    half = cols // CTAS
    for row in (0, 1, KEYS // 2, KEYS - 1):
        for col in (0, 1, half - 1, half, half + 1, cols - 1):
            lane, column = folded(row, col, cols)
            expect = lane * LANE + column
            got = cute.crd2idx(((row, (col % half, col // half)), 0, 0), layout)
            if got != expect:
                raise ValueError(f"sm100 backward d=256 pair: {name}'s TMEM layout {layout} puts ({row}, {col}) "
                                 f"at {got}, expected {expect}")


@dataclass(frozen=True)
class Pair256SharedTiles:
    q: cute.Tensor
    qt: cute.Tensor  # the Q buffer's second phase
    do: cute.Tensor
    dot: cute.Tensor  # the dO buffer's second phase
    k: cute.Tensor
    v: cute.Tensor
    kt: cute.Tensor
    pt: cute.Tensor
    dst: cute.Tensor
    ds: cute.Tensor
    lse: cute.Tensor
    dpsum: cute.Tensor
    dq: cute.Tensor


@dataclass(frozen=True)
class Pair256TmemLayouts:
    s: cute.Layout  # S^T and dP^T
    dv: cute.Layout
    dk: cute.Layout
    dq: cute.Layout
