"""Which kernel runs a problem: device capability -> compile target, problem -> ForwardConfig.

Everything here is a pure function of plain values (capability, dtype, head dims, mask flags), so it
can be tested without a GPU. Batch size and sequence lengths are deliberately not parameters of
anything that builds a config: they are runtime values of the kernel and never part of the compile key.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from . import device_info
from .fa4_kernels.arch import IMPLEMENTED, Arch, supported_devices
from .fa4_kernels.config import (AppendConfig, BackwardConfig, CombineConfig, ForwardConfig, PreprocessConfig,
                                 SplitKVConfig)
from .fa4_kernels.tiles import (backward_grid, backward_head_dims, backward_schedule, backward_tiles, forward_grid,
                                forward_schedule, forward_tiles, has_padded_pack)


_TORCH_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def arch_for_capability(capability: tuple[int, int], device_name: str = "this GPU",
                        kernel: str = "forward") -> Arch:
    """The compile target for a device, or a clear error.

    RuntimeError for GPUs we ship no kernels for; NotImplementedError for a supported family whose
    ``kernel`` is not implemented yet (per ``fa4_kernels.arch.IMPLEMENTED``).
    """
    major, minor = capability
    arch = Arch.for_capability(major, minor)
    if arch is None:
        raise RuntimeError(
            f"flash-attn4 has no kernels for {device_name} (compute capability {major}.{minor}); "
            f"supported: {supported_devices(IMPLEMENTED)}"
        )
    if kernel not in IMPLEMENTED.get(arch, ()):
        what = (f"{arch.family} kernels are not implemented yet" if not IMPLEMENTED.get(arch)
                else f"{arch.family} {kernel} kernels are not implemented yet")
        raise NotImplementedError(
            f"flash-attn4: {what} ({kernel} pass requested on {device_name}, compute capability "
            f"{major}.{minor}); supported: {supported_devices(IMPLEMENTED)}"
        )
    return arch


def arch_for_device(device: torch.device, kernel: str = "forward") -> Arch:
    info = device_info.get_device_info(device)
    return arch_for_capability(info.capability, f"{info.name} (cuda:{info.index})", kernel)


def choose_tiles(arch: Arch, head_dim: int, head_dim_v: int, causal: bool, local: bool, page_size: int = 0) -> dict:
    """Tile sizes and pipeline depth for a problem class (never for a problem size): the kernels'
    own table (fa4_kernels.tiles), so the torch layer asks for what CI compiles."""
    return forward_tiles(arch, head_dim, head_dim_v, causal, local, page_size=page_size)


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _TORCH_DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype}; supported: torch.bfloat16, torch.float16") from None


@functools.lru_cache(maxsize=1024)
def forward_config(arch: Arch, dtype: str, head_dim: int, head_dim_v: int, *, causal: bool, local: bool,
                   has_softcap: bool, varlen: bool, has_seqused_k: bool, has_sink: bool,
                   qhead_per_kvhead: int = 1, page_size: int = 0, split_kv: bool = False,
                   has_seqused_q: bool = False, pack_group: int = 0) -> ForwardConfig:
    """The ForwardConfig for a problem class (a model's head ratio included: it decides GQA
    packing; ``page_size``: of a paged KV cache, 0 for contiguous keys; ``split_kv``: the kernel that
    writes float32 partials for num_splits > 1; ``pack_group``: the ratio packed in padded groups of
    that many rows, padded_pack's choice for short queries). Cached: the same arguments give the
    same object."""
    return ForwardConfig(
        arch=arch, dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v, causal=causal, local=local,
        has_softcap=has_softcap, varlen=varlen, has_seqused_k=has_seqused_k, has_sink=has_sink, split_kv=split_kv,
        page_size=page_size, has_seqused_q=has_seqused_q,
        # Used query lengths end like packed sequences: the schedule's epilogue treats them alike.
        **forward_schedule(arch, head_dim, head_dim_v, varlen or has_seqused_q, qhead_per_kvhead, split_kv=split_kv,
                           pack_group=pack_group),
        **choose_tiles(arch, head_dim, head_dim_v, causal, local, page_size=page_size),
        **forward_grid(arch, head_dim, head_dim_v, causal, local, varlen or has_seqused_q, split_kv,
                       has_seqused_k=has_seqused_k, has_sink=has_sink, paged=page_size > 0),
    )


def self_check_fallback(cfg) -> Optional[ForwardConfig | BackwardConfig | SplitKVConfig]:
    """The configuration that computes ``cfg``'s problem class in its place once ``cfg`` has failed
    its first-use self-check on a device, or None (the failure raises: selfcheck.py). CTA pairs
    (cluster_m = 2: the newest, least verified kernels) fall back to single CTAs, the kernel the
    rules pick with the pair switch off (sm100/tiles.TWO_CTA for the forward, BWD_TWO_CTA for the
    backward, whose 1-CTA kernel takes the stages of its own rule). A forward packing padded GQA
    groups (pack_gqa_heads, a pair or not) falls back to the same heads unpacked on single CTAs:
    the kernel dispatch picks for longer queries, on the caller's tensors as they are. A split-KV
    pipeline falls back as its forward does, with the same combine."""
    if isinstance(cfg, SplitKVConfig):
        forward = self_check_fallback(cfg.forward)
        return None if forward is None else cfg.replace(forward=forward)
    if isinstance(cfg, ForwardConfig) and cfg.pack_gqa_heads:
        return cfg.replace(cluster_m=1, pack_gqa=1, pack_gqa_heads=0)
    if isinstance(cfg, ForwardConfig) and cfg.cluster_m > 1:
        return cfg.replace(cluster_m=1)
    if isinstance(cfg, BackwardConfig) and cfg.cluster_m > 1:
        single = backward_tiles(cfg.arch, cfg.head_dim, cfg.head_dim_v, cfg.causal, cfg.local, cfg.has_softcap)
        try:
            return cfg.replace(cluster_m=1, **single)
        except NotImplementedError:  # no single-CTA kernel at these head dims (sm100 d = 256): the failure raises
            return None
    return None


@functools.lru_cache(maxsize=256)
def backward_config(arch: Arch, dtype: str, head_dim: int, head_dim_v: int, *, causal: bool, local: bool,
                    has_softcap: bool, varlen: bool, has_seqused_k: bool, deterministic: bool) -> BackwardConfig:
    """The BackwardConfig for a problem class (tiles and grid: fa4_kernels/tiles.py)."""
    return BackwardConfig(arch=arch, dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v, causal=causal,
                          local=local, has_softcap=has_softcap, varlen=varlen, has_seqused_k=has_seqused_k,
                          deterministic=deterministic,
                          **{**backward_tiles(arch, head_dim, head_dim_v, causal, local, has_softcap),
                             **backward_schedule(arch, head_dim, head_dim_v, varlen),
                             **backward_grid(arch, head_dim, head_dim_v, causal, local, varlen, deterministic)})


@functools.lru_cache(maxsize=64)
def preprocess_config(arch: Arch, dtype: str, head_dim_v: int) -> PreprocessConfig:
    """The backward's preprocessing kernel for a dtype and head dim."""
    return PreprocessConfig(arch=arch, dtype=dtype, head_dim_v=head_dim_v)


@functools.lru_cache(maxsize=64)
def combine_config(arch: Arch, dtype: str, head_dim_v: int, has_sink: bool = False) -> CombineConfig:
    """The split-KV combine kernel for an output dtype and head dim (``has_sink``: it adds a learnable
    sink to the denominator)."""
    return CombineConfig(arch=arch, dtype=dtype, head_dim_v=head_dim_v, has_sink=has_sink)


def split_kv_config(arch: Arch, dtype: str, head_dim: int, head_dim_v: int, *, has_sink: bool,
                    **flags) -> SplitKVConfig:
    """The split-KV forward of a problem class as one host function: forward_config's split kernel
    (which leaves the sink out) and the combine that adds it (``has_sink``). Not cached itself: it
    composes the two cached choices, which tools and A/B runs replace (benchmarks/decode_tiles_ab.py)."""
    forward = forward_config(arch, dtype, head_dim, head_dim_v, **dict(flags, has_sink=False, split_kv=True))
    return SplitKVConfig(forward=forward, combine=combine_config(arch, dtype, head_dim_v, has_sink))


@functools.lru_cache(maxsize=64)
def append_config(arch: Arch, dtype: str, head_dim: int, head_dim_v: int, paged: bool, has_rows: bool) -> AppendConfig:
    """The KV-cache append kernel for a cache dtype and head dims (``paged``: through a page table;
    ``has_rows``: cache_batch_idx picks the rows)."""
    return AppendConfig(arch=arch, dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v, paged=paged,
                        has_rows=has_rows)


# ---- GQA packing for head ratios the kernels cannot pack ----

# Up to this many query tokens per sequence, a head ratio the kernel cannot pack (sm90 and sm100 pack
# ratios that divide 64) runs packed anyway, with dummy query heads padding each KV head's group to
# the next ratio that packs: decoding and speculative steps then read each K/V tile once per KV head
# instead of once per query head, for (padded - ratio) / padded rows of wasted tensor work. Longer
# query sequences fill tiles unpacked. Where the arch's forward packs padded groups itself
# (fa4_kernels.tiles.has_padded_pack: ForwardConfig.pack_gqa_heads) the dummy heads exist only as
# tile rows, never in memory; an arch without it runs such ratios unpacked.
PAD_PACK_MAX_QUERIES = 64


@functools.lru_cache(maxsize=256)
def padded_pack(arch: Arch, head_dim: int, head_dim_v: int, varlen: bool, qhead_per_kvhead: int,
                max_seqlen_q: int) -> int:
    """The padded group size to run a query-head ratio with, or 0 to run it as it is: the smallest
    ratio above ``qhead_per_kvhead`` that the arch's forward packs, when the ratio itself does not
    pack and the queries are short (at most PAD_PACK_MAX_QUERIES per sequence), on an arch whose
    forward packs padded groups (has_padded_pack)."""
    if qhead_per_kvhead <= 1 or max_seqlen_q > PAD_PACK_MAX_QUERIES or not has_padded_pack(arch):
        return 0
    packs = lambda g: forward_schedule(arch, head_dim, head_dim_v, varlen, g).get("pack_gqa", 1) == g  # noqa: E731
    if packs(qhead_per_kvhead):
        return 0
    return next((g for g in range(qhead_per_kvhead + 1, 65) if packs(g)), 0)


# ---- split-KV: how many CTAs share a tile's KV blocks ----

# The most splits the automatic choice takes (more only add combine traffic), and the most an
# explicit num_splits may ask for.
AUTO_MAX_SPLITS = 128
MAX_SPLITS = 256
# A problem whose tiles already fill this share of the SMs runs unsplit; so does a KV range of at
# most SHORT_KV_BLOCKS blocks (the partials and the combine would cost more than the idle SMs).
FULL_SHARE = 0.8
SHORT_KV_BLOCKS = 4
# Among the split counts, the smallest whose wave efficiency is this close to the best one's. At
# 0.85, 8 tiles took 15 splits (120 CTAs on 132 SMs); 16 (128 CTAs) ran 2.5-2.8% faster at 1 x 64k
# keys (H100, twice, benchmarks/decode_tiles_ab.py; docs/perf.md), and with 0.95 only such near-full waves
# change.
NEAR_BEST = 0.95


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def num_splits_heuristic(*, batch: int, num_heads: int, num_heads_kv: int, seqlen_q: int, seqlen_k: int,
                         tile_m: int, tile_n: int, pack_gqa: int, num_sms: int, window_left: int = -1,
                         window_right: int = -1, max_splits: int = AUTO_MAX_SPLITS) -> int:
    """The split count ``num_splits=0`` runs with: a pure function of the problem and the SM count.

    The head dims enter through the tiles (tile_m query rows x tile_n keys, the arch's rules for the
    head dims); ``pack_gqa`` query heads share a tile's rows (``pack_gqa`` > 1: tiles per KV head,
    seqlen_q * pack_gqa rows); varlen batches pass the longest sequences. A sliding window
    (window_left and window_right >= 0) bounds the keys a tile sees.

    1 when the KV range is short (<= SHORT_KV_BLOCKS blocks) or the output tiles alone fill
    FULL_SHARE of the SMs; else, among the counts s <= min(max_splits, num_sms, KV blocks), the
    smallest whose wave efficiency w / ceil(w), w = tiles * s / num_sms, is within NEAR_BEST of the
    best (more splits than needed to fill the waves only add partials to write and combine). Never
    more splits than KV blocks.
    """
    keys = seqlen_k
    if window_left >= 0 and window_right >= 0:
        tokens_per_tile = _ceil_div(tile_m, max(pack_gqa, 1))
        keys = min(keys, window_left + window_right + tokens_per_tile)
    n_blocks = _ceil_div(max(keys, 0), tile_n)
    if n_blocks <= SHORT_KV_BLOCKS or num_sms <= 0:
        return 1
    # Packed tiles walk KV heads (a padded group has fewer query heads than pack_gqa rows).
    tile_heads = num_heads_kv if pack_gqa > 1 else num_heads
    tiles = batch * tile_heads * _ceil_div(seqlen_q * max(pack_gqa, 1), tile_m)
    if tiles == 0 or tiles >= FULL_SHARE * num_sms:
        return 1
    return _fullest_split(tiles, min(max_splits, num_sms, n_blocks), num_sms)


@functools.lru_cache(maxsize=4096)
def _fullest_split(tiles: int, max_count: int, num_sms: int) -> int:
    """The smallest split count in [1, max_count] whose wave efficiency is within NEAR_BEST of the
    best. Cached: it is evaluated on every call that asks for num_splits=0, and a decode loop's
    arguments stay the same from step to step once its KV blocks outnumber the cap."""
    efficiency = {}
    for s in range(1, max_count + 1):
        waves = tiles * s / num_sms
        efficiency[s] = waves / math.ceil(waves)
    best = max(efficiency.values())
    return min(s for s, e in efficiency.items() if e >= NEAR_BEST * best)
