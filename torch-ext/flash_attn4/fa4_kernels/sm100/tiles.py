"""Blackwell (sm_100 family) forward tiles and schedule: a pure function of head dims, mask kind and
layout, never of sizes.

Every head dim runs 128 x 128 tiles (the M = 128 tcgen05 MMA of one CTA, a KV block of 128 keys,
one thread per query row in the softmax). Up to head_dim_v = 128 a CTA works on two query tiles
whose S and O accumulators fill the 512 columns of tensor memory (2 x 128 + 2 x 128); above that O
is up to 256 columns wide and a CTA keeps one query tile (128 + 256).

The softmax choices follow the FA4 design (docs/perf.md "Blackwell, on paper"): on B200 the
exponentials of a 128 x 128 tile take about as long as its two MMAs at d = 128, so a share of each
row's exponentials runs as a polynomial on the FMA pipe (one column pair in eight, 12.5 %) where the
head dim leaves the FMA pipe room (d <= 128), and O is rescaled only when a row maximum grew by more
than 2^8 (the conditional rescale: exact, since O and the row sum share the stale maximum).
"""

from __future__ import annotations

# The L2 share the longest-first tile order sizes its head groups by (scheduler.TileScheduler): about
# half of B200's 126 MB L2 (sm90 uses half of Hopper's 50 MB the same way; not measured on Blackwell).
L2_BUDGET_BYTES = 60 * 1024 * 1024

TILE_M = 128  # query rows per tile: the M of one CTA's tcgen05 MMA, one softmax thread per row
TILE_N = 128  # keys per KV block
# Conditional rescaling in log2 units: P stays <= 2^8, far from overflowing 16-bit P or the
# float32 O accumulator over any sequence length.
RESCALE_THRESHOLD = 8.0


def query_tiles(head_dim: int, head_dim_v: int) -> int:
    """Query tiles per CTA: two while both tiles' S and O fit in the 512 tensor-memory columns and
    two query tiles leave shared memory for a K/V ring of MIN_KV_STAGES (not at head_dim >= 224
    with head_dim_v <= 128)."""
    if _pad16(head_dim_v) > 128:
        return 1
    q_bytes, stage_bytes = _tile_bytes(head_dim, head_dim_v, 2, q_tiles=2)
    return 2 if (SMEM_BYTES - SMEM_RESERVED - q_bytes) // stage_bytes >= MIN_KV_STAGES else 1


def forward_tiles(head_dim: int, head_dim_v: int, causal: bool, local: bool, page_size: int = 0) -> dict:
    """ForwardConfig overrides (tile_m, tile_n, num_stages) for a problem class. num_stages is the
    depth of the K/V ring in shared memory: as many K or V tiles as fit beside the query tiles. Paged
    caches take the same tiles: 128 keys load in whole-page boxes from pages of 128 and more."""
    del causal, local, page_size
    return dict(tile_m=TILE_M * query_tiles(head_dim, head_dim_v), tile_n=TILE_N,
                num_stages=kv_stages(head_dim, head_dim_v))


def forward_schedule(head_dim: int, head_dim_v: int, varlen: bool, qhead_per_kvhead: int = 1,
                     split_kv: bool = False) -> dict:
    """ForwardConfig overrides for the softmax and GQA packing of a problem class (the split-KV
    variant, which stores float32 partials, schedules its softmax the same way)."""
    del varlen, split_kv
    return dict(
        rescale_threshold=RESCALE_THRESHOLD,
        exp2_emulated_eighths=1 if max(head_dim, head_dim_v) <= 128 else 0,
        pack_gqa=qhead_per_kvhead if qhead_per_kvhead > 1 and 64 % qhead_per_kvhead == 0 else 1,
    )


# Persistent CTAs (ForwardConfig.persistent_ctas), where upstream FA4 runs its static persistent
# scheduler: problems without a causal or local mask (every tile costs the same, so a static stride
# balances them), batched (varlen and seqused_q grids are sized for the longest sequence; upstream
# keeps one CTA per tile there too) and not split-KV (which needs a CTA per (tile, split)). Causal and
# local problems keep one CTA per tile in longest-first order, like upstream's single-tile LPT. The
# grid is min(tiles, PERSISTENT_CTAS): a compile-time count, since the DSL cannot ask the device at
# trace time (cutlass.utils.HardwareInfo needs libcuda) and the kernel's call convention has no SM
# count. B200 has 148 SMs (B300 products are reported with 148 to 160: with more, the extra SMs idle
# on these problems; with fewer, the last CTAs wait for a free SM). Not at head_dim 144..256 with two
# query tiles (d = 192, dv = 128): there the single-CTA MMA warp's 48 registers do not hold the tile
# loop beside the descriptors of 2 x 12 k-steps, and ptxas 13.4 spills (88 LDL / 43 STL); one CTA
# per tile stays spill-free. The CTA pair that runs this class keeps one pair per tile too: it would
# compile spill-free persistent, but its fallback (dispatch.self_check_fallback: the same config
# with cluster_m = 1) would then be the spilling single-CTA kernel. Not measured: no Blackwell GPU
# runs here. PERSISTENT = False turns the rule off.
PERSISTENT = True
PERSISTENT_CTAS = 148


