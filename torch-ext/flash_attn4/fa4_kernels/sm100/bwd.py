"""FlashAttention backward for Blackwell (sm_100a), one CTA per KV tile: tcgen05 MMAs with S^T,
dP^T, dK, dV and dQ in tensor memory.

A CTA owns TILE_N = 128 keys of one KV head (KV-stationary, as the sm90 backward) and walks, for
every query head sharing that KV head, the 128-row query blocks that see its keys. dK and dV
accumulate in tensor memory over the whole walk and are written once; dQ, which every KV tile
contributes to, is reduce-added into the zeroed float32 dq_accum per query block. The
preprocessing (fa4_kernels/bwd_preprocess.py) supplies LSE in log2 units and D = rowsum(dO * O),
the postprocessing (bwd_postprocess.py) scales and casts dQ. Call convention: BackwardConfig.

Masks and sequences are the shared modules': SeqlenInfo (varlen cu_seqlens, seqused_k: each
sequence addressed at its offsets, a KV tile past its sequence's keys has no step and writes
nothing) and AttentionMask (causal, local windows: which query blocks a KV tile visits, which of
them need the element-wise mask, the deterministic order's first KV block). Rows that see no key
have LSE +inf from the preprocessing, so P = 0 and their dQ stays 0. Softcap: P is recomputed from
cap * tanh(s * scale / cap) and dS^T carries the factor 1 - tanh^2.

Warp roles (16 warps):

    warps 0-3    dQ          thread = query row = TMEM lane: dQ_i from TMEM in BWD_DQ_CHUNK-column
                             chunks, staged in shared memory (dq_accum.py's order), one TMA
                             reduce-add (cp.reduce.async.bulk.tensor .add.f32) per chunk
    warps 4-7    compute 0   thread = key row = TMEM lane, query columns 0-63 of the block:
    warps 8-11   compute 1   ... and columns 64-127 (two warpgroups per lane quadrant: half the
                             exponentials and registers each)
                             by 32-column chunks: P^T = exp2(S^T * scale_log2 - LSE) (masked
                             entries 0), to TMEM as 16-bit over S^T columns it has read;
                             dS^T = P^T * (dP^T - D), to shared memory as 16-bit;
                             at the end dK * softmax_scale and dV from TMEM to
                             global memory (each warpgroup half of the head dim)
    warp 12      MMA         one thread issues every tcgen05 MMA (below) and commits them
    warp 13      load        TMA: K and V once; per step Q_i, dO_i (one ring of stages) and LSE_i,
                             D_i (their own ring, read by the compute warps)
    warps 14-15  idle

Deterministic (cfg.deterministic): the dQ warp adds a query block's chunks only once the block's
semaphore (dq_semaphore[batch, head, m_block, 0]) counts every earlier KV block that sees it, and
counts its own after its reduce-adds landed (deterministic_turn / deterministic_done).

First, in the tile that holds its sequence's last key (varlen keys, seqused_k), the MMA warp waits for
K and V and zeroes their rows past the keys (zero_kv_tail: NaN there would reach dQ). Then
per step i (query head h, query block m), the MMA warp issues, waiting where marked:
    [Q_i, dO_i landed]  [dQ_(i-1) read out, when dQ shares dP's columns]
    S^T = K Q_i^T, dP^T = V dO_i^T                       -> commit "S/dP full"
    [P^T and dS^T written: the compute warps' release]
    dV += P^T dO_i (A = P^T from TMEM), dK += dS^T Q_i   -> commit "Q_i/dO_i free"
    [dQ_(i-1) read out, otherwise]
    dQ_i = dS K (A = dS^T's buffer read M-major)         -> commit "dQ full"
and after the last step commits "dK/dV final". tcgen05 MMAs of one thread run in order, so S^T of
step i+1 overwrites P^T only after dV_i read it, and the compute warps, which write dS^T of step
i+1 only after "S/dP full" of i+1, find dK_i and dQ_i (the readers of dS^T_i) complete.

Why P^T in TMEM and dS^T in shared memory: dQ = dS K needs dS with the queries as M, which TMEM
(lanes = keys here) cannot give, so dS^T goes to shared memory anyway and dK reads it there; P^T
feeds only dV, whose A operand may come from TMEM (lanes = keys = M), which saves 32 KiB of shared
memory and its bandwidth (at d = 128 the Q/dO stage fits only without a P^T buffer).
Why a TMA reduce-add for dQ: one bulk instruction per 16 KiB chunk instead of 32 red.global.add.f32
per thread and chunk (the DSL has no vector red.global), and the smem staging is conflict-free.

Tensor memory (512 columns, lane = key row for S^T, dP^T, dK, dV; = query row for dQ):
    S^T 0-127 (P^T of compute warpgroup w: 16-bit pairs at 64 w .. 64 w + 31, over its own S^T
    columns), dP^T 128-255, dK 256.. (d), dV 256 + d.. (dv), dQ 256 + d + dv.. where that fits
    (d = dv = 64), else over dP^T's columns (d <= 128), after dS^T was computed from them.

Synchronisation (mbarrier pipelines, cutlass.pipeline):
    kv    TMA -> MMA        K and V, once
    qdo   TMA -> MMA        Q_i, dO_i per step (num_stages); released by tcgen05.commit
    rows  TMA -> compute    LSE_i, D_i per step (num_stages); released by each compute warp
    sdp   MMA -> compute    "S/dP full"; its empty barrier is "P^T and dS^T written"
    dq    MMA -> dQ         "dQ full"; its empty barrier is "dQ read out of TMEM"
    dkv   MMA -> compute    "dK/dV final", once
Named barriers: Barrier below. tests/cpu/test_sm100_bwd_protocol.py replays these calls on the
CPU (no deadlock, every hand-off sees its producer); tests/cpu/test_sm100_bwd_static.py checks
the compiled kernel (MMA count, TMEM, budgets, spills).
Tensor-memory hand-offs follow fwd.py: every tcgen05.ld/st is waited for (wait::ld/st) before the
barrier arrival that hands its columns on; shared-memory writes read by MMAs or TMA are fenced
(fence.proxy.async) before theirs.
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
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, tcgen05

from ..config import BackwardConfig
from ..dtypes import CUTLASS_DTYPES
from ..kv_tail import first_row_past_keys, tail_possible, zero_rows
from ..layouts import tma_partition_tile
from ..mask import AttentionMask
from ..pipelines import advanced
from ..scheduler import TileScheduler
from ..seqlen import SeqlenInfo, head_rows, packed_row_offset
from ..softmax import BackwardScales
from ..tile_work import QueryBlocks, TileWork
from .dq_accum import ROW, VECTOR, DqChunks, chunk_tiles
from .fwd import LAUNCH_REGISTERS, TMEM_COLUMNS, WARP, WARPGROUP, gemm, set_registers
from .tiles import (BWD_DQ_BUFFERS, BWD_DQ_CHUNK, BWD_TILE_M, L2_BUDGET_BYTES, SMEM_BYTES, TILE_N,
                    backward_shared_memory_bytes)

NUM_WARPS = 16
COMPUTE_GROUPS = 2  # compute warpgroups, each owning TILE_M / COMPUTE_GROUPS query columns
MMA_K = 16  # reduction depth of one 16-bit tcgen05 MMA


class Warp(enum.IntEnum):
    """Warp roles (warp index in the CTA). Every warpgroup that touches TMEM starts at a multiple
    of 4: warp w may only access lanes 32 * (w % 4) .. + 31."""

    DQ = 0  # warps 0-3
    COMPUTE = 4  # warps 4-7 (query columns 0-63) and 8-11 (64-127)
    MMA = 12
    LOAD = 13  # warps 14-15 idle


class Barrier(enum.IntEnum):
    """Named barrier ids (0 is __syncthreads)."""

    TMEM_ALLOC = 1  # the allocating warp published the TMEM address (MMA, compute, dQ warps)
    TMEM_FREE = 2  # compute and dQ warps are done with TMEM
    DQ_STAGE = 3  # the dQ warpgroup: a staging buffer is free / filled


# setmaxnreg budgets per warpgroup (registers per thread; the four warpgroups share 512 x 128).
# compute: one 32-column chunk of P^T, of dP^T and of dS^T (holding all 64 columns of P^T spilled
# in the causal kernels at 160 and 168); dQ: one 32-column chunk. The MMA warp's 40 descriptors at
# d = 128 spilled at 80, 96 and 104 registers under ptxas 13.4 and at 112 under 12.9 (the cu12
# flavour), not at 128 (the launch share: that warpgroup needs no setmaxnreg).
REGISTERS = dict(dq=64, compute=160, other=128)
# Two Q/dO stages with a head dim above 64 (d = 96, or dv != d): the stages' descriptors spilled the
# MMA/load warpgroup at 128 registers under ptxas 12.9 (8-16 B at d = 96; not under 13.4): 8 more
# there, from the dQ warpgroup (at most four 32-column chunks).
REGISTERS_TWO_STAGES = dict(dq=56, compute=160, other=136)


def registers(head_dim: int, head_dim_v: int, num_stages: int) -> dict:
    """setmaxnreg budgets per warpgroup role for these head dims and Q/dO stages."""
    return REGISTERS_TWO_STAGES if num_stages > 1 and max(head_dim, head_dim_v) > 64 else REGISTERS


def out_chunk(dim: int) -> int:
    """Columns per TMEM load when a compute warpgroup writes its half of dK or dV (dim columns)."""
    half = dim // COMPUTE_GROUPS
    width = BWD_DQ_CHUNK if half % BWD_DQ_CHUNK == 0 else MMA_K
    assert half % width == 0
    return width


class FlashAttentionBackwardSm100:
    def __init__(self, cfg: BackwardConfig):
        # BackwardConfig ran tiles.check_backward: head_dim and head_dim_v in BWD_HEAD_DIMS, 128 x 128 tiles.
        self.cfg = cfg
        self.dtype = CUTLASS_DTYPES[cfg.dtype]
        self.hdim, self.hdim_v = cfg.head_dim, cfg.head_dim_v
        self.num_stages = cfg.num_stages
        self.dq = DqChunks(BWD_TILE_M, self.hdim)
        self.registers = registers(self.hdim, self.hdim_v, self.num_stages)
        regs = self.registers
        assert regs["dq"] + COMPUTE_GROUPS * regs["compute"] + regs["other"] == 4 * LAUNCH_REGISTERS
        self.plan_tmem()
        # P^T of compute warpgroup w: its 64 query columns as 32 words of 16-bit pairs at 64 w.
        self.cols_per_group = BWD_TILE_M // COMPUTE_GROUPS
        self.p_words = self.cols_per_group * self.dtype.width // 32
        # dK and dV leave TMEM by chunks of a compute warpgroup's half of their head dim: BWD_DQ_CHUNK
        # columns, or 16 where the half is no multiple of it (96: 48 columns per warpgroup).
        self.dk_chunk, self.dv_chunk = (out_chunk(dim) for dim in (self.hdim, self.hdim_v))
        assert self.hdim % BWD_DQ_CHUNK == 0
        # The MMA warp zeroes K's and V's rows past the keys (zero_kv_tail) where the tensor can
        # hold such rows: varlen keys or seqused_k.
        self.zero_tail = tail_possible(cfg)

    def plan_tmem(self):
        """Tensor-memory plan (columns; module docstring)."""
        self.tmem_s, self.tmem_dp = 0, TILE_N
        self.tmem_dk = 2 * TILE_N
        self.tmem_dv = self.tmem_dk + self.hdim
        after_dv = self.tmem_dv + self.hdim_v
        self.dq_over_dp = after_dv + self.hdim > TMEM_COLUMNS
        self.tmem_dq = self.tmem_dp if self.dq_over_dp else after_dv
        assert after_dv <= TMEM_COLUMNS and self.tmem_dq + self.hdim <= TMEM_COLUMNS
        assert not self.dq_over_dp or self.hdim <= BWD_TILE_M

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
        mQ, mK, mV, mdO, mdK, mdV, mLSE, mdPsum, mdQacc, num_batch = self.sequence_first(
            mQ, mK, mV, mdO, mdK, mdV, mLSE, mdPsum, mdQacc, mCuSeqlensQ)
        num_heads_kv = mK.shape[2]
        qhead_per_kvhead = mQ.shape[2] // num_heads_kv

        mma_s, mma_dv, mma_dk, mma_dq = self.tiled_mmas(tcgen05.CtaGroup.ONE, TILE_N, tcgen05.OperandSource.SMEM)
        tilers = self.tilers(TILE_N)
        layouts = self.smem_layouts(mma_s, mma_dv, mma_dk, mma_dq, tilers)
        # Q, dO, K and dS^T are each read by two MMAs in different orientations from one buffer:
        # both views must put every element at the same offset (checked here, at trace time).
        check_same_elements(layouts.q, layouts.qt, BWD_TILE_M, d, "Q")
        check_same_elements(layouts.do, layouts.dot, BWD_TILE_M, dv, "dO")
        check_same_elements(layouts.k, layouts.kt, TILE_N, d, "K")
        check_same_elements(layouts.dst, layouts.ds, TILE_N, BWD_TILE_M, "dS^T")
        if cutlass.const_expr(self.zero_tail):
            check_key_rows(mma_s, layouts.k, d, "K")
            check_key_rows(mma_s, layouts.v, dv, "V")
        rows_layout = cute.make_layout((BWD_TILE_M, self.num_stages))
        # dQ staging: one chunk per buffer in dq_accum's order, rows of ROW floats (a TMA box).
        dq_rows = self.dq.rows_per_chunk
        sdQ_layout = cute.make_layout((dq_rows, ROW, BWD_DQ_BUFFERS), stride=(ROW, 1, dq_rows * ROW))

        tma_load = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        tma_atom_K, tma_K = cute.nvgpu.make_tiled_tma_atom_A(
            tma_load, mK, cute.select(layouts.k, mode=[0, 1, 2]), tilers.s, mma_s)
        tma_atom_V, tma_V = cute.nvgpu.make_tiled_tma_atom_A(
            tma_load, mV, cute.select(layouts.v, mode=[0, 1, 2]), tilers.dp, mma_s)
        tma_atom_Q, tma_Q = cute.nvgpu.make_tiled_tma_atom_B(
            tma_load, mQ, cute.select(layouts.q, mode=[0, 1, 2]), tilers.s, mma_s)
        tma_atom_dO, tma_dO = cute.nvgpu.make_tiled_tma_atom_B(
            tma_load, mdO, cute.select(layouts.do, mode=[0, 1, 2]), tilers.dp, mma_s)
        tma_atom_LSE, tma_LSE, tma_atom_dPsum, tma_dPsum = row_tma_atoms(mLSE, mdPsum)
        tma_atom_dQ, tma_dQ = cpasync.make_tiled_tma_atom(
            cpasync.CopyReduceBulkTensorTileS2GOp(), mdQacc, cute.select(sdQ_layout, mode=[0, 1]), (dq_rows, ROW))
        one_stage = [cute.size_in_bytes(self.dtype, cute.select(getattr(layouts, t), mode=[0, 1, 2]))
                     for t in ("k", "v", "q", "do")]
        self.tma_bytes_kv = one_stage[0] + one_stage[1]
        self.tma_bytes_qdo = one_stage[2] + one_stage[3]
        self.tma_bytes_rows = 2 * BWD_TILE_M * 4

        @cute.struct
        class SharedStorage:
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_qdo: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            mbar_rows: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            mbar_sdp: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_dq: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_dkv: cute.struct.MemRange[cutlass.Int64, 2]
            tmem_address: Int32
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(rows_layout)], 128]
            sdPsum: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(rows_layout)], 128]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts.k)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts.v)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts.q)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts.do)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts.dst)], 1024]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sdQ_layout)], 1024]

        self.set_shared_storage(SharedStorage, backward_shared_memory_bytes(d, self.num_stages, self.dtype.width // 8,
                                                                             dv), f"{self.num_stages} stages")
        scales = BackwardScales.of(softmax_scale, softcap, cutlass.const_expr(self.cfg.has_softcap))
        scheduler = self.scheduler(max_seqlen_k, TILE_N, mQ, qhead_per_kvhead, num_heads_kv, num_batch)
        self.kernel(
            tma_atom_Q, tma_Q, tma_atom_dO, tma_dO, tma_atom_K, tma_K, tma_atom_V, tma_V,
            tma_atom_LSE, tma_LSE, tma_atom_dPsum, tma_dPsum, tma_atom_dQ, tma_dQ, mdK, mdV,
            mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mSemaphore, scales, window_left, window_right,
            qhead_per_kvhead, layouts, rows_layout, sdQ_layout,
            mma_s, mma_dv, mma_dk, mma_dq, scheduler,
        ).launch(grid=scheduler.grid(), block=[NUM_WARPS * WARP, 1, 1], stream=stream, min_blocks_per_mp=1)

    # ---- host-side pieces the 1-CTA, pair and serial kernels share ----------------------------------
    def sequence_first(self, mQ, mK, mV, mdO, mdK, mdV, mLSE, mdPsum, mdQacc, mCuSeqlensQ) -> tuple:
        """The kernel's views, sequence first: (seq, d, head[, batch]), (seq_pad, head[, batch]),
        dq_accum (rows, 128, head[, batch]); varlen packs the sequences along seq (no batch mode).
        Returns the nine views and the number of sequences."""
        per_token = (mQ, mK, mV, mdO, mdK, mdV)
        if cutlass.const_expr(self.cfg.varlen):
            per_token = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=[0, 2, 1])) for t in per_token]
            rows = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 0])) for t in (mLSE, mdPsum)]
            mdQacc = cute.make_tensor(mdQacc.iterator, cute.select(mdQacc.layout, mode=[1, 2, 0]))
            num_batch = mCuSeqlensQ.shape[0] - 1
        else:
            per_token = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0])) for t in per_token]
            rows = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 1, 0])) for t in (mLSE, mdPsum)]
            mdQacc = cute.make_tensor(mdQacc.iterator, cute.select(mdQacc.layout, mode=[2, 3, 1, 0]))
            num_batch = per_token[0].shape[3]
        return (*per_token, *rows, mdQacc, num_batch)

    def tiled_mmas(self, cta_group, keys: int, dk_a_source) -> tuple:
        """(S^T / dP^T, dV, dK, dQ) MMAs over ``keys`` keys (TILE_N per CTA, or a pair's M = 256);
        ``dk_a_source``: where dK's A operand dS^T comes from (shared memory, or a pair's TMEM)."""
        major = cute.nvgpu.OperandMajorMode
        d, dv = self.hdim, self.hdim_v
        # S^T = K Q^T and dP^T = V dO^T: (keys, queries, d or dv), both operands head-dim-contiguous.
        mma_s = sm100_utils.make_trivial_tiled_mma(self.dtype, major.K, major.K, Float32, cta_group,
                                                   (keys, BWD_TILE_M))
        # dV += P^T dO: A = P^T (keys, queries) from TMEM, B = dO^T (d, queries) d-contiguous.
        mma_dv = sm100_utils.make_trivial_tiled_mma(self.dtype, major.K, major.MN, Float32, cta_group, (keys, dv),
                                                    tcgen05.OperandSource.TMEM)
        # dK += dS^T Q: A = dS^T (keys, queries) queries-contiguous, B = Q^T (d, queries).
        mma_dk = sm100_utils.make_trivial_tiled_mma(self.dtype, major.K, major.MN, Float32, cta_group, (keys, d),
                                                    dk_a_source)
        # dQ = dS K: A = dS (queries, keys) from dS^T's buffer, B = K^T (d, keys), both MN-major.
        mma_dq = sm100_utils.make_trivial_tiled_mma(self.dtype, major.MN, major.MN, Float32, cta_group,
                                                    (BWD_TILE_M, d))
        return mma_s, mma_dv, mma_dk, mma_dq

    def tilers(self, keys: int) -> "Tilers":
        d, dv = self.hdim, self.hdim_v
        return Tilers(s=(keys, BWD_TILE_M, d), dp=(keys, BWD_TILE_M, dv), dk=(keys, d, BWD_TILE_M),
                      dv=(keys, dv, BWD_TILE_M), dq=(BWD_TILE_M, d, keys))

    def smem_layouts(self, mma_s, mma_dv, mma_dk, mma_dq, tilers: "Tilers") -> "SmemLayouts":
        """Each operand's shared-memory layout as its MMA reads it; Q, dO and their transposes with
        the kernel's stages, the rest once."""
        a, b, stages = sm100_utils.make_smem_layout_a, sm100_utils.make_smem_layout_b, self.num_stages
        return SmemLayouts(
            k=a(mma_s, tilers.s, self.dtype, 1), v=a(mma_s, tilers.dp, self.dtype, 1),
            q=b(mma_s, tilers.s, self.dtype, stages), do=b(mma_s, tilers.dp, self.dtype, stages),
            qt=b(mma_dk, tilers.dk, self.dtype, stages), dot=b(mma_dv, tilers.dv, self.dtype, stages),
            kt=b(mma_dq, tilers.dq, self.dtype, 1), dst=a(mma_dk, tilers.dk, self.dtype, 1),
            ds=a(mma_dq, tilers.dq, self.dtype, 1), p=a(mma_dv, tilers.dv, self.dtype, 1))

    def set_shared_storage(self, storage, planned: int, what: str) -> None:
        """Keep the kernel's SharedStorage after checking it against the tiles module's plan (which
        dispatch sized the kernel by) and the per-CTA limit, at trace time."""
        if cutlass.const_expr(storage.size_in_bytes() > planned or planned > SMEM_BYTES):
            raise ValueError(f"sm100 backward ({type(self).__name__}): {storage.size_in_bytes()} bytes of shared "
                             f"memory (plan {planned}, limit {SMEM_BYTES}) at head dims {self.hdim}/{self.hdim_v}, "
                             f"{what}")
        self.shared_storage = storage

    def scheduler(self, max_seqlen_k, keys: int, mQ, qhead_per_kvhead, num_heads_kv, num_batch,
                  cluster_m: int = 1) -> TileScheduler:
        """The KV-stationary grid: one CTA (or cluster) per ``keys`` keys of a (KV head, batch),
        grouped by the bytes of Q and dO a KV head's CTAs share in L2."""
        qdo_bytes_per_head = mQ.shape[0] * 2 * self.hdim * (self.dtype.width // 8) * qhead_per_kvhead
        return TileScheduler.create((max_seqlen_k + keys - 1) // keys, num_heads_kv, num_batch, qdo_bytes_per_head,
                                    longest_first=False, longest_block_last=False,
                                    l2_budget_bytes=L2_BUDGET_BYTES, cluster_m=cluster_m)

    # ------------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, tma_atom_Q: cute.CopyAtom, mQ: cute.Tensor, tma_atom_dO: cute.CopyAtom, mdO: cute.Tensor,
               tma_atom_K: cute.CopyAtom, mK: cute.Tensor, tma_atom_V: cute.CopyAtom, mV: cute.Tensor,
               tma_atom_LSE: cute.CopyAtom, mLSE: cute.Tensor, tma_atom_dPsum: cute.CopyAtom, mdPsum: cute.Tensor,
               tma_atom_dQ: cute.CopyAtom, mdQacc: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor,
               mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor],
               mSeqUsedK: Optional[cute.Tensor], mSemaphore: Optional[cute.Tensor], scales: BackwardScales,
               window_left: Int32, window_right: Int32, qhead_per_kvhead: Int32, layouts: "SmemLayouts",
               rows_layout: cute.Layout, sdQ_layout: cute.Layout, mma_s: cute.TiledMma, mma_dv: cute.TiledMma,
               mma_dk: cute.TiledMma, mma_dq: cute.TiledMma, scheduler: TileScheduler):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp == Warp.LOAD:
            for atom in (tma_atom_Q, tma_atom_dO, tma_atom_K, tma_atom_V, tma_atom_LSE, tma_atom_dPsum, tma_atom_dQ):
                cpasync.prefetch_descriptor(atom)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        smem = self.shared_tiles(storage, layouts, rows_layout, sdQ_layout)
        pipes = self.make_pipelines(storage)
        tmem = cutlass.memory.TmemAllocator(
            storage.tmem_address.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(
                barrier_id=int(Barrier.TMEM_ALLOC), num_threads=WARP * (1 + 4 * (1 + COMPUTE_GROUPS))),
            allocator_warp_id=int(Warp.COMPUTE))
        pipeline.pipeline_init_arrive(is_relaxed=True)
        tmem_layouts = self.tmem_layouts(mma_s, mma_dv, mma_dk, mma_dq, layouts.p)
        pipeline.pipeline_init_wait()

        tile_args = (scheduler, mQ, mK, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, window_left, window_right,
                     qhead_per_kvhead)
        if warp >= Warp.MMA:
            set_registers(self.registers["other"])
            work = self.tile_work(*tile_args)
            if warp == Warp.LOAD:
                self.load(tma_atom_Q, mQ, tma_atom_dO, mdO, tma_atom_K, mK, tma_atom_V, mV, tma_atom_LSE, mLSE,
                          tma_atom_dPsum, mdPsum, smem, mma_s, pipes, work)
            if warp == Warp.MMA:
                tmem.wait_for_alloc()
                if cutlass.const_expr(self.zero_tail):
                    self.zero_kv_tail(storage, layouts, pipes.kv, work)
                self.mma(tmem.retrieve_ptr(Float32), smem, tmem_layouts, mma_s, mma_dv, mma_dk, mma_dq, pipes,
                         work.num_steps)
        elif warp >= Warp.COMPUTE:
            set_registers(self.registers["compute"])
            work = self.tile_work(*tile_args)
            if warp == Warp.COMPUTE:
                tmem.allocate(TMEM_COLUMNS)
                tmem.relinquish_alloc_permit()
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            group = (warp - Warp.COMPUTE) // 4
            self.compute(tmem_ptr, group, smem, tmem_layouts, pipes, work, scales)
            self.store_dkv(tmem_ptr, group, tmem_layouts, pipes, mdK, mdV, work, scales.softmax)
            pipeline.NamedBarrier(barrier_id=int(Barrier.TMEM_FREE),
                                  num_threads=WARPGROUP * (1 + COMPUTE_GROUPS)).arrive_and_wait()
            if warp == Warp.COMPUTE:
                tmem.free(tmem_ptr, TMEM_COLUMNS)  # allocated in another branch: name the columns
        else:
            set_registers(self.registers["dq"])
            work = self.tile_work(*tile_args)
            tmem.wait_for_alloc()
            self.reduce_dq(tmem.retrieve_ptr(Float32), smem, tmem_layouts, pipes, tma_atom_dQ, mdQacc, mSemaphore,
                           work)
            pipeline.NamedBarrier(barrier_id=int(Barrier.TMEM_FREE),
                                  num_threads=WARPGROUP * (1 + COMPUTE_GROUPS)).arrive()

    @cute.jit
    def tile_work(self, scheduler: TileScheduler, mQ, mK, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, window_left,
                  window_right, qhead_per_kvhead) -> TileWork:
        """The CTA's KV tile and its (query head, query block) steps: every query head of the KV
        head, each over the query blocks whose rows see a key of the tile (none for a tile past
        its sequence's keys: varlen grids are sized for the longest)."""
        n_block, head_kv, batch = scheduler.tile()
        seqlen = SeqlenInfo.create(batch, mQ.shape[0], mK.shape[0], mCuSeqlensQ, mCuSeqlensK, mSeqUsedK)
        mask = AttentionMask(BWD_TILE_M, TILE_N, self.cfg.causal, self.cfg.local, window_left, window_right)
        m_block_min, m_block_max = mask.m_block_range(seqlen, n_block)
        per_head = cutlass.max(m_block_max - m_block_min, 0)
        if n_block * TILE_N >= seqlen.seqlen_k:
            per_head = Int32(0)
        blocks = QueryBlocks(head_kv * qhead_per_kvhead, m_block_min, per_head)
        return TileWork(seqlen, mask, blocks, per_head * qhead_per_kvhead, n_block, head_kv, batch)

    def shared_tiles(self, storage, layouts: "SmemLayouts", rows_layout, sdQ_layout) -> "SharedTiles":
        """The shared-memory tensors, with the second orientation of Q, dO, K and dS^T viewing the
        same buffer (check_same_elements proved the offsets equal)."""
        def view(buffer, layout):
            return cute.make_tensor(cute.recast_ptr(buffer.iterator, layout.inner, dtype=self.dtype), layout.outer)

        sQ = storage.sQ.get_tensor(layouts.q.outer, swizzle=layouts.q.inner)
        sdO = storage.sdO.get_tensor(layouts.do.outer, swizzle=layouts.do.inner)
        sK = storage.sK.get_tensor(layouts.k.outer, swizzle=layouts.k.inner)
        sdSt = storage.sdS.get_tensor(layouts.dst.outer, swizzle=layouts.dst.inner)
        return SharedTiles(
            q=sQ, do=sdO, k=sK, v=storage.sV.get_tensor(layouts.v.outer, swizzle=layouts.v.inner),
            qt=view(sQ, layouts.qt), dot=view(sdO, layouts.dot), kt=view(sK, layouts.kt),
            dst=sdSt, ds=view(sdSt, layouts.ds),
            lse=storage.sLSE.get_tensor(rows_layout), dpsum=storage.sdPsum.get_tensor(rows_layout),
            dq=storage.sdQ.get_tensor(sdQ_layout))

    def make_pipelines(self, storage) -> "Pipelines":
        thread = pipeline.Agent.Thread
        one = pipeline.CooperativeGroup(thread)
        compute = pipeline.CooperativeGroup(thread, COMPUTE_GROUPS * WARPGROUP)
        kv = pipeline.PipelineTmaUmma.create(
            num_stages=1, producer_group=one, consumer_group=one, tx_count=self.tma_bytes_kv,
            barrier_storage=storage.mbar_kv.data_ptr(), defer_sync=True)
        qdo = pipeline.PipelineTmaUmma.create(
            num_stages=self.num_stages, producer_group=one, consumer_group=one, tx_count=self.tma_bytes_qdo,
            barrier_storage=storage.mbar_qdo.data_ptr(), defer_sync=True)
        # PipelineTmaAsync: one release per consumer warp (its lane 0), so the group counts warps.
        rows = pipeline.PipelineTmaAsync.create(
            num_stages=self.num_stages, producer_group=one,
            consumer_group=pipeline.CooperativeGroup(thread, COMPUTE_GROUPS * WARPGROUP // WARP),
            tx_count=self.tma_bytes_rows, barrier_storage=storage.mbar_rows.data_ptr(), defer_sync=True)
        sdp = pipeline.PipelineUmmaAsync.create(
            num_stages=1, producer_group=one, consumer_group=compute, barrier_storage=storage.mbar_sdp.data_ptr(),
            defer_sync=True)
        dq = pipeline.PipelineUmmaAsync.create(
            num_stages=1, producer_group=one, consumer_group=pipeline.CooperativeGroup(thread, WARPGROUP),
            barrier_storage=storage.mbar_dq.data_ptr(), defer_sync=True)
        dkv = pipeline.PipelineUmmaAsync.create(
            num_stages=1, producer_group=one, consumer_group=compute, barrier_storage=storage.mbar_dkv.data_ptr(),
            defer_sync=True)
        return Pipelines(kv, qdo, rows, sdp, dq, dkv)

    def tmem_layouts(self, mma_s, mma_dv, mma_dk, mma_dq, p_layout) -> "TmemLayouts":
        """Accumulator layouts (one tile each, placed by the caller) and P^T's as the dV MMA's A."""
        thr_s, thr_dv, thr_dk, thr_dq = (m.get_slice(0) for m in (mma_s, mma_dv, mma_dk, mma_dq))
        return TmemLayouts(
            s=thr_s.make_fragment_C(thr_s.partition_shape_C((TILE_N, BWD_TILE_M))).layout,
            dv=thr_dv.make_fragment_C(thr_dv.partition_shape_C((TILE_N, self.hdim_v))).layout,
            dk=thr_dk.make_fragment_C(thr_dk.partition_shape_C((TILE_N, self.hdim))).layout,
            dq=thr_dq.make_fragment_C(thr_dq.partition_shape_C((BWD_TILE_M, self.hdim))).layout,
            p=thr_dv.make_fragment_A(p_layout.outer)[None, None, None, 0].layout)

    # ---- load warp -------------------------------------------------------------------------------
    @cute.jit
    def load(self, tma_atom_Q, mQ, tma_atom_dO, mdO, tma_atom_K, mK, tma_atom_V, mV, tma_atom_LSE, mLSE,
             tma_atom_dPsum, mdPsum, smem: "SharedTiles", mma_s, pipes: "Pipelines", work: TileWork):
        """K and V once, then per step Q_i and dO_i (qdo ring) and LSE_i and D_i (rows ring)."""
        d, dv, varlen, seqlen = self.hdim, self.hdim_v, self.cfg.varlen, work.seqlen
        n_block, head_kv, batch = work.n_block, work.head_kv, work.batch
        thr = mma_s.get_slice(0)
        if work.num_steps > 0:
            gK = cute.local_tile(head_rows(mK, seqlen.offset_k, head_kv, batch, varlen), (TILE_N, d), (None, 0))
            gV = cute.local_tile(head_rows(mV, seqlen.offset_k, head_kv, batch, varlen), (TILE_N, dv), (None, 0))
            tKsK, tKgK = mma_tma_partition(tma_atom_K, smem.k, thr.partition_A(gK))
            tVsV, tVgV = mma_tma_partition(tma_atom_V, smem.v, thr.partition_A(gV))
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            pipes.kv.producer_acquire(kv_state)
            cute.copy(tma_atom_K, tKgK[None, n_block], tKsK[None, 0], tma_bar_ptr=pipes.kv.producer_get_barrier(kv_state))
            cute.copy(tma_atom_V, tVgV[None, n_block], tVsV[None, 0], tma_bar_ptr=pipes.kv.producer_get_barrier(kv_state))

        rows_offset = seqlen.offset_q  # of this entry's LSE / D rows (packed: 16-byte aligned starts)
        if cutlass.const_expr(varlen):
            rows_offset = packed_row_offset(seqlen.offset_q, batch)
        qdo_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        rows_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        for step in cutlass.range(work.num_steps, unroll=1):
            head, m_block = work.blocks.at(step)
            gQ = cute.local_tile(head_rows(mQ, seqlen.offset_q, head, batch, varlen), (BWD_TILE_M, d), (None, 0))
            gdO = cute.local_tile(head_rows(mdO, seqlen.offset_q, head, batch, varlen), (BWD_TILE_M, dv),
                                  (None, 0))
            tQsQ, tQgQ = mma_tma_partition(tma_atom_Q, smem.q, thr.partition_B(gQ))
            tdOsdO, tdOgdO = mma_tma_partition(tma_atom_dO, smem.do, thr.partition_B(gdO))
            pipes.qdo.producer_acquire(qdo_state)
            barrier = pipes.qdo.producer_get_barrier(qdo_state)
            cute.copy(tma_atom_Q, tQgQ[None, m_block], tQsQ[None, qdo_state.index], tma_bar_ptr=barrier)
            cute.copy(tma_atom_dO, tdOgdO[None, m_block], tdOsdO[None, qdo_state.index], tma_bar_ptr=barrier)
            qdo_state = advanced(qdo_state)

            pipes.rows.producer_acquire(rows_state)
            barrier = pipes.rows.producer_get_barrier(rows_state)
            for atom, tile, mRows in ((tma_atom_LSE, smem.lse, mLSE), (tma_atom_dPsum, smem.dpsum, mdPsum)):
                gRows = cute.local_tile(head_rows(mRows, rows_offset, head, batch, varlen), (BWD_TILE_M,), (m_block,))
                t_smem, t_gmem = tma_partition_tile(atom, tile, gRows, 1)
                cute.copy(atom, t_gmem, t_smem[None, rows_state.index], tma_bar_ptr=barrier)
            rows_state = advanced(rows_state)
        if work.num_steps > 0:
            # The MMA warp's last releases are tcgen05 commits: they must land before the CTA exits.
            pipes.qdo.producer_tail(qdo_state)

    # ---- MMA warp --------------------------------------------------------------------------------
    @cute.jit
    def mma(self, tmem_ptr, smem: "SharedTiles", tl: "TmemLayouts", mma_s, mma_dv, mma_dk, mma_dq,
            pipes: "Pipelines", num_steps):
        """Every MMA of the tile, step by step (module docstring)."""
        (tSrK, tSrQ, tdPrV, tdPrdO, tdVrdOt, tdKrdSt, tdKrQt, tdQrdS, tdQrKt, tStS, tdPtdP, tdVtdV, tdKtdK,
         tdQtdQ) = self.mma_operands(tmem_ptr, smem, tl, mma_s, mma_dv, mma_dk, mma_dq)
        # P^T as the dV MMA's A operand: compute warpgroup w's query columns (k-slices) start at
        # TMEM column 64 w, so its k-slices are read through a base shifted by w * (64 - 32).
        k_slices_per_group = self.cols_per_group // MMA_K
        tdVrP = [cute.make_tensor(cute.recast_ptr(tmem_ptr + self.tmem_s + w * (self.cols_per_group - self.p_words),
                                                  dtype=self.dtype), tl.p) for w in range(COMPUTE_GROUPS)]

        qdo_state, sdp_state, dq_state = self.mma_start(pipes, num_steps, self.num_stages)
        for i in cutlass.range(num_steps, unroll=1):
            pipes.qdo.consumer_wait(qdo_state)
            stage = qdo_state.index
            if cutlass.const_expr(self.dq_over_dp):
                pipes.dq.producer_acquire(dq_state)  # dQ_(i-1) is out of dP^T's columns
            mma_s = gemm(mma_s, tStS, tSrK[None, None, None, 0], tSrQ[None, None, None, stage], False)
            mma_s = gemm(mma_s, tdPtdP, tdPrV[None, None, None, 0], tdPrdO[None, None, None, stage], False)
            pipes.sdp.producer_commit(sdp_state)
            sdp_state = advanced(sdp_state)
            pipes.sdp.producer_acquire(sdp_state)  # P^T in TMEM, dS^T in shared memory
            mma_dv = gemm_a_by_groups(mma_dv, tdVtdV, tdVrP, tdVrdOt[None, None, None, stage], i > 0,
                                      k_slices_per_group)
            mma_dk = gemm(mma_dk, tdKtdK, tdKrdSt[None, None, None, 0], tdKrQt[None, None, None, stage], i > 0)
            pipes.qdo.consumer_release(qdo_state)
            qdo_state = advanced(qdo_state)
            if cutlass.const_expr(not self.dq_over_dp):
                pipes.dq.producer_acquire(dq_state)
            mma_dq, dq_state = self.issue_dq(mma_dq, tdQtdQ, tdQrdS, tdQrKt, pipes, dq_state)
        self.mma_finish(pipes, num_steps)

    @cute.jit
    def mma_start(self, pipes: "Pipelines", num_steps, qdo_stages: cutlass.Constexpr[int]):
        """The MMA warp's pipeline states (Q/dO consumer; S/dP and dQ producers), after K and V
        landed and the first S/dP stage was acquired (when the tile has steps)."""
        qdo_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, qdo_stages)
        sdp_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        dq_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        if num_steps > 0:
            pipes.kv.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))
            pipes.sdp.producer_acquire(sdp_state)
        return qdo_state, sdp_state, dq_state

    def issue_dq(self, mma_dq, tdQtdQ, tdQrdS, tdQrKt, pipes: "Pipelines", dq_state):
        """dQ_i = dS K (fresh accumulator), committed as "dQ full"; (MMA, next dq state)."""
        mma_dq = gemm(mma_dq, tdQtdQ, tdQrdS[None, None, None, 0], tdQrKt[None, None, None, 0], False)
        pipes.dq.producer_commit(dq_state)
        return mma_dq, advanced(dq_state)

    @cute.jit
    def mma_finish(self, pipes: "Pipelines", num_steps):
        """After the last step: commit "dK/dV final" (when the tile had steps)."""
        if num_steps > 0:
            pipes.dkv.producer_commit(pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1))

    @cute.jit
    def zero_kv_tail(self, storage, layouts: "SmemLayouts", pipe_kv, work: TileWork):
        """Zero K's and V's rows past the sequence's keys before any MMA reads them (issue 21,
        fa4_kernels/kv_tail.py). With varlen keys or seqused_k the tile holding the last key is
        loaded whole, and its rows past the key end belong to no key of this sequence and may hold
        NaN. The mask makes P^T = 0 on them, but dP^T = V dO^T puts NaN into those key rows of dP^T,
        dS^T = P^T (dP^T - D) turns 0 * NaN into NaN, and dQ = dS K multiplies K's rows again: every
        dQ row of the step would come out NaN. Zeroing the rows in shared memory, once per CTA,
        cures all three GEMMs; masking the scores cannot.

        The MMA warp does it itself, so that no other role or barrier is involved: its 32 threads
        wait for the K/V tile's TMA (mma's own wait then returns at once), zero the rows, fence the
        generic-proxy stores for the tensor cores (async proxy) and meet at a warp barrier before
        mma issues S^T = K Q^T. It costs the tile that holds the key end a delay of its first MMA;
        no other tile runs it. Never where the CTA has no step: the load warp then loads no K/V
        and the wait would never return."""
        first_row = first_row_past_keys(work.seqlen.seqlen_k, work.n_block, TILE_N)
        if work.num_steps > 0:
            if first_row < TILE_N:
                pipe_kv.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))
                for buffer, layout, cols in ((storage.sK, layouts.k, self.hdim), (storage.sV, layouts.v, self.hdim_v)):
                    rows = buffer.get_tensor(key_rows(layout.outer, cols), swizzle=layout.inner)
                    zero_rows(rows, first_row, cute.arch.lane_idx(), WARP)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.sync_warp()

    def mma_operands(self, tmem_ptr, smem: "SharedTiles", tl: "TmemLayouts", mma_s, mma_dv, mma_dk, mma_dq) -> tuple:
        """The MMA warp's shared-memory fragments (K, Q; V, dO; dO^T; dS^T, Q^T; dS, K^T) and TMEM
        accumulators (S^T, dP^T, dV, dK, dQ at the plan's columns)."""
        return (mma_s.make_fragment_A(smem.k), mma_s.make_fragment_B(smem.q),
                mma_s.make_fragment_A(smem.v), mma_s.make_fragment_B(smem.do),
                mma_dv.make_fragment_B(smem.dot),
                mma_dk.make_fragment_A(smem.dst), mma_dk.make_fragment_B(smem.qt),
                mma_dq.make_fragment_A(smem.ds), mma_dq.make_fragment_B(smem.kt),
                cute.make_tensor(tmem_ptr + self.tmem_s, tl.s), cute.make_tensor(tmem_ptr + self.tmem_dp, tl.s),
                cute.make_tensor(tmem_ptr + self.tmem_dv, tl.dv), cute.make_tensor(tmem_ptr + self.tmem_dk, tl.dk),
                cute.make_tensor(tmem_ptr + self.tmem_dq, tl.dq))

    def packed_chunks(self, tmem_ptr, s_layout, words: int, chunk_words: int, thread, load: bool = False):
        """(copy, TMEM per chunk, register shape) of 16-bit values packed in pairs, ``words`` columns
        of S^T's layout from ``tmem_ptr`` (P^T over S^T, dS^T over dP^T) by ``chunk_words``: a
        tcgen05.st (the chunks as destinations), or with ``load`` a tcgen05.ld (as sources)."""
        t = cute.make_tensor(tmem_ptr, cute.composition(s_layout, cute.make_layout((TILE_N, words))))
        t = cute.flat_divide(t, (TILE_N, chunk_words))[None, None, 0, None]  # (TILE_N, words, chunks)
        op = tcgen05.Ld32x32bOp if load else tcgen05.St32x32bOp
        copy = tcgen05.make_tmem_copy(cute.make_copy_atom(op(tcgen05.Repetition(chunk_words)), Float32),
                                      t[None, None, 0]).get_slice(thread)
        regs = copy.partition_S(cute.make_identity_tensor((TILE_N, chunk_words))).shape
        return copy, copy.partition_S(t) if load else copy.partition_D(t), regs

    # ---- compute warpgroups ----------------------------------------------------------------------
    @cute.jit
    def compute(self, tmem_ptr, group, smem: "SharedTiles", tl: "TmemLayouts", pipes: "Pipelines",
                work: TileWork, scales: BackwardScales):
        """P^T and dS^T of this thread's key row over the warpgroup's query columns, step by step."""
        thread = cute.arch.thread_idx()[0] % WARPGROUP
        first_col = group * self.cols_per_group
        load_s, tS, s_regs = self.tmem_row_chunks(tmem_ptr + self.tmem_s, tl.s, TILE_N, BWD_TILE_M, thread)
        load_dp, tdP, _ = self.tmem_row_chunks(tmem_ptr + self.tmem_dp, tl.s, TILE_N, BWD_TILE_M, thread)
        chunks = self.cols_per_group // BWD_DQ_CHUNK
        # P^T, chunk c of this warpgroup's columns: BWD_DQ_CHUNK / 2 words of 16-bit pairs at TMEM
        # column first_col + c * BWD_DQ_CHUNK / 2, inside S^T columns this warpgroup read already
        # (chunks 0..c), so each chunk's P^T is stored as soon as it is computed.
        chunk_words = BWD_DQ_CHUNK * self.dtype.width // 32
        tSt = cute.make_tensor(tmem_ptr + self.tmem_s, tl.s)
        tPt = cute.make_tensor(tmem_ptr + self.tmem_s + first_col,
                               cute.composition(tSt.layout, cute.make_layout((TILE_N, self.p_words))))
        tPt = cute.flat_divide(tPt, (TILE_N, chunk_words))[None, None, 0, None]  # (TILE_N, words, chunks)
        store_p = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.St32x32bOp(tcgen05.Repetition(chunk_words)), Float32),
            tPt[None, None, 0]).get_slice(thread)
        p_regs = store_p.partition_S(cute.make_identity_tensor((TILE_N, chunk_words))).shape
        copies = ChunkCopies(load_s, tS, load_dp, tdP, s_regs, store_p, store_p.partition_D(tPt), p_regs,
                             smem.dst[((thread, None), 0, None, 0)])  # dS^T: this key row, (MMA_K, k-slices)

        sdp_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        rows_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        for step in cutlass.range(work.num_steps, unroll=1):
            _, m_block = work.blocks.at(step)
            pipes.rows.consumer_wait(rows_state)
            pipes.sdp.consumer_wait(sdp_state)
            rows = (smem.lse[None, rows_state.index], smem.dpsum[None, rows_state.index])
            full = work.mask.block_is_full(work.seqlen, m_block, work.n_block)
            if cutlass.const_expr(self.cfg.has_softcap):
                # A loop, not unrolled: unrolled, ptxas starts the next chunk's tanh under this
                # chunk's dS^T, which spilled at 160 registers (d = 64 and 128, ptxas 13.4).
                for c in cutlass.range(chunks, unroll=1):
                    self.chunk_step(c, full, group, copies, rows, scales, work, m_block, thread)
            else:
                for c in cutlass.range_constexpr(chunks):
                    self.chunk_step(c, full, group, copies, rows, scales, work, m_block, thread)
            cute.arch.fence_view_async_tmem_store()  # P^T is in TMEM before the dV MMA reads it
            sdp_state, rows_state = self.end_step(pipes, sdp_state, rows_state)

    def end_step(self, pipes: "Pipelines", sdp_state, rows_state):
        """A compute warpgroup's step end: dS^T in shared memory made visible to the MMAs (async
        proxy), then "dS^T written" and LSE/D released; the next states."""
        cute.arch.fence_view_async_shared()
        pipes.sdp.consumer_release(sdp_state)
        pipes.rows.consumer_release(rows_state)
        return advanced(sdp_state), advanced(rows_state)

    @cute.jit
    def chunk_step(self, c, full, group, copies: "ChunkCopies", rows, scales: BackwardScales, work: TileWork, m_block,
                   thread):
        """chunk_gradients of chunk c, without the element-wise mask where the block is ``full``."""
        if full:
            self.chunk_gradients(c, group, copies, rows, scales, work, m_block, thread, False)
        else:
            self.chunk_gradients(c, group, copies, rows, scales, work, m_block, thread, True)

    @cute.jit
    def chunk_gradients(self, c, group, copies: "ChunkCopies", rows, scales: BackwardScales,
                        work: TileWork, m_block, thread, masked: cutlass.Constexpr[bool]):
        """Chunk c (BWD_DQ_CHUNK query columns) of this warpgroup: S^T from TMEM, P^T to TMEM (16-bit),
        dP^T from TMEM, dS^T = P^T (dP^T - D) to shared memory (16-bit; softcap: times 1 - tanh^2)."""
        sLSE, sdPsum = rows
        chunks = self.cols_per_group // BWD_DQ_CHUNK
        first_col = group * self.cols_per_group + c * BWD_DQ_CHUNK
        p = cute.make_rmem_tensor(copies.s_regs, Float32)
        cute.copy(copies.load_s, copies.s[None, None, None, group * chunks + c], p)
        cute.arch.fence_view_async_tmem_load()
        p = flat(p)
        p16 = cute.make_rmem_tensor(copies.p_regs, Float32)
        self.probabilities(p, cute.recast_tensor(p16, self.dtype), sLSE, first_col, scales, work, m_block, thread,
                           masked)
        cute.copy(copies.store_p, p16, copies.p[None, None, None, c])
        dp = cute.make_rmem_tensor(copies.s_regs, Float32)
        cute.copy(copies.load_dp, copies.dp[None, None, None, group * chunks + c], dp)
        cute.arch.fence_view_async_tmem_load()
        dp = flat(dp)
        ds = cute.make_rmem_tensor(BWD_DQ_CHUNK, self.dtype)
        for e in cutlass.range_constexpr(BWD_DQ_CHUNK):
            ds[e] = (p[e] * (dp[e] - sdPsum[first_col + e])).to(self.dtype)
        for s in cutlass.range_constexpr(BWD_DQ_CHUNK // MMA_K):
            cute.autovec_copy(cute.local_tile(ds, (MMA_K,), (s,)), copies.ds_row[None, first_col // MMA_K + s])

    @cute.jit
    def probabilities(self, p, p16, sLSE, first_col, scales: BackwardScales, work: TileWork, m_block, thread,
                      masked: cutlass.Constexpr[bool]):
        """From the scores s of this key row, per query column: P = exp2(s' * scales.log2 - LSE)
        into p16 in the input dtype (dV's operand), with s' = s, or tanh(s * scales.score) under
        softcap; and into p what dS^T = p (dP^T - D) needs: P, or P (1 - tanh^2) under softcap.
        With ``masked``, both 0 where the query may not see the key or lies past the sequence."""
        for e in cutlass.range_constexpr(cute.size(p)):
            score = p[e]
            if cutlass.const_expr(self.cfg.has_softcap):
                score = cute.math.tanh(score * scales.score, fastmath=True)
            value = cute.math.exp2(score * scales.log2 - sLSE[first_col + e], fastmath=True)
            if cutlass.const_expr(masked):
                row = m_block * BWD_TILE_M + first_col + e
                lo, hi = work.mask.key_bounds(work.seqlen, row, work.n_block)
                if thread >= hi or thread < lo or row >= work.seqlen.seqlen_q:
                    value = Float32(0.0)
            p16[e] = value.to(self.dtype)
            if cutlass.const_expr(self.cfg.has_softcap):
                value = value * (Float32(1.0) - score * score)
            p[e] = value

    @cute.jit
    def store_dkv(self, tmem_ptr, group, tl: "TmemLayouts", pipes: "Pipelines", mdK, mdV, work: TileWork,
                  softmax_scale: Float32):
        """dK * softmax_scale and dV of this thread's key row, this warpgroup's half of the head
        dim, in the input dtype (keys inside the sequence; zeros for a tile no query sees)."""
        thread = cute.arch.thread_idx()[0] % WARPGROUP
        if work.n_block * TILE_N < work.seqlen.seqlen_k:
            key = work.n_block * TILE_N + thread
            inside = key < work.seqlen.seqlen_k
            has_steps = work.num_steps > 0
            if has_steps:
                pipes.dkv.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))
            for column, layout, scale, mOut, dim, width in (
                    (self.tmem_dk, tl.dk, softmax_scale, mdK, self.hdim, self.dk_chunk),
                    (self.tmem_dv, tl.dv, Float32(1.0), mdV, self.hdim_v, self.dv_chunk)):
                chunks = dim // COMPUTE_GROUPS // width
                load, tX, regs = self.tmem_row_chunks(tmem_ptr + column, layout, TILE_N, dim, thread, width)
                gRow = head_rows(mOut, work.seqlen.offset_k, work.head_kv, work.batch, self.cfg.varlen)[key, None]
                for c in cutlass.range_constexpr(chunks):
                    chunk = group * chunks + c
                    out = cute.make_rmem_tensor(width, self.dtype)
                    if has_steps:
                        r = cute.make_rmem_tensor(regs, Float32)
                        cute.copy(load, tX[None, None, None, chunk], r)
                        cute.arch.fence_view_async_tmem_load()
                        for e in cutlass.range_constexpr(width):
                            out[e] = (r[e] * scale).to(self.dtype)
                    else:
                        out.fill(0.0)
                    if inside:
                        cute.autovec_copy(out, cute.local_tile(gRow, (width,), (chunk,)))

    def tmem_row_chunks(self, tmem_ptr, layout, rows: int, cols: int, thread, width: int = BWD_DQ_CHUNK):
        """A TMEM accumulator (rows = lanes, cols) read ``width`` columns at a time by the thread of
        its lane: (copy, source per chunk (..., chunk), register shape of a chunk)."""
        t = cute.make_tensor(tmem_ptr, layout)
        t = cute.flat_divide(t[(None, None), 0, 0], (rows, width))[None, None, 0, None]  # (rows, width, n)
        load = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(width)), Float32),
            t[None, None, 0]).get_slice(thread)
        return load, load.partition_S(t), load.partition_D(cute.make_identity_tensor((rows, width))).shape

    # ---- dQ warpgroup ----------------------------------------------------------------------------
    @cute.jit
    def reduce_dq(self, tmem_ptr, smem: "SharedTiles", tl: "TmemLayouts", pipes: "Pipelines", tma_atom_dQ,
                  mdQacc, mSemaphore: Optional[cute.Tensor], work: TileWork):
        """Per step: dQ_i from TMEM chunk by chunk, each staged in one of two shared-memory buffers
        and reduce-added into dq_accum by one TMA instruction of thread 0. Deterministic: a query
        block's reduce-adds in KV-block order (deterministic_turn / deterministic_done)."""
        thread = cute.arch.thread_idx()[0] % WARPGROUP
        load, tdQ, regs = self.tmem_row_chunks(tmem_ptr + self.tmem_dq, tl.dq, BWD_TILE_M, self.hdim, thread)
        stage_barrier = pipeline.NamedBarrier(barrier_id=int(Barrier.DQ_STAGE), num_threads=WARPGROUP)
        chunks = self.dq.chunks
        dq_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        buffer = Int32(0)
        for step in cutlass.range(work.num_steps, unroll=1):
            head, m_block = work.blocks.at(step)
            pipes.dq.consumer_wait(dq_state)
            gdQ = chunk_tiles(mdQacc, self.dq, work.seqlen.offset_q, head, work.batch, self.cfg.varlen)
            t_smem, t_gmem = tma_partition_tile(tma_atom_dQ, smem.dq, gdQ)
            for c in cutlass.range_constexpr(chunks):
                r = cute.make_rmem_tensor(regs, Float32)
                cute.copy(load, tdQ[None, None, None, c], r)
                cute.arch.fence_view_async_tmem_load()
                if cutlass.const_expr(c == chunks - 1):
                    pipes.dq.consumer_release(dq_state)  # TMEM read out: the next dQ (or dP^T) may land
                if thread < WARP:  # the issuing warp (its elected lane holds the bulk groups)
                    cute.arch.cp_async_bulk_wait_group(BWD_DQ_BUFFERS - 1, read=True)  # this buffer is free
                stage_barrier.arrive_and_wait()
                staged = smem.dq[None, None, buffer]
                for j in cutlass.range_constexpr(BWD_DQ_CHUNK // VECTOR):
                    dst = cute.make_tensor(staged.iterator + j * VECTOR * WARPGROUP + thread * VECTOR,
                                           cute.make_layout(VECTOR))
                    cute.autovec_copy(cute.local_tile(flat(r), (VECTOR,), (j,)), dst)
                cute.arch.fence_view_async_shared()  # generic-proxy writes -> visible to the TMA
                stage_barrier.arrive_and_wait()
                if thread < WARP:  # TMA copies are warp-collective: one lane is elected inside
                    if cutlass.const_expr(self.cfg.deterministic and c == 0):
                        self.deterministic_turn(mSemaphore, work, head, m_block)
                    cute.copy(tma_atom_dQ, t_smem[None, buffer], t_gmem[None, m_block * chunks + c])
                    cute.arch.cp_async_bulk_commit_group()
                    if cutlass.const_expr(self.cfg.deterministic and c == chunks - 1):
                        self.deterministic_done(mSemaphore, work, head, m_block)
                buffer = (buffer + 1) % BWD_DQ_BUFFERS
            dq_state = advanced(dq_state)
        if thread < WARP:
            cute.arch.cp_async_bulk_wait_group(0, read=True)  # shared memory stays alive until read


    @cute.jit
    def deterministic_turn(self, mSemaphore: cute.Tensor, work: TileWork, head, m_block):
        """Wait (the dQ issuing warp) until every KV block before this CTA's that sees query block
        m_block of ``head`` has added its dQ: its semaphore (batch, head, m_block, 0) counts them.
        The KV blocks that see a query block are the contiguous range mask.n_block_range gives
        (tests/cpu/test_bwd_tile_emulation.py checks it for these tiles), and CTAs start in
        KV-block order within a head, so the block waited for never waits for this one."""
        lock = mSemaphore.iterator + cute.crd2idx((work.batch, head, m_block, 0), mSemaphore.layout)
        n_block_first, _ = work.mask.n_block_range(work.seqlen, m_block)
        done = Int32(-1)
        while done != work.n_block - n_block_first:
            done = cute.arch.load(lock, Int32, sem="acquire", scope="gpu")
        cute.arch.fence_proxy("async.global")  # the earlier blocks' adds are visible to the TMA unit

    @cute.jit
    def deterministic_done(self, mSemaphore: cute.Tensor, work: TileWork, head, m_block):
        """After the query block's last reduce-add: wait until all of them have landed in global
        memory (not just read shared memory), then count this KV block on the semaphore."""
        lock = mSemaphore.iterator + cute.crd2idx((work.batch, head, m_block, 0), mSemaphore.layout)
        cute.arch.cp_async_bulk_wait_group(0)
        cute.arch.fence_proxy("async.global")
        if cute.arch.lane_idx() == 0:
            cute.arch.red(lock, Int32(1), op="add", dtype="s32", sem="release", scope="gpu")


@cute.jit
def gemm_a_by_groups(tiled_mma: cute.TiledMma, acc: cute.Tensor, a_groups: list, b: cute.Tensor, accumulate,
                     per_group: cutlass.Constexpr[int]):
    """fwd.gemm with the A operand's k-slices taken from ``a_groups[k // per_group]`` (P^T, whose
    compute warpgroups store their query columns at their own TMEM bases)."""
    for k in cutlass.range_constexpr(cute.size(b, mode=[2])):
        tiled_mma.set(tcgen05.Field.ACCUMULATE, accumulate or k != 0)
        cute.gemm(tiled_mma, acc, a_groups[k // per_group][None, None, k], b[None, None, k], acc)
    return tiled_mma


def flat(t: cute.Tensor) -> cute.Tensor:
    """A register fragment as a plain vector of its values."""
    return cute.make_tensor(t.iterator, cute.make_layout(cute.size(t)))


def mma_tma_partition(atom, smem, gmem_mma):
    """(smem, gmem) TMA partitions of MMA-partitioned tiles (no multicast): (TMA, stage) and
    (TMA, tile index)."""
    return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(smem, 0, 3),
                                 cute.group_modes(gmem_mma, 0, 3))


def key_rows(layout: cute.Layout, cols: int, keys: int = TILE_N) -> cute.Layout:
    """K's or V's MMA operand layout (the outer layout of SmemLayouts.k / .v: ((keys, MMA_K), 1,
    k-slices, 1), ``keys`` rows: TILE_N, or the d = 256 pair's 64) as a plain (key, column) layout
    over the same offsets, for zero_kv_tail. It takes the operand's coordinates to be ((key,
    column % MMA_K), 0, column // MMA_K, 0), which check_key_rows confirms against the MMA's own
    partitioning at trace time."""
    # (key, (column in k-slice, k-slice)) -> the operand's colexicographic index, then the operand.
    return cute.composition(layout, cute.make_layout((keys, (MMA_K, cols // MMA_K)),
                                                     stride=(1, (keys, keys * MMA_K))))


def check_key_rows(tiled_mma: cute.TiledMma, layout: cute.ComposedLayout, cols: int, name: str):
    """ValueError unless key_rows(layout) puts (key, column) where ``tiled_mma`` (S^T = K Q^T or
    dP^T = V dO^T, whose A partition the TMA load also follows) reads that key and column: each
    operand coordinate's (key, column), read off the MMA's A partition of an identity tile, must
    land at that coordinate's offset. Every key at the k-slice and swizzle-atom edges, every
    column of a few keys."""
    keys = tiled_mma.get_slice(0).partition_A(cute.make_identity_tensor((TILE_N, cols)))
    view = key_rows(layout.outer, cols)
    edges = {0, 1, MMA_K - 1, MMA_K, 31, 32, 63, 64, 65, cols - 1}
    sample = [(r, c) for r in range(TILE_N) for c in sorted(x for x in edges if x < cols)]
    sample += [(r, c) for r in (0, 1, MMA_K - 1, MMA_K, 63, 64, TILE_N - 1) for c in range(cols)]
    for r, c in sample:
        coord = ((r, c % MMA_K), 0, c // MMA_K)
        key, col = keys[coord]
        if cute.crd2idx((key, col), view) != cute.crd2idx((*coord, 0), layout.outer):
            raise ValueError(f"sm100 backward: the (key, column) view of {name} disagrees with the MMA at key "
                             f"{key}, column {col}")


def check_same_elements(a: cute.ComposedLayout, b: cute.ComposedLayout, mn: int, k: int, name: str):
    """ValueError unless layout ``a`` (an MMA operand (mn, k), k of MMA_K per k-slice) and layout
    ``b`` (the same buffer as the operand (k, mn) of another MMA) put every element (row r of the
    mn rows, column c of the k) at the same offset, with the same swizzle."""
    if str(a.inner) != str(b.inner):
        raise ValueError(f"sm100 backward: the two views of {name} swizzle differently ({a.inner} vs {b.inner})")
    outer_a, outer_b = a.outer, b.outer
    # Every row at a few columns (each side of the k-slice and swizzle-atom edges) and every column
    # of a few rows: enough to pin both layouts' strides, at trace-time cost.
    edges = {0, 1, MMA_K - 1, MMA_K, 63, 64, 65}
    sample = [(r, c) for r in range(mn) for c in sorted(x for x in edges | {k - 1} if x < k)]
    sample += [(r, c) for r in sorted(x for x in edges | {mn - 1} if x < mn) for c in range(k)]
    for r, c in sample:
            off_a = cute.crd2idx(((r, c % MMA_K), 0, c // MMA_K, 0), outer_a)
            off_b = cute.crd2idx(((c, r % MMA_K), 0, r // MMA_K, 0), outer_b)
            if off_a != off_b:
                raise ValueError(f"sm100 backward: the two views of {name} disagree at ({r}, {c}): {off_a} vs {off_b}")


@dataclass(frozen=True)
class Tilers:
    """MMA tilers (M, N, K) of S^T / dP^T (s, dp), dK, dV and dQ."""

    s: tuple
    dp: tuple
    dk: tuple
    dv: tuple
    dq: tuple


def row_tma_atoms(mLSE: cute.Tensor, mdPsum: cute.Tensor) -> tuple:
    """(atom, tensor) of the LSE and of dPsum: one BWD_TILE_M-float TMA box per query block."""
    tma_row = cpasync.CopyBulkTensorTileG2SOp()
    return (*cpasync.make_tiled_tma_atom(tma_row, mLSE, cute.make_layout(BWD_TILE_M), (BWD_TILE_M,)),
            *cpasync.make_tiled_tma_atom(tma_row, mdPsum, cute.make_layout(BWD_TILE_M), (BWD_TILE_M,)))


@dataclass(frozen=True)
class SmemLayouts:
    """Shared-memory layouts: each operand as its MMA reads it (qt, dot, kt, ds view the buffers of
    q, do, k, dst; p only shapes P^T's TMEM fragment). The pair kernel loads Q^T, dO^T and K^T into
    buffers of their own, and its dst only shapes dS^T's TMEM fragment (bwd_pair.py)."""

    k: cute.ComposedLayout
    v: cute.ComposedLayout
    q: cute.ComposedLayout
    do: cute.ComposedLayout
    qt: cute.ComposedLayout
    dot: cute.ComposedLayout
    kt: cute.ComposedLayout
    dst: cute.ComposedLayout
    ds: cute.ComposedLayout
    p: cute.ComposedLayout


@dataclass(frozen=True)
class SharedTiles:
    q: cute.Tensor
    do: cute.Tensor
    k: cute.Tensor
    v: cute.Tensor
    qt: cute.Tensor
    dot: cute.Tensor
    kt: cute.Tensor
    dst: cute.Tensor
    ds: cute.Tensor
    lse: cute.Tensor
    dpsum: cute.Tensor
    dq: cute.Tensor


@dataclass(frozen=True)
class ChunkCopies:
    """A compute thread's TMEM copies and destinations, by BWD_DQ_CHUNK-column chunk."""

    load_s: cute.TiledCopy
    s: cute.Tensor  # S^T source per chunk
    load_dp: cute.TiledCopy
    dp: cute.Tensor
    s_regs: cute.Shape  # registers of one loaded chunk
    store_p: cute.TiledCopy
    p: cute.Tensor  # P^T destination per chunk of this warpgroup
    p_regs: cute.Shape
    ds_row: cute.Tensor  # this key row of dS^T in shared memory, (MMA_K, k-slices)


@dataclass(frozen=True)
class TmemLayouts:
    s: cute.Layout  # S^T and dP^T
    dv: cute.Layout
    dk: cute.Layout
    dq: cute.Layout
    p: cute.Layout  # P^T, the dV MMA's A operand


@dataclass(frozen=True)
class Pipelines:
    kv: pipeline.PipelineTmaUmma
    qdo: pipeline.PipelineTmaUmma
    rows: pipeline.PipelineTmaAsync
    sdp: pipeline.PipelineUmmaAsync
    dq: pipeline.PipelineUmmaAsync
    dkv: pipeline.PipelineUmmaAsync
