"""FlashAttention backward for Blackwell (sm_100a) at head dims 192 / 128 (head_dim 192, head_dim_v
128): the 1-CTA kernel (bwd.py) with a serial schedule, so that dK and dV can stay in tensor memory.

Design note (issue 25, item 1: the sm100 backward above head dim 128)
---------------------------------------------------------------------
The 1-CTA kernel keeps dK (d columns) and dV (dv columns) in TMEM over its whole query walk, beside
S^T and dP^T (128 columns each, live together: one MMA hand-off per step) and dQ (d columns, over
dP^T where it does not fit). That needs 256 + d + dv <= 512: d + dv <= 256. At d = 192, dv = 128 it
is 576. What this kernel changes is only the schedule of one step, which frees 64 columns:

Tensor memory (512 columns, lane = key row, except dQ: lane = query row):
    dK     0 - 191   (d)
    dV   192 - 319   (dv)
    S^T  320 - 447   then P^T, 16-bit pairs, in 320 - 383 (below)
    dP^T 384 - 511   over S^T's upper 64 columns, once every compute thread has read them
    dQ   320 - 511   (d) over P^T and dP^T, once dV and the compute warps are done with them
i.e. d + dv + TILE_M / 2 (P^T, 16-bit) + TILE_M (dP^T) = 512, and dQ (d = 192) fits in what P^T and
dP^T leave behind (64 + 128). The serial part: dP^T lands only after the compute warps have read
all of S^T and written P^T, and the next S^T only after dQ was read out.

Per step the MMA warp issues, waiting where marked (one thread, tcgen05 MMAs run in issue order):
    [Q_i, dO_i landed] [dQ_(i-1) read out of 320 - 511]
    S^T = K Q_i^T                                       -> commit "S full"
    [P^T written, S^T read: the compute warps' first release]
    dP^T = V dO_i^T                                     -> commit "dP full"
    dV += P^T dO_i (A = P^T from TMEM)
    [dS^T written, dP^T and P^T read: the second release]
    dK += dS^T Q_i                                      -> commit "Q_i/dO_i free"
    dQ_i = dS K (over P^T and dP^T: dV_i read P^T before, in issue order) -> commit "dQ full"
The compute warps, per step: wait "S full", P^T of their columns into TMEM (phase 1), release;
wait "dP full", dS^T = P^T (dP^T - D) into shared memory (phase 2), release. Phase 2 reads P^T back
from TMEM (16-bit) instead of keeping P in registers: S^T is gone by then, and 64 float32 values of P
per thread spilled the 1-CTA kernel's compute warps before (bwd.REGISTERS). dS^T is therefore
computed from the 16-bit P^T that dV uses, where the 1-CTA kernel uses the float32 P (relative error
2^-9 per element, the same order as dS^T's own rounding to 16 bits; tests/bwd_tile_model.py models
it). Both releases are arrivals on the 1-CTA kernel's one-stage "sdp" pipeline, twice per step.

P^T's columns: phase 1 of compute warpgroup w works through two 32-column chunks c of the block's
queries, chunk c at query columns 64 c + 32 w (interleaved, not the 1-CTA kernel's 64 w + 32 c), so
that the lower 64 S^T columns, which dP^T does not cover, hold chunk 0 of both warpgroups. P^T of
(w, c) goes to the 16 words at 32 w + 16 c: inside warpgroup w's own chunk-0 columns, which it has
read (chunk 0) before it writes there (c = 0 after that chunk's load, c = 1 later), so no warpgroup
writes over S^T another still reads. The dV MMA reads query k-slice s (16 queries) at word
32 w + 16 c + 8 (s % 2) with c = s // 4, w = s // 2 % 2 (serial_p_slices).

Warp roles and register budgets: the 1-CTA kernel's (bwd.Warp, bwd.REGISTERS: dQ 64, compute 2 x
160, MMA/load 128 per thread; one Q/dO stage). The MMA warp holds 12 + 8 + 8 + 8 + 8 = 44 k-step
descriptors at d = 192 (the 1-CTA d = 128 kernel 40, spill-free at 128).

Shared memory (tiles.backward_shared_memory_bytes(192, 1, head_dim_v=128)): K 48 KiB, V 32 KiB, one
Q/dO stage 48 + 32 KiB, dS^T 32 KiB, dQ staging 2 x 16 KiB, LSE/D 1 KiB, barriers <= 1 KiB: 226 KiB
of the 227 KiB a block may use. Two Q/dO stages would need 307 KiB.

Softcap: dS^T's factor 1 - t^2 (t = tanh(S * scale / cap)) needs S^T, which dP^T has overwritten by
phase 2. Phase 2 recovers t from the 16-bit P^T it reads anyway and the row's LSE: P = exp2(t * cap *
log2(e) - LSE), so t = (log2(P) + LSE) / (cap log2(e)) (softcap_tanh: one MUFU.LG2 per element, and
per column pair one FADD2, FMUL2, FFMA2, FMUL2 more). dt / dP = 1 / (P cap): P's rounding e moves
P (1 - t^2) by at most 2 e / cap, i.e. at cap >= 2 by no more than the rounding of P that dS^T
carries anyway; against small 1 - t^2 (saturated scores at caps 1-2) that is large relatively, and
dK, dQ then stand at up to 1.6 x the bf16 reference's error in the CPU model (within the suite's 2 x;
tests/cpu/test_bwd_tile_emulation.py, docs/perf.md). P = 0 gives t = -1 and a factor 0.

What it does not do: CTA pairs at these head dims (tiles._check_backward_pair).

Versus upstream (flash-attn-4's flash_bwd_sm100, read, not copied): upstream runs d = 192 / dv = 128
only on CTA pairs (2-CTA M = 256 MMAs, cluster of two, dS halves exchanged through distributed
shared memory), with a TMEM plan of the same shape (dV, dK, S^T, dP^T over the top of S^T, dQ's
d / 2 pair columns over dP^T) and its "serial" schedule. This kernel takes the 1-CTA route because
the 1-CTA shared-memory plan fits (226 KiB) and reuses the 1-CTA kernel's load, dQ, epilogue and
protocol unchanged; the pair kernel's per-CTA plan at d = 192 (K, V, K^T half, Q / dO in both
orientations, dS) is 258 KiB without aliasing. A pair at these dims reads K/V from L2 once per
256 keys instead of per 128 and halves each CTA's dQ adds; not measured (no Blackwell GPU here).

Head dims this kernel does not reach (NotImplementedError in tiles.check_backward):
    d = dv = 192: TMEM d + dv = 384 leaves 128 columns for S^T, P^T, dP^T and dQ (192): dQ does not
        fit even serially; and one Q/dO stage makes the 1-CTA shared memory 258 KiB. Candidates:
        (a) a pair with 64 keys per CTA (M = 128 2-CTA MMAs, whose accumulators fold 64 rows into
        128 lanes x N / 2 columns): dK 96 + dV 96 + S^T 64 + dP^T 64 + dQ 96 = 416 columns, about
        202 KiB of shared memory per CTA, no serialisation needed; (b) this 1-CTA kernel with
        64-row query blocks: S^T and dP^T 64 columns each beside dK and dV (512), 178 KiB of shared
        memory, but dQ (M = 64, 192 columns) only in two 96-column halves over S^T / dP^T, each read
        out before the next (and the M = 64 accumulator's lane layout to be settled for the dQ warps).
    d = dv = 256 (built since: sm100/bwd_pair256.py, this plan with dS in a buffer of its own, 226 KiB):
        the same pair layout needs 128 + 128 + 64 + 64 + 128 = 512 columns (fits, no TMEM
        aliasing), and fits shared memory once Q^T / dO^T are not buffers of their own: upstream
        (flash_bwd_sm100, 2-CTA, 64-row KV tile, "serial" schedule) loads each step's Q and dO
        query halves for S^T / dP^T, then the head-dim halves Q^T / dO^T into the same buffers for
        dK / dV. In the folded (M = 128 pair) accumulator layout P^T and dS^T cannot be TMEM A
        operands, so they go to shared memory (16 KiB each), and the peer's dS is a contiguous
        block of dS^T (no exchange buffer). Per CTA: K, V, K^T half, Q, dO 32 KiB each, P^T and
        dS^T 16 KiB each, dQ staging 8-16 KiB, LSE/D 1 KiB: about 210-218 KiB. What it needs here,
        beside bwd_pair.py: compute threads over folded rows (lane l: key l % 64, query half
        l // 64), P^T / dS^T stores into shared memory, a second TMA phase per step on the Q/dO
        buffers (and its barrier in the protocol replay), the folded dK / dV epilogue, 64-key
        blocks in the block ranges and the tile model. Upstream's kernel compiles here with
        162 / 116 LDL / STL (ptxas 13.4; docs/perf.md).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32

from ..config import BackwardConfig
from ..dtypes import CUTLASS_DTYPES
from ..pipelines import advanced
from ..softmax import BackwardScales
from ..tile_work import TileWork
from .bwd import (COMPUTE_GROUPS, MMA_K, FlashAttentionBackwardSm100, Pipelines, SharedTiles, TmemLayouts, flat,
                  gemm_a_by_groups)
from .fwd import TMEM_COLUMNS, WARPGROUP, gemm
from .tiles import BWD_DQ_CHUNK, BWD_SERIAL_HEAD_DIMS, BWD_TILE_M, TILE_N

CHUNKS = BWD_TILE_M // COMPUTE_GROUPS // BWD_DQ_CHUNK  # 32-column chunks per compute warpgroup and step


def serial_chunk_column(group: int, c: int) -> int:
    """First query column of chunk c of compute warpgroup ``group`` (interleaved, module docstring)."""
    return c * COMPUTE_GROUPS * BWD_DQ_CHUNK + group * BWD_DQ_CHUNK


def serial_p_word(group: int, c: int, words_per_chunk: int) -> int:
    """First TMEM column (32-bit word, from S^T's base) of P^T of chunk c of warpgroup ``group``:
    inside the warpgroup's own chunk-0 columns."""
    return serial_chunk_column(group, 0) + c * words_per_chunk


def serial_p_slices(words_per_chunk: int) -> list[int]:
    """For each query k-slice (MMA_K queries) of the dV MMA, its first P^T word from S^T's base."""
    slices = []
    for s in range(BWD_TILE_M // MMA_K):
        column = s * MMA_K
        c, group = column // (COMPUTE_GROUPS * BWD_DQ_CHUNK), column // BWD_DQ_CHUNK % COMPUTE_GROUPS
        slices.append(serial_p_word(group, c, words_per_chunk) + (column % BWD_DQ_CHUNK) // 2)
    return slices


class FlashAttentionBackwardSm100Serial(FlashAttentionBackwardSm100):
    def __init__(self, cfg: BackwardConfig):
        assert (cfg.head_dim, cfg.head_dim_v) in BWD_SERIAL_HEAD_DIMS and cfg.num_stages == 1
        assert cfg.cluster_m == 1
        self.chunk_words = BWD_DQ_CHUNK * CUTLASS_DTYPES[cfg.dtype].width // 32  # P^T words per chunk
        super().__init__(cfg)

    def plan_tmem(self):
        """Tensor-memory plan (module docstring): dK, dV, S^T with P^T in its lower half, dP^T over
        its upper half, dQ over P^T and dP^T."""
        self.tmem_dk, self.tmem_dv = 0, self.hdim
        self.tmem_s = self.tmem_dv + self.hdim_v
        self.tmem_dp = TMEM_COLUMNS - BWD_TILE_M
        self.tmem_dq, self.dq_over_dp = self.tmem_s, True
        self.p_slices = serial_p_slices(self.chunk_words)
        p_end = max(serial_p_word(w, c, self.chunk_words) + self.chunk_words
                    for w in range(COMPUTE_GROUPS) for c in range(CHUNKS))
        assert self.tmem_s + p_end <= self.tmem_dp  # P^T lies below dP^T
        assert self.tmem_dq + self.hdim == TMEM_COLUMNS and self.tmem_dp + BWD_TILE_M == TMEM_COLUMNS

    # ---- MMA warp --------------------------------------------------------------------------------
    @cute.jit
    def mma(self, tmem_ptr, smem: SharedTiles, tl: TmemLayouts, mma_s, mma_dv, mma_dk, mma_dq, pipes: Pipelines,
            num_steps):
        """Every MMA of the tile, in the serial order (module docstring)."""
        (tSrK, tSrQ, tdPrV, tdPrdO, tdVrdOt, tdKrdSt, tdKrQt, tdQrdS, tdQrKt, tStS, tdPtdP, tdVtdV, tdKtdK,
         tdQtdQ) = self.mma_operands(tmem_ptr, smem, tl, mma_s, mma_dv, mma_dk, mma_dq)
        # P^T as the dV MMA's A operand, one base per k-slice: slice s of tl.p starts s * MMA_K / 2
        # words after its base, so the base is shifted to put it at serial_p_slices()[s].
        tdVrP = [cute.make_tensor(cute.recast_ptr(tmem_ptr + self.tmem_s + word - s * MMA_K // 2, dtype=self.dtype),
                                  tl.p) for s, word in enumerate(self.p_slices)]

        qdo_state, sdp_state, dq_state = self.mma_start(pipes, num_steps, 1)
        for i in cutlass.range(num_steps, unroll=1):
            pipes.qdo.consumer_wait(qdo_state)
            pipes.dq.producer_acquire(dq_state)  # dQ_(i-1) is out of S^T's and dP^T's columns
            mma_s = gemm(mma_s, tStS, tSrK[None, None, None, 0], tSrQ[None, None, None, 0], False)
            pipes.sdp.producer_commit(sdp_state)  # "S full"
            sdp_state = advanced(sdp_state)
            pipes.sdp.producer_acquire(sdp_state)  # P^T written, S^T read
            mma_s = gemm(mma_s, tdPtdP, tdPrV[None, None, None, 0], tdPrdO[None, None, None, 0], False)
            pipes.sdp.producer_commit(sdp_state)  # "dP full"
            sdp_state = advanced(sdp_state)
            mma_dv = gemm_a_by_groups(mma_dv, tdVtdV, tdVrP, tdVrdOt[None, None, None, 0], i > 0, 1)
            pipes.sdp.producer_acquire(sdp_state)  # dS^T written, dP^T and P^T read
            mma_dk = gemm(mma_dk, tdKtdK, tdKrdSt[None, None, None, 0], tdKrQt[None, None, None, 0], i > 0)
            pipes.qdo.consumer_release(qdo_state)
            qdo_state = advanced(qdo_state)
            mma_dq, dq_state = self.issue_dq(mma_dq, tdQtdQ, tdQrdS, tdQrKt, pipes, dq_state)
        self.mma_finish(pipes, num_steps)

    # ---- compute warpgroups ----------------------------------------------------------------------
    @cute.jit
    def compute(self, tmem_ptr, group, smem: SharedTiles, tl: TmemLayouts, pipes: Pipelines, work: TileWork,
                scales: BackwardScales):
        """Per step: P^T of this key row over the warpgroup's query chunks into TMEM (phase 1),
        then dS^T into shared memory (phase 2), each phase ended by a release of "sdp"."""
        thread = cute.arch.thread_idx()[0] % WARPGROUP
        load_s, tS, s_regs = self.tmem_row_chunks(tmem_ptr + self.tmem_s, tl.s, TILE_N, BWD_TILE_M, thread)
        load_dp, tdP, _ = self.tmem_row_chunks(tmem_ptr + self.tmem_dp, tl.s, TILE_N, BWD_TILE_M, thread)
        # P^T's words from S^T's base, by chunks of chunk_words (stored in phase 1, loaded in phase 2).
        words = COMPUTE_GROUPS * CHUNKS * self.chunk_words
        store_p, tP_store, p_regs = self.packed_chunks(tmem_ptr + self.tmem_s, tl.s, words, self.chunk_words, thread)
        load_p, tP_load, _ = self.packed_chunks(tmem_ptr + self.tmem_s, tl.s, words, self.chunk_words, thread,
                                                load=True)
        ds_row = smem.dst[((thread, None), 0, None, 0)]  # dS^T: this key row, (MMA_K, k-slices)

        # Softcap: phase 2 recovers tanh from P^T (serial_ds_chunk), dividing by scales.log2 once here.
        inv_log2 = Float32(1.0) / scales.log2 if cutlass.const_expr(self.cfg.has_softcap) else None

        sdp_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        rows_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        for step in cutlass.range(work.num_steps, unroll=1):
            _, m_block = work.blocks.at(step)
            pipes.rows.consumer_wait(rows_state)
            sLSE, sdPsum = smem.lse[None, 0], smem.dpsum[None, 0]
            pipes.sdp.consumer_wait(sdp_state)  # "S full"
            full = work.mask.block_is_full(work.seqlen, m_block, work.n_block)
            p_copies = (load_s, tS, s_regs, store_p, tP_store, p_regs)
            if full:
                for c in cutlass.range_constexpr(CHUNKS):
                    self.serial_p_chunk(c, group, p_copies, sLSE, scales, work, m_block, thread, False)
            else:
                # A loop, not unrolled: the masked variant runs on the blocks a mask cuts only, and
                # unrolled it took the kernel over upstream's instruction count under ptxas 12.9.
                for c in cutlass.range(CHUNKS, unroll=1):
                    self.serial_p_chunk(c, group, p_copies, sLSE, scales, work, m_block, thread, True)
            cute.arch.fence_view_async_tmem_store()  # P^T is in TMEM before dV reads it
            pipes.sdp.consumer_release(sdp_state)
            sdp_state = advanced(sdp_state)
            pipes.sdp.consumer_wait(sdp_state)  # "dP full"
            for c in cutlass.range_constexpr(CHUNKS):
                self.serial_ds_chunk(c, group, load_p, tP_load, p_regs, load_dp, tdP, s_regs, ds_row, sdPsum, sLSE,
                                     inv_log2)
            sdp_state, rows_state = self.end_step(pipes, sdp_state, rows_state)

    @cute.jit
    def serial_p_chunk(self, c, group, p_copies, sLSE, scales: BackwardScales, work: TileWork, m_block, thread,
                       masked: cutlass.Constexpr[bool]):
        """Phase 1, chunk c: S^T from TMEM, P^T (16-bit, masked entries 0 with ``masked``) to TMEM."""
        load_s, tS, s_regs, store_p, tP, p_regs = p_copies
        first_col, cw = serial_chunk_column(group, c), self.chunk_words
        p = cute.make_rmem_tensor(s_regs, Float32)
        cute.copy(load_s, tS[None, None, None, first_col // BWD_DQ_CHUNK], p)
        cute.arch.fence_view_async_tmem_load()
        p16 = cute.make_rmem_tensor(p_regs, Float32)
        self.probabilities(flat(p), cute.recast_tensor(p16, self.dtype), sLSE, first_col, scales, work, m_block,
                           thread, masked)
        cute.copy(store_p, p16, tP[None, None, None, serial_p_word(group, c, cw) // cw])

    @cute.jit
    def serial_ds_chunk(self, c, group, load_p, tP, p_regs, load_dp, tdP, s_regs, ds_row, sdPsum, sLSE, inv_log2):
        """Phase 2, chunk c: dS^T = P^T (dP^T - D) from the 16-bit P^T and dP^T in TMEM, to shared
        memory as 16-bit; under softcap times 1 - t^2, with t recovered from P^T (softcap_tanh)."""
        first_col, cw = serial_chunk_column(group, c), self.chunk_words
        p16 = cute.make_rmem_tensor(p_regs, Float32)
        cute.copy(load_p, tP[None, None, None, serial_p_word(group, c, cw) // cw], p16)
        dp = cute.make_rmem_tensor(s_regs, Float32)
        cute.copy(load_dp, tdP[None, None, None, first_col // BWD_DQ_CHUNK], dp)
        cute.arch.fence_view_async_tmem_load()
        p, dp = flat(cute.recast_tensor(p16, self.dtype)), flat(dp)
        ds = cute.make_rmem_tensor(BWD_DQ_CHUNK, self.dtype)
        for e in cutlass.range_constexpr(0, BWD_DQ_CHUNK, 2):  # packed f32x2: half the FADD/FMUL issues
            d0, d1 = sdPsum[first_col + e], sdPsum[first_col + e + 1]
            w = (p[e].to(Float32), p[e + 1].to(Float32))
            if cutlass.const_expr(self.cfg.has_softcap):
                # P (1 - t^2) (dP - D) as P (t^2 - 1) (D - dP): the same products, one FMA for t^2 - 1.
                t0, t1 = softcap_tanh(w, (sLSE[first_col + e], sLSE[first_col + e + 1]), inv_log2)
                w = cute.arch.mul_packed_f32x2(w, cute.arch.fma_packed_f32x2((t0, t1), (t0, t1),
                                                                             (Float32(-1.0), Float32(-1.0))))
                centred = cute.arch.sub_packed_f32x2((d0, d1), (dp[e], dp[e + 1]))
            else:
                centred = cute.arch.sub_packed_f32x2((dp[e], dp[e + 1]), (d0, d1))
            ds0, ds1 = cute.arch.mul_packed_f32x2(w, centred)
            ds[e], ds[e + 1] = ds0.to(self.dtype), ds1.to(self.dtype)
        for s in cutlass.range_constexpr(BWD_DQ_CHUNK // MMA_K):
            cute.autovec_copy(cute.local_tile(ds, (MMA_K,), (s,)), ds_row[None, first_col // MMA_K + s])


@cute.jit
def softcap_tanh(p, lse, inv_log2):
    """t = tanh(S * scale / cap) of two queries, recovered from their 16-bit P = exp2(t * log2 - LSE)
    (log2 = cap * log2(e), LSE in log2 units): t = (log2(P) + LSE) / log2. dt / dP = 1 / (P cap), so
    P's rounding error e moves P (1 - t^2) by at most 2 |t| e / cap <= 2 e / cap: at cap >= 2 no more
    than the rounding of P itself, which dS^T carries anyway. Clamped below at -1 only: P = 0
    (masked, underflowed, or a row without keys, whose LSE is +inf: log2(0) + inf is NaN) gives -inf
    or NaN, and max.f32 returns its non-NaN operand, so t = -1 and 1 - t^2 = 0 there, as P = 0 needs
    (P * inf would be NaN). Above 1, t overshoots by at most the same 1 / (P cap) e: within the bound."""
    x0 = cute.math.log2(p[0], fastmath=True)
    x1 = cute.math.log2(p[1], fastmath=True)
    t0, t1 = cute.arch.mul_packed_f32x2(cute.arch.add_packed_f32x2((x0, x1), lse), (inv_log2, inv_log2))
    return cute.arch.fmax(t0, Float32(-1.0)), cute.arch.fmax(t1, Float32(-1.0))
