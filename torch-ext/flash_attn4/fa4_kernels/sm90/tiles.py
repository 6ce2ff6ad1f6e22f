"""Hopper (sm_90a) rules: tile shapes and schedule choices per problem class (a pure function of head
dims, mask kind and layout, never of sizes), the checks of what the sm90 kernels can build, the
kernel set CI compiles, and the device facts the kernels size themselves by. Plain Python: the
shared lookup (fa4_kernels/tiles.py, through the registry in arch.py) imports it without the DSL.

Forward, measured on the H200 (docs/perf.md has the A/B runs):
- max(d, dv) <= 64: three consumer warpgroups (192 x 128 tiles). At d=64 the exponentials take as
  long as the GEMMs; a third warpgroup keeps the tensor cores fed while two others run softmax.
  Its 160-register budget fits S, P and O only up to 64 columns of O.
- <= 128: 128 x 128.  <= 192: 128 x 96.  <= 256: 128 x 80 (Q and two K/V stages fill 224 KiB
  of shared memory; 80 beat 64 at d=256 causal and tied non-causal), 128 x 64 for a paged cache of
  pages of 32 keys or more (whole-page TMA boxes).

Backward (sm90/bwd.py): 64 queries x 128 keys, each consumer warpgroup owning 64 keys with
dK and dV for the whole head dim in registers, while head_dim == head_dim_v <= 128; 128 queries at
d <= 64, 80 at d = 128 without softcap or a local window (H200: 1.01-1.04x non-causal, 1.06-1.08x
causal over 64, although the causal kernel spills 17 registers; softcap spills 40 and local 9, not
measured, so they keep 64). Beyond that (or
for d != dv) those accumulators no longer fit: 64 x 64 with the head dim split between the
warpgroups, two Q/dO stages up to d = 192 and one above (shared memory: 210 KiB at d = 192 with two,
209 KiB at d = 256 with one).

ForwardConfig fields only the sm90 forward reads: pingpong, tma_store_o, rescale_o_before_pv,
whole_k_gemms (and tile_m in 64-row warpgroup units). BackwardConfig fields only the sm90 backward
reads: split_head_dim, exp_eighths_under_dp, and the schedule switches tma_store_dkv (on where
backward_schedule says), separate_do_barrier, dq_bulk_reduce and one_step_body (off; for A/B runs,
docs/perf.md).
"""

from __future__ import annotations

# The L2 share the longest-first tile order sizes its head groups by (scheduler.TileScheduler):
# about half of the H100/H200's 50 MB L2, the rest left to Q, O and other streams.
L2_BUDGET_BYTES = 24 * 1024 * 1024


def forward_tiles(head_dim: int, head_dim_v: int, causal: bool, local: bool, page_size: int = 0) -> dict:
    """ForwardConfig overrides (tile_m, tile_n, num_stages) for a problem class; ``page_size``: of a
    paged KV cache (0: contiguous keys). (Causal, every head's query tiles run longest first. At 1k,
    where a head has at most 8 tiles, one H100 call measured it at 0.95-0.99x of the launch order, the
    next at 0.98-1.01x: nothing to act on; docs/perf.md, session 20.)"""
    del causal, local  # no mask-specific tiles measured to pay yet
    d = max(head_dim, head_dim_v)
    if d <= 64:
        return dict(tile_m=192, tile_n=128, num_stages=2)
    if d <= 128:
        return dict(tile_m=128, tile_n=128, num_stages=2)
    if d <= 192:
        return dict(tile_m=128, tile_n=96, num_stages=2)
    if page_size > 16:
        # A paged tile loads in boxes of gcd(tile_n, page_size) rows (paged_kv.py), each box a page
        # table read and its own TMA copies: 80 keys take five 16-row boxes from any page, 64 keys one
        # box from pages of 64 and more. Decoding 4 x 32k keys at page 256, H100: 64 keys 0.98x the
        # time of 80, level with the dense cache; at page 16 (16-row boxes either way) 80 is 0.99x
        # of 64 (benchmarks/decode_tiles_ab.py --call, docs/perf.md).
        return dict(tile_m=128, tile_n=64, num_stages=2)
    return dict(tile_m=128, tile_n=80, num_stages=2)