def forward_grid(head_dim: int, head_dim_v: int, causal: bool, local: bool, varlen: bool, split_kv: bool, *,
                 has_seqused_k: bool = False, has_sink: bool = False, paged: bool = False) -> dict:
    """ForwardConfig overrides for the launch grid of a problem class (``varlen``: cu_seqlens_q or
    seqused_q; ``paged``: a paged KV cache, whose kernel runs one CTA per tile, never a pair): persistent CTAs
    where upstream uses them and our kernel compiles spill-free with them (see PERSISTENT), and CTA
    pairs (cluster_m = 2) where pair_applies says."""
    fits = _pad16(head_dim) <= 128 or query_tiles(head_dim, head_dim_v) == 1
    persistent = PERSISTENT and fits and not (causal or local or varlen or split_kv or paged)
    grid = dict(persistent_ctas=PERSISTENT_CTAS if persistent else 0)
    if not paged and pair_applies(head_dim, head_dim_v, causal, local, varlen, split_kv,
                                  has_seqused_k=has_seqused_k, has_sink=has_sink):
        grid["cluster_m"] = 2
    return grid


# CTA pairs (ForwardConfig.cluster_m = 2): a cluster of two CTAs along M runs the M = 256 tcgen05
# MMAs of cta_group::2, issued by the even CTA's MMA warp; each CTA keeps its own 128-row query
# tiles (two at d = 128, one at d = 256; its S, P and O in its own TMEM) and loads half of every K
# tile (64 keys) and of every V tile (half of its head_dim_v columns), so a pair reads each K/V
# block from L2 once where two single CTAs read it twice, and each CTA's K/V ring stages are half as
# large. Upstream runs its 2-CTA kernels for these head dims without causal or local masks and
# without varlen or split-KV; so does this rule (every CTA of a pair then sees the same KV blocks).
# At d = 192 / dv = 128 (two query tiles per CTA, one pair per tile: see PERSISTENT) the MMA warp
# makes its operands afresh after each barrier wait (fwd.FlashAttentionForwardSm100.pair_operands):
# in a cluster launch the shared-memory base is a runtime value, and ptxas hoisted the 2 x 12 + 12
# + 8 descriptors out of the KV loop and spilled them (13.4: 102 LDL / 86 STL). Not run on a GPU
# here: a pair that fails its first-use self-check on a B200 or B300 is replaced by single CTAs
# (dispatch.self_check_fallback). TWO_CTA = False turns the rule off.
TWO_CTA = True
FORWARD_CLUSTER_M = (1, 2)
# Head dims (padded to 16) a pair runs: (head_dim, head_dim_v).
PAIR_HEAD_DIMS = ((128, 128), (192, 128), (256, 256))


def pair_applies(head_dim: int, head_dim_v: int, causal: bool, local: bool, varlen: bool, split_kv: bool, *,
                 has_seqused_k: bool = False, has_sink: bool = False) -> bool:
    """Whether the rule runs a problem class on CTA pairs (see TWO_CTA). Not with seqused_k: keys end
    inside the tensor there, and the V rows past them must be zeroed before P V (kv_tail.py), which
    the pair kernel does not do (half of each V tile is in the partner CTA's shared memory, and only
    the leader's MMA warp waits on the V tiles). Not with learnable sinks: the pair kernel spills
    there under ptxas 13.4 (d = 128: 7 LDL / 4 STL, 27 / 19 with softcap; the single-CTA kernel
    none), in its correction and softmax warps."""
    return (TWO_CTA and pair_supported(head_dim, head_dim_v)
            and not (causal or local or varlen or split_kv or has_seqused_k or has_sink))


def pair_supported(head_dim: int, head_dim_v: int) -> bool:
    return (_pad16(head_dim), _pad16(head_dim_v)) in PAIR_HEAD_DIMS


# Shared memory: 227 KiB a block can opt into, less room for barriers and the row statistics.
SMEM_BYTES = 227 * 1024
SMEM_RESERVED = 4 * 1024
MAX_KV_STAGES = 6
MIN_KV_STAGES = 2


