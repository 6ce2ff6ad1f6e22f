"""FlashAttention backward for Hopper (sm_90a): dQ, dK, dV from Q, K, V, dO, LSE and rowsum(dO * O).

One CTA owns one KV tile (tile_n = 128 keys) of one KV head and walks, for every query head that
shares the KV head (GQA), the query blocks that see the tile. dK and dV so accumulate in registers
over all their contributions and are written once, in the input dtype, without atomics; only dQ,
which every KV tile contributes to, is reduced across CTAs.

    warp 0          producer   K_j and V_j once; then per (query head, query block i) Q_i, dO_i,
                               LSE_i and rowsum_i into a ``num_stages``-deep ring (TMA)
    warp 1          dQ writer  per query block, one TMA reduce-add per consumer warpgroup's part of
                               dQ into the fp32 dq_accum, as the parts land in shared memory; in
                               deterministic mode in KV-tile order (a semaphore per block and part)
    warpgroups 1,2  consumers  64 keys each, in the transposed orientation (keys are the
                               accumulator rows), per query block of tile_m rows (64; 128 at
                               d <= 64; 80 at d = 128 where chosen):
        S^T  = K Q_i^T     dP^T = V dO_i^T        issued together; P waits for S^T alone
        P^T  = exp2(S^T * scale_log2 - LSE_i)     masked entries 0 (only blocks on a mask edge);
                                                  exp_eighths_under_dp of the columns under dP^T's
                                                  GEMM, the rest column by column with dS^T
        dS^T = P^T * (dP^T - rowsum_i)            softcap: times 1 - tanh^2
        dV  += P^T dO_i                           P from registers, issued before the barrier
        dS^T -> shared memory (stmatrix), one barrier: the dQ GEMM needs both warpgroups' keys
        dQ_i = dS K                               each warpgroup its 64 rows (tile_m 128) or half
                                                  of the head dim (as dQ^T = K^T dS^T at tile_m
                                                  80); issued before dK's GEMM so that its
                                                  staging runs under dK
        dK  += dS^T Q_i                           dS from registers
        dQ_i -> shared memory -> the writer warp  in register order (dq_accum.py): 128-bit stores

dS alternates between two shared-memory buffers by query block, so one barrier per step suffices:
the other warpgroup's dQ GEMM of block i-1 reads the other buffer. Measured on the H200 and kept:
each of these (docs/perf.md, backward). Tried, measured and removed: issuing dV before dS (no
effect), storing dS^T before issuing dV (no effect), the next block's S^T/dP^T before this block's
dQ (14-35% slower).

Schedule switches (BackwardConfig): tma_store_dkv (dK/dV through K's and V's tiles and a TMA store
each), on wherever the layout allows it (batched, unsplit: tiles.backward_schedule; 7-12% slower at
d=128 when ptxas serialised the WGMMAs around it, which it no longer does since dQ is staged in
register order; now 0.98x the time, geometric mean: docs/perf.md). Off by default, for A/B runs:
separate_do_barrier (Q with LSE and dO with rowsum behind their own mbarriers, so that S^T starts
before dO lands), dq_bulk_reduce (each dQ part added by one 1-D bulk reduce instead of a 2-D TMA
tensor reduce), one_step_body (every query block takes the masked step: one copy of the step's code,
as flash-attn-4; measured no faster, docs/perf.md).

Head dims above 128, and d != dv (``split_head_dim``): 64 keys per CTA would need more accumulator
registers than a warpgroup has (dK and dV of 64 keys x d each), so both consumer warpgroups work on
one 64-key tile. Each computes S^T and dP^T for its half of the query block's rows, writes its half
of P^T and dS^T to shared memory, and after a barrier computes, over all queries, its half of the
head dim of dV, dK and dQ (A operands from shared memory). One Q/dO stage above d = 192 (shared
memory).

ops.py runs the preprocessing kernel before (LSE in log2 units, rowsum(dO * O); bwd_preprocess.py)
and the postprocessing kernel after (dQ = dq_accum * softmax_scale, back in (row, column) order;
sm90/bwd_postprocess.py). Call convention: BackwardConfig's docstring.

Varlen: the LSE / rowsum rows of each sequence start 16-byte aligned (seqlen.packed_row_offset), as
the TMA that loads them requires.
"""

from __future__ import annotations

import enum

from dataclasses import dataclass
from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.experimental.primitives.nvvm_wrapper import CpReduceType, cp_reduce_async_bulk_global_shared_cta

from ..config import BackwardConfig
from ..dtypes import CUTLASS_DTYPES
from ..exp2 import emulated, exp2_fma
from ..kv_tail import first_row_past_keys, zero_rows
from ..layouts import tma_partition_tile, transpose_view
from ..mask import AttentionMask
from ..pipelines import advanced
from ..scheduler import TileScheduler, longest_first_applies
from ..seqlen import SeqlenInfo, head_rows, packed_row_offset
from ..softmax import BackwardScales
from ..tile_work import QueryBlocks, TileWork
from .dq_accum import ROW, DqTiling, dq_tiled_mma, part_tile, register_order
from .fragments import QueryRowValues, acc_as_a_operand, acc_rows_view, stmatrix_copy, store_converted
from .tiles import L2_BUDGET_BYTES
from .wgmma import WARPGROUP_THREADS, WGMMA_M, WarpGroup, smem_layout, warpgroup_index, warpgroup_slice_thread, wgmma

NUM_CONSUMER_WARPGROUPS = 2
PRODUCER_REGISTERS, CONSUMER_REGISTERS = 24, 240
SMEM_BYTES_PER_BLOCK = 227 * 1024  # the most dynamic shared memory an sm90 block can opt into


# zero_kv_tail (fa4_kernels/kv_tail.py): a switch so that tests/cpu/test_kernels.py can build the kernel
# both ways and show what the fix adds; on in the shipped kernels.
ZERO_KV_TAIL = True


class Barrier(enum.IntEnum):
    """Named barrier ids (0 is __syncthreads). The *_FIRST ids are per consumer warpgroup: FIRST + w
    for consumer w's part of dQ."""

    DS = 1  # the consumers' shared dS tile
    DQ_FULL_FIRST = 2  # consumer w's dQ part is staged in shared memory
    DQ_EMPTY_FIRST = DQ_FULL_FIRST + NUM_CONSUMER_WARPGROUPS  # the writer warp has read it
    DKV = DQ_EMPTY_FIRST + NUM_CONSUMER_WARPGROUPS  # tma_store_dkv: K's/V's tiles free, then staged
    KV_TAIL = DKV + 1  # zero_kv_tail: the consumers have zeroed K's and V's rows past the keys


class Warp(enum.IntEnum):
    """Warps of the producer warpgroup (warp index in the CTA); its other two warps are idle."""

    LOAD = 0  # TMA loads of K, V, then Q, dO, LSE and rowsum per query block
    DQ_WRITER = 1  # TMA reduce-adds of the staged dQ parts into dq_accum


# A dQ part changes hands between its consumer warpgroup and the writer warp: both count.
DQ_HANDSHAKE_THREADS = WARPGROUP_THREADS + cute.arch.WARP_SIZE


