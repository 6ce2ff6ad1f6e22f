"""FlashAttention forward for Hopper (sm_90a).

One CTA computes one (tile_m x head_dim_v) output tile of one head, with 64 query rows per consumer
warpgroup (tile_m = 128: two consumers; 192: three; 64: one, without ping-pong, an A/B variant for
decoding, where a tile holds a few real rows); or, with ``persistent_ctas``, a grid of at most
that many CTAs each computes a strided series of tiles, its pipelines running on from one to the next:

    warpgroup 0    producer   one warp issues TMA loads: Q once, then K_j and V_j for every KV
                              block j into a ``num_stages``-deep ring of shared-memory buffers
    warpgroup 1..  consumers  S_j = Q K_j^T (WGMMA, both operands in shared memory), mask, online
                              softmax, O += P_j V_j (WGMMA, P from registers), then the epilogue

Synchronisation: three mbarrier pipelines (Q, K, V). The producer waits on a stage's "empty"
barrier before reloading it and the TMA unit completes its "full" barrier; consumers wait on "full"
and release "empty" as soon as the WGMMA that read the stage has retired. K and V have separate
pipelines so that S = Q K^T can start before V has landed.

Overlap inside a consumer: S_j = Q K_j^T and O += P_{j+1} V_{j+1} are issued back to back and the
softmax of S_j runs while P V is still on the tensor cores (P of the previous block is kept in
registers). Overlap between consumers (ping-pong, optional): named barriers hand the right to issue
GEMMs from one warpgroup to the next, so one's softmax runs under another's GEMMs.

The first block of a tile can reach past the sequence's keys into rows of the tensor that hold
anything (fa4_kernels/kv_tail.py): the consumers zero V's rows there after V's full barrier, fence
them for WGMMA and meet at one named barrier before any P @ V (zero_v_tail; only kernels with
varlen, seqused_k or pages build it).

GQA packing (``pack_gqa``): the query heads of a KV head are rows of its tiles, token by token; a
ratio that 64 does not divide runs in padded groups (``pack_gqa_heads``, fa4_kernels/layouts.py
QueryPacking) whose dummy rows Q's TMA load fills with zeros and the epilogue never stores.

KV blocks are visited from the last to the first: blocks that cross the right mask edge (sequence
end, causal diagonal) come first, then full blocks in a loop with no mask code, then (local) blocks
that cross the left window edge.

The producer gives registers up (setmaxnreg) so that the consumers can hold S, P and O at once.

Split-KV (``split_kv``): the grid's head mode holds head * num_splits + split (scheduler.KVSplits);
a CTA walks only its split's share of the tile's KV blocks and stores O normalised over those keys
alone, as float32 from the accumulator layout, with their LSE, into its split's slice of the partial
buffers (an empty share stores O = 0, LSE = -inf like a tile that sees no key); fa4_kernels/combine.py
merges them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import partial
from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup

from ..config import ForwardConfig
from ..dtypes import CUTLASS_DTYPES
from ..kv_tail import first_row_past_keys, tail_possible, zero_rows
from ..layouts import QueryPacking, last_mode_slice, tma_partition_tile, transpose_view
from ..mask import AttentionMask
from ..paged_kv import PagedKV, kernel_view, rows_per_copy
from ..pipelines import advanced
from ..scheduler import KVSplits, TileScheduler, longest_first_applies
from ..seqlen import SeqlenInfo, head_rows
from ..softmax import OnlineSoftmax, exp2_rows, score_scales
from ..tile_work import OutputTile
from .fragments import THREADS_PER_ROW, acc_as_a_operand, acc_rows_view, stmatrix_copy, store_converted
from .tiles import L2_BUDGET_BYTES
from .wgmma import (WARPGROUP_THREADS, WGMMA_M, WarpGroup, mma_k_multiple, smem_layout, warpgroup_index,
                    warpgroup_slice_thread, wgmma)

# setmaxnreg budgets (producer, each consumer) by consumer warpgroup count: the 64K-register file
# split over 128 producer threads and 128 threads per consumer warpgroup (one consumer: the budget of
# two, not tuned; the file would hold more).
REGISTERS = {1: (24, 240), 2: (24, 240), 3: (32, 160)}
MAX_CONSUMER_WARPGROUPS = max(REGISTERS)
# The producer warpgroup's warp that issues the TMA loads (and prefetches their descriptors).
LOAD_WARP = 0
# Paged KV: K/V tiles of at most this many page boxes read their page-table entries before waiting
# for a free stage (produce_kv_paged). 5 keeps the d = 256 tiles (80 keys: five 16-row boxes) there:
# read box by box, their producer spilled more (ptxas 13.4: 47 instead of 23 stores at page 16, 130
# instead of 23 at page 64; it spills either way, docs/perf.md).
PREFETCHED_PAGE_BOXES = 5


class Barrier(enum.IntEnum):
    """Named barrier ids (0 is __syncthreads). The *_FIRST ids are per consumer warpgroup: FIRST + w
    for consumer w, one id for each of up to MAX_CONSUMER_WARPGROUPS."""

    PINGPONG_FIRST = 1  # 1, 2 (and 3): consumer w's turn to issue its GEMMs
    # tma_store_o: 4, 5 (and 6) hold each warpgroup's TMA store until its O tile is in shared memory
    EPILOGUE_FIRST = PINGPONG_FIRST + MAX_CONSUMER_WARPGROUPS
    # tma_store_o with O staged in Q's buffer: every consumer warpgroup is past its GEMMs
    Q_FREE = EPILOGUE_FIRST + MAX_CONSUMER_WARPGROUPS
    # zero_v_tail: every consumer warpgroup has zeroed its share of the last KV block's V rows
    V_TAIL = Q_FREE + 1


# A GEMM turn is handed from one warpgroup (arriving) to the next (waiting): both count.
PINGPONG_THREADS = 2 * WARPGROUP_THREADS
SMEM_BYTES_PER_BLOCK = 227 * 1024  # the most dynamic shared memory an sm90 block can opt into
SMEM_RESERVED_BYTES = 4 * 1024  # beside the tiles: mbarriers, alignment


class FlashAttentionForwardSm90:
    def __init__(self, cfg: ForwardConfig):
        if cfg.tile_m not in (64, 128, 192):
            raise ValueError(f"sm90 forward: tile_m must be 64, 128 or 192 (64 rows per consumer warpgroup), got "
                             f"{cfg.tile_m}")
        if cfg.tile_n % 16 != 0:
            raise ValueError(f"sm90 forward: tile_n must be a multiple of 16, got {cfg.tile_n}")
        self.cfg = cfg
        self.packing = QueryPacking.of(cfg)
        self.dtype = CUTLASS_DTYPES[cfg.dtype]
        # What O is stored as: the input dtype, or float32 split-KV partials.
        self.o_dtype = Float32 if cfg.split_kv else self.dtype
        self.tile_m, self.tile_n = cfg.tile_m, cfg.tile_n
        self.hdim, self.hdim_v = cfg.head_dim, cfg.head_dim_v
        # A WGMMA reduces 16 bf16/fp16 columns at a time, so Q, K and V tiles are 16-column multiples
        # wide: TMA fills the columns past the head dim with zeros (they add nothing to Q K^T and make
        # O columns that are never stored).
        self.hdim_tile, self.hdim_v_tile = mma_k_multiple(self.hdim), mma_k_multiple(self.hdim_v)
        self.num_stages = cfg.num_stages
        self.num_consumer_wg = cfg.tile_m // WGMMA_M
        self.producer_regs, self.consumer_regs = REGISTERS[self.num_consumer_wg]
        self.num_threads = WARPGROUP_THREADS * (1 + self.num_consumer_wg)

    # ------------------------------------------------------------------------------------------
    # Host side: views, MMAs, shared-memory layouts, TMA descriptors, launch
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (b, sq, hq, d) or (total_q, hq, d)
        mK: cute.Tensor,  # (b, sk, hk, d) or (total_k, hk, d)
        mV: cute.Tensor,  # (b, sk, hk, dv) or (total_k, hk, dv)
        mO: cute.Tensor,  # like mQ with dv; split_kv: (num_splits, ...) float32
        mLSE: cute.Tensor,  # (b, hq, sq) or (hq, total_q), float32; split_kv: (num_splits, ...)
        mCuSeqlensQ: Optional[cute.Tensor],
        mCuSeqlensK: Optional[cute.Tensor],
        mSeqUsedQ: Optional[cute.Tensor],
        mSeqUsedK: Optional[cute.Tensor],
        mPageTable: Optional[cute.Tensor],  # (b, max_pages) int32 with a paged cache (cfg.page_size)
        mSink: Optional[cute.Tensor],
        softmax_scale: Float32,
        softcap: Float32,
        window_left: Int32,
        window_right: Int32,
        max_seqlen_q: Int32,
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        splits = None
        if cutlass.const_expr(cfg.split_kv):
            # Partials: the leading split mode goes last, where the kernel slices a CTA's split
            # off; what remains is laid out like the unsplit O and LSE.
            splits = KVSplits(mO.shape[0])
            rank_o, rank_lse = cute.rank(mO), cute.rank(mLSE)
            mO = cute.make_tensor(mO.iterator, cute.select(mO.layout, mode=[*range(1, rank_o), 0]))
            mLSE = cute.make_tensor(mLSE.iterator, cute.select(mLSE.layout, mode=[*range(1, rank_lse), 0]))
        # Re-view everything as (seq, dim, head[, batch]) so that the sequence is the tiled mode
        # (split-KV partials: (..., split)).
        split_mode = [cute.rank(mQ)] if cutlass.const_expr(cfg.split_kv) else []
        if cutlass.const_expr(cfg.varlen):
            mQ = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[0, 2, 1]))
            if cutlass.const_expr(cfg.page_size > 0):
                mK, mV = kernel_view(mK), kernel_view(mV)  # (page_size, d, hk, page)
            else:
                mK, mV = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=[0, 2, 1])) for t in (mK, mV)]
            mO = cute.make_tensor(mO.iterator, cute.select(mO.layout, mode=[0, 2, 1] + split_mode))
            mLSE = cute.make_tensor(mLSE.iterator, cute.select(mLSE.layout, mode=[1, 0] + [m - 1 for m in split_mode]))
            num_batch = mCuSeqlensQ.shape[0] - 1
        else:
            mQ = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[1, 3, 2, 0]))
            if cutlass.const_expr(cfg.page_size > 0):
                mK, mV = kernel_view(mK), kernel_view(mV)  # (page_size, d, hk, page)
            else:
                mK, mV = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0])) for t in (mK, mV)]
            mO = cute.make_tensor(mO.iterator, cute.select(mO.layout, mode=[1, 3, 2, 0] + split_mode))
            mLSE = cute.make_tensor(mLSE.iterator,
                                    cute.select(mLSE.layout, mode=[2, 1, 0] + [m - 1 for m in split_mode]))
            num_batch = mQ.shape[3]
        num_heads = mQ.shape[2]
        qhead_per_kvhead = num_heads // mK.shape[2]
        packing = self.packing
        if cutlass.const_expr(packing.group > 1):
            # Each KV head's query heads become rows: (token, head) -> row token * g + head, and the
            # grid walks KV heads. Q and O also get the views their TMA descriptors are made from,
            # which clip a padded group's dummy heads (QueryPacking.tma_view).
            mQ, mO_tma = [packing.tma_view(t, 2, qhead_per_kvhead) for t in (mQ, mO)]
            mO = packing.view(mO, head_mode=2)
            mLSE = packing.view(mLSE, head_mode=1)
            num_heads, qhead_per_kvhead = mK.shape[2], 1
            max_seqlen_q = max_seqlen_q * packing.group
        else:
            mO_tma = mO

        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
            Float32, atom_layout_mnk=(self.num_consumer_wg, 1, 1), tiler_mn=(WGMMA_M, self.tile_n),
        )
        # P comes from registers; V^T is read N-major straight from V's row-major tile.
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN,
            Float32, atom_layout_mnk=(self.num_consumer_wg, 1, 1), tiler_mn=(WGMMA_M, self.hdim_v_tile),
            a_source=warpgroup.OperandSource.RMEM,
        )

        sQ_layout = smem_layout(self.dtype, self.tile_m, self.hdim_tile)
        sK_layout = smem_layout(self.dtype, self.tile_n, self.hdim_tile, self.num_stages)
        sV_layout = smem_layout(self.dtype, self.tile_n, self.hdim_v_tile, self.num_stages)

        tma_load = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(tma_load, mQ, sQ_layout,
                                                        packing.tma_tiler(self.tile_m, self.hdim_tile))
        # A K/V tile is one TMA box, or with a paged cache several, each within one page.
        kv_rows, sK_box, sV_box = self.tile_n, cute.select(sK_layout, mode=[0, 1]), cute.select(sV_layout, mode=[0, 1])
        if cutlass.const_expr(cfg.page_size > 0):
            kv_rows = rows_per_copy(self.tile_n, cfg.page_size)
            sK_box, sV_box = (smem_layout(self.dtype, kv_rows, self.hdim_tile),
                              smem_layout(self.dtype, kv_rows, self.hdim_v_tile))
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(tma_load, mK, sK_box, (kv_rows, self.hdim_tile), 1)
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(tma_load, mV, sV_box, (kv_rows, self.hdim_v_tile), 1)
        # tma_store_o: one (64, dv) slab per consumer warpgroup, each its own TMA box, and a
        # one-warpgroup view of the P @ V MMA for the stmatrix copy out of its accumulator.
        sO_layout = smem_layout(self.dtype, WGMMA_M, self.hdim_v_tile, self.num_consumer_wg)
        tma_atom_O, tma_O, tiled_mma_o = None, mO, None
        if cutlass.const_expr(cfg.tma_store_o):
            tma_atom_O, tma_O = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mO_tma, cute.select(sO_layout, mode=[0, 1]),
                packing.tma_tiler(WGMMA_M, self.hdim_v_tile))
            tiled_mma_o = sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN,
                Float32, atom_layout_mnk=(1, 1, 1), tiler_mn=(WGMMA_M, self.hdim_v_tile),
                a_source=warpgroup.OperandSource.RMEM)
        # The slabs get shared memory of their own where it fits beside Q, K and V (d <= 192); else
        # they reuse Q's buffer, dead once every consumer warpgroup's last Q K^T has retired
        # (store_o_by_tma waits for that). A persistent CTA loads its next Q under the epilogue, so
        # it cannot lend Q's buffer.
        element_bytes = self.dtype.width // 8
        tile_bytes = sum(cute.cosize(x) for x in (sQ_layout, sK_layout, sV_layout, sO_layout)) * element_bytes
        self.o_in_q = cfg.tma_store_o and tile_bytes + SMEM_RESERVED_BYTES > SMEM_BYTES_PER_BLOCK
        if cutlass.const_expr(self.o_in_q and cfg.persistent_ctas > 0):
            raise ValueError(f"sm90 forward: tma_store_o at head dims {self.hdim}/{self.hdim_v} stages O in Q's "
                             f"shared memory, which a persistent CTA needs for its next tile's Q")
        if cutlass.const_expr(self.o_in_q and cute.cosize(sO_layout) > cute.cosize(sQ_layout)):
            raise ValueError(f"sm90 forward: tma_store_o: O's slabs ({self.hdim_v_tile} columns) do not fit in Q's "
                             f"buffer ({self.hdim_tile} columns) nor beside it")
        sO_elements = cute.cosize(sO_layout) if cfg.tma_store_o and not self.o_in_q else 0
        self.tma_bytes_q = cute.size_in_bytes(self.dtype, sQ_layout)
        self.tma_bytes_k = cute.size_in_bytes(self.dtype, cute.select(sK_layout, mode=[0, 1]))
        self.tma_bytes_v = cute.size_in_bytes(self.dtype, cute.select(sV_layout, mode=[0, 1]))

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[self.dtype, sO_elements], 1024]  # last: offsets stay

        if cutlass.const_expr(SharedStorage.size_in_bytes() > SMEM_BYTES_PER_BLOCK):
            raise ValueError(f"sm90 forward: {SharedStorage.size_in_bytes()} bytes of shared memory for head "
                             f"dims {self.hdim}/{self.hdim_v} (tma_store_o={cfg.tma_store_o}), above the "
                             f"{SMEM_BYTES_PER_BLOCK} a block can have")
        self.shared_storage = SharedStorage

        score_prescale, scale_log2 = score_scales(softmax_scale, softcap, cfg.has_softcap)

        num_m_blocks = (max_seqlen_q + self.tile_m - 1) // self.tile_m
        # Longest-first order for masked problems, in L2 groups sized by a head's K and V (a paged
        # sequence's: as many keys as its row of the table holds).
        kv_rows_per_head = (mK.shape[0] if cutlass.const_expr(cfg.page_size == 0)
                            else mPageTable.shape[1] * cfg.page_size)
        kv_bytes_per_head = kv_rows_per_head * (self.hdim + self.hdim_v) * (self.dtype.width // 8)
        # Split-KV folds the split into the head mode (KVSplits); its tiles keep the launch order.
        longest_first = cfg.longest_first and longest_first_applies(cfg) and not cfg.split_kv
        scheduler = TileScheduler.create(num_m_blocks, num_heads if splits is None else splits.fold(num_heads),
                                         num_batch, kv_bytes_per_head, longest_first=longest_first,
                                         min_blocks=cfg.longest_first_min_blocks,
                                         num_ctas=cfg.persistent_ctas, l2_budget_bytes=L2_BUDGET_BYTES)
        self.kernel(
            tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V,
            tma_atom_O, tma_O, mLSE, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, mPageTable, mSink,
            score_prescale, scale_log2, window_left, window_right, qhead_per_kvhead,
            sQ_layout, sK_layout, sV_layout, sO_layout, tiled_mma_qk, tiled_mma_pv, tiled_mma_o, scheduler, splits,
        ).launch(grid=scheduler.grid(), block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    # ------------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        tma_atom_Q: cute.CopyAtom, mQ: cute.Tensor,
        tma_atom_K: cute.CopyAtom, mK: cute.Tensor,
        tma_atom_V: cute.CopyAtom, mV: cute.Tensor,
        tma_atom_O: Optional[cute.CopyAtom], mO: cute.Tensor, mLSE: cute.Tensor,
        mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor],
        mSeqUsedQ: Optional[cute.Tensor], mSeqUsedK: Optional[cute.Tensor], mPageTable: Optional[cute.Tensor],
        mSink: Optional[cute.Tensor], score_prescale: Float32, scale_log2: Float32,
        window_left: Int32, window_right: Int32, qhead_per_kvhead: Int32,
        sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
        tiled_mma_o: Optional[cute.TiledMma], scheduler: TileScheduler, splits: Optional[KVSplits],
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == LOAD_WARP:
            for atom in (tma_atom_Q, tma_atom_K, tma_atom_V):
                cpasync.prefetch_descriptor(atom)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        sO = None
        if cutlass.const_expr(self.cfg.tma_store_o):
            o_buffer = storage.sQ if self.o_in_q else storage.sO
            sO = o_buffer.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        smem = SharedTiles(q=storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner),
                           k=storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner),
                           v=storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner), o=sO)

        # One TMA-issuing warp produces; every consumer warp releases a stage once (lane 0 arrives).
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumers = pipeline.CooperativeGroup(
            pipeline.Agent.Thread, self.num_consumer_wg * WARPGROUP_THREADS // cute.arch.WARP_SIZE)
        pipe_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_q.data_ptr(), num_stages=1, producer_group=producer,
            consumer_group=consumers, tx_count=self.tma_bytes_q, defer_sync=True)
        pipe_k = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_k.data_ptr(), num_stages=self.num_stages,
            producer_group=producer, consumer_group=consumers, tx_count=self.tma_bytes_k, defer_sync=True)
        pipe_v = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_v.data_ptr(), num_stages=self.num_stages,
            producer_group=producer, consumer_group=consumers, tx_count=self.tma_bytes_v, defer_sync=True)
        # Barrier initialisation must be visible to the async proxy and to every warp before use.
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        pipes = Pipelines(q=pipe_q, k=pipe_k, v=pipe_v)
        mmas = Mmas(qk=tiled_mma_qk, pv=tiled_mma_pv, o=tiled_mma_o)
        outputs = Outputs(o=mO, lse=mLSE, sink=mSink, tma_atom_o=tma_atom_O)
        loads = (tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mV, mPageTable)
        tile_args = (qhead_per_kvhead, mQ, mK, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, window_left,
                     window_right)
        warpgroup_idx = warpgroup_index(tidx)
        if cutlass.const_expr(self.cfg.persistent_ctas > 0):
            # Persistent: CTA i works on tiles i, i + grid, ... of the scheduler's order; the
            # pipelines' states (and the ping-pong turn) carry over from one tile to the next.
            first, stride = cute.arch.block_idx()[0], cute.arch.grid_dim()[0]
            if warpgroup_idx == WarpGroup.PRODUCER:
                cute.arch.setmaxregister_decrease(self.producer_regs)
                if warp_idx == LOAD_WARP:
                    q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
                    kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
                    for tile_index in cutlass.range(first, scheduler.num_tiles(), stride, unroll=1):
                        tile = self.tile_work(*scheduler.tile_at(tile_index), *tile_args)
                        if tile.in_sequence():
                            q_state, kv_state = self.produce(*loads, smem, pipes, tile, q_state, kv_state)
            else:
                cute.arch.setmaxregister_increase(self.consumer_regs)
                self.gemm_turn_init(warpgroup_idx - WarpGroup.FIRST_CONSUMER)
                q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
                kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
                for tile_index in cutlass.range(first, scheduler.num_tiles(), stride, unroll=1):
                    tile = self.tile_work(*scheduler.tile_at(tile_index), *tile_args)
                    if tile.in_sequence():
                        q_state, kv_state = self.consume(tidx - WARPGROUP_THREADS, smem, pipes, mmas, outputs, tile,
                                                         q_state, kv_state, score_prescale, scale_log2,
                                                         first_tile=False)
        else:
            m_block, head, batch = scheduler.tile()
            split = None
            if cutlass.const_expr(self.cfg.split_kv):
                head, split = splits.unfold(head)
                outputs = Outputs(o=last_mode_slice(mO, split), lse=last_mode_slice(mLSE, split), sink=mSink,
                                  tma_atom_o=tma_atom_O)
            tile = self.tile_work(m_block, head, batch, *tile_args, splits=splits, split=split)
            if tile.in_sequence():
                if warpgroup_idx == WarpGroup.PRODUCER:
                    cute.arch.setmaxregister_decrease(self.producer_regs)
                    if warp_idx == LOAD_WARP:
                        self.produce(*loads, smem, pipes, tile,
                                     pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1),
                                     pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                                  self.num_stages))
                        if cutlass.const_expr(self.cfg.split_kv):
                            # The combine is a programmatic dependent of this grid (combine.py): it
                            # may launch once every CTA has issued its last load (a few KV blocks
                            # before the end), and waits for this grid to finish.
                            cute.arch.griddepcontrol_launch_dependents()
                else:
                    cute.arch.setmaxregister_increase(self.consumer_regs)
                    self.consume(tidx - WARPGROUP_THREADS, smem, pipes, mmas, outputs, tile,
                                 pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1),
                                 pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages),
                                 score_prescale, scale_log2, first_tile=True)

    @cute.jit
    def tile_work(self, m_block: Int32, head: Int32, batch: Int32, qhead_per_kvhead: Int32, mQ: cute.Tensor,
                  mK: cute.Tensor, mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor],
                  mSeqUsedQ: Optional[cute.Tensor], mSeqUsedK: Optional[cute.Tensor], window_left: Int32,
                  window_right: Int32,
                  splits: Optional[KVSplits] = None, split: Optional[Int32] = None) -> "OutputTile":
        """An output tile with its sequence lengths, mask and visible KV blocks (with split-KV, split
        ``split``'s share of them)."""
        tokens_q = mQ.shape[0] if cutlass.const_expr(self.cfg.pack_gqa == 1) else mQ.shape[0][1]
        seqlen = SeqlenInfo.create(batch, tokens_q, mK.shape[0], mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mSeqUsedQ)
        mask = AttentionMask(self.tile_m, self.tile_n, self.cfg.causal, self.cfg.local,
                             window_left, window_right, self.cfg.pack_gqa)
        n_block_min, n_block_max = mask.n_block_range(seqlen, m_block)
        if cutlass.const_expr(splits is not None):
            n_block_min, n_block_max = splits.block_range(n_block_min, n_block_max, split)
        return OutputTile(self.tile_m, seqlen, mask, m_block, head, batch, head // qhead_per_kvhead,
                          n_block_min, n_block_max)

    # ---- producer warp --------------------------------------------------------------------------
    @cute.jit
    def produce(self, tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mV, mPageTable, smem: "SharedTiles",
                pipes: "Pipelines", tile: "OutputTile", q_state, kv_state):
        """Q of the tile, then K_j and V_j from the last visible KV block to the first. Returns the
        pipeline states after them."""
        seqlen, head, batch = tile.seqlen, tile.head, tile.batch
        gQ = self.packing.tma_tile(head_rows(mQ, self.packing.tma_rows_before(tile.mask, seqlen), head, batch,
                                             self.cfg.varlen), self.tile_m, self.hdim_tile, tile.m_block)
        tQsQ, tQgQ = tma_partition_tile(tma_atom_Q, smem.q, gQ)
        # Q is loaded even when no KV block is visible, so that consumers never special-case it.
        pipes.q.producer_acquire(q_state)
        cute.copy(tma_atom_Q, tQgQ, tQsQ, tma_bar_ptr=pipes.q.producer_get_barrier(q_state))
        q_state = advanced(q_state)
        if cutlass.const_expr(self.cfg.page_size > 0):
            kv_state = self.produce_kv_paged(tma_atom_K, mK, tma_atom_V, mV, mPageTable, smem, pipes, tile, kv_state)
        else:
            kv_state = self.produce_kv(tma_atom_K, mK, tma_atom_V, mV, smem, pipes, tile, kv_state)
        return q_state, kv_state

    @cute.jit
    def produce_kv(self, tma_atom_K, mK, tma_atom_V, mV, smem: "SharedTiles", pipes: "Pipelines",
                   tile: "OutputTile", kv_state):
        """K_j and V_j of contiguous (batched or packed) keys, one TMA box per tile."""
        seqlen, batch, head_kv = tile.seqlen, tile.batch, tile.head_kv
        gK = cute.local_tile(head_rows(mK, seqlen.offset_k, head_kv, batch, self.cfg.varlen),
                             (self.tile_n, self.hdim_tile), (None, 0))  # (tile_n, d, n_blocks)
        gV = cute.local_tile(head_rows(mV, seqlen.offset_k, head_kv, batch, self.cfg.varlen),
                             (self.tile_n, self.hdim_v_tile), (None, 0))
        tKsK, tKgK = tma_partition_tile(tma_atom_K, smem.k, gK)
        tVsV, tVgV = tma_partition_tile(tma_atom_V, smem.v, gV)
        for i in cutlass.range(tile.n_block_max - tile.n_block_min, unroll=1):
            n_block = tile.n_block_max - 1 - i
            pipes.k.producer_acquire(kv_state)
            cute.copy(tma_atom_K, tKgK[None, n_block], tKsK[None, kv_state.index],
                      tma_bar_ptr=pipes.k.producer_get_barrier(kv_state))
            pipes.v.producer_acquire(kv_state)
            cute.copy(tma_atom_V, tVgV[None, n_block], tVsV[None, kv_state.index],
                      tma_bar_ptr=pipes.v.producer_get_barrier(kv_state))
            kv_state = advanced(kv_state)
        return kv_state

    @cute.jit
    def produce_kv_paged(self, tma_atom_K, mK, tma_atom_V, mV, mPageTable, smem: "SharedTiles",
                         pipes: "Pipelines", tile: "OutputTile", kv_state):
        """K_j and V_j of a paged cache: PagedKV.copies boxes per tile, each from the page the page
        table names (zeros past the sequence's end). Up to PREFETCHED_PAGE_BOXES boxes the table is
        read before K_j's wait for a free stage, so that the reads' latency overlaps it, and V_j's
        boxes reuse K_j's pages; more boxes (small pages) would not stay in the producer's registers
        across the waits (d = 128 at page 16: ptxas 13.4 spilled 3-4), so those are read box by box
        after each wait, for K_j and again for V_j."""
        pages = PagedKV(self.cfg.page_size, self.tile_n, mPageTable, tile.batch)
        tKsK, tKgK = tma_partition_tile(tma_atom_K, pages.stage_boxes(smem.k),
                                        pages.head_boxes(mK, tile.head_kv, self.hdim_tile))  # (TMA, box, stage)
        tVsV, tVgV = tma_partition_tile(tma_atom_V, pages.stage_boxes(smem.v),
                                        pages.head_boxes(mV, tile.head_kv, self.hdim_v_tile))  # (TMA, in page, page)
        num_pages = mK.shape[3]
        early = pages.copies <= PREFETCHED_PAGE_BOXES
        for i in cutlass.range(tile.n_block_max - tile.n_block_min, unroll=1):
            n_block = tile.n_block_max - 1 - i
            sources = None
            if cutlass.const_expr(early):
                sources = []
                for box in cutlass.range_constexpr(pages.copies):
                    sources.append(pages.box_source(n_block, box, tile.seqlen.seqlen_k, num_pages))
            pipes.k.producer_acquire(kv_state)
            self.copy_page_boxes(tma_atom_K, tKgK, tKsK[None, None, kv_state.index], pages, sources, n_block,
                                 tile.seqlen.seqlen_k, num_pages, pipes.k.producer_get_barrier(kv_state))
            pipes.v.producer_acquire(kv_state)
            self.copy_page_boxes(tma_atom_V, tVgV, tVsV[None, None, kv_state.index], pages, sources, n_block,
                                 tile.seqlen.seqlen_k, num_pages, pipes.v.producer_get_barrier(kv_state))
            kv_state = advanced(kv_state)
        return kv_state

    @cute.jit
    def copy_page_boxes(self, atom, gmem: cute.Tensor, smem: cute.Tensor, pages: PagedKV, sources: Optional[list],
                        n_block: Int32, seqlen_k: Int32, num_pages: Int32, barrier):
        """The TMA copies of one K or V tile's boxes into its stage (``smem``: (TMA, box)), from
        ``sources`` (box within page, page) read beforehand, or (None) reading the table box by box."""
        for box in cutlass.range_constexpr(pages.copies):
            if cutlass.const_expr(sources is not None):
                within, page = sources[box]
            else:
                within, page = pages.box_source(n_block, box, seqlen_k, num_pages)
            cute.copy(atom, gmem[None, within, page], smem[None, box], tma_bar_ptr=barrier)

    # ---- consumer warpgroups --------------------------------------------------------------------
    @cute.jit
    def consume(self, tidx, smem: "SharedTiles", pipes: "Pipelines", mmas: "Mmas", outputs: "Outputs",
                tile: "OutputTile", q_state, kv, score_prescale: Float32, scale_log2: Float32,
                first_tile: cutlass.Constexpr[bool]):
        """One output tile: the main loop over its KV blocks, then the epilogue. Returns the pipeline
        states after it (Q is released only by persistent CTAs, which load the next tile's Q). The
        ping-pong turn starts with the first tile; persistent CTAs start it before their loop."""
        cfg = self.cfg
        seqlen, mask, m_block, head, batch = tile.seqlen, tile.mask, tile.m_block, tile.head, tile.batch
        n_block_min, n_block_max = tile.n_block_min, tile.n_block_max
        sQ, sK, sV = smem.q, smem.k, smem.v
        pipe_q, pipe_k, pipe_v = pipes.q, pipes.k, pipes.v
        tiled_mma_qk, tiled_mma_pv = mmas.qk, mmas.pv
        warpgroup_first_thread = warpgroup_slice_thread(tidx)
        wg_mma_qk = tiled_mma_qk.get_slice(warpgroup_first_thread)
        wg_mma_pv = tiled_mma_pv.get_slice(warpgroup_first_thread)
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        thr_mma_pv = tiled_mma_pv.get_slice(tidx)

        tSrQ = wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(sQ))  # (MMA, MMA_M, MMA_K)
        tSrK = wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(sK))  # (MMA, MMA_N, MMA_K, stage)
        tOrVt = wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(transpose_view(sV)))
        acc_S_shape = thr_mma_qk.partition_shape_C((self.tile_m, self.tile_n))
        acc_O = thr_mma_pv.make_fragment_C(thr_mma_pv.partition_shape_C((self.tile_m, self.hdim_v_tile)))
        acc_O.fill(0.0)

        # Score coordinates within a (tile_m, tile_n) block, for masking.
        tScS = acc_rows_view(thr_mma_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n))))
        softmax = OnlineSoftmax.create(scale_log2, cute.size(tScS, mode=[0]), THREADS_PER_ROW)

        wg = warpgroup_index(tidx)
        row_scale = cute.make_rmem_tensor(softmax.num_rows, Float32)
        rP = cute.make_rmem_tensor(acc_S_shape, self.dtype)  # P of the previous block, A of P@V
        step = partial(self.mainloop_step, wg=wg, tSrQ=tSrQ, tSrK=tSrK, tOrVt=tOrVt, acc_O=acc_O, rP=rP,
                       acc_S_shape=acc_S_shape, pipe_k=pipe_k, pipe_v=pipe_v,
                       tiled_mma_qk=tiled_mma_qk, tiled_mma_pv=tiled_mma_pv, softmax=softmax,
                       mask=mask, tScS=tScS, seqlen=seqlen, m_block=m_block,
                       score_prescale=score_prescale, row_scale=row_scale)

        pipe_q.consumer_wait(q_state)
        if cutlass.const_expr(first_tile):
            self.gemm_turn_init(wg)
        if n_block_max > n_block_min:
            # Prologue: S and P of the last block (always checked against the masks); its P @ V
            # joins the next block's S = Q K^T.
            acc_S = cute.make_rmem_tensor(acc_S_shape, Float32)
            pipe_k.consumer_wait(kv)
            self.gemm_turn_wait(wg)
            wgmma(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, kv.index], zero_init=True,
                  whole_k=self.whole_k(cold=True))
            self.gemm_turn_pass(wg)
            warpgroup.wait_group(0)
            pipe_k.consumer_release(kv)
            self.scores_to_probs(acc_S, softmax, mask, tScS, seqlen, m_block, n_block_max - 1,
                                 score_prescale, row_scale, masked=True)
            store_converted(rP, acc_S)
            if cutlass.const_expr(tail_possible(cfg)):
                self.zero_v_tail(tidx, sV, pipe_v, kv, seqlen, n_block_max - 1)

            # Steady state, from the last KV block to the first: blocks that cross the right mask
            # edge (sequence end, causal diagonal, right window), then full blocks without any mask
            # code, then (local only) blocks that cross the left window edge. Two copies of the step's
            # code, masked and not: one loop masking every block compiled 35% faster at d = 256 but
            # ran 4-10% slower at d = 192 and 256 (H200, docs/perf.md).
            n_full_max = cutlass.max(mask.n_block_max_full(seqlen, m_block), n_block_min)
            n_full_min = cutlass.max(mask.n_block_min_full(seqlen, m_block), n_block_min)
            n_full_max = cutlass.min(cutlass.max(n_full_max, n_full_min), n_block_max - 1)
            if cutlass.const_expr(cfg.causal or cfg.local):
                # Without either, only the last block can cross the right edge (the sequence
                # end), and the prologue took it: this loop would never run, so it is not built.
                for i in cutlass.range(n_block_max - 1 - n_full_max, unroll=1):
                    kv = step(kv, n_block=n_block_max - 2 - i, masked=True)
            for i in cutlass.range(n_full_max - n_full_min, unroll=1):
                kv = step(kv, n_block=n_full_max - 1 - i, masked=False)
            if cutlass.const_expr(cfg.local):
                n_left = cutlass.min(n_full_min, n_block_max - 1)
                for i in cutlass.range(n_left - n_block_min, unroll=1):
                    kv = step(kv, n_block=n_left - 1 - i, masked=True)

            # Epilogue of the loop: P @ V of the first block.
            pipe_v.consumer_wait(kv)
            if cutlass.const_expr(cfg.rescale_o_before_pv):
                self.rescale_rows(acc_O, row_scale)
            wgmma(tiled_mma_pv, acc_O, acc_as_a_operand(rP), tOrVt[None, None, None, kv.index],
                  zero_init=False, whole_k=self.whole_k(cold=True))
            warpgroup.wait_group(0)
            pipe_v.consumer_release(kv)
            kv = advanced(kv)  # a persistent CTA's next tile starts at the stage after this one
        if cutlass.const_expr(cfg.persistent_ctas > 0):
            pipe_q.consumer_release(q_state)  # every S = Q K^T of the tile has completed
        q_state = advanced(q_state)

        sink = None
        if cutlass.const_expr(cfg.has_sink):
            sink = self.sink_logits(outputs.sink, tScS, m_block, head)
        out_scale, lse = softmax.finalize(sink)
        if cutlass.const_expr(cfg.tma_store_o):
            self.store_o_by_tma(tidx, mmas.o, outputs.tma_atom_o, smem.o, acc_O, out_scale, outputs.o, m_block, head,
                                batch)
        self.epilogue(tidx, thr_mma_pv, acc_O, out_scale, lse, outputs.o, outputs.lse, seqlen, mask, m_block, head,
                      batch)
        return q_state, kv

    @cute.jit
    def zero_v_tail(self, tidx, sV: cute.Tensor, pipe_v, kv, seqlen: SeqlenInfo, n_block: Int32):
        """Zero the rows of V stage ``kv`` (block ``n_block``, the tile's first) past the sequence's
        keys, before any P @ V reads them (fa4_kernels/kv_tail.py: 0 * NaN). Once per tile, only
        where the block reaches past the keys; the consumer warpgroups' threads share the rows (each
        warpgroup's P @ V reads all of them, so all must be written before any warpgroup issues):
        wait for V's TMA, zero, fence the generic-proxy stores for WGMMA (async proxy), then one
        barrier of every consumer thread. The stage's later wait (P @ V) returns at once and its
        release is unchanged."""
        first_row = first_row_past_keys(seqlen.seqlen_k, n_block, self.tile_n)
        if first_row < self.tile_n:
            consumer_threads = self.num_consumer_wg * WARPGROUP_THREADS
            pipe_v.consumer_wait(kv)
            zero_rows(sV[None, None, kv.index], first_row, tidx, consumer_threads)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=int(Barrier.V_TAIL), number_of_threads=consumer_threads)

    @cute.jit
    def mainloop_step(self, kv, n_block: Int32, masked: cutlass.Constexpr[bool], wg, tSrQ, tSrK, tOrVt,
                      acc_O, rP, acc_S_shape, pipe_k, pipe_v, tiled_mma_qk, tiled_mma_pv,
                      softmax: OnlineSoftmax, mask: AttentionMask, tScS, seqlen: SeqlenInfo,
                      m_block: Int32, score_prescale: Float32, row_scale: cute.Tensor):
        """One steady-state block: issue S_j = Q K_j^T and O += P_{j+1} V_{j+1} back to back, then run
        the softmax of S_j while P_{j+1} V_{j+1} is still on the tensor cores. Returns the next
        pipeline state (block j's stage, whose V the next step consumes)."""
        kv_prev = kv
        kv = advanced(kv)
        acc_S = cute.make_rmem_tensor(acc_S_shape, Float32)
        pipe_k.consumer_wait(kv)
        self.gemm_turn_wait(wg)
        wgmma(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, kv.index], zero_init=True,
              whole_k=self.whole_k(cold=masked and self.cfg.causal))
        if cutlass.const_expr(self.cfg.rescale_o_before_pv):
            self.rescale_rows(acc_O, row_scale)  # the previous block's factors, under Q K_j^T
        pipe_v.consumer_wait(kv_prev)
        wgmma(tiled_mma_pv, acc_O, acc_as_a_operand(rP), tOrVt[None, None, None, kv_prev.index],
              zero_init=False, whole_k=self.whole_k(cold=False))
        self.gemm_turn_pass(wg)
        warpgroup.wait_group(1)  # S_j has landed; P V may still run
        pipe_k.consumer_release(kv)
        self.scores_to_probs(acc_S, softmax, mask, tScS, seqlen, m_block, n_block, score_prescale,
                             row_scale, masked=masked)
        warpgroup.wait_group(0)  # rP is an operand of the running GEMM until here
        pipe_v.consumer_release(kv_prev)
        if cutlass.const_expr(not self.cfg.rescale_o_before_pv):
            self.rescale_rows(acc_O, row_scale)
        store_converted(rP, acc_S)
        return kv

    def whole_k(self, cold: bool) -> bool:
        """Whether a GEMM is one call over its k slices: with whole_k_gemms, where it runs a few times
        per tile (``cold``: the prologue's Q K^T, the causal diagonal's, the last P @ V). The hot
        loop keeps a call per k slice, whose descriptors stay uniform."""
        return self.cfg.whole_k_gemms and cold

    @cute.jit
    def scores_to_probs(self, acc_S: cute.Tensor, softmax: OnlineSoftmax, mask: AttentionMask,
                        tScS: cute.Tensor, seqlen: SeqlenInfo, m_block: Int32, n_block: Int32,
                        score_prescale: Float32, row_scale: cute.Tensor, masked: cutlass.Constexpr[bool]):
        """Softcap, mask and online softmax of one score block, in place. Only blocks known to be
        full (no -inf scores) may use the FMA-pipe exp2."""
        cfg = self.cfg
        s_rows = acc_rows_view(acc_S)
        if cutlass.const_expr(cfg.has_softcap):
            for j in cutlass.range_constexpr(cute.size(acc_S)):
                acc_S[j] = cute.math.tanh(acc_S[j] * score_prescale, fastmath=True)
        # The mask and softmax steps pass the scores along as values (see softmax.py).
        rows, cols = cute.size(s_rows, mode=[0]), cute.size(s_rows, mode=[1])
        scores = [[s_rows[r, c] for c in range(cols)] for r in range(rows)]
        if cutlass.const_expr(masked):
            scores = mask.apply(scores, tScS, seqlen, m_block, n_block)
        shift = softmax.update_max(scores, row_scale, cfg.rescale_threshold)
        probs = exp2_rows(scores, softmax.scale_log2, shift, 0 if masked else cfg.exp2_emulated_eighths)
        for r in cutlass.range_constexpr(rows):
            for c in cutlass.range_constexpr(cols):
                s_rows[r, c] = probs[r][c]
        softmax.update_sum(probs, row_scale)

    @cute.jit
    def rescale_rows(self, acc_O: cute.Tensor, row_scale: cute.Tensor):
        """O *= row_scale per row. With conditional rescaling most blocks leave every factor at
        exactly 1: the warp skips the multiplies when none of its rows moved (a warp-uniform branch,
        so no divergence)."""
        o_rows = acc_rows_view(acc_O)
        if cutlass.const_expr(self.cfg.rescale_threshold > 0.0):
            moved = row_scale[0] != Float32(1.0)
            for r in cutlass.range_constexpr(1, cute.size(o_rows, mode=[0])):
                moved = moved or row_scale[r] != Float32(1.0)
            if cute.arch.vote_any_sync(moved):
                self._scale_rows(o_rows, row_scale)
        else:
            self._scale_rows(o_rows, row_scale)

    @cute.jit
    def _scale_rows(self, o_rows: cute.Tensor, row_scale: cute.Tensor):
        for r in cutlass.range_constexpr(cute.size(o_rows, mode=[0])):
            scale = row_scale[r]
            for c in cutlass.range_constexpr(cute.size(o_rows, mode=[1])):
                o_rows[r, c] = o_rows[r, c] * scale

    @cute.jit
    def sink_logits(self, mSink: cute.Tensor, tScS: cute.Tensor, m_block: Int32, head: Int32):
        """The learnable sink logit of each of the thread's rows: the tile's head, or with GQA
        packing, each row's own query head (head here is the KV head; QueryPacking.query_head)."""
        if cutlass.const_expr(self.packing.group == 1):
            return Float32(mSink[head])
        sinks = cute.make_rmem_tensor(cute.size(tScS, mode=[0]), Float32)
        for r in cutlass.range_constexpr(cute.size(tScS, mode=[0])):
            sinks[r] = Float32(mSink[self.packing.query_head(head, m_block * self.tile_m + tScS[r, 0][0])])
        return sinks

    # ---- ping-pong between the consumer warpgroups ----------------------------------------------
    # Named barrier Barrier.PINGPONG_FIRST + w gates warpgroup w's GEMM issue. A warpgroup waits on its
    # own barrier, issues, then arrives on the next one's (cyclically); warpgroup 0 has the first turn.
    @cute.jit
    def gemm_turn_init(self, wg: Int32):
        if cutlass.const_expr(self.cfg.pingpong):
            if wg == 0:
                cute.arch.barrier_arrive(barrier_id=int(Barrier.PINGPONG_FIRST), number_of_threads=PINGPONG_THREADS)

    @cute.jit
    def gemm_turn_wait(self, wg: Int32):
        if cutlass.const_expr(self.cfg.pingpong):
            cute.arch.barrier(barrier_id=Barrier.PINGPONG_FIRST + wg, number_of_threads=PINGPONG_THREADS)

    @cute.jit
    def gemm_turn_pass(self, wg: Int32):
        if cutlass.const_expr(self.cfg.pingpong):
            nxt = wg + 1
            if nxt == self.num_consumer_wg:
                nxt = 0
            cute.arch.barrier_arrive(barrier_id=Barrier.PINGPONG_FIRST + nxt, number_of_threads=PINGPONG_THREADS)

    @cute.jit
    def epilogue(self, tidx, thr_mma_pv, acc_O, out_scale, lse, mO, mLSE, seqlen: SeqlenInfo,
                 mask: AttentionMask, m_block, head, batch):
        """Normalise O, write the rows that lie inside the sequence and hold a real query head (unless
        store_o_by_tma did), and their LSE."""
        tOcO = acc_rows_view(thr_mma_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.hdim_v_tile))))
        o_rows = acc_rows_view(acc_O)
        rows_left = mask.rows(seqlen) - m_block * self.tile_m
        gLSE = head_rows(mLSE, mask.rows_before(seqlen), head, batch, self.cfg.varlen)
        tOgO = None
        if cutlass.const_expr(not self.cfg.tma_store_o):
            gO = cute.local_tile(head_rows(mO, mask.rows_before(seqlen), head, batch, self.cfg.varlen),
                                 (self.tile_m, self.hdim_v_tile), (m_block, 0))
            tOgO = acc_rows_view(thr_mma_pv.partition_C(gO))
        for r in cutlass.range_constexpr(cute.size(o_rows, mode=[0])):
            row = tOcO[r, 0][0]
            inside = row < rows_left
            if cutlass.const_expr(self.packing.padded):
                inside = inside & self.packing.real_row(row)  # a dummy row aliases a real head
            if inside:
                if cutlass.const_expr(not self.cfg.tma_store_o):
                    scale = out_scale[r]
                    for c in cutlass.range_constexpr(cute.size(o_rows, mode=[1])):
                        if cutlass.const_expr(self.hdim_v_tile == self.hdim_v):
                            tOgO[r, c] = (o_rows[r, c] * scale).to(self.o_dtype)
                        elif tOcO[r, c][1] < self.hdim_v:  # not a zero-padding column
                            tOgO[r, c] = (o_rows[r, c] * scale).to(self.o_dtype)
                if tidx % THREADS_PER_ROW == 0:
                    gLSE[m_block * self.tile_m + row] = lse[r]

    @cute.jit
    def store_o_by_tma(self, tidx, tiled_mma_o, tma_atom_O, sO, acc_O, out_scale, mO, m_block, head, batch):
        """tma_store_o: this warpgroup's 64 normalised rows of O into its shared-memory slab with
        stmatrix, then one TMA store, which clips the rows past the sequence (batched inputs) and a
        padded group's dummy heads (QueryPacking.tma_view). The issuing warp waits until the TMA has
        read the slab, so the CTA outlives it."""
        wg = warpgroup_index(tidx)
        if cutlass.const_expr(self.cfg.persistent_ctas > 0):
            # The slab's previous TMA store has read it (its issuing warp waited for that).
            cute.arch.barrier(barrier_id=Barrier.EPILOGUE_FIRST + wg, number_of_threads=WARPGROUP_THREADS)
        if cutlass.const_expr(self.o_in_q):
            # The slabs overlay all of Q, not each warpgroup's own rows: every consumer warpgroup's
            # GEMMs must have retired (each waited for them before its epilogue) before any writes.
            cute.arch.barrier(barrier_id=int(Barrier.Q_FREE),
                              number_of_threads=self.num_consumer_wg * WARPGROUP_THREADS)
        rO = cute.make_rmem_tensor(acc_O.shape, self.dtype)
        o_rows, ro_rows = acc_rows_view(acc_O), acc_rows_view(rO)
        for r in cutlass.range_constexpr(cute.size(o_rows, mode=[0])):
            scale = out_scale[r]
            for c in cutlass.range_constexpr(cute.size(o_rows, mode=[1])):
                ro_rows[r, c] = (o_rows[r, c] * scale).to(self.dtype)
        slab = sO[None, None, wg]
        store = stmatrix_copy(tiled_mma_o, self.dtype)
        thr_store = store.get_slice(tidx % WARPGROUP_THREADS)
        cute.copy(store, thr_store.retile(rO), thr_store.partition_D(slab))
        cute.arch.fence_view_async_shared()  # generic-proxy writes -> visible to the TMA
        cute.arch.barrier(barrier_id=Barrier.EPILOGUE_FIRST + wg, number_of_threads=WARPGROUP_THREADS)
        if cute.arch.make_warp_uniform((tidx % WARPGROUP_THREADS) // cute.arch.WARP_SIZE) == 0:
            gO = self.packing.tma_tile(head_rows(mO, Int32(0), head, batch, False), WGMMA_M, self.hdim_v_tile,
                                       m_block * self.num_consumer_wg + wg)
            t_smem, t_gmem = tma_partition_tile(tma_atom_O, slab, gO)
            cute.copy(tma_atom_O, t_smem, t_gmem)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)


@dataclass(frozen=True)
class SharedTiles:
    """The CTA's shared-memory tiles: Q; K and V with a trailing stage mode; O's per-warpgroup
    slabs (tma_store_o only, else None)."""

    q: cute.Tensor
    k: cute.Tensor
    v: cute.Tensor
    o: Optional[cute.Tensor]


@dataclass(frozen=True)
class Pipelines:
    q: pipeline.PipelineTmaAsync
    k: pipeline.PipelineTmaAsync
    v: pipeline.PipelineTmaAsync


@dataclass(frozen=True)
class Mmas:
    """S = Q K^T (qk), O += P V (pv), and one warpgroup's view of pv for stmatrix (o, tma_store_o)."""

    qk: cute.TiledMma
    pv: cute.TiledMma
    o: Optional[cute.TiledMma]


@dataclass(frozen=True)
class Outputs:
    o: cute.Tensor
    lse: cute.Tensor
    sink: Optional[cute.Tensor]  # learnable sink logits per query head (has_sink)
    tma_atom_o: Optional[cute.CopyAtom]  # tma_store_o