def forward_schedule(head_dim: int, head_dim_v: int, varlen: bool, qhead_per_kvhead: int = 1,
                     split_kv: bool = False) -> dict:
    """ForwardConfig overrides for the epilogue, the O rescale, the GEMM calls and GQA packing of a
    problem class (``split_kv``: the kernel that writes float32 partials for the combine)."""
    return dict(
        # O through shared memory and one TMA store per warpgroup (at d > 128 in Q's buffer): in one
        # H200 run 1.01-1.10x at every head dim but one outlier row (docs/perf.md, 2026-12-03).
        # Batched only (a TMA box would write past a packed sequence), and stmatrix stores 16
        # columns at a time. Split-KV partials are float32 and leave from the registers.
        tma_store_o=not varlen and head_dim_v % 16 == 0 and not split_kv,
        # O rescaled under the next Q K^T rather than after P V where O is wider than 64 columns
        # (tiles of two warpgroups): d = 128 1.01-1.02x in every case, d = 256 1.00-1.02x. At d = 64
        # (three warpgroups, 32 multiplies per thread) it ran 1-3% slower (H200, docs/perf.md).
        rescale_o_before_pv=head_dim_v > 64,
        # The GEMMs outside the loop's hot path as one call over their k slices where the
        # accumulators are wide: d = 256 compiles in 0.90x the time of a call per slice (192 causal
        # 0.86x, development CPU), and runs within 0-2% of it (H200, docs/perf.md). At d = 64 the
        # whole-K P @ V ran 4% slower.
        whole_k_gemms=max(head_dim, head_dim_v) > 128,
        # The query heads of a KV head share tiles wherever the kernel can pack them (a ratio
        # dividing 64): one kernel per model, short query sequences (decoding) fill whole tiles.
        # 2.7-3.7x at 1-32 queries against 8k keys, batched or varlen; 0.99-1.04x at 128 queries and
        # more (docs/perf.md).
        pack_gqa=qhead_per_kvhead if qhead_per_kvhead > 1 and 64 % qhead_per_kvhead == 0 else 1,
    )