class FlashAttentionBackwardSm90:
    def __init__(self, cfg: BackwardConfig):
        d, dv = cfg.head_dim, cfg.head_dim_v
        if cfg.split_head_dim:
            if not all(32 <= x <= 256 and x % 16 == 0 for x in (d, dv)):
                raise NotImplementedError(
                    f"sm90 backward (split head dim): head dims are multiples of 16 in [32, 256]; got {d}/{dv}")
        elif d != dv or not 32 <= d <= 128 or d % 16 != 0:
            raise NotImplementedError(
                f"sm90 backward: head_dim == head_dim_v, a multiple of 16 in [32, 128], or split_head_dim; "
                f"got {d}/{dv}")
        self.cfg = cfg
        self.dtype = CUTLASS_DTYPES[cfg.dtype]
        self.tile_m, self.tile_n = cfg.tile_m, cfg.tile_n
        self.hdim, self.hdim_v = d, dv
        self.split = cfg.split_head_dim
        self.num_stages = cfg.num_stages
        self.num_threads = WARPGROUP_THREADS * (1 + NUM_CONSUMER_WARPGROUPS)
        # dQ_i = dS K comes in two parts, one per consumer warpgroup, staged and reduce-added
        # separately: with 128-query blocks each warpgroup's 64 rows (a GEMM as wide as the head dim,
        # reading only its own half of dS), else its half of the head dim. A WGMMA's M is 64 rows, so
        # query blocks that are no multiple of 64 (80) compute dQ^T = K^T dS^T, the head dim as M.
        self.dq = DqTiling(self.tile_m, d)
        assert self.dq.parts_m * self.dq.parts_n == NUM_CONSUMER_WARPGROUPS

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
        cfg = self.cfg
        # Sequence first: (seq, d, head[, batch]) and (seq, head[, batch]); dq_accum (rows, 128,
        # head[, batch]), its rows the query blocks' (dq_accum.py).
        per_token = (mQ, mK, mV, mdO, mdK, mdV)
        if cutlass.const_expr(cfg.varlen):
            mQ, mK, mV, mdO, mdK, mdV = [
                cute.make_tensor(t.iterator, cute.select(t.layout, mode=[0, 2, 1])) for t in per_token]
            mLSE, mdPsum = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 0])) for t in (mLSE, mdPsum)]
            mdQacc = cute.make_tensor(mdQacc.iterator, cute.select(mdQacc.layout, mode=[1, 2, 0]))
            num_batch = mCuSeqlensQ.shape[0] - 1
        else:
            mQ, mK, mV, mdO, mdK, mdV = [
                cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0])) for t in per_token]
            mLSE, mdPsum = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 1, 0]))
                            for t in (mLSE, mdPsum)]
            mdQacc = cute.make_tensor(mdQacc.iterator, cute.select(mdQacc.layout, mode=[2, 3, 1, 0]))
            num_batch = mQ.shape[3]
        num_heads_kv = mK.shape[2]
        qhead_per_kvhead = mQ.shape[2] // num_heads_kv

        scales = BackwardScales.of(softmax_scale, softcap, cutlass.const_expr(cfg.has_softcap))

        K_major, MN_major = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        wgs = NUM_CONSUMER_WARPGROUPS
        d, dv = self.hdim, self.hdim_v
        if cutlass.const_expr(not self.split):
            # S^T = K Q^T and dP^T = V dO^T: keys are the M mode, one 64-key atom per consumer warpgroup.
            tiled_mma_sdp = sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, K_major, K_major, Float32,
                atom_layout_mnk=(wgs, 1, 1), tiler_mn=(WGMMA_M, self.tile_m))
            # dK += dS^T Q and dV += P^T dO: A from registers, B = Q / dO read N-major.
            tiled_mma_dk = tiled_mma_dv = sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, K_major, MN_major, Float32,
                atom_layout_mnk=(wgs, 1, 1), tiler_mn=(WGMMA_M, d), a_source=warpgroup.OperandSource.RMEM)
        else:
            # One 64-key tile for both warpgroups: S^T and dP^T split by query halves; dK and dV by
            # head-dim halves, A = dS^T / P^T from shared memory (all queries), B = Q / dO N-major.
            tiled_mma_sdp = sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, K_major, K_major, Float32,
                atom_layout_mnk=(1, wgs, 1), tiler_mn=(WGMMA_M, self.tile_m // wgs))
            tiled_mma_dk, tiled_mma_dv = [sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, K_major, MN_major, Float32,
                atom_layout_mnk=(1, wgs, 1), tiler_mn=(WGMMA_M, dim // wgs)) for dim in (d, dv)]
        # dQ = dS K, one part per warpgroup (__init__); dS is read from its (keys, queries) tile, M-major
        # (N-major as the B operand of dQ^T).
        tiled_mma_dq = dq_tiled_mma(self.dtype, self.dq)

        # Q and dO are B operands split between the warpgroups by head dim when split (dK, dV); K is
        # always (the dQ GEMM): the swizzle atom must tile each half.
        operand_split = wgs if self.split else 1
        sQ_layout = smem_layout(self.dtype, self.tile_m, d, self.num_stages, split=operand_split)
        sdO_layout = smem_layout(self.dtype, self.tile_m, dv, self.num_stages, split=operand_split)
        sK_layout = smem_layout(self.dtype, self.tile_n, d, split=wgs)
        sV_layout = smem_layout(self.dtype, self.tile_n, dv)
        # (keys, queries), as computed; sP too. Unsplit: two buffers, alternating by query block.
        sdS_layout = smem_layout(self.dtype, self.tile_n, self.tile_m, None if self.split else 2)
        # LSE and rowsum per stage. A TMA destination must be 128-byte aligned, so each stage starts
        # on a multiple of 32 floats (80-query blocks took a misaligned-address fault on the H200).
        sRow_layout = cute.make_layout((self.tile_m, self.num_stages), stride=(1, -(-self.tile_m // 32) * 32))
        # dQ staging, fp32 in register order: one buffer per part (the last mode), each one TMA box
        # of `values` rows of 128 floats, unswizzled (a warp's 128-bit stores are 512 contiguous bytes).
        dq_rows = self.dq.values
        sdQ_layout = cute.make_layout((dq_rows, ROW, wgs), stride=(ROW, 1, dq_rows * ROW))

        tma_load = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(
            tma_load, mQ, cute.select(sQ_layout, mode=[0, 1]), (self.tile_m, d))
        tma_atom_dO, tma_dO = cpasync.make_tiled_tma_atom(
            tma_load, mdO, cute.select(sdO_layout, mode=[0, 1]), (self.tile_m, dv))
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(tma_load, mK, sK_layout, (self.tile_n, d))
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(tma_load, mV, sV_layout, (self.tile_n, dv))
        tma_atom_LSE, tma_LSE = cpasync.make_tiled_tma_atom(
            tma_load, mLSE, cute.make_layout(self.tile_m), (self.tile_m,))
        tma_atom_dPsum, tma_dPsum = cpasync.make_tiled_tma_atom(
            tma_load, mdPsum, cute.make_layout(self.tile_m), (self.tile_m,))
        tma_atom_dQ, tma_dQ = cpasync.make_tiled_tma_atom(
            cpasync.CopyReduceBulkTensorTileS2GOp(), mdQacc, cute.select(sdQ_layout, mode=[0, 1]), (dq_rows, ROW))
        if cutlass.const_expr(cfg.dq_bulk_reduce):  # plain addresses, no tensor map
            tma_atom_dQ, tma_dQ = None, mdQacc
        # tma_store_dkv: dK and dV leave through K's and V's tiles, one TMA store each.
        tma_atom_dK = tma_atom_dV = None
        if cutlass.const_expr(cfg.tma_store_dkv):
            tma_store = cpasync.CopyBulkTensorTileS2GOp()
            tma_atom_dK, mdK = cpasync.make_tiled_tma_atom(tma_store, mdK, sK_layout, (self.tile_n, d))
            tma_atom_dV, mdV = cpasync.make_tiled_tma_atom(tma_store, mdV, sV_layout, (self.tile_n, dv))
        self.tma_bytes_kv = cute.size_in_bytes(self.dtype, sK_layout) + cute.size_in_bytes(self.dtype, sV_layout)
        # A stage's bytes: Q with its LSE rows, dO with its rowsum rows (separate_do_barrier: each
        # pair behind its own mbarrier, else all four behind one).
        self.tma_bytes_q = cute.size_in_bytes(self.dtype, cute.select(sQ_layout, mode=[0, 1])) + self.tile_m * 4
        self.tma_bytes_do = cute.size_in_bytes(self.dtype, cute.select(sdO_layout, mode=[0, 1])) + self.tile_m * 4
        self.tma_bytes_qdo = self.tma_bytes_q + self.tma_bytes_do

        sP_elements = cute.cosize(sdS_layout) if self.split else 0

        @cute.struct
        class SharedStorage:
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_qdo: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sRow_layout)], 128]
            sdPsum: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sRow_layout)], 128]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdO_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdS_layout)], 1024]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sdQ_layout)], 1024]
            # P^T goes through shared memory only when split (last: the other offsets stay put).
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, sP_elements], 1024]
            # dO's own mbarriers (separate_do_barrier; last, so that the other offsets stay put).
            mbar_do: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages if cfg.separate_do_barrier else 0]

        if cutlass.const_expr(SharedStorage.size_in_bytes() > SMEM_BYTES_PER_BLOCK):
            raise ValueError(f"sm90 backward: head dims {d}/{dv} with {self.num_stages} Q/dO stages need "
                             f"{SharedStorage.size_in_bytes()} bytes of shared memory, above the "
                             f"{SMEM_BYTES_PER_BLOCK} a block can have")
        self.shared_storage = SharedStorage
        num_n_blocks = (max_seqlen_k + self.tile_n - 1) // self.tile_n
        # A KV tile streams Q and dO of every query head sharing its KV head.
        qdo_bytes_per_head = mQ.shape[0] * (d + dv) * (self.dtype.width // 8) * qhead_per_kvhead
        scheduler = TileScheduler.create(
            num_n_blocks, num_heads_kv, num_batch, qdo_bytes_per_head,
            longest_first=cfg.longest_first and longest_first_applies(cfg),
            longest_block_last=False, l2_budget_bytes=L2_BUDGET_BYTES, min_group=cfg.longest_first_min_group,
            min_blocks=cfg.longest_first_min_blocks)
        self.kernel(
            tma_atom_Q, tma_Q, tma_atom_dO, tma_dO, tma_atom_K, tma_K, tma_atom_V, tma_V,
            tma_atom_LSE, tma_LSE, tma_atom_dPsum, tma_dPsum, tma_atom_dQ, tma_dQ,
            mdK, mdV, tma_atom_dK, tma_atom_dV, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mSemaphore,
            scales.softmax, scales.score, scales.log2, window_left, window_right, qhead_per_kvhead,
            sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout, sRow_layout, sdQ_layout,
            tiled_mma_sdp, tiled_mma_dk, tiled_mma_dv, tiled_mma_dq, scheduler,
        ).launch(grid=scheduler.grid(), block=[self.num_threads, 1, 1],
                 stream=stream, min_blocks_per_mp=1)

    # ------------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, tma_atom_Q: cute.CopyAtom, mQ: cute.Tensor, tma_atom_dO: cute.CopyAtom, mdO: cute.Tensor,
               tma_atom_K: cute.CopyAtom, mK: cute.Tensor, tma_atom_V: cute.CopyAtom, mV: cute.Tensor,
               tma_atom_LSE: cute.CopyAtom, mLSE: cute.Tensor, tma_atom_dPsum: cute.CopyAtom,
               mdPsum: cute.Tensor, tma_atom_dQ: Optional[cute.CopyAtom], mdQacc: cute.Tensor,
               mdK: cute.Tensor, mdV: cute.Tensor, tma_atom_dK: Optional[cute.CopyAtom],
               tma_atom_dV: Optional[cute.CopyAtom], mCuSeqlensQ: Optional[cute.Tensor],
               mCuSeqlensK: Optional[cute.Tensor], mSeqUsedK: Optional[cute.Tensor],
               mSemaphore: Optional[cute.Tensor], softmax_scale: Float32, score_prescale: Float32,
               scale_log2: Float32, window_left: Int32, window_right: Int32, qhead_per_kvhead: Int32,
               sQ_layout: cute.ComposedLayout, sdO_layout: cute.ComposedLayout,
               sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
               sdS_layout: cute.ComposedLayout, sRow_layout: cute.Layout, sdQ_layout: cute.Layout,
               tiled_mma_sdp: cute.TiledMma, tiled_mma_dk: cute.TiledMma, tiled_mma_dv: cute.TiledMma,
               tiled_mma_dq: cute.TiledMma, scheduler: TileScheduler):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == Warp.LOAD:
            for atom in (tma_atom_Q, tma_atom_dO, tma_atom_K, tma_atom_V, tma_atom_LSE, tma_atom_dPsum,
                         tma_atom_dQ, tma_atom_dK, tma_atom_dV):
                if cutlass.const_expr(atom is not None):
                    cpasync.prefetch_descriptor(atom)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        sP = sdS  # unused unless split
        if cutlass.const_expr(self.split):
            sP = storage.sP.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        smem = SharedTiles(
            q=storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner),
            do=storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner),
            k=storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner),
            v=storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner),
            p=sP, ds=sdS,
            dq=storage.sdQ.get_tensor(sdQ_layout),
            lse=storage.sLSE.get_tensor(sRow_layout), dpsum=storage.sdPsum.get_tensor(sRow_layout))

        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumers = pipeline.CooperativeGroup(
            pipeline.Agent.Thread, NUM_CONSUMER_WARPGROUPS * WARPGROUP_THREADS // cute.arch.WARP_SIZE)
        pipe_kv = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_kv.data_ptr(), num_stages=1, producer_group=producer,
            consumer_group=consumers, tx_count=self.tma_bytes_kv, defer_sync=True)
        # separate_do_barrier: pipe_qdo carries Q and LSE, pipe_do dO and rowsum (same stages).
        separate_do = self.cfg.separate_do_barrier
        pipe_qdo = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_qdo.data_ptr(), num_stages=self.num_stages, producer_group=producer,
            consumer_group=consumers, tx_count=self.tma_bytes_q if separate_do else self.tma_bytes_qdo,
            defer_sync=True)
        pipe_do = None
        if cutlass.const_expr(separate_do):
            pipe_do = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar_do.data_ptr(), num_stages=self.num_stages, producer_group=producer,
                consumer_group=consumers, tx_count=self.tma_bytes_do, defer_sync=True)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        n_block, head_kv, batch = scheduler.tile()
        seqlen = SeqlenInfo.create(batch, mQ.shape[0], mK.shape[0], mCuSeqlensQ, mCuSeqlensK, mSeqUsedK)
        # Varlen grids are sized for the longest key sequence; shorter ones leave CTAs idle.
        if n_block * self.tile_n < seqlen.seqlen_k:
            mask = AttentionMask(self.tile_m, self.tile_n, self.cfg.causal, self.cfg.local,
                                 window_left, window_right)
            m_block_min, m_block_max = mask.m_block_range(seqlen, n_block)
            blocks = QueryBlocks(head_kv * qhead_per_kvhead, m_block_min,
                                 cutlass.max(m_block_max - m_block_min, 0))
            work = TileWork(seqlen, mask, blocks, blocks.per_head * qhead_per_kvhead, n_block, head_kv, batch)

            warpgroup_idx = warpgroup_index(tidx)
            if warpgroup_idx == WarpGroup.PRODUCER:
                cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
                if warp_idx == Warp.DQ_WRITER:
                    self.write_dq(tma_atom_dQ, smem.dq, mdQacc, mSemaphore, work)
                if warp_idx == Warp.LOAD:
                    self.produce(tma_atom_Q, mQ, tma_atom_dO, mdO, tma_atom_K, mK, tma_atom_V, mV,
                                 tma_atom_LSE, mLSE, tma_atom_dPsum, mdPsum, smem, pipe_kv, pipe_qdo, pipe_do,
                                 work)
            else:
                cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
                consume = self.consume_split if cutlass.const_expr(self.split) else self.consume
                consume(tidx - WARPGROUP_THREADS, smem, Mmas(tiled_mma_sdp, tiled_mma_dk, tiled_mma_dv, tiled_mma_dq),
                        pipe_kv, pipe_qdo, pipe_do, KeyOutputs(mdK, mdV, tma_atom_dK, tma_atom_dV), work,
                        BackwardScales(softmax_scale, score_prescale, scale_log2))

    # ---- producer warp --------------------------------------------------------------------------
    @cute.jit
    def produce(self, tma_atom_Q, mQ, tma_atom_dO, mdO, tma_atom_K, mK, tma_atom_V, mV,
                tma_atom_LSE, mLSE, tma_atom_dPsum, mdPsum, smem: "SharedTiles", pipe_kv, pipe_qdo, pipe_do,
                work: "TileWork"):
        varlen = self.cfg.varlen
        seqlen, n_block, head_kv, batch = work.seqlen, work.n_block, work.head_kv, work.batch
        gK = cute.local_tile(head_rows(mK, seqlen.offset_k, head_kv, batch, varlen),
                             (self.tile_n, self.hdim), (n_block, 0))
        gV = cute.local_tile(head_rows(mV, seqlen.offset_k, head_kv, batch, varlen),
                             (self.tile_n, self.hdim_v), (n_block, 0))
        tKsK, tKgK = tma_partition_tile(tma_atom_K, smem.k, gK)
        tVsV, tVgV = tma_partition_tile(tma_atom_V, smem.v, gV)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        pipe_kv.producer_acquire(kv_state)
        cute.copy(tma_atom_K, tKgK, tKsK, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))
        cute.copy(tma_atom_V, tVgV, tVsV, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))

        rows_offset = seqlen.offset_q  # of this entry's LSE / rowsum rows
        if cutlass.const_expr(varlen):
            rows_offset = packed_row_offset(seqlen.offset_q, batch)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        for step in cutlass.range(work.num_steps, unroll=1):
            head, m_block = work.blocks.at(step)
            rows = (self.tile_m,)
            gQ = cute.local_tile(head_rows(mQ, seqlen.offset_q, head, batch, varlen), (self.tile_m, self.hdim),
                                 (m_block, 0))
            gdO = cute.local_tile(head_rows(mdO, seqlen.offset_q, head, batch, varlen), (self.tile_m, self.hdim_v),
                                  (m_block, 0))
            gLSE = cute.local_tile(head_rows(mLSE, rows_offset, head, batch, varlen), rows, (m_block,))
            gdPsum = cute.local_tile(head_rows(mdPsum, rows_offset, head, batch, varlen), rows, (m_block,))
            pipe_qdo.producer_acquire(state)
            barrier = pipe_qdo.producer_get_barrier(state)
            if cutlass.const_expr(pipe_do is None):
                for atom, tile, gmem, box_rank in ((tma_atom_Q, smem.q, gQ, 2), (tma_atom_dO, smem.do, gdO, 2),
                                                   (tma_atom_LSE, smem.lse, gLSE, 1),
                                                   (tma_atom_dPsum, smem.dpsum, gdPsum, 1)):
                    t_smem, t_gmem = tma_partition_tile(atom, tile, gmem, box_rank)
                    cute.copy(atom, t_gmem, t_smem[None, state.index], tma_bar_ptr=barrier)
            else:
                # Q and LSE first, behind their own barrier: S^T needs nothing else.
                for atom, tile, gmem, box_rank in ((tma_atom_Q, smem.q, gQ, 2), (tma_atom_LSE, smem.lse, gLSE, 1)):
                    t_smem, t_gmem = tma_partition_tile(atom, tile, gmem, box_rank)
                    cute.copy(atom, t_gmem, t_smem[None, state.index], tma_bar_ptr=barrier)
                pipe_do.producer_acquire(state)
                barrier_do = pipe_do.producer_get_barrier(state)
                for atom, tile, gmem, box_rank in ((tma_atom_dO, smem.do, gdO, 2),
                                                   (tma_atom_dPsum, smem.dpsum, gdPsum, 1)):
                    t_smem, t_gmem = tma_partition_tile(atom, tile, gmem, box_rank)
                    cute.copy(atom, t_gmem, t_smem[None, state.index], tma_bar_ptr=barrier_do)
            state = advanced(state)

    # ---- consumer warpgroups --------------------------------------------------------------------
    @cute.jit
    def zero_kv_tail(self, tidx, smem: "SharedTiles", work: "TileWork"):
        """Zero the KV tile's K and V rows past the sequence's keys (fa4_kernels/kv_tail.py): with
        varlen keys or seqused_k they are rows of the tensor that belong to no key of this sequence
        and may hold NaN, and although their scores are masked (P = 0), dP^T = V dO^T and dQ = dS K
        would multiply them (0 * NaN). Once per CTA, after the K/V tile's full barrier and before any
        GEMM reads it: all consumer threads share the stores, fence them for WGMMA (async proxy) and
        meet at one named barrier (every warpgroup's GEMMs read every row). Only in the tile that
        holds the key end; kernels without varlen or seqused_k are built without it (their keys end
        at the tensor's end, where TMA fills zeros)."""
        if cutlass.const_expr(ZERO_KV_TAIL and (self.cfg.varlen or self.cfg.has_seqused_k)):
            first_row = first_row_past_keys(work.seqlen.seqlen_k, work.n_block, self.tile_n)
            if first_row < self.tile_n:
                threads = NUM_CONSUMER_WARPGROUPS * WARPGROUP_THREADS
                zero_rows(smem.k, first_row, tidx, threads)
                zero_rows(smem.v, first_row, tidx, threads)
                cute.arch.fence_view_async_shared()
                cute.arch.barrier(barrier_id=int(Barrier.KV_TAIL), number_of_threads=threads)

    @cute.jit
    def consume(self, tidx, smem: "SharedTiles", mmas: "Mmas", pipe_kv, pipe_qdo, pipe_do, outputs: "KeyOutputs",
                work: "TileWork", scales: BackwardScales):
        """The unsplit layout: each warpgroup owns 64 keys and the whole head dim (mmas.dk serves dK
        and dV, as d == dv; smem.p and mmas.dv are unused)."""
        tiled_mma_dkv = mmas.dk
        wg_first = warpgroup_slice_thread(tidx)
        wg_dkv, thr_dkv = tiled_mma_dkv.get_slice(wg_first), tiled_mma_dkv.get_slice(tidx)
        scores = self.score_operands(mmas.sdp, tidx, smem)
        tQrdS, tQrKt, acc_dq_shape, tdQsdQ = self.dq_operands(mmas.dq, tidx, smem)
        # dV += P^T dO, dK += dS^T Q: A = P^T / dS^T from registers, B = dO^T / Q^T (d x queries),
        # N-major views.
        tVrdOt = wg_dkv.make_fragment_B(wg_dkv.partition_B(transpose_view(smem.do)))
        tKrQt = wg_dkv.make_fragment_B(wg_dkv.partition_B(transpose_view(smem.q)))
        acc_dK = thr_dkv.make_fragment_C(thr_dkv.partition_shape_C((self.tile_n, self.hdim)))
        acc_dV = thr_dkv.make_fragment_C(thr_dkv.partition_shape_C((self.tile_n, self.hdim)))
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)

        rP = cute.make_rmem_tensor(scores.acc_s.shape, self.dtype)
        rdS = cute.make_rmem_tensor(scores.acc_s.shape, self.dtype)
        # dS leaves the registers as 8x8 matrices (stmatrix.x4): 4 stores per 64 values.
        store_ds = stmatrix_copy(mmas.sdp, self.dtype).get_slice(tidx)
        tdSsdS, tdSrdS = store_ds.partition_D(smem.ds), store_ds.retile(rdS)

        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pipe_kv.consumer_wait(kv_state)
        self.zero_kv_tail(tidx, smem, work)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        for step in cutlass.range(work.num_steps, unroll=1):
            _, m_block = work.blocks.at(step)
            stage = state.index
            ds_groups = None
            if cutlass.const_expr(self.cfg.ds_store_by_group):
                ds_groups = DsGroups(store_ds, tdSrdS, store_ds.retile(scores.acc_dp),
                                     tdSsdS[None, None, None, step % 2])
            self.scores_and_gradients(pipe_qdo, pipe_do, state, mmas.sdp, scores, rP, rdS, smem, work, m_block,
                                      scales, ds_groups)
            wgmma(tiled_mma_dkv, acc_dV, acc_as_a_operand(rP), tVrdOt[None, None, None, stage], zero_init=False)

            # dQ needs every key of the tile: both warpgroups' dS go through shared memory, into
            # this block's buffer of two. The other warpgroup's dQ GEMM of the previous block read
            # the other buffer, and it had finished with this one before the previous step's barrier
            # (so ds_groups may store into it from the step's start).
            buffer = step % 2
            if cutlass.const_expr(ds_groups is None):
                cute.copy(store_ds, tdSrdS, tdSsdS[None, None, None, buffer])
            cute.arch.fence_view_async_shared()  # generic-proxy writes -> visible to WGMMA
            cute.arch.barrier(barrier_id=int(Barrier.DS), number_of_threads=NUM_CONSUMER_WARPGROUPS * WARPGROUP_THREADS)
            acc_dQ = cute.make_rmem_tensor(acc_dq_shape, Float32)
            self.dq_gemm(mmas.dq, acc_dQ, tQrdS[None, None, None, buffer], tQrKt)
            # dK after dQ: dQ's staging for the writer warp runs while dK's GEMM does.
            wgmma(tiled_mma_dkv, acc_dK, acc_as_a_operand(rdS), tKrQt[None, None, None, stage], zero_init=False)
            warpgroup.wait_group(1)  # dV and dQ done
            self.stage_dq(tidx, acc_dQ, tdQsdQ)
            warpgroup.wait_group(0)  # dK done: rdS and the stage are free
            pipe_qdo.consumer_release(state)
            if cutlass.const_expr(pipe_do is not None):
                pipe_do.consumer_release(state)
            state = advanced(state)

        self.finish(tidx, smem, pipe_kv, kv_state, tiled_mma_dkv, thr_dkv, acc_dK, thr_dkv, acc_dV, outputs, work,
                    scales)

    @cute.jit
    def consume_split(self, tidx, smem: "SharedTiles", mmas: "Mmas", pipe_kv, pipe_qdo, pipe_do,
                      outputs: "KeyOutputs", work: "TileWork", scales: BackwardScales):
        """The split layout (head dims above 128, d != dv): both warpgroups work on the CTA's 64 keys.
        Each computes S^T and dP^T for half of the query block, writes its half of P^T and dS^T to
        shared memory, and then, over all queries, its half of the head dim of dV, dK and dQ."""
        wg_first = warpgroup_slice_thread(tidx)
        wg_dk, thr_dk = mmas.dk.get_slice(wg_first), mmas.dk.get_slice(tidx)
        wg_dv, thr_dv = mmas.dv.get_slice(wg_first), mmas.dv.get_slice(tidx)
        # S^T and dP^T: this warpgroup's half of the query rows (the tiled MMA splits N).
        scores = self.score_operands(mmas.sdp, tidx, smem)
        tQrdS, tQrKt, acc_dq_shape, tdQsdQ = self.dq_operands(mmas.dq, tidx, smem)
        # dV += P^T dO, dK += dS^T Q: A = P^T / dS^T (keys x all queries) from shared memory, B =
        # this warpgroup's head-dim half of dO^T / Q^T.
        tVrP = wg_dv.make_fragment_A(wg_dv.partition_A(smem.p))
        tVrdOt = wg_dv.make_fragment_B(wg_dv.partition_B(transpose_view(smem.do)))
        tKrdS = wg_dk.make_fragment_A(wg_dk.partition_A(smem.ds))
        tKrQt = wg_dk.make_fragment_B(wg_dk.partition_B(transpose_view(smem.q)))
        acc_dK = thr_dk.make_fragment_C(thr_dk.partition_shape_C((self.tile_n, self.hdim)))
        acc_dV = thr_dv.make_fragment_C(thr_dv.partition_shape_C((self.tile_n, self.hdim_v)))
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)

        thr_sdp = mmas.sdp.get_slice(tidx)
        tdSsdS, tPsP = thr_sdp.partition_C(smem.ds), thr_sdp.partition_C(smem.p)
        rP = cute.make_rmem_tensor(scores.acc_s.shape, self.dtype)
        rdS = cute.make_rmem_tensor(scores.acc_s.shape, self.dtype)

        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pipe_kv.consumer_wait(kv_state)
        self.zero_kv_tail(tidx, smem, work)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        all_consumers = NUM_CONSUMER_WARPGROUPS * WARPGROUP_THREADS
        for step in cutlass.range(work.num_steps, unroll=1):
            _, m_block = work.blocks.at(step)
            stage = state.index
            self.scores_and_gradients(pipe_qdo, pipe_do, state, mmas.sdp, scores, rP, rdS, smem, work, m_block,
                                      scales)

            # The first barrier: the other warpgroup's GEMMs of the previous block have read sP and sdS.
            cute.arch.barrier(barrier_id=int(Barrier.DS), number_of_threads=all_consumers)
            tPsP.store(rP.load())
            tdSsdS.store(rdS.load())
            cute.arch.fence_view_async_shared()  # generic-proxy writes -> visible to WGMMA
            cute.arch.barrier(barrier_id=int(Barrier.DS), number_of_threads=all_consumers)
            wgmma(mmas.dv, acc_dV, tVrP, tVrdOt[None, None, None, stage], zero_init=False)
            wgmma(mmas.dk, acc_dK, tKrdS, tKrQt[None, None, None, stage], zero_init=False)
            acc_dQ = cute.make_rmem_tensor(acc_dq_shape, Float32)
            self.dq_gemm(mmas.dq, acc_dQ, tQrdS, tQrKt)
            warpgroup.wait_group(0)  # the stage, sP and sdS are free (for this warpgroup)
            pipe_qdo.consumer_release(state)
            if cutlass.const_expr(pipe_do is not None):
                pipe_do.consumer_release(state)
            state = advanced(state)
            self.stage_dq(tidx, acc_dQ, tdQsdQ)

        self.finish(tidx, smem, pipe_kv, kv_state, mmas.dk, thr_dk, acc_dK, thr_dv, acc_dV, outputs, work, scales)

    # ---- pieces both consumer layouts use ----------------------------------------------------------
    def score_operands(self, tiled_mma_sdp: cute.TiledMma, tidx, smem: "SharedTiles") -> "ScoreOperands":
        """S^T = K Q^T and dP^T = V dO^T for this thread's warpgroup."""
        wg = tiled_mma_sdp.get_slice(warpgroup_slice_thread(tidx))
        thr = tiled_mma_sdp.get_slice(tidx)
        acc_shape = thr.partition_shape_C((self.tile_n, self.tile_m))
        tScS = acc_rows_view(thr.partition_C(cute.make_identity_tensor((self.tile_n, self.tile_m))))
        return ScoreOperands(
            k=wg.make_fragment_A(wg.partition_A(smem.k)), q=wg.make_fragment_B(wg.partition_B(smem.q)),
            v=wg.make_fragment_A(wg.partition_A(smem.v)), do=wg.make_fragment_B(wg.partition_B(smem.do)),
            coords=tScS, acc_s=cute.make_rmem_tensor(acc_shape, Float32),
            acc_dp=cute.make_rmem_tensor(acc_shape, Float32))

    def dq_operands(self, tiled_mma_dq: cute.TiledMma, tidx, smem: "SharedTiles"):
        """dQ = dS K, this warpgroup's part: the dS (queries x keys) and K^T (d x keys) fragments,
        both transposed views of their tiles, the accumulator shape and this thread's elements of
        its part's staging buffer, in register order. Transposed, dQ^T = K^T dS^T: K^T is the A
        operand and dS the B."""
        wg = tiled_mma_dq.get_slice(warpgroup_slice_thread(tidx))
        thr = tiled_mma_dq.get_slice(tidx)
        ds, kt = transpose_view(smem.ds), transpose_view(smem.k)
        staged = smem.dq[None, None, warpgroup_index(tidx)].iterator
        if cutlass.const_expr(self.dq.transposed):
            ds_frag, kt_frag = wg.make_fragment_B(wg.partition_B(ds)), wg.make_fragment_A(wg.partition_A(kt))
            acc_shape = thr.partition_shape_C((self.hdim, self.tile_m))
        else:
            ds_frag, kt_frag = wg.make_fragment_A(wg.partition_A(ds)), wg.make_fragment_B(wg.partition_B(kt))
            acc_shape = thr.partition_shape_C((self.tile_m, self.hdim))
        return ds_frag, kt_frag, acc_shape, register_order(acc_shape, tidx % WARPGROUP_THREADS, staged)

    @cute.jit
    def dq_gemm(self, tiled_mma_dq: cute.TiledMma, acc_dQ: cute.Tensor, ds: cute.Tensor, kt: cute.Tensor):
        """acc_dQ = dS K, or dQ^T = K^T dS^T (transposed), issued as one WGMMA group."""
        if cutlass.const_expr(self.dq.transposed):
            wgmma(tiled_mma_dq, acc_dQ, kt, ds, zero_init=True)
        else:
            wgmma(tiled_mma_dq, acc_dQ, ds, kt, zero_init=True)

    @cute.jit
    def finish(self, tidx, smem: "SharedTiles", pipe_kv, kv_state, tiled_mma_dk: cute.TiledMma, thr_dk,
               acc_dK: cute.Tensor, thr_dv, acc_dV: cute.Tensor, outputs: "KeyOutputs", work: "TileWork",
               scales: BackwardScales):
        """After the last query block: K/V released, dK and dV written (the writer warp keeps the
        CTA, and so sdQ, alive until its last reduce-add has read it)."""
        pipe_kv.consumer_release(kv_state)
        if cutlass.const_expr(self.cfg.tma_store_dkv):
            self.store_dkv_by_tma(tidx, smem, tiled_mma_dk, acc_dK, acc_dV, outputs, work, scales.softmax)
        else:
            self.write_dkv(thr_dk, acc_dK, thr_dv, acc_dV, outputs.dk, outputs.dv, work, scales.softmax)

    @cute.jit
    def scores_and_gradients(self, pipe_qdo, pipe_do, state, tiled_mma_sdp: cute.TiledMma, scores: "ScoreOperands",
                             rP: cute.Tensor, rdS: cute.Tensor, smem: "SharedTiles", work: "TileWork",
                             m_block: Int32, scales: BackwardScales, ds_groups: Optional["DsGroups"] = None):
        """The first half of a step, the same in both layouts: once the query block's stage has
        landed, S^T and dP^T, then P^T (rP, and scores.acc_s), the first exp_eighths_under_dp of it
        while dP^T still runs, then dS^T (rdS; with ds_groups, converted and stored to shared
        memory a stmatrix at a time as its columns are done)."""
        stage = state.index
        pipe_qdo.consumer_wait(state)
        self.issue_scores(tiled_mma_sdp, scores, stage, pipe_do, state)
        # LSE (and below, rowsum) loaded under the GEMMs (query_row says how).
        lse = self.query_row(scores.coords, smem.lse[None, stage])
        warpgroup.wait_group(1)  # S^T is in; dP^T keeps running under the exponentials
        # P^T for the first exp_eighths_under_dp of the thread's query columns while dP^T runs; the
        # other columns' P^T after dP^T, each followed by its dS^T, so that their MUFU exponentials
        # and FMA-pipe gradients can interleave.
        columns = cute.size(acc_rows_view(scores.acc_s), mode=[1])
        under_dp = columns * self.cfg.exp_eighths_under_dp // 8
        # Most blocks need no element-wise mask: only those on a mask edge or the sequence's end pay
        # (one_step_body: every block takes the masked step, one copy of the step's code).
        full = False
        if cutlass.const_expr(not self.cfg.one_step_body):
            full = work.mask.block_is_full(work.seqlen, m_block, work.n_block)
        if full:
            self.probabilities(scores, rP, lse, work, m_block, scales, False, 0, under_dp)
        else:
            self.probabilities(scores, rP, lse, work, m_block, scales, True, 0, under_dp)
        convert_p_early = not self.cfg.has_softcap and under_dp == columns
        if cutlass.const_expr(convert_p_early):
            rP.store(scores.acc_s.load().to(self.dtype))
        dpsum = self.query_row(scores.coords, smem.dpsum[None, stage])
        warpgroup.wait_group(0)  # dP^T is in
        if cutlass.const_expr(under_dp < columns):
            if full:
                self.probabilities_then_gradients(scores, rP, lse, dpsum, work, m_block, scales, False, under_dp,
                                                  columns, ds_groups)
            else:
                self.probabilities_then_gradients(scores, rP, lse, dpsum, work, m_block, scales, True, under_dp,
                                                  columns, ds_groups)
        self.score_gradients(scores, dpsum, 0, under_dp, ds_groups, under_dp)
        if cutlass.const_expr(not convert_p_early and not self.cfg.has_softcap):
            rP.store(scores.acc_s.load().to(self.dtype))
        if cutlass.const_expr(ds_groups is None):
            rdS.store(scores.acc_dp.load().to(self.dtype))

    @cute.jit
    def probabilities_then_gradients(self, scores: "ScoreOperands", rP: cute.Tensor, lse: QueryRowValues,
                                     dpsum: QueryRowValues, work: "TileWork", m_block: Int32,
                                     scales: BackwardScales, masked: cutlass.Constexpr[bool],
                                     first: cutlass.Constexpr[int], end: cutlass.Constexpr[int],
                                     ds_groups: Optional["DsGroups"] = None):
        """P^T and then dS^T, column by column, for the thread's query columns [first, end): those
        past P^T's share under dP^T, computed before the columns below ``first``."""
        for c in cutlass.range_constexpr(first, end):
            self.probabilities(scores, rP, lse, work, m_block, scales, masked, c, c + 1)
            self.score_gradients(scores, dpsum, c, c + 1, ds_groups, first)

    def query_row(self, coords: cute.Tensor, row: cute.Tensor) -> QueryRowValues:
        """A stage's LSE or rowsum row at this thread's score columns: in registers at 64-query
        blocks (16 columns); at longer blocks, where a register per column would spill, by warp
        shuffle (query_rows_by_shuffle) or from shared memory at each use."""
        if self.tile_m == WGMMA_M:
            return QueryRowValues.per_column(row, coords)
        if self.cfg.query_rows_by_shuffle:
            return QueryRowValues.by_shuffle(row, coords, self.tile_m)
        return QueryRowValues.from_smem(row, coords)

    @cute.jit
    def score_gradients(self, scores: "ScoreOperands", dpsum: QueryRowValues,
                        first: cutlass.Constexpr[int], end: cutlass.Constexpr[int],
                        ds_groups: Optional["DsGroups"] = None, under_dp: cutlass.Constexpr[int] = 0):
        """dS^T = acc_s * (dP^T - rowsum) without the softmax scale (dK's epilogue applies it), into
        acc_dp in fp32, for the thread's query columns [first, end). With ds_groups, each stmatrix
        group leaves for shared memory after its last column (the columns from under_dp on are
        computed before those below it)."""
        dS_rows, dP_rows = acc_rows_view(scores.acc_s), acc_rows_view(scores.acc_dp)
        for c in cutlass.range_constexpr(first, end):
            rowsum = dpsum.at(c)
            for r in cutlass.range_constexpr(cute.size(dP_rows, mode=[0])):
                dP_rows[r, c] = dS_rows[r, c] * (dP_rows[r, c] - rowsum)
            if cutlass.const_expr(ds_groups is not None):
                group = ds_groups.completed_by(c, under_dp)
                if cutlass.const_expr(group is not None):
                    ds_groups.store(group)

    @cute.jit
    def issue_scores(self, tiled_mma_sdp: cute.TiledMma, scores: "ScoreOperands", stage: Int32, pipe_do, state):
        """S^T = K Q^T and dP^T = V dO^T of the query block in ``stage``, as two WGMMA groups (S^T
        first, so that it can be waited for alone); with dO behind its own barrier (pipe_do), dP^T
        once dO has landed."""
        wgmma(tiled_mma_sdp, scores.acc_s, scores.k, scores.q[None, None, None, stage], zero_init=True)
        if cutlass.const_expr(pipe_do is not None):
            pipe_do.consumer_wait(state)
        wgmma(tiled_mma_sdp, scores.acc_dp, scores.v, scores.do[None, None, None, stage], zero_init=True)

    @cute.jit
    def probabilities(self, scores: "ScoreOperands", rP: cute.Tensor, lse_row: QueryRowValues,
                      work: "TileWork", m_block: Int32, scales: BackwardScales,
                      masked: cutlass.Constexpr[bool], first: cutlass.Constexpr[int], end: cutlass.Constexpr[int]):
        """P^T from S^T for the thread's query columns [first, end); with ``masked``, entries the
        mask hides and rows past the sequence 0. scores.acc_s keeps, in fp32, what dS^T = acc_s * (dP^T - rowsum) needs: P, or P * (1 -
        tanh^2) under softcap, where rP gets P itself in the input dtype (without softcap the caller
        converts acc_s)."""
        tScS, seqlen = scores.coords, work.seqlen
        s_rows = acc_rows_view(scores.acc_s)
        p_rows = acc_rows_view(rP)
        # Bounds in absolute keys (key_bounds at KV block 0) against the thread's key rows plus the
        # KV block's first key, added once: relative to the block, each column's bound took a
        # subtraction (d=128: 40 fewer instructions per masked step). Not at 128-query blocks (32
        # columns per thread), where it spilled 6 registers at d=64 causal; not under softcap.
        absolute = masked and not self.cfg.has_softcap and self.tile_m != 128
        for c in cutlass.range_constexpr(first, end):
            if cutlass.const_expr(masked):
                row = m_block * self.tile_m + tScS[0, c][1]
                lo, hi = work.mask.key_bounds(seqlen, row, Int32(0) if absolute else work.n_block)
                if row >= seqlen.seqlen_q:
                    hi = lo  # no key
            lse = lse_row.at(c)
            for r in cutlass.range_constexpr(cute.size(s_rows, mode=[0])):
                key = tScS[r, 0][0]
                if cutlass.const_expr(absolute):
                    key = work.n_block * self.tile_n + key
                score = s_rows[r, c]
                if cutlass.const_expr(self.cfg.has_softcap):
                    score = cute.math.tanh(score * scales.score, fastmath=True)
                exponent = score * scales.log2 - lse
                if cutlass.const_expr(masked and not self.cfg.has_softcap):
                    # The exponent to -inf by a select (any sign of the scale): a branch per score
                    # (mask.apply says why) or a select of P after the exponential cost a second
                    # FSEL per score or spills. The left bound only with a window: otherwise
                    # lo <= 0 <= key (a row past the sequence has hi = lo).
                    keep = key < hi
                    if cutlass.const_expr(self.cfg.local):
                        keep = keep & (key >= lo)
                    exponent = Float32(cutlass.select_(keep, exponent, -Float32.inf))
                if cutlass.const_expr(not masked and emulated(c, self.cfg.exp2_emulated_eighths)):
                    p = exp2_fma(exponent)  # finite here: -inf exponents only come from the mask
                else:
                    p = cute.math.exp2(exponent, fastmath=True)
                if cutlass.const_expr(masked and self.cfg.has_softcap):
                    # After the exponential: tanh(-inf) would give P > 0. A branch here spills less
                    # than a select under softcap's extra live values.
                    if key >= hi or key < lo:
                        p = Float32(0.0)
                if cutlass.const_expr(self.cfg.has_softcap):
                    p_rows[r, c] = p.to(self.dtype)
                    s_rows[r, c] = p * (Float32(1.0) - score * score)
                else:
                    s_rows[r, c] = p

    @cute.jit
    def stage_dq(self, tidx, acc_dQ: cute.Tensor, tdQsdQ: cute.Tensor):
        """This warpgroup's part of the KV tile's dQ (unscaled) into its shared-memory buffer, once
        the writer warp has read the previous one, and signalled to the writer warp (write_dq)."""
        part = warpgroup_index(tidx)
        handshake = DQ_HANDSHAKE_THREADS
        cute.arch.barrier(barrier_id=Barrier.DQ_EMPTY_FIRST + part, number_of_threads=handshake)
        tdQsdQ.store(acc_dQ.load())
        cute.arch.fence_view_async_shared()  # generic-proxy writes -> visible to the TMA
        cute.arch.barrier_arrive(barrier_id=Barrier.DQ_FULL_FIRST + part, number_of_threads=handshake)

    @cute.jit
    def write_dq(self, tma_atom_dQ: cute.CopyAtom, sdQ: cute.Tensor, mdQacc: cute.Tensor,
                 mSemaphore: Optional[cute.Tensor], work: "TileWork"):
        """The dQ writer warp: per query block, as each consumer warpgroup's part of dQ lands in
        shared memory (DQ_FULL), one TMA reduce-add of it; the part's buffer is handed back
        (DQ_EMPTY) once the TMA has read it. Both buffers start free. The warp returns only once
        every reduce-add has read shared memory, which keeps the CTA (and sdQ) alive until then."""
        handshake = DQ_HANDSHAKE_THREADS
        num_steps = work.num_steps
        if num_steps > 0:  # arrivals match the consumers' waits one for one
            for part in cutlass.range_constexpr(NUM_CONSUMER_WARPGROUPS):
                cute.arch.barrier_arrive(barrier_id=Barrier.DQ_EMPTY_FIRST + part, number_of_threads=handshake)
        for step in cutlass.range(num_steps, unroll=1):
            head, m_block = work.blocks.at(step)
            for part in cutlass.range_constexpr(NUM_CONSUMER_WARPGROUPS):
                cute.arch.barrier(barrier_id=Barrier.DQ_FULL_FIRST + part, number_of_threads=handshake)
                self.add_dq(part, tma_atom_dQ, sdQ, mdQacc, mSemaphore, work, head, m_block)
            for part in cutlass.range_constexpr(NUM_CONSUMER_WARPGROUPS):
                # Bulk groups complete in order: this part's reduce-add has read its buffer.
                cute.arch.cp_async_bulk_wait_group(NUM_CONSUMER_WARPGROUPS - 1 - part, read=True)
                if step + 1 < num_steps:  # no consumer waits after the last block
                    cute.arch.barrier_arrive(barrier_id=Barrier.DQ_EMPTY_FIRST + part, number_of_threads=handshake)

    @cute.jit
    def add_dq(self, part, tma_atom_dQ: cute.CopyAtom, sdQ: cute.Tensor, mdQacc: cute.Tensor,
               mSemaphore: Optional[cute.Tensor], work: "TileWork", head: Int32, m_block: Int32):
        """One TMA reduce-add of the staged dQ part ``part`` into dq_accum, issued by the calling warp
        (TMA copies are warp-collective: one lane is elected inside) and committed as a bulk group."""
        batch = work.batch
        gdQ = part_tile(mdQacc, self.dq, work.seqlen.offset_q, head, batch, self.cfg.varlen, m_block, part)
        t_smem, t_gmem = sdQ[None, None, part], gdQ  # dq_bulk_reduce: the part's two ends
        if cutlass.const_expr(not self.cfg.dq_bulk_reduce):
            t_smem, t_gmem = tma_partition_tile(tma_atom_dQ, sdQ[None, None, part], gdQ)
        if cutlass.const_expr(self.cfg.deterministic):
            # Reduce-adds into one (query block, part) happen in KV-tile order: wait for the
            # tiles before this one, add, and count this one once its add has landed.
            lock = mSemaphore.iterator + cute.crd2idx((batch, head, m_block, part), mSemaphore.layout)
            n_block_first, _ = work.mask.n_block_range(work.seqlen, m_block)
            done = Int32(-1)
            while done != work.n_block - n_block_first:
                done = cute.arch.load(lock, Int32, sem="acquire", scope="gpu")
            cute.arch.fence_proxy("async.global")
            self.reduce_add_part(tma_atom_dQ, t_smem, t_gmem)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0)
            cute.arch.fence_proxy("async.global")
            if cute.arch.lane_idx() == 0:
                cute.arch.red(lock, Int32(1), op="add", dtype="s32", sem="release", scope="gpu")
        else:
            self.reduce_add_part(tma_atom_dQ, t_smem, t_gmem)
            cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def reduce_add_part(self, tma_atom_dQ: Optional[cute.CopyAtom], t_smem: cute.Tensor, t_gmem: cute.Tensor):
        """The staged part added into its dq_accum rows, by the calling warp, into its bulk group: a
        2-D TMA tensor reduce (the copy elects a lane), or with dq_bulk_reduce one 1-D bulk reduce
        (no tensor map) of the part's bytes, issued by lane 0: both ends are contiguous (``values``
        rows of 128 floats, register order)."""
        if cutlass.const_expr(self.cfg.dq_bulk_reduce):
            if cute.arch.lane_idx() == 0:
                cp_reduce_async_bulk_global_shared_cta(t_gmem.iterator, t_smem.iterator, self.dq.values * ROW * 4,
                                                       type=CpReduceType.F32)
        else:
            cute.copy(tma_atom_dQ, t_smem, t_gmem)

    @cute.jit
    def write_dkv(self, thr_dk, acc_dK: cute.Tensor, thr_dv, acc_dV: cute.Tensor, mdK: cute.Tensor,
                  mdV: cute.Tensor, work: "TileWork", softmax_scale: Float32):
        """dK (times the softmax scale) and dV of the tile, in the input dtype, keys inside the sequence."""
        varlen = self.cfg.varlen
        seqlen, n_block = work.seqlen, work.n_block
        keys_left = seqlen.seqlen_k - n_block * self.tile_n
        for acc, thr, scale, mOut, dim in ((acc_dK, thr_dk, softmax_scale, mdK, self.hdim),
                                           (acc_dV, thr_dv, Float32(1.0), mdV, self.hdim_v)):
            tile = (self.tile_n, dim)
            gmem = thr.partition_C(cute.local_tile(head_rows(mOut, seqlen.offset_k, work.head_kv, work.batch, varlen),
                                                   tile, (n_block, 0)))
            coords = thr.partition_C(cute.make_identity_tensor(tile))
            out = cute.make_rmem_tensor(acc.shape, self.dtype)
            out.store((acc.load() * scale).to(self.dtype))
            for i in cutlass.range_constexpr(cute.size(out)):
                if coords[i][0] < keys_left:
                    gmem[i] = out[i]

    @cute.jit
    def store_dkv_by_tma(self, tidx, smem: "SharedTiles", tiled_mma_dkv: cute.TiledMma, acc_dK: cute.Tensor,
                         acc_dV: cute.Tensor, outputs: "KeyOutputs", work: "TileWork", softmax_scale: Float32):
        """tma_store_dkv (unsplit layout, batched): dK (times the softmax scale) and dV into K's and
        V's shared-memory tiles with stmatrix, then one TMA store each, which clips the keys past the
        sequence. K is free only once both warpgroups' GEMMs have retired (every dQ GEMM reads all
        of the tile's keys), hence the barrier before the first write. The issuing warp waits until
        the TMA has read the tiles, so that the CTA outlives them."""
        all_consumers = NUM_CONSUMER_WARPGROUPS * WARPGROUP_THREADS
        cute.arch.barrier(barrier_id=int(Barrier.DKV), number_of_threads=all_consumers)
        store = stmatrix_copy(tiled_mma_dkv, self.dtype).get_slice(tidx)
        acc_dK.store(acc_dK.load() * softmax_scale)
        for acc, tile in ((acc_dK, smem.k), (acc_dV, smem.v)):
            out = cute.make_rmem_tensor(acc.shape, self.dtype)
            store_converted(out, acc)
            cute.copy(store, store.retile(out), store.partition_D(tile))
        cute.arch.fence_view_async_shared()  # generic-proxy writes -> visible to the TMA
        cute.arch.barrier(barrier_id=int(Barrier.DKV), number_of_threads=all_consumers)
        if cute.arch.make_warp_uniform(tidx // cute.arch.WARP_SIZE) == 0:
            for atom, mOut, tile, dim in ((outputs.tma_atom_dk, outputs.dk, smem.k, self.hdim),
                                          (outputs.tma_atom_dv, outputs.dv, smem.v, self.hdim_v)):
                gOut = cute.local_tile(head_rows(mOut, Int32(0), work.head_kv, work.batch, False),
                                       (self.tile_n, dim), (work.n_block, 0))
                t_smem, t_gmem = tma_partition_tile(atom, tile, gOut)
                cute.copy(atom, t_smem, t_gmem)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)