def kv_stages(head_dim: int, head_dim_v: int, element_bytes: int = 2) -> int:
    """K and V tiles share one ring of stages, each as large as the larger of the two: as many as
    fit beside the query tiles."""
    q_bytes, stage_bytes = _tile_bytes(head_dim, head_dim_v, element_bytes)
    return min(MAX_KV_STAGES, (SMEM_BYTES - SMEM_RESERVED - q_bytes) // stage_bytes)


def shared_memory_bytes(head_dim: int, head_dim_v: int, num_stages: int, element_bytes: int = 2,
                        cluster_m: int = 1) -> int:
    """Dynamic shared memory of the sm100 forward: the query tiles, the K/V ring (a CTA of a pair
    holds half of each K or V tile) and (at most) SMEM_RESERVED for the mbarriers, the TMEM address
    and the per-row statistics."""
    q_bytes, stage_bytes = _tile_bytes(head_dim, head_dim_v, element_bytes)
    return q_bytes + num_stages * stage_bytes // cluster_m + SMEM_RESERVED


def _tile_bytes(head_dim: int, head_dim_v: int, element_bytes: int, q_tiles: int = 0) -> tuple[int, int]:
    q_tiles = q_tiles or query_tiles(head_dim, head_dim_v)
    q_bytes = q_tiles * TILE_M * _pad16(head_dim) * element_bytes
    stage_bytes = TILE_N * max(_pad16(head_dim), _pad16(head_dim_v)) * element_bytes
    return q_bytes, stage_bytes


def check_forward(cfg) -> None:
    """ValueError for a ForwardConfig the sm100 forward cannot build (run when one is constructed)."""
    q_tiles = query_tiles(cfg.head_dim, cfg.head_dim_v)
    if cfg.tile_m != TILE_M * q_tiles or cfg.tile_n != TILE_N:
        raise ValueError(f"sm100 forward: tiles are {TILE_M * q_tiles} x {TILE_N} at head_dim_v {cfg.head_dim_v}, "
                         f"got {cfg.tile_m} x {cfg.tile_n}")
    if cfg.head_dim < 16 or cfg.head_dim_v < 16:
        raise NotImplementedError(f"{cfg.arch.value} forward: head dims below 16 (one 16-column MMA step) are not "
                                  f"implemented, got {cfg.head_dim}/{cfg.head_dim_v}")
    if cfg.num_stages < MIN_KV_STAGES:
        # The MMA warp holds K_j while it waits for V_(j-1), the next stage of the ring: with one
        # stage the loader can never bring V_(j-1) (tests/cpu/test_sm100_protocol.py).
        raise ValueError(f"sm100 forward: the K/V ring needs at least {MIN_KV_STAGES} stages, got {cfg.num_stages}")
    if cfg.num_stages > min(MAX_KV_STAGES, kv_stages(cfg.head_dim, cfg.head_dim_v)):
        raise ValueError(f"sm100 forward: {cfg.num_stages} K/V stages do not fit in shared memory beside "
                         f"{q_tiles} query tile(s) at head dims {cfg.head_dim}/{cfg.head_dim_v}")
    if cfg.pack_gqa < 1 or 64 % cfg.pack_gqa:
        raise ValueError(f"pack_gqa must divide 64 (1: off), got {cfg.pack_gqa}")
    if cfg.cluster_m == 2:
        _check_pair(cfg)
    for name in ("tma_store_o", "rescale_o_before_pv", "whole_k_gemms"):
        if getattr(cfg, name):
            raise ValueError(f"sm100 forward: {name} is a Hopper schedule switch; the sm100 kernel has no such "
                             f"option (got {name}={getattr(cfg, name)})")


def _check_pair(cfg) -> None:
    """NotImplementedError for a problem class the pair kernel does not run (every CTA of a pair
    must see the same KV blocks, and each loads its own query rows with one TMA box)."""
    arch = cfg.arch.value
    if not pair_supported(cfg.head_dim, cfg.head_dim_v):
        raise NotImplementedError(f"{arch} forward: cluster_m=2 (CTA pairs) is not implemented at head dims "
                                  f"{cfg.head_dim}/{cfg.head_dim_v}; pairs run head dims {PAIR_HEAD_DIMS}")
    for name in ("causal", "local", "varlen", "has_seqused_q", "has_seqused_k", "split_kv"):
        if getattr(cfg, name):
            raise NotImplementedError(f"{arch} forward: cluster_m=2 (CTA pairs) with {name}=True is not "
                                      f"implemented; pairs run batched problems without causal or local masks")
    if cfg.page_size:
        raise NotImplementedError(f"{arch} forward: cluster_m=2 (CTA pairs) with a paged KV cache is not implemented")


# Problem classes CI compiles for sm_100a (fa4_kernels.compile.kernel_set): each head-dim class and
# every feature once; the ones in ../shared/sm100/ANCHOR_SASS.md are compared with upstream there.
FORWARD_KERNEL_SET = (
    dict(), dict(causal=True), dict(dtype="float16"), dict(varlen=True, has_seqused_k=True), dict(local=True),
    dict(has_softcap=True, has_sink=True), dict(causal=True, qhead_per_kvhead=4), dict(qhead_per_kvhead=4),
    dict(d=64, dv=64), dict(d=64, dv=64, causal=True), dict(d=96, dv=96), dict(d=192, dv=128),
    dict(d=256, dv=256), dict(d=256, dv=256, causal=True), dict(d=256, dv=128),
    # Decoding and padded batches: split-KV partials (GQA-packed, varlen with a KV cache's lengths,
    # one query tile at d = 256) and seqused_q, batched and varlen.
    dict(split_kv=True, qhead_per_kvhead=4), dict(split_kv=True, causal=True, varlen=True, has_seqused_k=True),
    dict(d=256, dv=256, split_kv=True), dict(d=64, dv=64, split_kv=True, local=True),
    dict(has_seqused_q=True, causal=True), dict(varlen=True, has_seqused_q=True, has_seqused_k=True, qhead_per_kvhead=4),
    # Paged KV caches: one box per tile (page 256), two (64, d = 128) and eight (16), through split-KV
    # too; batched queries (flash_attn_with_kvcache) once.
    dict(varlen=True, has_seqused_k=True, page_size=256, qhead_per_kvhead=4),
    dict(split_kv=True, varlen=True, has_seqused_k=True, page_size=64, causal=True),
    dict(varlen=True, has_seqused_k=True, page_size=16, qhead_per_kvhead=4),
    dict(has_seqused_k=True, page_size=256, qhead_per_kvhead=4, causal=True),
    # The single-CTA kernels d = 128 and d = 192 / 128 fall back to where their CTA pair fails the
    # first-use check.
    dict(cluster_m=1), dict(d=192, dv=128, cluster_m=1),
    # Head ratios packed in padded groups (ForwardConfig.pack_gqa_heads): 7 of 8 rows (Qwen2.5)
    # batched through split-KV, 5 of 8 varlen from a paged cache, 3 of 4 with a causal mask and
    # sinks at d = 64.
    dict(split_kv=True, qhead_per_kvhead=7, pack_group=8),
    dict(varlen=True, has_seqused_k=True, page_size=256, qhead_per_kvhead=5, pack_group=8),
    dict(d=64, dv=64, causal=True, has_sink=True, qhead_per_kvhead=3, pack_group=4),
)
# This arch's forward has the split-KV variant (ForwardConfig.split_kv).
FORWARD_SPLIT_KV = True
# Its forward packs a head ratio that does not divide 64 in padded groups (ForwardConfig.pack_gqa_heads).
FORWARD_PADDED_PACK = True


def _pad16(d: int) -> int:
    return -(-d // 16) * 16


# ---- Backward (sm100/bwd.py) ------------------------------------------------------------------
# A CTA owns TILE_N = 128 keys of one KV head and walks 128-row query blocks. Shared memory: K, V,
# Q and dO per stage, dS^T, two float32 dQ staging buffers of BWD_DQ_CHUNK columns, LSE and rowsum
# per stage, and at most BWD_SMEM_RESERVED of barriers. d = 64 takes two Q/dO stages (163 KiB),
# d = 96 two (211 KiB), d = 128 one (194 KiB): two would need 256 KiB, which is why upstream runs
# d = 128 on two CTAs. 192 / 128 (the serial kernel) one (226 KiB); d = dv = 192 would need 258 KiB
# for one stage.
BWD_TILE_M = 128
BWD_DQ_CHUNK = 32  # dQ columns per TMEM load / shared-memory stage / TMA reduce-add
BWD_DQ_BUFFERS = 2
BWD_MAX_STAGES = 2
BWD_SMEM_RESERVED = 1024
BWD_HEAD_DIMS = (64, 96, 128)
# (head_dim, head_dim_v) the serial 1-CTA kernel runs (sm100/bwd_serial.py): dK and dV stay in TMEM
# beside S^T, P^T and dP^T only when dP^T lands after S^T has been read (576 columns otherwise), and
# one Q/dO stage fits (226 KiB). Softcap's dS^T factor 1 - tanh^2 comes from the 16-bit P^T there
# (S^T is overwritten by dP^T by then): bwd_serial.softcap_tanh.
BWD_SERIAL_HEAD_DIMS = ((192, 128),)


def backward_shared_memory_bytes(head_dim: int, num_stages: int, element_bytes: int = 2,
                                 head_dim_v: int | None = None) -> int:
    """Dynamic shared memory of the sm100 backward (head_dim_v defaults to head_dim): what the
    kernel's SharedStorage holds, each buffer rounded up to its 1024-byte alignment."""
    dims = _pad16(head_dim) + _pad16(head_dim if head_dim_v is None else head_dim_v)
    kv = TILE_N * dims * element_bytes  # K and V
    qdo = num_stages * BWD_TILE_M * dims * element_bytes  # Q and dO
    ds = TILE_N * BWD_TILE_M * element_bytes
    dq = BWD_DQ_BUFFERS * BWD_TILE_M * BWD_DQ_CHUNK * 4
    rows = num_stages * 2 * BWD_TILE_M * 4
    return kv + qdo + ds + dq + rows + BWD_SMEM_RESERVED


def backward_stages(head_dim: int, head_dim_v: int | None = None) -> int:
    """Q/dO stages: as many as fit, up to BWD_MAX_STAGES (0 if not even one fits)."""
    fits = [s for s in range(1, BWD_MAX_STAGES + 1)
            if backward_shared_memory_bytes(head_dim, s, head_dim_v=head_dim_v) <= SMEM_BYTES]
    return max(fits, default=0)


def backward_tiles(head_dim: int, head_dim_v: int, causal: bool, local: bool, has_softcap: bool) -> dict:
    """BackwardConfig overrides (tile_m, tile_n, num_stages) for a problem class."""
    del causal, local, has_softcap
    return dict(tile_m=BWD_TILE_M, tile_n=TILE_N, num_stages=max(backward_stages(head_dim, head_dim_v), 1))


# What each BackwardConfig flag the sm100 backward lacks is called in the public functions (none
# today: the check stays for the next flag a kernel change leaves out).
BWD_UNIMPLEMENTED: dict[str, str] = {}


def backward_supported() -> str:
    """What the sm100 backward runs, for messages."""
    return (f"1-CTA kernel: bf16/fp16, head_dim and head_dim_v each in {BWD_HEAD_DIMS}, causal or local windows, "
            f"softcap, batched or varlen (cu_seqlens, seqused_k), MHA/GQA/MQA, learnable sinks, deterministic=True; "
            f"(head_dim, head_dim_v) in {BWD_SERIAL_HEAD_DIMS} the same; {BWD_PAIR256_HEAD_DIMS} on CTA pairs, "
            f"batched or varlen (cu_seqlens, seqused_k)")


def backward_head_dims(head_dim: int, head_dim_v: int) -> tuple[int, int]:
    """Head dims the backward runs at (fa4_kernels.tiles.backward_head_dims): the smallest kernel
    class holding both, since each kernel is built for fixed head dims. Up to 128 each: the 1-CTA
    (or d = 128 pair) kernel's BWD_HEAD_DIMS, per dim (32 and 48 run at 64, 80 at 96, 112 at 128);
    above that the serial 192 / 128 kernel where dv <= 128, else the d = dv = 256 pair (160, 192 /
    192, 224, 256 / 128 ...). The GEMM work grows with the padded dims: 256 / 192 = 1.33x at 192 / 192,
    up to 256 / 136 = 1.9x."""
    if head_dim <= BWD_HEAD_DIMS[-1] and head_dim_v <= BWD_HEAD_DIMS[-1]:
        return tuple(min(c for c in BWD_HEAD_DIMS if c >= x) for x in (head_dim, head_dim_v))
    return next((d, dv) for d, dv in BWD_SERIAL_HEAD_DIMS + BWD_PAIR256_HEAD_DIMS
                if head_dim <= d and head_dim_v <= dv)


def backward_serial(head_dim: int, head_dim_v: int) -> bool:
    """Whether (padded) head dims run the serial 1-CTA kernel (sm100/bwd_serial.py)."""
    return (head_dim, head_dim_v) in BWD_SERIAL_HEAD_DIMS


# CTA pairs for the backward (BackwardConfig.cluster_m = 2, sm100/bwd_pair.py): a cluster of two
# CTAs, TILE_N keys each, runs the M = 256 tcgen05 MMAs of cta_group::2 issued by the even CTA, as
# upstream does at d = 128. Per CTA: K, V (its keys), K^T's half of the head dim over the pair's 256
# keys, one Q/dO stage as two halves each (the query half the S^T/dP^T MMAs read, the head-dim half
# the dK/dV MMAs read), dS for its 64 query rows over the pair's keys (half of it written by the
# peer through distributed shared memory), dQ staging for its 64 rows. Which problem classes the
# pair kernel runs: BWD_PAIR_HEAD_DIMS, batched or varlen (cu_seqlens, seqused_k), causal, local
# windows, softcap and deterministic included: the pair walks the union of its two KV blocks' query
# blocks; a varlen pair owns two KV blocks of one sequence, the odd one possibly past its keys, and
# the even CTA zeroes both CTAs' K/V rows past the keys (bwd_pair.pair_zero_kv_tail); deterministic
# dQ adds go in pair order. BWD_TWO_CTA switches the dispatch rule (backward_grid): on, as upstream
# runs its backward at d >= 128 on two CTAs, varlen included.
# Compiled and statically checked only (docs/perf.md); not run on a GPU here: a pair that fails its
# first-use self-check on a B200 is replaced by the 1-CTA backward (dispatch.self_check_fallback).
# The kernel is reachable through BackwardConfig(cluster_m=2) either way.
BACKWARD_CLUSTER_M = (1, 2)
BWD_PAIR_HEAD_DIMS = ((128, 128),)
BWD_TWO_CTA = True
BWD_PAIR_DQ_ROWS = BWD_TILE_M // 2  # dQ rows of a CTA: the M = 128 dQ MMA of a pair splits its rows


def backward_pair_shared_memory_bytes(head_dim: int, head_dim_v: int, element_bytes: int = 2) -> int:
    """Dynamic shared memory of a CTA of the backward pair kernel (one Q/dO stage), each buffer
    rounded up to its 1024-byte alignment."""
    d, dv = _pad16(head_dim), _pad16(head_dim_v)
    kv = TILE_N * (d + dv) * element_bytes  # K and V, this CTA's keys
    kt = 2 * TILE_N * (d // 2) * element_bytes  # K^T: half the head dim, both CTAs' keys
    qdo = 2 * BWD_TILE_M * (d + dv) // 2 * element_bytes  # Q, dO (query halves), Q^T, dO^T (dim halves)
    ds = BWD_PAIR_DQ_ROWS * 2 * TILE_N * element_bytes  # dS: this CTA's query rows, the pair's keys
    dq = 2 * BWD_PAIR_DQ_ROWS * BWD_DQ_CHUNK * 4  # two staged dQ chunks
    rows = 2 * BWD_TILE_M * 4
    return kv + kt + qdo + ds + dq + rows + BWD_SMEM_RESERVED


def backward_grid(head_dim: int, head_dim_v: int, causal: bool, local: bool, varlen: bool,
                  deterministic: bool) -> dict:
    """BackwardConfig overrides for the launch grid: CTA pairs where BWD_TWO_CTA and the pair
    kernel's rules allow (off: the 1-CTA kernel everywhere)."""
    del causal, local, varlen, deterministic  # the pair kernels take them
    if backward_pair256(head_dim, head_dim_v):
        # d = dv = 256 has no 1-CTA kernel: its pair (sm100/bwd_pair256.py; batched or varlen) runs
        # whatever BWD_TWO_CTA says.
        return dict(cluster_m=2, num_stages=1)
    pair = BWD_TWO_CTA and (_pad16(head_dim), _pad16(head_dim_v)) in BWD_PAIR_HEAD_DIMS
    return dict(cluster_m=2, num_stages=1) if pair else {}


def _check_backward_pair(cfg) -> None:
    """NotImplementedError for a problem class the backward pair kernel does not run."""
    arch = cfg.arch.value
    pair256 = (cfg.head_dim, cfg.head_dim_v) in BWD_PAIR256_HEAD_DIMS
    if (cfg.head_dim, cfg.head_dim_v) not in BWD_PAIR_HEAD_DIMS and not pair256:
        raise NotImplementedError(f"{arch} backward: cluster_m=2 (CTA pairs) is not implemented at head dims "
                                  f"{cfg.head_dim}/{cfg.head_dim_v}; pairs run head dims "
                                  f"{BWD_PAIR_HEAD_DIMS + BWD_PAIR256_HEAD_DIMS}")
    if cfg.num_stages != 1:
        raise ValueError(f"{arch} backward: the pair kernel has one Q/dO stage, got {cfg.num_stages}")
    smem = backward_pair256_shared_memory_bytes if pair256 else backward_pair_shared_memory_bytes
    if smem(cfg.head_dim, cfg.head_dim_v) > SMEM_BYTES:
        raise ValueError(f"{arch} backward: the pair kernel's shared memory exceeds {SMEM_BYTES} bytes at head "
                         f"dims {cfg.head_dim}/{cfg.head_dim_v}")


def check_backward(cfg) -> None:
    """NotImplementedError for what the sm100 backward does not do (naming the option and the
    arch), ValueError for tiles it cannot build; run when a BackwardConfig is constructed, i.e. in
    dispatch before anything is compiled."""
    arch = cfg.arch.value
    for name, what in BWD_UNIMPLEMENTED.items():
        if getattr(cfg, name):
            raise NotImplementedError(f"{arch} backward: {name}=True ({what}) is not implemented yet on "
                                      f"{arch}; it runs: {backward_supported()}")
    serial = backward_serial(cfg.head_dim, cfg.head_dim_v)
    # d = dv = 256 runs only on CTA pairs (sm100/bwd_pair256.py), whose plan has its own check.
    pair256 = cfg.cluster_m == 2 and (cfg.head_dim, cfg.head_dim_v) in BWD_PAIR256_HEAD_DIMS
    if cfg.cluster_m == 1 and (cfg.head_dim, cfg.head_dim_v) in BWD_PAIR256_HEAD_DIMS:
        raise NotImplementedError(f"{arch} backward: head dims {cfg.head_dim}/{cfg.head_dim_v} are not implemented "
                                  f"on single CTAs (they run on CTA pairs); it runs: {backward_supported()}")
    if not serial and not pair256 and (cfg.head_dim not in BWD_HEAD_DIMS or cfg.head_dim_v not in BWD_HEAD_DIMS):
        raise NotImplementedError(f"{arch} backward: head dims {cfg.head_dim}/{cfg.head_dim_v} are not implemented "
                                  f"yet on {arch} (the torch layer pads head dims to a kernel's: backward_head_dims); "
                                  f"it runs: {backward_supported()}")
    if cfg.tile_m != BWD_TILE_M or cfg.tile_n != TILE_N:
        raise ValueError(f"{arch} backward: tiles are {BWD_TILE_M} x {TILE_N}, got {cfg.tile_m} x {cfg.tile_n}")
    if cfg.cluster_m == 2:
        _check_backward_pair(cfg)
    stages = 1 if pair256 else backward_stages(cfg.head_dim, cfg.head_dim_v)
    if not 1 <= cfg.num_stages <= stages:
        raise ValueError(f"{arch} backward: {cfg.num_stages} Q/dO stages do not fit in shared memory at head dims "
                         f"{cfg.head_dim}/{cfg.head_dim_v} (at most {stages})")
    hopper_only = ("longest_first", "split_head_dim", "separate_do_barrier", "dq_bulk_reduce", "tma_store_dkv",
                   "one_step_body", "exp2_emulated_eighths", "ds_store_by_group", "query_rows_by_shuffle")
    if any(getattr(cfg, name) for name in hopper_only) or cfg.exp_eighths_under_dp != 8:
        raise ValueError(f"{arch} backward: {', '.join(hopper_only)} and exp_eighths_under_dp are Hopper "
                         f"schedule switches the sm100 kernel does not have")


def check_postprocess(cfg) -> None:
    head_dims = BWD_HEAD_DIMS + tuple(d for d, _ in BWD_SERIAL_HEAD_DIMS + BWD_PAIR256_HEAD_DIMS)
    if cfg.tile_m != BWD_TILE_M or cfg.head_dim not in head_dims:
        raise NotImplementedError(f"{cfg.arch.value} backward postprocess: tile_m {BWD_TILE_M} and head dims "
                                  f"{head_dims} only, got tile_m {cfg.tile_m}, head dim {cfg.head_dim}")


# Problem classes CI compiles for sm_100a's backward: each head dim, causal or not, the
# deterministic dQ order, varlen (with seqused_k) and a local window (with softcap) once each (a
# handful: the target's compile time).
# The d = 128 entries are CTA pairs where BWD_TWO_CTA runs them; the cluster_m=1 entries the
# 1-CTA kernels those pairs fall back to. The serial kernel (192 / 128) plain, causal, and causal with
# softcap (its dS^T factor from P^T: bwd_serial.softcap_tanh). The d = 256 pair plain, causal, and
# varlen causal with seqused_k (its K/V/K^T tail zeroing, bwd_pair.pair_zero_kv_tail on 64-key blocks).
BACKWARD_KERNEL_SET = (dict(d=64, dv=64), dict(d=64, dv=64, causal=True), dict(d=96, dv=96, causal=True), dict(),
                       dict(causal=True), dict(causal=True, deterministic=True),
                       dict(causal=True, varlen=True, has_seqused_k=True), dict(local=True, has_softcap=True),
                       dict(cluster_m=1), dict(causal=True, cluster_m=1),
                       dict(causal=True, varlen=True, has_seqused_k=True, cluster_m=1),
                       dict(local=True, has_softcap=True, cluster_m=1),
                       dict(causal=True, deterministic=True, cluster_m=1),
                       dict(d=192, dv=128), dict(d=192, dv=128, causal=True),
                       dict(d=192, dv=128, causal=True, has_softcap=True),
                       dict(d=256, dv=256), dict(d=256, dv=256, causal=True),
                       dict(d=256, dv=256, causal=True, varlen=True, has_seqused_k=True))


# ---- Backward at d = dv = 256 (sm100/bwd_pair256.py) ---------------------------------------------
# A CTA pair with BWD_PAIR256_KEYS = 64 keys per CTA: the M = 128 tcgen05 MMAs of cta_group::2, whose
# accumulators hold a CTA's 64 rows x N folded into 128 lanes x N / 2 columns (lane l: row l % 64,
# column half l // 64). Tensor memory, per CTA (no column is shared by two accumulators, so no MMA
# waits for a TMEM read-out other than its own accumulator's):
#     dK 0-127, dV 128-255 (64 keys x 256 each), S^T 256-319, dP^T 320-383 (64 keys x 128 queries),
#     dQ 384-511 (64 query rows x 256).
# P^T and dS^T cannot be TMEM A operands in the folded layout (an A operand from TMEM must hold
# its M rows in lanes 0..M/2-1 with K along columns), so they go to shared memory. Shared memory per
# CTA: K, V (64 keys x 256) and K^T's head-dim half over the pair's 128 keys, 32 KiB each; one
# Q/dO buffer pair, 32 KiB each, holding first the query halves Q, dO (64 queries x 256, the B of
# S^T / dP^T), then the head-dim halves Q^T, dO^T (128 x 128 queries, the B of dK / dV): two TMA
# phases per step on the same buffers (same bytes); P^T, dS^T (64 keys x 128 queries) 16 KiB each;
# dS, the dQ MMA's A (this CTA's 64 query rows x the pair's 128 keys, half written by the peer),
# 16 KiB; dQ staging two 64-row x 32-column float32 chunks, 16 KiB; LSE, D; barriers.
BWD_PAIR256_HEAD_DIMS = ((256, 256),)
BWD_PAIR256_KEYS = 64  # keys per CTA


def backward_pair256(head_dim: int, head_dim_v: int) -> bool:
    """Whether (padded) head dims run the d = 256 pair kernel (sm100/bwd_pair256.py)."""
    return (_pad16(head_dim), _pad16(head_dim_v)) in BWD_PAIR256_HEAD_DIMS


def backward_pair256_tmem_columns(head_dim: int = 256, head_dim_v: int = 256) -> dict:
    """{accumulator: (first column, columns)} of the d = 256 pair kernel: each folded accumulator
    of 64 rows x N takes N / 2 columns (S^T, dP^T: N = 128 queries; dK, dV, dQ: N = the head dim)."""
    widths = dict(dk=head_dim // 2, dv=head_dim_v // 2, s=BWD_TILE_M // 2, dp=BWD_TILE_M // 2,
                  dq=head_dim // 2)
    plan, col = {}, 0
    for name in ("dk", "dv", "s", "dp", "dq"):
        plan[name] = (col, widths[name])
        col += widths[name]
    return plan


def backward_pair256_shared_memory_bytes(head_dim: int = 256, head_dim_v: int = 256, element_bytes: int = 2) -> int:
    """Dynamic shared memory of a CTA of the d = 256 pair kernel, each buffer a multiple of its
    1024-byte alignment (checked against the kernel's SharedStorage at trace time)."""
    d, dv, keys = _pad16(head_dim), _pad16(head_dim_v), BWD_PAIR256_KEYS
    kv = keys * (d + dv) * element_bytes  # K, V: this CTA's keys
    kt = (d // 2) * 2 * keys * element_bytes  # K^T: half the head dim, the pair's keys
    # Q (64 queries x d) then Q^T (d / 2 x 128 queries) in one buffer; dO likewise.
    q = max(BWD_TILE_M // 2 * d, d // 2 * BWD_TILE_M) * element_bytes
    do = max(BWD_TILE_M // 2 * dv, dv // 2 * BWD_TILE_M) * element_bytes
    pt = dst = keys * BWD_TILE_M * element_bytes  # P^T, dS^T: this CTA's keys x the block's queries
    ds = BWD_TILE_M // 2 * 2 * keys * element_bytes  # dS: this CTA's query rows x the pair's keys
    dq = 2 * BWD_PAIR_DQ_ROWS * BWD_DQ_CHUNK * 4
    rows = 2 * BWD_TILE_M * 4
    return kv + kt + q + do + pt + dst + ds + dq + rows + BWD_SMEM_RESERVED
