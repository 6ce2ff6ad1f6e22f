"""FlashAttention backward for Hopper (sm_90a): dQ, dK, dV from Q, K, V, dO, LSE and rowsum(dO * O).

STATUS: compiles for sm_90a (tests/cpu/test_kernels.py; SASS at d=128: no spills non-causal, 2 causal);
not yet run on a GPU and not dispatched.

One CTA owns one KV tile (tile_n = 128 keys) of one query head and walks the query blocks that see it:

    warpgroup 0    producer   one warp: K_j and V_j once, then Q_i and dO_i for every query block i
                              into a ``num_stages``-deep ring (TMA)
    warpgroup 1,2  consumers  64 keys each. Per query block (tile_m = 64 rows), in the transposed
                              orientation (keys are the accumulator rows):
                                S^T  = K Q_i^T          dP^T = V dO_i^T          (WGMMA, smem operands)
                                P^T  = exp2(S^T * scale_log2 - LSE_i)             (mask: S^T = -inf)
                                dS^T = P^T * (dP^T - rowsum(dO_i * O_i))
                                dV  += P^T dO_i          dK  += dS^T Q_i           (WGMMA, P/dS in registers)
                                dQ_i += dS K             (both warpgroups' dS through shared memory; each
                                                          warpgroup takes half of the head dim; fp32
                                                          atomics into dq_accum)
                              then dK (times the softmax scale) and dV go out with fp32 atomics, which
                              also sums the query heads of a KV head (GQA).

The caller turns dq_accum into dQ (times the softmax scale) and dk/dv_accum into the input dtype.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup

from ..config import BackwardConfig
from ..mask import AttentionMask
from ..seqlen import SeqlenInfo
from ..softmax import LOG2_E
from .fragments import acc_as_a_operand, acc_rows_view
from .wgmma import (DTYPES, WARPGROUP_THREADS, advanced, smem_layout, tma_partition_tile, transpose_view,
                    wgmma)

NUM_CONSUMER_WARPGROUPS = 2
PRODUCER_REGISTERS, CONSUMER_REGISTERS = 24, 240
# Named barrier 0 is __syncthreads; 1 orders the consumers' shared dS tile.
DS_BARRIER = 1


class FlashAttentionBackwardSm90:
    def __init__(self, cfg: BackwardConfig):
        if cfg.tile_n != 64 * NUM_CONSUMER_WARPGROUPS or cfg.tile_m != 64:
            raise ValueError("sm90 backward: tiles are 64 query rows x 128 keys")
        if cfg.head_dim != cfg.head_dim_v or cfg.head_dim > 128 or cfg.head_dim % 16 != 0:
            raise NotImplementedError(
                f"sm90 backward: head_dim == head_dim_v, a multiple of 16 up to 128 so far; got "
                f"{cfg.head_dim}/{cfg.head_dim_v}")
        self.cfg = cfg
        self.dtype = DTYPES[cfg.dtype]
        self.tile_m, self.tile_n = cfg.tile_m, cfg.tile_n
        self.hdim = cfg.head_dim
        self.num_stages = cfg.num_stages
        self.num_threads = WARPGROUP_THREADS * (1 + NUM_CONSUMER_WARPGROUPS)

    # ------------------------------------------------------------------------------------------
    # Host side
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSE: cute.Tensor, mdPsum: cute.Tensor, mdQacc: cute.Tensor, mdKacc: cute.Tensor,
                 mdVacc: cute.Tensor, softmax_scale: Float32, window_left: Int32, window_right: Int32,
                 stream: cuda.CUstream):
        # (b, s, h, d) -> (s, d, h, b); (b, h, s) -> (s, h, b): the sequence is the tiled mode.
        mQ, mK, mV, mdO, mdQacc, mdKacc, mdVacc = [
            cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))
            for t in (mQ, mK, mV, mdO, mdQacc, mdKacc, mdVacc)]
        mLSE, mdPsum = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 1, 0])) for t in (mLSE, mdPsum)]
        num_heads, num_batch = mQ.shape[2], mQ.shape[3]
        qhead_per_kvhead = num_heads // mK.shape[2]

        K_major, MN_major = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        # S^T = K Q^T and dP^T = V dO^T: keys are the M mode, one 64-key atom per consumer warpgroup.
        tiled_mma_sdp = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_major, K_major, Float32,
            atom_layout_mnk=(NUM_CONSUMER_WARPGROUPS, 1, 1), tiler_mn=(64, self.tile_m))
        # dK += dS^T Q and dV += P^T dO: A from registers, B = Q / dO read N-major.
        tiled_mma_dkv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_major, MN_major, Float32,
            atom_layout_mnk=(NUM_CONSUMER_WARPGROUPS, 1, 1), tiler_mn=(64, self.hdim),
            a_source=warpgroup.OperandSource.RMEM)
        # dQ = dS K: the 64 query rows once, the head dim split between the two warpgroups.
        tiled_mma_dq = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_major, MN_major, Float32,
            atom_layout_mnk=(1, NUM_CONSUMER_WARPGROUPS, 1), tiler_mn=(64, self.hdim // NUM_CONSUMER_WARPGROUPS))

        sQ_layout = smem_layout(self.dtype, self.tile_m, self.hdim, self.num_stages)
        sdO_layout = smem_layout(self.dtype, self.tile_m, self.hdim, self.num_stages)
        sK_layout = smem_layout(self.dtype, self.tile_n, self.hdim)
        sV_layout = smem_layout(self.dtype, self.tile_n, self.hdim)
        sdS_layout = smem_layout(self.dtype, self.tile_m, self.tile_n)  # (queries, keys)

        tma_load = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(
            tma_load, mQ, cute.select(sQ_layout, mode=[0, 1]), (self.tile_m, self.hdim), 1)
        tma_atom_dO, tma_dO = cpasync.make_tiled_tma_atom(
            tma_load, mdO, cute.select(sdO_layout, mode=[0, 1]), (self.tile_m, self.hdim), 1)
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(tma_load, mK, sK_layout, (self.tile_n, self.hdim))
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(tma_load, mV, sV_layout, (self.tile_n, self.hdim))
        self.tma_bytes_kv = cute.size_in_bytes(self.dtype, sK_layout) + cute.size_in_bytes(self.dtype, sV_layout)
        self.tma_bytes_qdo = 2 * cute.size_in_bytes(self.dtype, cute.select(sQ_layout, mode=[0, 1]))

        @cute.struct
        class SharedStorage:
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_qdo: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdO_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdS_layout)], 1024]

        self.shared_storage = SharedStorage
        num_n_blocks = (mK.shape[0] + self.tile_n - 1) // self.tile_n
        self.kernel(
            tma_atom_Q, tma_Q, tma_atom_dO, tma_dO, tma_atom_K, tma_K, tma_atom_V, tma_V,
            mLSE, mdPsum, mdQacc, mdKacc, mdVacc, softmax_scale, softmax_scale * LOG2_E,
            window_left, window_right, qhead_per_kvhead,
            sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout,
            tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq,
        ).launch(grid=(num_n_blocks, num_heads, num_batch), block=[self.num_threads, 1, 1],
                 stream=stream, min_blocks_per_mp=1)

    # ------------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, tma_atom_Q: cute.CopyAtom, mQ: cute.Tensor, tma_atom_dO: cute.CopyAtom, mdO: cute.Tensor,
               tma_atom_K: cute.CopyAtom, mK: cute.Tensor, tma_atom_V: cute.CopyAtom, mV: cute.Tensor,
               mLSE: cute.Tensor, mdPsum: cute.Tensor, mdQacc: cute.Tensor, mdKacc: cute.Tensor,
               mdVacc: cute.Tensor, softmax_scale: Float32, scale_log2: Float32,
               window_left: Int32, window_right: Int32, qhead_per_kvhead: Int32,
               sQ_layout: cute.ComposedLayout, sdO_layout: cute.ComposedLayout,
               sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
               sdS_layout: cute.ComposedLayout, tiled_mma_sdp: cute.TiledMma,
               tiled_mma_dkv: cute.TiledMma, tiled_mma_dq: cute.TiledMma):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == 0:
            for atom in (tma_atom_Q, tma_atom_dO, tma_atom_K, tma_atom_V):
                cpasync.prefetch_descriptor(atom)

        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)

        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumers = pipeline.CooperativeGroup(
            pipeline.Agent.Thread, NUM_CONSUMER_WARPGROUPS * WARPGROUP_THREADS // cute.arch.WARP_SIZE)
        pipe_kv = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_kv.data_ptr(), num_stages=1, producer_group=producer,
            consumer_group=consumers, tx_count=self.tma_bytes_kv, defer_sync=True)
        pipe_qdo = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_qdo.data_ptr(), num_stages=self.num_stages, producer_group=producer,
            consumer_group=consumers, tx_count=self.tma_bytes_qdo, defer_sync=True)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        n_block, head, batch = cute.arch.block_idx()
        seqlen = SeqlenInfo.create(batch, mQ.shape[0], mK.shape[0])
        mask = AttentionMask(self.tile_m, self.tile_n, self.cfg.causal, self.cfg.local, window_left, window_right)
        m_block_min, m_block_max = mask.m_block_range(seqlen, n_block)
        head_kv = head // qhead_per_kvhead

        warpgroup_idx = cute.arch.make_warp_uniform(tidx // WARPGROUP_THREADS)
        if warpgroup_idx == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
            if warp_idx == 0:
                self.produce(tma_atom_Q, mQ, tma_atom_dO, mdO, tma_atom_K, mK, tma_atom_V, mV,
                             sQ, sdO, sK, sV, pipe_kv, pipe_qdo, n_block, head, head_kv, batch,
                             m_block_min, m_block_max)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
            self.consume(tidx - WARPGROUP_THREADS, sQ, sdO, sK, sV, sdS, pipe_kv, pipe_qdo,
                         tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq, mLSE, mdPsum, mdQacc, mdKacc,
                         mdVacc, seqlen, mask, n_block, head, head_kv, batch, m_block_min, m_block_max,
                         softmax_scale, scale_log2)

    # ---- producer warp --------------------------------------------------------------------------
    @cute.jit
    def produce(self, tma_atom_Q, mQ, tma_atom_dO, mdO, tma_atom_K, mK, tma_atom_V, mV,
                sQ, sdO, sK, sV, pipe_kv, pipe_qdo, n_block, head, head_kv, batch,
                m_block_min, m_block_max):
        gK = cute.local_tile(mK[None, None, head_kv, batch], (self.tile_n, self.hdim), (n_block, 0))
        gV = cute.local_tile(mV[None, None, head_kv, batch], (self.tile_n, self.hdim), (n_block, 0))
        gQ = cute.local_tile(mQ[None, None, head, batch], (self.tile_m, self.hdim), (None, 0))
        gdO = cute.local_tile(mdO[None, None, head, batch], (self.tile_m, self.hdim), (None, 0))
        tKsK, tKgK = tma_partition_tile(tma_atom_K, sK, gK)
        tVsV, tVgV = tma_partition_tile(tma_atom_V, sV, gV)
        tQsQ, tQgQ = tma_partition_tile(tma_atom_Q, sQ, gQ)
        tdOsdO, tdOgdO = tma_partition_tile(tma_atom_dO, sdO, gdO)

        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        pipe_kv.producer_acquire(kv_state)
        cute.copy(tma_atom_K, tKgK, tKsK, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))
        cute.copy(tma_atom_V, tVgV, tVsV, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        for m_block in cutlass.range(m_block_min, m_block_max, unroll=1):
            pipe_qdo.producer_acquire(state)
            cute.copy(tma_atom_Q, tQgQ[None, m_block], tQsQ[None, state.index],
                      tma_bar_ptr=pipe_qdo.producer_get_barrier(state))
            cute.copy(tma_atom_dO, tdOgdO[None, m_block], tdOsdO[None, state.index],
                      tma_bar_ptr=pipe_qdo.producer_get_barrier(state))
            state = advanced(state)

    # ---- consumer warpgroups --------------------------------------------------------------------
    @cute.jit
    def consume(self, tidx, sQ, sdO, sK, sV, sdS, pipe_kv, pipe_qdo, tiled_mma_sdp, tiled_mma_dkv,
                tiled_mma_dq, mLSE, mdPsum, mdQacc, mdKacc, mdVacc, seqlen: SeqlenInfo,
                mask: AttentionMask, n_block, head, head_kv, batch, m_block_min, m_block_max,
                softmax_scale, scale_log2):
        wg_first = (tidx // WARPGROUP_THREADS) * WARPGROUP_THREADS
        wg_sdp, thr_sdp = tiled_mma_sdp.get_slice(wg_first), tiled_mma_sdp.get_slice(tidx)
        wg_dkv, thr_dkv = tiled_mma_dkv.get_slice(wg_first), tiled_mma_dkv.get_slice(tidx)
        wg_dq, thr_dq = tiled_mma_dq.get_slice(wg_first), tiled_mma_dq.get_slice(tidx)

        # Operands. S^T = K Q^T, dP^T = V dO^T: A = K / V (keys x d), B = Q / dO (queries x d).
        tSrK = wg_sdp.make_fragment_A(wg_sdp.partition_A(sK))
        tSrQ = wg_sdp.make_fragment_B(wg_sdp.partition_B(sQ))  # (..., stage)
        tPrV = wg_sdp.make_fragment_A(wg_sdp.partition_A(sV))
        tPrdO = wg_sdp.make_fragment_B(wg_sdp.partition_B(sdO))
        # dV += P^T dO, dK += dS^T Q: B = dO^T / Q^T (d x queries), N-major views.
        tVrdOt = wg_dkv.make_fragment_B(wg_dkv.partition_B(transpose_view(sdO)))
        tKrQt = wg_dkv.make_fragment_B(wg_dkv.partition_B(transpose_view(sQ)))
        # dQ = dS K: A = dS (queries x keys), B = K^T (d x keys), N-major view.
        tQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(sdS))
        tQrKt = wg_dq.make_fragment_B(wg_dq.partition_B(transpose_view(sK)))

        acc_sdp_shape = thr_sdp.partition_shape_C((self.tile_n, self.tile_m))
        acc_dK = thr_dkv.make_fragment_C(thr_dkv.partition_shape_C((self.tile_n, self.hdim)))
        acc_dV = thr_dkv.make_fragment_C(thr_dkv.partition_shape_C((self.tile_n, self.hdim)))
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)
        acc_dq_shape = thr_dq.partition_shape_C((self.tile_m, self.hdim))

        # (key, query) of each score element, and where each element of dS^T goes in sdS.
        tScS = acc_rows_view(thr_sdp.partition_C(cute.make_identity_tensor((self.tile_n, self.tile_m))))
        tQcdQ = thr_dq.partition_C(cute.make_identity_tensor((self.tile_m, self.hdim)))
        rP = cute.make_rmem_tensor(acc_sdp_shape, self.dtype)
        rdS = cute.make_rmem_tensor(acc_sdp_shape, self.dtype)

        gLSE = mLSE[None, head, batch]
        gdPsum = mdPsum[None, head, batch]
        gdQ = mdQacc[None, None, head, batch]

        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pipe_kv.consumer_wait(kv_state)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        for m_block in cutlass.range(m_block_min, m_block_max, unroll=1):
            pipe_qdo.consumer_wait(state)
            acc_S = cute.make_rmem_tensor(acc_sdp_shape, Float32)
            acc_dP = cute.make_rmem_tensor(acc_sdp_shape, Float32)
            wgmma(tiled_mma_sdp, acc_S, tSrK, tSrQ[None, None, None, state.index], zero_init=True)
            wgmma(tiled_mma_sdp, acc_dP, tPrV, tPrdO[None, None, None, state.index], zero_init=True)
            warpgroup.wait_group(0)

            s_rows, dp_rows = acc_rows_view(acc_S), acc_rows_view(acc_dP)
            for c in cutlass.range_constexpr(cute.size(s_rows, mode=[1])):
                # Per-query statistics and visible keys, computed where they are used: holding them
                # for every column across the GEMMs spills registers at d=128. A row past the
                # sequence gets LSE = +inf, so P = 0.
                row = m_block * self.tile_m + tScS[0, c][1]
                lo, hi = mask.key_bounds(seqlen, row, n_block)
                lse = Float32.inf
                dpsum = Float32(0.0)
                if row < seqlen.seqlen_q:
                    lse = gLSE[row]
                    dpsum = gdPsum[row]
                for r in cutlass.range_constexpr(cute.size(s_rows, mode=[0])):
                    key = tScS[r, 0][0]
                    p = cute.math.exp2(s_rows[r, c] * scale_log2 - lse, fastmath=True)
                    if key >= hi or key < lo:
                        p = Float32(0.0)
                    s_rows[r, c] = p
                    dp_rows[r, c] = p * (dp_rows[r, c] - dpsum)  # dS^T, without the softmax scale
            rP.store(acc_S.load().to(self.dtype))
            rdS.store(acc_dP.load().to(self.dtype))

            # dV += P^T dO and dK += dS^T Q, both from registers.
            wgmma(tiled_mma_dkv, acc_dV, acc_as_a_operand(rP), tVrdOt[None, None, None, state.index],
                  zero_init=False)
            wgmma(tiled_mma_dkv, acc_dK, acc_as_a_operand(rdS), tKrQt[None, None, None, state.index],
                  zero_init=False)

            # dQ needs every key of the tile: both warpgroups' dS go through shared memory. The
            # barrier before the writes keeps the previous block's dQ GEMM reads intact.
            cute.arch.barrier(barrier_id=DS_BARRIER, number_of_threads=NUM_CONSUMER_WARPGROUPS * WARPGROUP_THREADS)
            ds_rows = acc_rows_view(rdS)
            for r in cutlass.range_constexpr(cute.size(ds_rows, mode=[0])):
                for c in cutlass.range_constexpr(cute.size(ds_rows, mode=[1])):
                    sdS[tScS[r, c][1], tScS[r, c][0]] = ds_rows[r, c]
            cute.arch.fence_view_async_shared()  # generic-proxy writes -> visible to WGMMA
            cute.arch.barrier(barrier_id=DS_BARRIER, number_of_threads=NUM_CONSUMER_WARPGROUPS * WARPGROUP_THREADS)
            acc_dQ = cute.make_rmem_tensor(acc_dq_shape, Float32)
            wgmma(tiled_mma_dq, acc_dQ, tQrdS, tQrKt, zero_init=True)
            warpgroup.wait_group(0)  # dV, dK and dQ GEMMs done: rP, rdS, sQ, sdO and sdS are free
            pipe_qdo.consumer_release(state)
            state = advanced(state)

            # dQ (unscaled) into the fp32 accumulator, rows inside the sequence only.
            for i in cutlass.range_constexpr(cute.size(acc_dQ)):
                row, col = tQcdQ[i]
                row = row + m_block * self.tile_m
                if row < seqlen.seqlen_q:
                    cute.arch.red(gdQ.iterator + cute.crd2idx((row, col), gdQ.layout), acc_dQ[i],
                                  op="add", dtype="f32", sem="relaxed", scope="gpu")

        pipe_kv.consumer_release(kv_state)
        self.epilogue(thr_dkv, acc_dK, acc_dV, mdKacc, mdVacc, seqlen, n_block, head_kv, batch, softmax_scale)

    @cute.jit
    def epilogue(self, thr_dkv, acc_dK, acc_dV, mdKacc, mdVacc, seqlen: SeqlenInfo, n_block, head_kv,
                 batch, softmax_scale):
        """dK (times the softmax scale) and dV added into the fp32 accumulators of the KV head, so
        that the query heads sharing it (GQA) sum up."""
        gdK = mdKacc[None, None, head_kv, batch]
        gdV = mdVacc[None, None, head_kv, batch]
        tcKV = thr_dkv.partition_C(cute.make_identity_tensor((self.tile_n, self.hdim)))
        for i in cutlass.range_constexpr(cute.size(acc_dK)):
            row, col = tcKV[i]
            row = row + n_block * self.tile_n
            if row < seqlen.seqlen_k:
                cute.arch.red(gdK.iterator + cute.crd2idx((row, col), gdK.layout), acc_dK[i] * softmax_scale,
                              op="add", dtype="f32", sem="relaxed", scope="gpu")
                cute.arch.red(gdV.iterator + cute.crd2idx((row, col), gdV.layout), acc_dV[i],
                              op="add", dtype="f32", sem="relaxed", scope="gpu")