@dataclass(frozen=True)
class SharedTiles:
    """The CTA's shared-memory tensors: Q, dO, LSE and rowsum with a trailing stage mode; dS with
    two buffers (unsplit layout); dQ staging with one buffer per consumer warpgroup's part."""

    q: cute.Tensor
    do: cute.Tensor
    k: cute.Tensor
    v: cute.Tensor
    p: cute.Tensor  # P^T (split layout only; otherwise an alias of ds)
    ds: cute.Tensor
    dq: cute.Tensor
    lse: cute.Tensor
    dpsum: cute.Tensor


@dataclass(frozen=True)
class KeyOutputs:
    """Where dK and dV go: the global tensors (their TMA views with tma_store_dkv) and the TMA
    store atoms (tma_store_dkv only, else None)."""

    dk: cute.Tensor
    dv: cute.Tensor
    tma_atom_dk: Optional[cute.CopyAtom]
    tma_atom_dv: Optional[cute.CopyAtom]


@dataclass(frozen=True)
class Mmas:
    """The tiled WGMMAs: S^T and dP^T (sdp), dK, dV (the same as dk when unsplit) and dQ."""

    sdp: cute.TiledMma
    dk: cute.TiledMma
    dv: cute.TiledMma
    dq: cute.TiledMma


@dataclass(frozen=True)
class DsGroups:
    """dS^T on its way to this block's shared-memory buffer a stmatrix.x4 at a time
    (BackwardConfig.ds_store_by_group): the tiled copy, the 16-bit and fp32 (acc_dp) fragments in
    its register view, the buffer's partition. One stmatrix.x4 takes 8 values of a thread: two
    8-column groups of the accumulator, i.e. the thread's query columns [4g, 4g + 4) (acc_rows_view).
    Columns are computed in two runs, [under_dp, end) and then [0, under_dp)
    (exp_eighths_under_dp), so a group is complete after the last of its columns in that order."""

    copy: cute.TiledCopy
    regs: cute.Tensor
    acc: cute.Tensor
    smem: cute.Tensor

    COLUMNS = 4  # a thread's query columns per stmatrix.x4

    def completed_by(self, column: int, under_dp: int) -> Optional[int]:
        """The group whose last column in computing order is ``column``, if any (trace time)."""
        group = column // self.COLUMNS
        first, end = group * self.COLUMNS, (group + 1) * self.COLUMNS
        if first >= under_dp:  # all in the later-computed run
            return group if column == end - 1 else None
        return group if column == min(end, under_dp) - 1 else None

    @cute.jit
    def store(self, group: cutlass.Constexpr[int]):
        regs = self.regs[(None, group), None, None]
        regs.store(self.acc[(None, group), None, None].load().to(regs.element_type))
        cute.copy(self.copy, regs, self.smem[(None, group), None, None])


@dataclass(frozen=True)
class ScoreOperands:
    """S^T = K Q^T and dP^T = V dO^T for one thread: the A (K, V) and B (Q, dO; last mode the stage)
    fragments, the (key, query) coordinate of each accumulator element, the two fp32 accumulators."""

    k: cute.Tensor
    q: cute.Tensor
    v: cute.Tensor
    do: cute.Tensor
    coords: cute.Tensor
    acc_s: cute.Tensor
    acc_dp: cute.Tensor
