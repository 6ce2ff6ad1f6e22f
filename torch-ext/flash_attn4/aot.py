"""Ahead-of-time compiled kernels: the set shipped in the Hub build, and how a model's configurations
are derived (shared with ``warmup``).

What ships is chosen from model profiles (MODEL_PROFILES: the head dims, head ratios, sliding windows
and softcaps of the transformers models our tests run plus common released models) and the call
patterns that reach the kernels (CALL_PATTERNS below). Every configuration comes out of ``dispatch``'s
own functions, so the shipped set holds nothing dispatch cannot pick. docs/AOT.md lists it.

Layout (the disk cache's, so one naming rule serves both; see compile_cache)::

    <shipped root>/manifest.json                                  fingerprint, DSL version, entries
    <shipped root>/<fingerprint>/<kind>-<sha256(key)[:32]>.so     (+ .json sidecar with the key)

Each kernel is a shared library (the exported object linked at build time), which native.py loads
without importing the DSL.

The shipped root is ``<package>/aot`` (what scripts/build_hub.py writes), or FLASH_ATTN4_AOT_DIR;
FLASH_ATTN4_DISABLE_AOT=1 ignores it. Only the folder named by the running sources' fingerprint is
read, and an entry is used only when its sidecar names the requested key: a kernel built from other
sources or another DSL version is never loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from . import dispatch, settings
from .fa4_kernels.arch import IMPLEMENTED, Arch
from .fa4_kernels.tiles import has_split_kv

MANIFEST = "manifest.json"
DTYPES = ("bfloat16", "float16")
# What the Hub build ships: every listed checkpoint is published in bfloat16, and float16 would double
# the build (CI time) and the Hub tree; `scripts/build_aot.py --dtype float16` adds it, and
# `python -m flash_attn4.warmup --dtype float16` puts a model's float16 kernels into the disk cache.
SHIPPED_DTYPES = ("bfloat16",)


@dataclass(frozen=True)
class ModelProfile:
    """What decides a model's attention kernels: head dims, head ratio, masks. ``sliding``: the model
    has sliding-window layers; ``full``: it has full causal layers (Gemma-2 alternates, Mistral-7B-v0.1
    is all sliding)."""

    name: str
    head_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim_v: int | None = None
    sliding: bool = False
    full: bool = True
    softcap: bool = False
    causal: bool = True  # False: an encoder (bidirectional attention)

    @property
    def ratio(self) -> int:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        return self.num_heads // self.num_kv_heads

    @property
    def dv(self) -> int:
        return self.head_dim_v or self.head_dim


# The data the shipped list is chosen from. The first four are the models tests/gpu/
# test_transformers_model.py runs (Llama d64/d128 over 2 KV heads, Gemma-2 d64 softcap + sliding,
# Mistral d128 sliding); the rest are the head shapes of widely used released checkpoints.
MODEL_PROFILES = (
    ModelProfile("test-llama-d64", 64, 4, 2),
    ModelProfile("test-llama-d128", 128, 4, 2),
    ModelProfile("test-gemma2", 64, 4, 2, sliding=True, softcap=True),
    ModelProfile("test-mistral", 128, 4, 2, sliding=True, full=False),
    ModelProfile("llama-3-8b/70b", 128, 32, 8),
    ModelProfile("llama-3.2-1b", 64, 32, 8),
    ModelProfile("qwen2.5-7b", 128, 28, 4),
    ModelProfile("mistral-7b-v0.1", 128, 32, 8, sliding=True, full=False),
    ModelProfile("gemma-2-9b", 256, 16, 8, sliding=True, softcap=True),
    ModelProfile("gemma-3-4b", 256, 8, 4, sliding=True),
    ModelProfile("deepseek-v3-mla", 192, 128, 128, head_dim_v=128),
    ModelProfile("bert-base", 64, 12, 12, causal=False),
)

# How calls reach the kernels (ops.py): "dense" = flash_attn_func on an unpadded batch; "varlen" =
# padded or packed batches (the transformers adapter unpads to cu_seqlens); "decode" = one query per
# sequence (a ratio that does not pack run in padded groups, dispatch.padded_pack), sent causal as the
# transformers adapter sends its decode steps, batched (dynamic cache: unsplit, and split-KV for long
# caches) or varlen (padding with holes); "kvcache" = flash_attn_with_kvcache
# over a contiguous cache, unsplit and split-KV (with its combine, one pipeline): batched + seqused_k (entry b on
# cache row b from position 0: decoding's common case) and varlen + seqused_k (cache_batch_idx or
# cache_leftpad: left-padded batches, the transformers adapter's left padding), with the append kernel;
# "paged" = the same call over a paged cache (batched + seqused_k + page table), unsplit and split-KV, for
# each SHIPPED_PAGE_SIZES, with the paged append kernel.
CALL_PATTERNS = ("dense", "varlen", "decode", "kvcache", "paged")
# The page size is part of the compile key and the serving engine's choice: the shipped one is
# transformers' continuous-batching default (256 tokens), whose paged decode step would call
# flash_attn_with_kvcache with a block table once it routes FA4 names there (docs/DECODING.md: as of
# 5.22 only FA2/FA3 names take that path). Other sizes (vLLM's 16) compile on first use.
SHIPPED_PAGE_SIZES = (256,)


def _mask_kinds(p: ModelProfile) -> list[dict]:
    if not p.causal:
        return [dict(causal=False, local=False)]
    kinds = [dict(causal=True, local=False)] if p.full else []
    if p.sliding:  # causal with a left window: local in the kernel's terms (validate.canonical_mask)
        kinds.append(dict(causal=False, local=True))
    return kinds


def _ratio(arch: Arch, p: ModelProfile, varlen: bool, short: bool) -> dict:
    """forward_config's head-ratio arguments for the model's calls: for short queries a ratio the
    kernel cannot pack runs in padded groups (dispatch.padded_pack), which the kernel packs itself
    (pack_group)."""
    group = dispatch.padded_pack(arch, p.head_dim, p.dv, varlen, p.ratio, 1 if short else 1 << 20)
    return dict(qhead_per_kvhead=p.ratio, pack_group=group) if group else dict(qhead_per_kvhead=p.ratio)


def forward_configs(arch: Arch, p: ModelProfile, dtype: str, patterns=CALL_PATTERNS) -> list:
    out = []
    for mask in _mask_kinds(p):
        base = dict(has_softcap=p.softcap, has_sink=False, **mask)

        def fwd(varlen, short, **extra):
            return dispatch.forward_config(arch, dtype, p.head_dim, p.dv, varlen=varlen,
                                           **_ratio(arch, p, varlen, short), **base, **extra)

        def split(varlen, **extra):  # the split-KV pipeline (split kernel + combine, one call)
            return dispatch.split_kv_config(arch, dtype, p.head_dim, p.dv, varlen=varlen,
                                            **_ratio(arch, p, varlen, True), **base, **extra)

        if "dense" in patterns:
            out.append(fwd(False, False, has_seqused_k=False))
        if "varlen" in patterns:
            out.append(fwd(True, False, has_seqused_k=False))
        if "decode" in patterns and p.causal:
            out += [fwd(False, True, has_seqused_k=False), fwd(True, True, has_seqused_k=False)]
            if has_split_kv(arch):  # a long dynamic cache: flash_attn_func's automatic split-KV
                out.append(split(False, has_seqused_k=False))
        if "kvcache" in patterns and p.causal:
            for varlen in (False, True):
                out.append(fwd(varlen, True, has_seqused_k=True))
                if has_split_kv(arch):
                    out.append(split(varlen, has_seqused_k=True))
            # The append of new tokens into the cache (cache_batch_idx: compiled on first use).
            out.append(dispatch.append_config(arch, dtype, p.head_dim, p.dv, paged=False, has_rows=False))
        if "paged" in patterns and p.causal:
            for page_size in SHIPPED_PAGE_SIZES:
                out.append(fwd(False, True, has_seqused_k=True, page_size=page_size))
                if has_split_kv(arch):
                    out.append(split(False, has_seqused_k=True, page_size=page_size))
            out.append(dispatch.append_config(arch, dtype, p.head_dim, p.dv, paged=True, has_rows=False))
    return out


def backward_configs(arch: Arch, p: ModelProfile, dtype: str) -> list:
    if "backward" not in IMPLEMENTED.get(arch, ()):
        return []
    out = []
    for mask in _mask_kinds(p):
        for varlen in (False, True):
            try:  # an arch's backward may lack a class (sm_100a: head dims other than 64, 128): calling it raises
                cfg = dispatch.backward_config(arch, dtype, p.head_dim, p.dv, varlen=varlen, has_softcap=p.softcap,
                                               has_seqused_k=False, deterministic=False, **mask)
            except NotImplementedError:
                continue
            out += [cfg, cfg.postprocess()]
    out.append(dispatch.preprocess_config(arch, dtype, p.dv))
    return out


def model_configs(arch: Arch, p: ModelProfile, dtypes=DTYPES, training: bool = True,
                  patterns=CALL_PATTERNS) -> list:
    """Every kernel configuration a model's calls dispatch to (forward, and backward when
    ``training``), without duplicates, in a stable order. A configuration the arch cannot build
    (NotImplementedError/ValueError from dispatch's rules) is left out: calling it raises anyway."""
    found: dict[tuple, object] = {}
    for dtype in dtypes:
        for make in (lambda: forward_configs(arch, p, dtype, patterns),
                     lambda: backward_configs(arch, p, dtype) if training else []):
            try:
                for cfg in make():
                    found.setdefault(cfg.key(), cfg)
            except (NotImplementedError, ValueError):
                continue
    return list(found.values())


def kind_of(cfg) -> str:
    """The compile-cache kind of a configuration (compile_cache.get_*_kernel)."""
    return {"ForwardConfig": "fwd", "BackwardConfig": "bwd", "PreprocessConfig": "bwd_pre",
            "PostprocessConfig": "bwd_post", "CombineConfig": "combine",
            "AppendConfig": "append", "SplitKVConfig": "split_kv"}[type(cfg).__name__]


def shipped_configs(arch: Arch, profiles=MODEL_PROFILES, dtypes=SHIPPED_DTYPES) -> list:
    """The configurations the Hub build ships for ``arch`` (forward for every arch with kernels;
    backward where implemented), sorted by (kind, key)."""
    if not IMPLEMENTED.get(arch):
        return []
    found: dict[tuple, object] = {}
    for p in profiles:
        for cfg in model_configs(arch, p, dtypes):
            found.setdefault((kind_of(cfg),) + cfg.key(), cfg)
    return [found[k] for k in sorted(found)]


# ---- lookup (compile_cache calls this between memory and disk) ----


def shipped_root() -> Path | None:
    """The shipped set's folder: FLASH_ATTN4_AOT_DIR, else <package>/aot; None when disabled."""
    if settings.aot_disabled():
        return None
    explicit = settings.aot_dir()
    return explicit if explicit is not None else Path(__file__).resolve().parent / "aot"


def shipped_entry(kind: str, key: tuple, name: str, fingerprint: str) -> Path | None:
    """The shipped object for (kind, key), or None. ``name``: the entry's file name (the disk cache's
    naming rule); only the folder of the running fingerprint is looked at, and the sidecar must name
    this very key (a renamed or mixed-up file is not used)."""
    root = shipped_root()
    if root is None:
        return None
    path = root / fingerprint / name
    try:
        sidecar = json.loads(path.with_suffix(".json").read_text())
    except (OSError, ValueError):
        return None
    if sidecar.get("key") != list(key) or sidecar.get("kind", kind) != kind or not path.is_file():
        return None
    return path
