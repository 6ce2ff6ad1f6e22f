"""FlashAttention backward for Blackwell (sm_100a) on CTA pairs: the 1-CTA kernel's roles (bwd.py)
with the M = 256 tcgen05 MMAs of cta_group::2 over the 256 keys of a cluster of two CTAs.

Dispatch runs it where tiles.backward_grid says (switch BWD_TWO_CTA): d = dv = 128, batched or varlen
(cu_seqlens, seqused_k), with causal or local masks, softcap, GQA, deterministic.
Compiled and statically checked for sm_100a only, never run on a GPU here (docs/perf.md); on a B200
a pair that fails its first-use self-check is replaced by the 1-CTA kernel
(dispatch.self_check_fallback).

A pair owns KV blocks 2p (the even CTA, rank 0) and 2p + 1 (rank 1), 128 keys each, of one KV head
and walks the (query head, 128-row query block) steps of the 1-CTA kernel, over the query blocks
that see a key of either block (under a causal or window mask, a block hidden from one CTA's keys
runs the masked step there: its P^T and dS^T are 0). Warp roles and register budgets are the 1-CTA
kernel's (bwd.Warp, bwd.REGISTERS), in each CTA of the pair:

    warps 0-3    dQ          setmaxnreg 64: its CTA's 64 dQ rows out of TMEM, reduce-added (below)
    warps 4-11   compute     setmaxnreg 160: two warpgroups, query columns 0-63 / 64-127 of the
                             step, thread = key row: P^T, dS^T (the 1-CTA kernel's chunk work, plus
                             dS^T into TMEM and dS into the dQ operand); dK, dV out at the end
    warp 12      MMA         the even CTA's issues the pair's MMAs (varlen, seqused_k: after
                             pair_zero_kv_tail); the odd CTA's idles
    warp 13      load        TMA of this CTA's shares (below)
    warps 14-15  idle        (12-15: the launch's 128 registers, no setmaxnreg)

Varlen: a pair owns KV blocks 2p and 2p + 1 of one sequence (grids are sized for the longest; a pair
past its sequence's keys has no step, in both CTAs alike) and addresses every tensor at the sequence's
offsets as the 1-CTA kernel does (dq_accum and the LSE / D rows in its packed orders). With an odd
number of KV blocks the odd CTA's block lies past the keys: its keys are masked (P^T = dS^T = 0), it
stores no dK / dV row (those rows are the next sequence's), and its K and V rows are zeroed with the
rest of the pair's rows past the keys, K^T's in both CTAs included (pair_zero_kv_tail: those rows are
the next sequence's keys or, with seqused_k, an unused cache's, NaN possible, and 0 * NaN would reach
dP^T, dS^T and dQ).

What changes against the 1-CTA kernel:

Who issues: the even CTA's MMA warp issues every MMA of the pair (cta_group::2; commits multicast
to both CTAs' barriers); the odd CTA's MMA warp idles. Both load warps load their CTA's share.

MMAs per step (M = the pair's 256 keys, each CTA's TMEM holding its own 128 key rows):
    S^T = K Q^T, dP^T = V dO^T      B: Q / dO split by query halves (CTA r: queries 64r..64r+63)
    dV += P^T dO, dK += dS^T Q      A: P^T / dS^T from TMEM (the compute warps write both, 16-bit,
                                    over the S^T / dP^T columns they have read); B: dO^T / Q^T split
                                    by head-dim halves (CTA r: columns 64r..64r+63), a second TMA
                                    load of the same rows in that orientation
    dQ = dS K (M = 128 queries)     the M = 128 MMA of cta_group::2: CTA r holds dS for its 64
                                    query rows over the pair's 256 keys (A) and K^T's head-dim half
                                    over the 256 keys (B); its TMEM receives dQ of those 64 rows
                                    (row i in lane i for columns 0-63, lane 64 + i for 64-127).

How dS reaches the partner: compute warpgroup w of either CTA owns query columns 64w..64w+63,
i.e. query half w. dS of this CTA's keys for query half w belongs to CTA w's dQ operand, at the
k-steps of this CTA's keys (8 r .. 8 r + 7): the warpgroup with w == rank stores it into its own
shared memory, the other one into the peer's (st.shared::cluster through mapa), at the same
offsets. Each then fences (fence.proxy.async.shared::cluster) and releases "P^T and dS^T written"
with a cluster-scope arrival on the even CTA's barrier; the MMA warp's wait there, followed by a
cluster acq_rel fence, covers both CTAs' local and remote writes. No relay warp: the writer is the
compute thread itself.

dQ: each CTA's dQ warpgroup reads its 64 rows from TMEM (thread t: row t % 64, 32 of the head-dim
half t // 64 per load), stages them in dq_accum's order (dq_accum.py; the same order as the 1-CTA
kernel, so the postprocessing is shared) and adds them with 1-D bulk reduce-adds
(cp.reduce.async.bulk .add.f32): its rows of a chunk are 8 runs of two 128-float rows. The two CTAs
add disjoint rows; pairs of different KV blocks add into the same rows in any order, or, when
deterministic, in pair order: semaphore slot ``rank`` of the query block counts the pairs that added
(pair_turn / pair_done; the 1-CTA kernel's protocol with pairs in place of KV blocks).
dK, dV: each CTA's own key rows, from its TMEM, as in the 1-CTA kernel.

Tensor memory (512 columns, allocated and freed once with cta_group::2 by compute warp 4 of each
CTA, freed after the pair's dealloc handshake): S^T 0-127 (P^T over it), dP^T 128-255 (dS^T over
it, 16-bit, at 128 + 64 w), dK 256-383, dV 384-511, dQ 128-191 (64 columns x 128 lanes, over dP^T:
the MMA warp waits for "dQ read out" before the next S^T/dP^T, as the 1-CTA kernel does at d = 128).

Shared memory per CTA (tiles.backward_pair_shared_memory_bytes): K, V 32 KiB each; K^T half 32 KiB;
Q, dO query halves and Q^T, dO^T head-dim halves 16 KiB each (one stage); dS 32 KiB (its 64 query
rows x 256 keys); dQ staging 2 x 8 KiB; LSE and D 1 KiB.

Barriers (cutlass.pipeline, over the cluster where the MMA warp is involved):
    kv    TMA -> MMA      K, V, K^T once; both CTAs' bytes on the even CTA's barrier (whose MMA warp
                          then zeroes the rows past the keys, where the pair holds the last key)
    qdo   TMA -> MMA      Q, dO, Q^T, dO^T per step; released by the (multicast) commit
    rows  TMA -> compute  LSE, D per step, per CTA (each CTA loads all 128 rows)
    sdp   MMA -> compute  "S/dP full" (multicast); empty: both CTAs' compute threads (512)
    dq    MMA -> dQ       "dQ full" (multicast); empty: both CTAs' dQ threads (256)
    dkv   MMA -> compute  "dK/dV final", once
Named barriers: bwd.Barrier (TMEM_ALLOC also counts the odd CTA's idle MMA warp, which waits for
the allocation like the even one). In a cluster launch shared-memory addresses are runtime values:
the MMA warp rebuilds its operand descriptors every step (pair_mma), hoisted they spilled.
tests/cpu/test_sm100_bwd_protocol.py replays these barriers for both CTAs; test_sm100_bwd_static.py
checks the compiled kernel (2-CTA forms, MMA count, TMEM, spills, budgets, the dS stores and fences).
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
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.experimental.primitives.nvvm_wrapper import CpReduceType, cp_reduce_async_bulk_global_shared_cta

from ..config import BackwardConfig
from ..kv_tail import first_row_past_keys, zero_rows
from ..layouts import tma_partition_tile
from ..mask import AttentionMask
from ..pipelines import advanced
from ..scheduler import TileScheduler
from ..seqlen import SeqlenInfo, head_rows, packed_row_offset
from ..softmax import BackwardScales
from ..tile_work import QueryBlocks, TileWork
from .bwd import (COMPUTE_GROUPS, MMA_K, NUM_WARPS, Barrier, ChunkCopies, FlashAttentionBackwardSm100, Pipelines,
                  SmemLayouts, Warp, flat, gemm_a_by_groups, key_rows, mma_tma_partition, row_tma_atoms)
from .bwd_serial import FlashAttentionBackwardSm100Serial
from .dq_accum import VECTOR, chunk_tiles
from .fwd import PAIR_LEADER, FlashAttentionForwardSm100, TMEM_COLUMNS, WARP, WARPGROUP, gemm, set_registers
from .tiles import (BWD_DQ_CHUNK, BWD_PAIR_DQ_ROWS, BWD_TILE_M, TILE_N, backward_pair_shared_memory_bytes,
                    backward_serial)

CTAS = 2
PAIR_N = CTAS * TILE_N  # keys of one MMA (M of S^T, dP^T, dK, dV; K of dQ)


def backward_kernel(cfg: BackwardConfig):
    """The registry's sm100 backward (arch.py): the pair kernel for cluster_m = 2, the serial 1-CTA
    kernel at its head dims (bwd_serial.py), else the 1-CTA kernel."""
    if cfg.cluster_m == 2:
        return FlashAttentionBackwardSm100Pair(cfg)
    if backward_serial(cfg.head_dim, cfg.head_dim_v):
        return FlashAttentionBackwardSm100Serial(cfg)
    return FlashAttentionBackwardSm100(cfg)


class FlashAttentionBackwardSm100Pair(FlashAttentionBackwardSm100):
    # Keys per CTA (a KV block): the pair's blocks 2p, 2p + 1 are of this size (the d = 256 pair: 64).
    CTA_KEYS = TILE_N

    def __init__(self, cfg: BackwardConfig):
        super().__init__(cfg)
        assert cfg.cluster_m == CTAS and self.hdim == self.hdim_v == BWD_TILE_M and self.num_stages == 1
        # Tensor-memory plan (module docstring). dQ: 64 rows per CTA folded into 128 lanes x d / 2.
        self.tmem_s, self.tmem_dp = 0, TILE_N
        self.tmem_dk = 2 * TILE_N
        self.tmem_dv = self.tmem_dk + self.hdim
        self.tmem_dq, self.dq_over_dp = self.tmem_dp, True
        self.dq_cols = self.hdim // CTAS
        assert self.tmem_dv + self.hdim_v <= TMEM_COLUMNS and self.dq_cols <= TILE_N
        # dQ chunks a dQ thread reads (its head-dim half) and the bulk runs of a staged chunk.
        self.dq_loads = self.dq_cols // BWD_DQ_CHUNK
        self.dq_runs = BWD_DQ_CHUNK // VECTOR  # runs of BWD_PAIR_DQ_ROWS * VECTOR floats per chunk

    # ------------------------------------------------------------------------------------------
    # Host side
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSE: cute.Tensor, mdPsum: cute.Tensor, mdQacc: cute.Tensor, mdK: cute.Tensor,
                 mdV: cute.Tensor, mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor],
                 mSeqUsedK: Optional[cute.Tensor], mSemaphore: Optional[cute.Tensor],
                 softmax_scale: Float32, softcap: Float32, window_left: Int32, window_right: Int32,
                 max_seqlen_k: Int32, stream: cuda.CUstream):
        d, dv = self.hdim, self.hdim_v
        # Sequence first; the transposed views (d, seq, head[, batch]), varlen ones packed along seq.
        mQ, mK, mV, mdO, mdK, mdV, mLSE, mdPsum, mdQacc, num_batch = self.sequence_first(
            mQ, mK, mV, mdO, mdK, mdV, mLSE, mdPsum, mdQacc, mCuSeqlensQ)
        num_heads_kv = mK.shape[2]
        qhead_per_kvhead = mQ.shape[2] // num_heads_kv

        # M = 256 keys across the pair; dK's A operand dS^T comes from TMEM (module docstring).
        two = tcgen05.CtaGroup.TWO
        mma_s, mma_dv, mma_dk, mma_dq = self.tiled_mmas(two, PAIR_N, tcgen05.OperandSource.TMEM)
        tilers = self.tilers(PAIR_N)
        layouts = self.smem_layouts(mma_s, mma_dv, mma_dk, mma_dq, tilers)
        if cutlass.const_expr(self.zero_tail):
            check_pair_key_rows(mma_s, mma_dq, layouts, d, dv)
        # dQ staging: per head-dim half of the dQ warpgroup, one chunk of its 64 rows in dq_accum's
        # order (runs of 64 rows x VECTOR floats).
        sdQ_layout = cute.make_layout((BWD_PAIR_DQ_ROWS * BWD_DQ_CHUNK, CTAS))

        loads, cluster = self.pair_loads(mQ, mK, mV, mdO, mLSE, mdPsum, layouts, tilers,
                                         (mma_s, mma_dv, mma_dk, mma_dq))

        def stage_bytes(*names):
            return CTAS * sum(cute.size_in_bytes(self.dtype, cute.select(getattr(layouts, n), mode=[0, 1, 2]))
                              for n in names)

        # Transaction bytes: both CTAs' 2-CTA TMA loads land on the even CTA's barrier.
        self.tma_bytes_kv = stage_bytes("k", "v", "kt")
        self.tma_bytes_qdo = stage_bytes("q", "do", "qt", "dot")
        self.tma_bytes_rows = 2 * BWD_TILE_M * 4

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
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts.q)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts.do)], 1024]
            sQt: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts.qt)], 1024]
            sdOt: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts.dot)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts.ds)], 1024]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sdQ_layout)], 1024]

        self.set_shared_storage(SharedStorage, backward_pair_shared_memory_bytes(d, dv, self.dtype.width // 8),
                                "CTA pair")
        scales = BackwardScales.of(softmax_scale, softcap, cutlass.const_expr(self.cfg.has_softcap))
        scheduler = self.scheduler(max_seqlen_k, PAIR_N, mQ, qhead_per_kvhead, num_heads_kv, num_batch,
                                   cluster_m=CTAS)
        self.kernel(loads, mdQacc, mdK, mdV, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mSemaphore, scales, qhead_per_kvhead,
                    window_left, window_right, layouts, sdQ_layout,
                    mma_s, mma_dv, mma_dk, mma_dq, scheduler, cluster).launch(
            grid=scheduler.grid(), block=[NUM_WARPS * WARP, 1, 1], cluster=[CTAS, 1, 1], stream=stream,
            min_blocks_per_mp=1)

    def pair_loads(self, mQ, mK, mV, mdO, mLSE, mdPsum, layouts: "SmemLayouts", tilers, mmas: tuple) -> tuple:
        """(PairLoads, the cluster's layout): the TMA atoms and tensors of a pair kernel (this one
        and the d = 256 pair), from the sequence-first views and the pair's MMAs (S^T / dP^T, dV,
        dK, dQ). K, V: the A of S^T = K Q^T and dP^T = V dO^T (2-CTA loads, each CTA its keys);
        Q, dO their B; Q^T, dO^T (transposed views of Q, dO: (d, seq, head[, batch]), varlen ones
        packed along seq) the B of dK, dV; K^T the B of dQ; LSE, D per CTA (row_tma_atoms)."""
        mma_s, mma_dv, mma_dk, mma_dq = mmas
        swap = [1, 0, 2] if cutlass.const_expr(self.cfg.varlen) else [1, 0, 2, 3]
        mQt, mdOt, mKt = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=swap)) for t in (mQ, mdO, mK)]
        cluster = cute.tiled_divide(cute.make_layout((CTAS, 1, 1)), (mma_s.thr_id,))
        tma_load = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.TWO)
        tma_atom_K, tma_K = cute.nvgpu.make_tiled_tma_atom_A(
            tma_load, mK, cute.select(layouts.k, mode=[0, 1, 2]), tilers.s, mma_s, cluster.shape)
        tma_atom_V, tma_V = cute.nvgpu.make_tiled_tma_atom_A(
            tma_load, mV, cute.select(layouts.v, mode=[0, 1, 2]), tilers.dp, mma_s, cluster.shape)
        op_b = sm100_utils.cluster_shape_to_tma_atom_B((CTAS, 1, 1), mma_s.thr_id)
        tma_atom_Q, tma_Q = cute.nvgpu.make_tiled_tma_atom_B(
            op_b, mQ, cute.select(layouts.q, mode=[0, 1, 2]), tilers.s, mma_s, cluster.shape)
        tma_atom_dO, tma_dO = cute.nvgpu.make_tiled_tma_atom_B(
            op_b, mdO, cute.select(layouts.do, mode=[0, 1, 2]), tilers.dp, mma_s, cluster.shape)
        tma_atom_Qt, tma_Qt = cute.nvgpu.make_tiled_tma_atom_B(
            op_b, mQt, cute.select(layouts.qt, mode=[0, 1, 2]), tilers.dk, mma_dk, cluster.shape)
        tma_atom_dOt, tma_dOt = cute.nvgpu.make_tiled_tma_atom_B(
            op_b, mdOt, cute.select(layouts.dot, mode=[0, 1, 2]), tilers.dv, mma_dv, cluster.shape)
        tma_atom_Kt, tma_Kt = cute.nvgpu.make_tiled_tma_atom_B(
            op_b, mKt, cute.select(layouts.kt, mode=[0, 1, 2]), tilers.dq, mma_dq, cluster.shape)
        tma_atom_LSE, tma_LSE, tma_atom_dPsum, tma_dPsum = row_tma_atoms(mLSE, mdPsum)
        loads = PairLoads(tma_atom_Q, tma_Q, tma_atom_dO, tma_dO, tma_atom_Qt, tma_Qt, tma_atom_dOt, tma_dOt,
                          tma_atom_K, tma_K, tma_atom_V, tma_V, tma_atom_Kt, tma_Kt, tma_atom_LSE, tma_LSE,
                          tma_atom_dPsum, tma_dPsum)
        return loads, cluster

    # ------------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, loads: "PairLoads", mdQacc: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor,
               mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor],
               mSeqUsedK: Optional[cute.Tensor], mSemaphore: Optional[cute.Tensor], scales: BackwardScales,
               qhead_per_kvhead: Int32, window_left: Int32, window_right: Int32, layouts: "SmemLayouts",
               sdQ_layout: cute.Layout,
               mma_s: cute.TiledMma, mma_dv: cute.TiledMma, mma_dk: cute.TiledMma, mma_dq: cute.TiledMma,
               scheduler: TileScheduler, cluster: cute.Layout):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp == Warp.LOAD:
            for atom in (loads.atom_Q, loads.atom_dO, loads.atom_Qt, loads.atom_dOt, loads.atom_K, loads.atom_V,
                         loads.atom_Kt, loads.atom_LSE, loads.atom_dPsum):
                cpasync.prefetch_descriptor(atom)
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        smem = self.pair_shared_tiles(storage, layouts, sdQ_layout)
        pipes = self.make_pair_pipelines(storage, cluster)
        tmem = cutlass.memory.TmemAllocator(
            storage.tmem_address.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(
                barrier_id=int(Barrier.TMEM_ALLOC), num_threads=WARP * (1 + 4 * (1 + COMPUTE_GROUPS))),
            allocator_warp_id=int(Warp.COMPUTE), is_two_cta=True,
            two_cta_tmem_dealloc_mbar_ptr=storage.tmem_dealloc.data_ptr(), initialize_mbarrier=True)
        cluster_mn = cute.make_layout((CTAS, 1))
        pipeline.pipeline_init_arrive(cluster_mn, is_relaxed=True)
        tl = self.pair_tmem_layouts(mma_s, mma_dv, mma_dk, mma_dq, layouts)
        pipeline.pipeline_init_wait(cluster_mn)

        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        tile_args = (scheduler, loads.Q, loads.K, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, rank, qhead_per_kvhead,
                     window_left, window_right)
        if warp >= Warp.MMA:
            set_registers(self.registers["other"])
            work = self.pair_tile_work(*tile_args)
            if warp == Warp.LOAD:
                self.pair_load(loads, smem, mma_s, mma_dv, mma_dk, mma_dq, pipes, work, rank)
            if warp == Warp.MMA:
                tmem.wait_for_alloc()
                if rank == PAIR_LEADER:  # the even CTA issues the pair's MMAs
                    if cutlass.const_expr(self.zero_tail):
                        self.pair_zero_kv_tail(storage, layouts, pipes.kv, work)
                    self.pair_mma(tmem.retrieve_ptr(Float32), storage.tmem_address.ptr, smem, tl,
                                  (mma_s, mma_dv, mma_dk, mma_dq), pipes, work.num_steps)
        elif warp >= Warp.COMPUTE:
            set_registers(self.registers["compute"])
            work = self.pair_tile_work(*tile_args)
            if warp == Warp.COMPUTE:
                tmem.allocate(TMEM_COLUMNS)
                tmem.relinquish_alloc_permit()
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            group = (warp - Warp.COMPUTE) // 4
            self.pair_compute(tmem_ptr, group, rank, smem, tl, pipes, work, scales)
            self.pair_store_dkv(tmem_ptr, group, tl, pipes, mdK, mdV, work, scales.softmax)
            pipeline.NamedBarrier(barrier_id=int(Barrier.TMEM_FREE),
                                  num_threads=WARPGROUP * (1 + COMPUTE_GROUPS)).arrive_and_wait()
            if warp == Warp.COMPUTE:
                tmem.free(tmem_ptr, TMEM_COLUMNS)  # both CTAs together (TmemAllocator's handshake)
        else:
            set_registers(self.registers["dq"])
            work = self.pair_tile_work(*tile_args)
            tmem.wait_for_alloc()
            self.pair_reduce_dq(tmem.retrieve_ptr(Float32), smem, tl, pipes, mdQacc, mSemaphore, work, rank)
            pipeline.NamedBarrier(barrier_id=int(Barrier.TMEM_FREE),
                                  num_threads=WARPGROUP * (1 + COMPUTE_GROUPS)).arrive()

    @cute.jit
    def pair_store_dkv(self, tmem_ptr, group, tl: "PairTmemLayouts", pipes: Pipelines, mdK, mdV, work: TileWork,
                       softmax_scale: Float32):
        """dK and dV of this CTA's keys (bwd.store_dkv). The odd CTA of a pair whose keys end in the
        even CTA's block stores nothing, but stays until the pair's last MMA (which reads its shared
        memory) has completed."""
        if work.num_steps > 0 and work.n_block * TILE_N >= work.seqlen.seqlen_k:
            pipes.dkv.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))
        self.store_dkv(tmem_ptr, group, tl, pipes, mdK, mdV, work, softmax_scale)

    @cute.jit
    def pair_tile_work(self, scheduler: TileScheduler, mQ, mK, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, rank,
                       qhead_per_kvhead, window_left, window_right) -> TileWork:
        """This CTA's KV block (2 * pair + rank) and the pair's steps: for every query head of the
        KV head, the query blocks that see a key of either CTA's block (the MMAs are the pair's: a
        block only the even CTA's keys are visible to is fully masked for the odd CTA, whose P^T
        and dS^T are then 0); none for a pair past the keys (varlen grids are sized for the longest
        sequence). Both CTAs of a pair compute the same steps: the even CTA's MMA warp issues them for
        both."""
        pair, head_kv, batch = scheduler.tile()
        n_block = pair * CTAS + rank
        seqlen = SeqlenInfo.create(batch, mQ.shape[0], mK.shape[0], mCuSeqlensQ, mCuSeqlensK, mSeqUsedK)
        keys = self.CTA_KEYS
        mask = AttentionMask(BWD_TILE_M, keys, self.cfg.causal, self.cfg.local, window_left, window_right)
        # Causal and window ranges move right with the keys: the even block's start, the odd one's end
        # (when the odd block holds keys; a range reaching past the keys would make the deterministic
        # order wait for pairs that do not exist).
        m_block_min, m_block_max = mask.m_block_range(seqlen, pair * CTAS)
        if cutlass.const_expr(self.cfg.local):
            if (pair * CTAS + 1) * keys < seqlen.seqlen_k:
                _, m_block_max = mask.m_block_range(seqlen, pair * CTAS + 1)
        per_head = cutlass.max(m_block_max - m_block_min, 0)
        if pair * CTAS * keys >= seqlen.seqlen_k:
            per_head = Int32(0)
        blocks = QueryBlocks(head_kv * qhead_per_kvhead, m_block_min, per_head)
        return TileWork(seqlen, mask, blocks, per_head * qhead_per_kvhead, n_block, head_kv, batch)

    def pair_shared_tiles(self, storage, layouts: "SmemLayouts", sdQ_layout) -> "PairSharedTiles":
        def tile(buffer, layout):
            return buffer.get_tensor(layout.outer, swizzle=layout.inner)

        return PairSharedTiles(
            q=tile(storage.sQ, layouts.q), do=tile(storage.sdO, layouts.do), qt=tile(storage.sQt, layouts.qt),
            dot=tile(storage.sdOt, layouts.dot), k=tile(storage.sK, layouts.k), v=tile(storage.sV, layouts.v),
            kt=tile(storage.sKt, layouts.kt), ds=tile(storage.sdS, layouts.ds),
            lse=storage.sLSE.get_tensor(cute.make_layout((BWD_TILE_M, 1))),
            dpsum=storage.sdPsum.get_tensor(cute.make_layout((BWD_TILE_M, 1))),
            dq=storage.sdQ.get_tensor(sdQ_layout))

    def make_pair_pipelines(self, storage, cluster) -> Pipelines:
        """The 1-CTA kernel's pipelines over the cluster: full barriers of kv and qdo count both
        CTAs' TMA bytes on the even CTA; the empty barriers of sdp and dq count both CTAs' threads
        there; commits multicast to both CTAs. rows stays per CTA."""
        thread = pipeline.Agent.Thread
        one = pipeline.CooperativeGroup(thread)
        compute = pipeline.CooperativeGroup(thread, CTAS * COMPUTE_GROUPS * WARPGROUP)
        kv = pipeline.PipelineTmaUmma.create(
            num_stages=1, producer_group=one, consumer_group=one, tx_count=self.tma_bytes_kv,
            barrier_storage=storage.mbar_kv.data_ptr(), cta_layout_vmnk=cluster, defer_sync=True)
        qdo = pipeline.PipelineTmaUmma.create(
            num_stages=1, producer_group=one, consumer_group=one, tx_count=self.tma_bytes_qdo,
            barrier_storage=storage.mbar_qdo.data_ptr(), cta_layout_vmnk=cluster, defer_sync=True)
        rows = pipeline.PipelineTmaAsync.create(
            num_stages=1, producer_group=one,
            consumer_group=pipeline.CooperativeGroup(thread, COMPUTE_GROUPS * WARPGROUP // WARP),
            tx_count=self.tma_bytes_rows, barrier_storage=storage.mbar_rows.data_ptr(), defer_sync=True)
        sdp = pipeline.PipelineUmmaAsync.create(
            num_stages=1, producer_group=one, consumer_group=compute, barrier_storage=storage.mbar_sdp.data_ptr(),
            cta_layout_vmnk=cluster, defer_sync=True)
        dq = pipeline.PipelineUmmaAsync.create(
            num_stages=1, producer_group=one, consumer_group=pipeline.CooperativeGroup(thread, CTAS * WARPGROUP),
            barrier_storage=storage.mbar_dq.data_ptr(), cta_layout_vmnk=cluster, defer_sync=True)
        dkv = pipeline.PipelineUmmaAsync.create(
            num_stages=1, producer_group=one, consumer_group=compute, barrier_storage=storage.mbar_dkv.data_ptr(),
            cta_layout_vmnk=cluster, defer_sync=True)
        return Pipelines(kv, qdo, rows, sdp, dq, dkv)

    def pair_tmem_layouts(self, mma_s, mma_dv, mma_dk, mma_dq, layouts) -> "PairTmemLayouts":
        thr_s, thr_dv, thr_dk, thr_dq = (m.get_slice(0) for m in (mma_s, mma_dv, mma_dk, mma_dq))
        dq = thr_dq.make_fragment_C(thr_dq.partition_shape_C((BWD_TILE_M, self.hdim))).layout
        # The M = 128 accumulator of a pair: row i of this CTA's 64 at lane i for columns 0..63 and
        # at lane 64 + i for 64..127 (checked here: the dQ warpgroup reads it that way).
        lane = 1 << 16
        for row in (0, 1, BWD_PAIR_DQ_ROWS - 1):
            for col in (0, 1, self.dq_cols - 1, self.dq_cols, self.hdim - 1):
                expect = (row + BWD_PAIR_DQ_ROWS * (col // self.dq_cols)) * lane + col % self.dq_cols
                got = cute.crd2idx(((row, (col % self.dq_cols, col // self.dq_cols)), 0, 0), dq)
                if got != expect:
                    raise ValueError(f"sm100 backward pair: dQ's TMEM layout {dq} puts ({row}, {col}) at {got}")
        return PairTmemLayouts(
            s=thr_s.make_fragment_C(thr_s.partition_shape_C((PAIR_N, BWD_TILE_M))).layout,
            dv=thr_dv.make_fragment_C(thr_dv.partition_shape_C((PAIR_N, self.hdim_v))).layout,
            dk=thr_dk.make_fragment_C(thr_dk.partition_shape_C((PAIR_N, self.hdim))).layout,
            dq=dq,
            p=thr_dv.make_fragment_A(layouts.p.outer)[None, None, None, 0].layout,
            dst=thr_dk.make_fragment_A(layouts.dst.outer)[None, None, None, 0].layout)

    # ---- load warp -------------------------------------------------------------------------------
    @cute.jit
    def pair_load(self, loads: "PairLoads", smem: "PairSharedTiles", mma_s, mma_dv, mma_dk, mma_dq,
                  pipes: Pipelines, work: TileWork, rank):
        """K, V, K^T once (this CTA's share of the pair's tiles), then per step Q, dO, Q^T, dO^T
        (its shares) and LSE, D (all 128 rows, for its own compute warps)."""
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
                                         (loads.atom_dO, smem.do, thr_s.partition_B(gdO)),
                                         (loads.atom_Qt, smem.qt, thr_dk.partition_B(gQt)),
                                         (loads.atom_dOt, smem.dot, thr_dv.partition_B(gdOt))), pipes, qdo_state,
                                        m_block)
            rows_state = self.load_rows(loads, smem, pipes, rows_state, rows_offset, head, batch, m_block)
        if work.num_steps > 0:
            pipes.qdo.producer_tail(qdo_state)

    @cute.jit
    def query_tiles(self, loads: "PairLoads", work: TileWork, head):
        """The query blocks of query head ``head`` in the tile's sequence: Q and dO by rows (the B of
        S^T and dP^T), Q^T and dO^T by head-dim columns (the B of dK and dV)."""
        offset, batch, varlen = work.seqlen.offset_q, work.batch, self.cfg.varlen
        gQ = cute.local_tile(head_rows(loads.Q, offset, head, batch, varlen), (BWD_TILE_M, self.hdim), (None, 0))
        gdO = cute.local_tile(head_rows(loads.dO, offset, head, batch, varlen), (BWD_TILE_M, self.hdim_v), (None, 0))
        gQt = cute.local_tile(head_columns(loads.Qt, offset, head, batch, varlen), (self.hdim, BWD_TILE_M), (0, None))
        gdOt = cute.local_tile(head_columns(loads.dOt, offset, head, batch, varlen), (self.hdim_v, BWD_TILE_M),
                               (0, None))
        return gQ, gdO, gQt, gdOt

    @cute.jit
    def pair_load_kv(self, loads: "PairLoads", smem, thr_s, thr_dq, pipes: Pipelines, work: TileWork):
        """K, V and K^T of the pair's CTAS * CTA_KEYS keys (this CTA's shares: the MMA partitions of
        its slices), once per tile, on the kv barrier; nothing where the tile has no step."""
        head_kv, batch, seqlen, varlen = work.head_kv, work.batch, work.seqlen, self.cfg.varlen
        pair, keys = work.n_block // CTAS, CTAS * self.CTA_KEYS
        if work.num_steps > 0:
            gK = cute.local_tile(head_rows(loads.K, seqlen.offset_k, head_kv, batch, varlen), (keys, self.hdim),
                                 (None, 0))
            gV = cute.local_tile(head_rows(loads.V, seqlen.offset_k, head_kv, batch, varlen), (keys, self.hdim_v),
                                 (None, 0))
            gKt = cute.local_tile(head_columns(loads.Kt, seqlen.offset_k, head_kv, batch, varlen), (self.hdim, keys),
                                  (0, None))
            tKsK, tKgK = mma_tma_partition(loads.atom_K, smem.k, thr_s.partition_A(gK))
            tVsV, tVgV = mma_tma_partition(loads.atom_V, smem.v, thr_s.partition_A(gV))
            tKtsKt, tKtgKt = mma_tma_partition(loads.atom_Kt, smem.kt, thr_dq.partition_B(gKt))
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            pipes.kv.producer_acquire(kv_state)
            barrier = pipes.kv.producer_get_barrier(kv_state)
            cute.copy(loads.atom_K, tKgK[None, pair], tKsK[None, 0], tma_bar_ptr=barrier)
            cute.copy(loads.atom_V, tVgV[None, pair], tVsV[None, 0], tma_bar_ptr=barrier)
            cute.copy(loads.atom_Kt, tKtgKt[None, pair], tKtsKt[None, 0], tma_bar_ptr=barrier)

    @cute.jit
    def rows_offset(self, work: TileWork):
        """Where this tile's sequence starts in LSE / D (varlen: bwd.load's packed starts)."""
        rows_offset = work.seqlen.offset_q
        if cutlass.const_expr(self.cfg.varlen):
            rows_offset = packed_row_offset(work.seqlen.offset_q, work.batch)
        return rows_offset

    @cute.jit
    def load_phase(self, copies, pipes: Pipelines, qdo_state, m_block):
        """One phase of the Q/dO buffers: wait until the MMAs released them, load ``copies``
        ((atom, shared tile, MMA-partitioned global tiles)) of query block m_block; the next state."""
        pipes.qdo.producer_acquire(qdo_state)
        barrier = pipes.qdo.producer_get_barrier(qdo_state)
        for atom, sX, gX in copies:
            t_smem, t_gmem = mma_tma_partition(atom, sX, gX)
            cute.copy(atom, t_gmem[None, m_block], t_smem[None, 0], tma_bar_ptr=barrier)
        return advanced(qdo_state)

    @cute.jit
    def load_rows(self, loads: "PairLoads", smem, pipes: Pipelines, rows_state, rows_offset, head, batch, m_block):
        """LSE and D of query block m_block (all BWD_TILE_M rows: each CTA's compute warps read
        them all) on the rows barrier; the next state."""
        pipes.rows.producer_acquire(rows_state)
        barrier = pipes.rows.producer_get_barrier(rows_state)
        for atom, tile, mRows in ((loads.atom_LSE, smem.lse, loads.LSE), (loads.atom_dPsum, smem.dpsum, loads.dPsum)):
            gRows = cute.local_tile(head_rows(mRows, rows_offset, head, batch, self.cfg.varlen), (BWD_TILE_M,),
                                    (m_block,))
            t_smem, t_gmem = tma_partition_tile(atom, tile, gRows, 1)
            cute.copy(atom, t_gmem, t_smem[None, 0], tma_bar_ptr=barrier)
        return advanced(rows_state)

    # ---- MMA warp (even CTA) -----------------------------------------------------------------------
    @cute.jit
    def pair_zero_kv_tail(self, storage, layouts: "SmemLayouts", pipe_kv, work: TileWork):
        """bwd.zero_kv_tail for the pair that holds its sequence's last key (varlen keys, seqused_k):
        K's, V's and K^T's rows past the keys hold the next sequence's keys or an unused cache's
        contents (NaN possible) in both CTAs' shared memory, and the pair's MMAs read all of them
        (0 * NaN in dP^T, dS^T and dQ; kv_tail.py). The even CTA's MMA warp zeroes them all, its own
        and the odd CTA's (through shared::cluster addresses, one code path for both): only it can
        wait for the K/V loads, whose bytes from both CTAs complete on its barrier, and it issues
        every MMA that reads them. The odd CTA's block may lie wholly past the keys (an odd number
        of blocks in the sequence): then all its K and V rows are zeroed. K^T (each CTA: a head-dim
        half over both blocks' keys) is zeroed from the sequence's end on in both CTAs. Never where
        the pair has no step: nothing is loaded then."""
        pair, keys = work.n_block // CTAS, self.CTA_KEYS
        seqlen_k = work.seqlen.seqlen_k
        first_key = first_row_past_keys(seqlen_k, pair, CTAS * keys)
        if work.num_steps > 0:
            if first_key < CTAS * keys:
                pipe_kv.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))
                lane = cute.arch.lane_idx()
                half = self.hdim // CTAS
                # Rolled over the two CTAs (a runtime mapa target): unrolled, 56-64 more instructions.
                for cta in cutlass.range(CTAS, unroll=1):
                    first_row = first_row_past_keys(seqlen_k, pair * CTAS + cta, keys)
                    for buffer, layout, cols in ((storage.sK, layouts.k, self.hdim),
                                                 (storage.sV, layouts.v, self.hdim_v)):
                        rows = key_rows(layout.outer, cols, keys)
                        zero_rows(peer_tile(buffer.get_tensor(rows, swizzle=layout.inner), cta), first_row, lane, WARP)
                    kt = storage.sKt.get_tensor(kt_key_rows(layouts.kt.outer, half, CTAS * keys),
                                                swizzle=layouts.kt.inner)
                    zero_rows(peer_tile(kt, cta), first_key, lane, WARP)
                # The generic-proxy stores, local and remote, before the MMAs (async proxy) read them.
                cute.arch.fence_proxy("async.shared", space="cluster")
                cute.arch.sync_warp()
                cute.arch.fence_acq_rel_cluster()

    @cute.jit
    def pair_mma(self, tmem_ptr, tmem_address, smem: "PairSharedTiles", tl: "PairTmemLayouts", mmas: tuple,
                 pipes: Pipelines, num_steps):
        """The pair's MMAs, step by step (module docstring; the 1-CTA kernel's order). ``mmas``:
        the tiled MMAs of S^T / dP^T, dV, dK, dQ; ``tmem_address``: where the allocator published
        the TMEM address (read per step, see below)."""
        mma_s, mma_dv, mma_dk, mma_dq = mmas
        tStS = cute.make_tensor(tmem_ptr + self.tmem_s, tl.s)
        tdPtdP = cute.make_tensor(tmem_ptr + self.tmem_dp, tl.s)
        tdVtdV = cute.make_tensor(tmem_ptr + self.tmem_dv, tl.dv)
        tdKtdK = cute.make_tensor(tmem_ptr + self.tmem_dk, tl.dk)
        tdQtdQ = cute.make_tensor(tmem_ptr + self.tmem_dq, tl.dq)
        # P^T and dS^T as A operands: warpgroup w's query columns (k-slices) start at TMEM column
        # 64 w of S^T's and dP^T's columns (see the 1-CTA kernel's mma).
        k_slices_per_group = self.cols_per_group // MMA_K
        shift = self.cols_per_group - self.p_words
        tdVrP = [cute.make_tensor(cute.recast_ptr(tmem_ptr + self.tmem_s + w * shift, dtype=self.dtype), tl.p)
                 for w in range(COMPUTE_GROUPS)]
        tdKrdS = [cute.make_tensor(cute.recast_ptr(tmem_ptr + self.tmem_dp + w * shift, dtype=self.dtype), tl.dst)
                  for w in range(COMPUTE_GROUPS)]

        qdo_state, sdp_state, dq_state = self.mma_start(pipes, num_steps, 1)
        for i in cutlass.range(num_steps, unroll=1):
            # In a cluster launch shared-memory addresses are runtime values: hoisted out of the
            # loop, the 80 descriptors spilled at 128 registers; per step they are rebuilt.
            # Offset by min(TMEM address, 0) = 0 blocks, read from shared memory per step.
            opaque = cute.make_tensor(tmem_address, cute.make_layout(1))[0]
            k, v, q, do, qt, dot, ds, kt = [FlashAttentionForwardSm100.tile_variant(x, opaque) for x in (
                smem.k, smem.v, smem.q, smem.do, smem.qt, smem.dot, smem.ds, smem.kt)]
            tSrK, tSrQ = mma_s.make_fragment_A(k), mma_s.make_fragment_B(q)
            tdPrV, tdPrdO = mma_s.make_fragment_A(v), mma_s.make_fragment_B(do)
            tdVrdOt = mma_dv.make_fragment_B(dot)
            tdKrQt = mma_dk.make_fragment_B(qt)
            tdQrdS, tdQrKt = mma_dq.make_fragment_A(ds), mma_dq.make_fragment_B(kt)
            pipes.qdo.consumer_wait(qdo_state)
            pipes.dq.producer_acquire(dq_state)  # dQ_(i-1) is out of dP^T's columns (both CTAs)
            mma_s = gemm(mma_s, tStS, tSrK[None, None, None, 0], tSrQ[None, None, None, 0], False)
            mma_s = gemm(mma_s, tdPtdP, tdPrV[None, None, None, 0], tdPrdO[None, None, None, 0], False)
            pipes.sdp.producer_commit(sdp_state)
            sdp_state = advanced(sdp_state)
            pipes.sdp.producer_acquire(sdp_state)  # P^T, dS^T in TMEM and dS in shared memory (both CTAs)
            cute.arch.fence_acq_rel_cluster()  # the acquire side of the compute threads' cluster release
            mma_dv = gemm_a_by_groups(mma_dv, tdVtdV, tdVrP, tdVrdOt[None, None, None, 0], i > 0,
                                      k_slices_per_group)
            mma_dk = gemm_a_by_groups(mma_dk, tdKtdK, tdKrdS, tdKrQt[None, None, None, 0], i > 0,
                                      k_slices_per_group)
            pipes.qdo.consumer_release(qdo_state)
            qdo_state = advanced(qdo_state)
            mma_dq, dq_state = self.issue_dq(mma_dq, tdQtdQ, tdQrdS, tdQrKt, pipes, dq_state)
        self.mma_finish(pipes, num_steps)

    # ---- compute warpgroups ----------------------------------------------------------------------
    @cute.jit
    def pair_compute(self, tmem_ptr, group, rank, smem: "PairSharedTiles", tl: "PairTmemLayouts",
                     pipes: Pipelines, work: TileWork, scales: BackwardScales):
        """The 1-CTA kernel's compute step, with dS^T also into TMEM (dK's A operand) and dS into
        the dQ operand of CTA ``group`` (this CTA's or the peer's shared memory)."""
        thread = cute.arch.thread_idx()[0] % WARPGROUP
        first_col = group * self.cols_per_group
        load_s, tS, s_regs = self.tmem_row_chunks(tmem_ptr + self.tmem_s, tl.s, TILE_N, BWD_TILE_M, thread)
        load_dp, tdP, _ = self.tmem_row_chunks(tmem_ptr + self.tmem_dp, tl.s, TILE_N, BWD_TILE_M, thread)
        chunks = self.cols_per_group // BWD_DQ_CHUNK
        chunk_words = BWD_DQ_CHUNK * self.dtype.width // 32
        tSt = cute.make_tensor(tmem_ptr + self.tmem_s, tl.s)
        store_p, tPt, p_regs = self.packed_chunks(tmem_ptr + self.tmem_s + first_col, tSt.layout, self.p_words,
                                                  chunk_words, thread)
        _, tdSt, _ = self.packed_chunks(tmem_ptr + self.tmem_dp + first_col, tSt.layout, self.p_words, chunk_words,
                                        thread)
        # dS of this key row for query half ``group``: the dQ operand's k-step of this CTA's key.
        key = rank * TILE_N + thread
        ds_row = smem.ds[((None, key % MMA_K), 0, key // MMA_K, 0)]  # (64 queries,)
        # One code path for both warpgroups: a shared::cluster address of CTA ``group`` (this CTA's
        # own shared memory when group == rank).
        ds_row = cute.make_tensor(cute.arch.map_dsmem_ptr(ds_row.iterator, group), ds_row.layout)
        copies = ChunkCopies(load_s, tS, load_dp, tdP, s_regs, store_p, tPt, p_regs, ds_row)

        sdp_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        rows_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        for step in cutlass.range(work.num_steps, unroll=1):
            _, m_block = work.blocks.at(step)
            pipes.rows.consumer_wait(rows_state)
            pipes.sdp.consumer_wait(sdp_state)
            rows = (smem.lse[None, 0], smem.dpsum[None, 0])
            full = work.mask.block_is_full(work.seqlen, m_block, work.n_block)
            for c in cutlass.range_constexpr(chunks):
                if full:
                    self.pair_chunk(c, group, copies, tdSt, rows, scales, work, m_block, thread, False)
                else:
                    self.pair_chunk(c, group, copies, tdSt, rows, scales, work, m_block, thread, True)
            cute.arch.fence_view_async_tmem_store()  # P^T, dS^T in TMEM before the dV / dK MMAs
            cute.arch.fence_proxy("async.shared", space="cluster")  # dS (local or remote) -> MMA
            # The release of "P^T and dS^T written" (consumer_release's arrival on the even CTA's
            # barrier) at cluster scope: it hands on shared-memory data written across CTAs.
            cute.arch.mbarrier_arrive(pipes.sdp.sync_object_empty.get_barrier(sdp_state.index), PAIR_LEADER,
                                      scope=nvvm.MemScopeKind.CLUSTER)
            pipes.rows.consumer_release(rows_state)
            sdp_state = advanced(sdp_state)
            rows_state = advanced(rows_state)

    @cute.jit
    def pair_chunk(self, c, group, copies: ChunkCopies, tdSt, rows, scales: BackwardScales, work: TileWork, m_block,
                   thread, masked: cutlass.Constexpr[bool]):
        """Chunk c: P^T to TMEM, dS^T = P^T (dP^T - D) to TMEM (packed) and to the dQ operand."""
        sLSE, sdPsum = rows
        first_col = group * self.cols_per_group + c * BWD_DQ_CHUNK
        p = cute.make_rmem_tensor(copies.s_regs, Float32)
        cute.copy(copies.load_s, copies.s[None, None, None, (first_col // BWD_DQ_CHUNK)], p)
        cute.arch.fence_view_async_tmem_load()
        p = flat(p)
        p16 = cute.make_rmem_tensor(copies.p_regs, Float32)
        self.probabilities(p, cute.recast_tensor(p16, self.dtype), sLSE, first_col, scales, work, m_block, thread,
                           masked)
        cute.copy(copies.store_p, p16, copies.p[None, None, None, c])
        dp = cute.make_rmem_tensor(copies.s_regs, Float32)
        cute.copy(copies.load_dp, copies.dp[None, None, None, (first_col // BWD_DQ_CHUNK)], dp)
        cute.arch.fence_view_async_tmem_load()
        dp = flat(dp)
        ds32 = cute.make_rmem_tensor(copies.p_regs, Float32)
        ds = cute.recast_tensor(ds32, self.dtype)
        for e in cutlass.range_constexpr(BWD_DQ_CHUNK):
            ds[e] = (p[e] * (dp[e] - sdPsum[first_col + e])).to(self.dtype)
        cute.copy(copies.store_p, ds32, tdSt[None, None, None, c])
        cute.autovec_copy(flat(ds), cute.local_tile(copies.ds_row, (BWD_DQ_CHUNK,), (c,)))

    # ---- dQ warpgroup ----------------------------------------------------------------------------
    @cute.jit
    def pair_reduce_dq(self, tmem_ptr, smem: "PairSharedTiles", tl: "PairTmemLayouts", pipes: Pipelines, mdQacc,
                       mSemaphore: Optional[cute.Tensor], work: TileWork, rank):
        """Per step: this CTA's 64 dQ rows from TMEM (thread t: row t % 64 of its rows, head-dim
        half t // 64), chunk by chunk staged in dq_accum's order and added by bulk reduce-adds of
        thread 0 (runs of two 128-float rows). Deterministic: a query block's adds of this CTA's
        rows in pair order, on semaphore slot ``rank`` (pair_turn / pair_done)."""
        thread = cute.arch.thread_idx()[0] % WARPGROUP
        half, row = thread // BWD_PAIR_DQ_ROWS, thread % BWD_PAIR_DQ_ROWS
        t = cute.make_tensor(tmem_ptr + self.tmem_dq, cute.make_layout((WARPGROUP, self.dq_cols), stride=(1 << 16, 1)))
        t = cute.flat_divide(t, (WARPGROUP, BWD_DQ_CHUNK))[None, None, 0, None]  # (lanes, chunk, loads)
        load = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(BWD_DQ_CHUNK)), Float32),
            t[None, None, 0]).get_slice(thread)
        tdQ = load.partition_S(t)
        regs = load.partition_D(cute.make_identity_tensor((WARPGROUP, BWD_DQ_CHUNK))).shape
        stage_barrier = pipeline.NamedBarrier(barrier_id=int(Barrier.DQ_STAGE), num_threads=WARPGROUP)
        run_floats = BWD_PAIR_DQ_ROWS * VECTOR  # one run: this CTA's rows of VECTOR columns
        dq_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        for step in cutlass.range(work.num_steps, unroll=1):
            head, m_block = work.blocks.at(step)
            pipes.dq.consumer_wait(dq_state)
            gdQ = chunk_tiles(mdQacc, self.dq, work.seqlen.offset_q, head, work.batch, self.cfg.varlen)
            for k in cutlass.range_constexpr(self.dq_loads):
                r = cute.make_rmem_tensor(regs, Float32)
                cute.copy(load, tdQ[None, None, None, k], r)
                cute.arch.fence_view_async_tmem_load()
                if cutlass.const_expr(k == self.dq_loads - 1):
                    pipes.dq.consumer_release(dq_state)  # TMEM read out: the next dP^T may land
                if thread == 0:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)  # the staging buffers are free
                stage_barrier.arrive_and_wait()
                staged = smem.dq[None, half]
                for j in cutlass.range_constexpr(self.dq_runs):
                    dst = cute.make_tensor(staged.iterator + j * run_floats + row * VECTOR, cute.make_layout(VECTOR))
                    cute.autovec_copy(cute.local_tile(flat(r), (VECTOR,), (j,)), dst)
                cute.arch.fence_view_async_shared()
                stage_barrier.arrive_and_wait()
                if thread == 0:
                    if cutlass.const_expr(self.cfg.deterministic and k == 0):
                        self.pair_turn(mSemaphore, work, head, m_block, rank)
                    for h in cutlass.range_constexpr(CTAS):
                        chunk = m_block * self.dq.chunks + h * self.dq_loads + k
                        base = gdQ[None, None, chunk].iterator + rank * run_floats
                        for j in cutlass.range(self.dq_runs, unroll=1):  # one issuing thread: a loop
                            cp_reduce_async_bulk_global_shared_cta(
                                base + j * WARPGROUP * VECTOR, smem.dq[None, h].iterator + j * run_floats,
                                run_floats * 4, type=CpReduceType.F32)
                    cute.arch.cp_async_bulk_commit_group()
                    if cutlass.const_expr(self.cfg.deterministic and k == self.dq_loads - 1):
                        self.pair_done(mSemaphore, work, head, m_block, rank)
            dq_state = advanced(dq_state)
        if thread == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def pair_turn(self, mSemaphore: cute.Tensor, work: TileWork, head, m_block, rank):
        """Wait (the issuing thread) until every pair before this one that visits query block
        m_block of ``head`` has added its rows of this CTA's half: slot ``rank`` of the block's
        semaphore counts them. The pairs that visit a query block are contiguous from the one holding
        its first KV block, mask.n_block_range's (tests/cpu/test_bwd_tile_emulation.py checks it for
        the pair walk), and pairs start in KV-block order within a head, so the pair waited for never
        waits for this one."""
        lock = mSemaphore.iterator + cute.crd2idx((work.batch, head, m_block, rank), mSemaphore.layout)
        n_block_first, _ = work.mask.n_block_range(work.seqlen, m_block)
        turn = work.n_block // CTAS - n_block_first // CTAS
        done = Int32(-1)
        while done != turn:
            done = cute.arch.load(lock, Int32, sem="acquire", scope="gpu")
        cute.arch.fence_proxy("async.global")  # the earlier pairs' adds are visible to the bulk copies

    @cute.jit
    def pair_done(self, mSemaphore: cute.Tensor, work: TileWork, head, m_block, rank):
        """After the query block's last reduce-add (this thread's bulk groups): wait until they have
        landed in global memory, then count this pair on slot ``rank``."""
        lock = mSemaphore.iterator + cute.crd2idx((work.batch, head, m_block, rank), mSemaphore.layout)
        cute.arch.cp_async_bulk_wait_group(0)
        cute.arch.fence_proxy("async.global")
        cute.arch.red(lock, Int32(1), op="add", dtype="s32", sem="release", scope="gpu")


@cute.jit
def head_columns(t: cute.Tensor, offset: Int32, head: Int32, batch: Int32,
                 varlen: cutlass.Constexpr[bool]) -> cute.Tensor:
    """seqlen.head_rows for a transposed view, (dim, seq, head[, batch]): one head of one batch
    entry, a varlen entry's tokens from ``offset`` on."""
    if cutlass.const_expr(varlen):
        return cute.domain_offset((0, offset), t[None, None, head])
    return t[None, None, head, batch]