def backward_head_dims(head_dim: int, head_dim_v: int) -> tuple[int, int]:
    """Head dims the backward runs at (fa4_kernels.tiles.backward_head_dims): multiples of 16 (a
    WGMMA's reduction step, and the 16-column tiles of dQ, dK, dV), at least 32."""
    return max(32, -(-head_dim // 16) * 16), max(32, -(-head_dim_v // 16) * 16)


def backward_tiles(head_dim: int, head_dim_v: int, causal: bool, local: bool, has_softcap: bool) -> dict:
    """BackwardConfig overrides (tile_m, tile_n, num_stages, split_head_dim, exp_eighths_under_dp,
    the tile order) for a problem class."""
    d = max(head_dim, head_dim_v)
    if head_dim == head_dim_v and d <= 128:
        # Longer query blocks spread the per-step overheads (barriers, LSE/rowsum loads, the dQ
        # reduce) over more rows; S^T and dP^T grow with them: 128 rows fit beside dK and dV up to
        # d = 64 (H200: 1.10-1.16x over 64 rows), 80 at d = 128.
        tile_m = 128 if d <= 64 else 80 if d == 128 and not (local or has_softcap) else 64
        # How much of P^T under dP^T's GEMM, the rest interleaved with dS^T (H200, docs/perf.md):
        # 3/8 at 80-query blocks (1.01-1.04x over all first). At 128-query blocks without a mask
        # 2/8 (whole backward 1.04-1.06x at 4k-16k). Masked, 2/8 alone was 2-9% slower than all
        # first (the masked step carries a second copy of the code), but 3/8 with dS^T stored a
        # stmatrix at a time as its columns finish (ds_store_by_group, flash-attn-4's step shape)
        # is faster: d = 64 causal 1.00-1.04x over all first in two H100 calls (sessions 19, 20);
        # without a mask it was 0.95-1.03x of 2/8, so not there.
        by_groups = tile_m == 128 and (causal or local)
        exp_eighths_under_dp = 3 if tile_m == 80 or by_groups else 2 if tile_m == 128 else 8
        return dict(tile_m=tile_m, tile_n=128, num_stages=2, split_head_dim=False,
                    exp_eighths_under_dp=exp_eighths_under_dp, ds_store_by_group=by_groups,
                    **_backward_order(causal, local))
    return dict(tile_n=64, num_stages=2 if d <= 192 else 1, split_head_dim=True)


# Masked (causal, local) batched backwards of the unsplit layout (d = dv <= 128) take their KV tiles
# longest first within L2 groups of at least this many heads (BackwardConfig.longest_first; fewer:
# the launch order, chosen at run time by the same kernel). H100, two calls, 2026-12-06 (docs/perf.md):
# against the launch order 1.02 / 1.01 / 1.04 and 0.98 / 1.04 / 1.06 at d = 64 causal 4k / 8k / 16k
# (24, 12, 6 heads a group), 1.03 / 1.04 and 1.03 / 1.04 at d = 128 4k / 8k (12, 6): small, near the
# calls' noise (the same kernel against itself 0.97-1.04), always in the H200's earlier direction;
# d = 128 16k (3 heads) keeps the launch order, where grouping measured -3% on the H200. The split
# layout (d > 128) keeps it everywhere: 0.99 at d = 256 causal 4k, nothing gained.
BWD_LONGEST_FIRST_MIN_GROUP = 4
# ... and only where a head has at least this many KV tiles (4k keys at 128 a tile). Below, the
# longest tiles are short and the launch order's L2 sharing wins (a head's tiles run together and
# share its Q, dO and dQ accumulator): the launch order against the grouped order (H100, 2026-12-06,
# session 18, docs/perf.md) 1.18 / 1.04 at d = 64 causal 1k / 2k (8 and 16 tiles, 96 and 48 heads a
# group), 1.12 / 1.00 at d = 128; at 4k 1.00 and 0.95 (32 tiles). With the rule, d64 causal 1k went
# from 0.80 to 0.92 of flash-attn-4, d128 causal 1k from 0.85 to 0.95.
BWD_LONGEST_FIRST_MIN_BLOCKS = 32


def _backward_order(causal: bool, local: bool) -> dict:
    if not (causal or local):
        return {}
    return dict(longest_first=True, longest_first_min_group=BWD_LONGEST_FIRST_MIN_GROUP,
                longest_first_min_blocks=BWD_LONGEST_FIRST_MIN_BLOCKS)


def backward_schedule(head_dim: int, head_dim_v: int, varlen: bool) -> dict:
    """BackwardConfig overrides that depend on the layout of a problem class (what backward_tiles,
    which sees only head dims and masks, cannot decide)."""
    # dK and dV through K's and V's tiles and one TMA store each, where the unsplit layout and batched
    # inputs allow it (a TMA box would write past a packed sequence): H100, two runs of
    # bench.py --mode bwd (d 64 / 128, 4k-16k, causal or not): 0.93 -> 1.00 of the plain stores'
    # time at d = 128 causal 4k, 0.94-1.05 elsewhere, 0.98 geometric mean (docs/perf.md, 2026-12-06).
    unsplit = head_dim == head_dim_v and head_dim <= 128
    return dict(tma_store_dkv=unsplit and not varlen)


# The problem classes CI compiles (fa4_kernels.compile.kernel_set), with the tiles and schedule
# dispatch picks for them: each head-dim class, plus each feature switch once.
FORWARD_KERNEL_SET = (
    dict(), dict(causal=True), dict(dtype="float16"), dict(varlen=True, has_seqused_k=True), dict(local=True),
    dict(has_softcap=True, has_sink=True), dict(causal=True, qhead_per_kvhead=4),
    dict(d=64, dv=64), dict(d=64, dv=64, causal=True), dict(d=96, dv=96), dict(d=192, dv=192), dict(d=192, dv=128),
    dict(d=256, dv=256),
    # Split-KV (float32 partials): decoding with GQA packing, and the masks and varlen once.
    dict(split_kv=True, qhead_per_kvhead=4), dict(split_kv=True, causal=True, varlen=True, has_seqused_k=True),
    dict(d=64, dv=64, split_kv=True, local=True),
    # Paged KV caches: small pages (several TMA boxes per K/V tile) with GQA packing, whole-tile
    # pages through split-KV, and d = 256 (64-key tiles from pages of 32 and more, each one box);
    # batched queries (flash_attn_with_kvcache: O stored by TMA) once.
    dict(varlen=True, has_seqused_k=True, page_size=16, qhead_per_kvhead=4),
    dict(split_kv=True, varlen=True, has_seqused_k=True, page_size=256, qhead_per_kvhead=4, causal=True),
    dict(d=256, dv=256, varlen=True, has_seqused_k=True, page_size=64),
    dict(has_seqused_k=True, page_size=64, qhead_per_kvhead=4, causal=True),
    # Padded batches (seqused_q), batched and varlen.
    dict(has_seqused_q=True, causal=True), dict(varlen=True, has_seqused_q=True, has_seqused_k=True, qhead_per_kvhead=4),
    # Decoding with a head ratio packed in padded groups (7 of 8 rows; Qwen2.5): batched with the
    # TMA store of O, and the split-KV partials of a paged cache.
    dict(qhead_per_kvhead=7, pack_group=8, has_seqused_k=True),
    dict(split_kv=True, varlen=True, has_seqused_k=True, page_size=256, qhead_per_kvhead=7, pack_group=8),
)
# This arch's forward has the split-KV variant (ForwardConfig.split_kv).
FORWARD_SPLIT_KV = True
# Its forward packs a head ratio that does not divide 64 in padded groups (ForwardConfig.pack_gqa_heads).
FORWARD_PADDED_PACK = True
# Backward: the common head dims and every feature switch once (compile.backward_kernel_set adds the
# postprocessing of each dQ tiling and the preprocessing).
BACKWARD_KERNEL_SET = (
    dict(), dict(causal=True), dict(d=64, dv=64),
    dict(varlen=True, has_seqused_k=True, local=True, has_softcap=True, deterministic=True),
    dict(d=192, dv=192), dict(d=256, dv=256, causal=True), dict(d=192, dv=128, varlen=True, deterministic=True),
)


def check_forward(cfg) -> None:
    """ValueError for a ForwardConfig the sm90 forward cannot build (run by ForwardConfig);
    NotImplementedError for a problem class it does not implement, so that dispatch refuses it
    before anything compiles or launches."""
    if cfg.head_dim_v < 16:
        # An 8-column WGMMA accumulator has no column-group mode for the row views to split.
        raise NotImplementedError(f"sm_90a forward: head_dim_v below 16 is not implemented, got {cfg.head_dim_v}")
    if cfg.tile_m == 64 and cfg.pingpong:
        raise ValueError("pingpong hands the GEMMs between consumer warpgroups: tile_m 64 (one warpgroup) needs "
                         "pingpong=False")
    if 64 % cfg.pack_gqa:
        raise ValueError(f"pack_gqa must divide 64 (1: off; TMA boxes of whole tokens in 64-row warpgroup "
                         f"tiles), got {cfg.pack_gqa}")
    if cfg.tma_store_o and (cfg.varlen or cfg.has_seqused_q):
        raise ValueError("tma_store_o is for batched inputs without seqused_q: a TMA box would write past a packed "
                         "sequence or a sequence's used queries")
    if cfg.tma_store_o and cfg.split_kv:
        raise ValueError("tma_store_o stores O in the input dtype; split-KV partials are float32 (tma_store_o=False)")
    if cfg.tma_store_o and cfg.head_dim_v % 16:
        raise ValueError(f"tma_store_o writes O to shared memory in 16-column stmatrix tiles: head_dim_v "
                         f"must be a multiple of 16, got {cfg.head_dim_v}")


def check_backward(cfg) -> None:
    """ValueError for a BackwardConfig the sm90 backward cannot build (run by BackwardConfig)."""
    if cfg.tma_store_dkv and (cfg.varlen or cfg.split_head_dim):
        raise ValueError("tma_store_dkv is for batched inputs in the unsplit layout: a TMA box would write past a "
                         "packed sequence, and the split layout's K/V tiles hold half the keys' head dims")
    if cfg.ds_store_by_group and cfg.split_head_dim:
        raise ValueError("ds_store_by_group is for the unsplit layout: the split layout stores dS^T from the "
                         "accumulator layout, between two barriers, not by stmatrix")
    # 128-query blocks (S^T and dP^T of 64 fp32 registers each per thread) fit beside dK and dV
    # only up to d = 64; 80-query blocks compute dQ transposed (dQ^T = K^T dS^T, M = the head
    # dim), which needs 64 of it per consumer warpgroup: d = 128.
    tile_ms = (64,)
    if not cfg.split_head_dim:
        d = max(cfg.head_dim, cfg.head_dim_v)
        tile_ms = (64, 128) if d <= 64 else (64, 80) if d == 128 else (64,)
    if cfg.tile_n != (64 if cfg.split_head_dim else 128) or cfg.tile_m not in tile_ms:
        raise ValueError(f"sm90 backward tiles are {' or '.join(map(str, tile_ms))} queries x "
                         f"{64 if cfg.split_head_dim else 128} keys here (split_head_dim="
                         f"{cfg.split_head_dim}, head dims {cfg.head_dim}/{cfg.head_dim_v}), "
                         f"got {cfg.tile_m} x {cfg.tile_n}")


def check_postprocess(cfg) -> None:
    """ValueError for a PostprocessConfig the sm90 postprocessing cannot build: its dQ tiles are
    the backward's query blocks, split in two 64-row or 64-column parts (sm90/dq_accum.py)."""
    if cfg.head_dim % 16 or not 32 <= cfg.head_dim <= 256:
        raise ValueError(f"head_dim must be a multiple of 16 in [32, 256], got {cfg.head_dim}")
    if cfg.tile_m not in (64, 80, 128):
        raise ValueError(f"tile_m must be one of the backward's query blocks (64, 80, 128), got {cfg.tile_m}")