def peer_tile(tile: cute.Tensor, cta) -> cute.Tensor:
    """A shared-memory tile of CTA ``cta`` of the cluster (this CTA's own when cta is its rank)."""
    return cute.make_tensor(cute.arch.map_dsmem_ptr(tile.iterator, cta), tile.layout)


def kt_key_rows(layout: cute.Layout, cols: int, pair_keys: int = PAIR_N) -> cute.Layout:
    """K^T's operand layout (the outer layout of SmemLayouts.kt, a CTA's ``cols`` head-dim columns
    over the pair's ``pair_keys`` keys: ((cols, MMA_K), 1, k-slices, 1), columns contiguous) as a
    plain (key, column) layout over the same offsets, for pair_zero_kv_tail; check_pair_key_rows
    confirms it."""
    return cute.composition(layout, cute.make_layout(((MMA_K, pair_keys // MMA_K), cols),
                                                     stride=((cols, cols * MMA_K), 1)))


def check_pair_key_rows(mma_s: cute.TiledMma, mma_dq: cute.TiledMma, layouts: "SmemLayouts", d: int, dv: int,
                        keys: Optional[int] = None):
    """ValueError unless the (key, column) views pair_zero_kv_tail zeroes through put each key where
    the pair's MMAs read it, in either CTA (trace time, bwd.check_key_rows for the pair): K's and
    V's rows as S^T = K Q^T and dP^T = V dO^T read them (CTA r: the pair's keys ``keys`` * r ..,
    ``keys`` per CTA: TILE_N, the d = 256 pair's 64), K^T's as dQ = dS K does (CTA r: head-dim
    columns d / 2 * r .., every key of the pair). The rows sampled are those of K's tile."""
    keys = TILE_N if keys is None else keys  # read at call time (a test moves the CTAs' first keys)
    half = d // CTAS
    rows = cute.size(layouts.k.outer, mode=[0, 0])  # key rows of a CTA's K / V tile
    pair_keys = CTAS * rows
    for rank in range(CTAS):
        for layout, cols, name in ((layouts.k, d, "K"), (layouts.v, dv, "V")):
            part = mma_s.get_slice(rank).partition_A(cute.make_identity_tensor((pair_keys, cols)))
            view = key_rows(layout.outer, cols, rows)
            sample = [(r, c) for r in range(rows) for c in (0, 1, 7, 8, MMA_K, cols - 1)]
            sample += [(r, c) for r in (0, 1, MMA_K - 1, MMA_K, rows // 2 - 1, rows // 2, rows - 1)
                       for c in range(cols)]
            for r, c in sample:
                coord = ((r, c % MMA_K), 0, c // MMA_K)
                key, col = part[coord]
                if (key - rank * keys, col) != (r, c) or \
                        cute.crd2idx((r, c), view) != cute.crd2idx((*coord, 0), layout.outer):
                    raise ValueError(f"sm100 backward pair: the (key, column) view of {name} disagrees with the "
                                     f"MMA of CTA {rank} at key {key}, column {col}")
        part = mma_dq.get_slice(rank).partition_B(cute.make_identity_tensor((d, pair_keys)))
        view = kt_key_rows(layouts.kt.outer, half, pair_keys)
        sample = [(key, n) for key in range(pair_keys) for n in (0, 1, 7, 8, half - 1)]
        sample += [(key, n) for key in (0, 1, MMA_K - 1, MMA_K, rows - 1, rows, pair_keys - 1) for n in range(half)]
        for key, n in sample:
            coord = ((n, key % MMA_K), 0, key // MMA_K)
            col, k = part[coord]
            if (k, col - rank * half) != (key, n) or \
                    cute.crd2idx((key, n), view) != cute.crd2idx((*coord, 0), layouts.kt.outer):
                raise ValueError(f"sm100 backward pair: the (key, column) view of K^T disagrees with the MMA of "
                                 f"CTA {rank} at key {k}, column {col}")


@dataclass(frozen=True)
class PairLoads:
    atom_Q: cute.CopyAtom
    Q: cute.Tensor
    atom_dO: cute.CopyAtom
    dO: cute.Tensor
    atom_Qt: cute.CopyAtom
    Qt: cute.Tensor
    atom_dOt: cute.CopyAtom
    dOt: cute.Tensor
    atom_K: cute.CopyAtom
    K: cute.Tensor
    atom_V: cute.CopyAtom
    V: cute.Tensor
    atom_Kt: cute.CopyAtom
    Kt: cute.Tensor
    atom_LSE: cute.CopyAtom
    LSE: cute.Tensor
    atom_dPsum: cute.CopyAtom
    dPsum: cute.Tensor


@dataclass(frozen=True)
class PairSharedTiles:
    q: cute.Tensor
    do: cute.Tensor
    qt: cute.Tensor
    dot: cute.Tensor
    k: cute.Tensor
    v: cute.Tensor
    kt: cute.Tensor
    ds: cute.Tensor
    lse: cute.Tensor
    dpsum: cute.Tensor
    dq: cute.Tensor


@dataclass(frozen=True)
class PairTmemLayouts:
    s: cute.Layout
    dv: cute.Layout
    dk: cute.Layout
    dq: cute.Layout
    p: cute.Layout
    dst: cute.Layout
