"""Precompile a model's kernels into the disk cache ahead of serving (no GPU needed: the kernels are
cross-compiled for the arch named, or this machine's GPU).

    python -m flash_attn4.warmup --model meta-llama/Llama-3.1-8B          # a transformers config (Hub or folder)
    python -m flash_attn4.warmup --head-dim 128 --heads 32 --kv-heads 8 --sliding --arch sm_90a
    python -m flash_attn4.warmup --model ./my-model --dtype float16 --no-backward

or from Python: ``warmup.warmup(warmup.profile_from_config(config), arch=...)``. The configurations are
the ones the model's calls dispatch to (aot.model_configs: dense and varlen prefill, decode,
KV-cache decode with and without split-KV, over a contiguous cache and over pages of
aot.SHIPPED_PAGE_SIZES, and the backward when training); kernels already shipped
precompiled with the package or already on disk are loaded, not compiled again. The disk cache is
FLASH_ATTN4_CACHE_DIR (settings.py); each process that later runs the model loads them from there.
"""

from __future__ import annotations

import argparse
import sys
import time

from . import aot, compile_cache, dispatch
from .fa4_kernels.arch import Arch

_GETTERS = {"fwd": compile_cache.get_forward_kernel, "bwd": compile_cache.get_backward_kernel,
            "bwd_pre": compile_cache.get_backward_preprocess_kernel,
            "bwd_post": compile_cache.get_backward_postprocess_kernel, "combine": compile_cache.get_combine_kernel,
            "split_kv": compile_cache.get_split_kv_kernel,
            "append": compile_cache.get_append_kernel}


def profile_from_config(config) -> aot.ModelProfile:
    """A ModelProfile from a transformers config (or any object with its attribute names): hidden_size,
    num_attention_heads, num_key_value_heads, head_dim, sliding_window, attn_logit_softcapping, and
    for DeepSeek-style MLA qk_nope_head_dim + qk_rope_head_dim / v_head_dim."""
    config = getattr(config, "text_config", None) or config  # multimodal wrappers keep the LM's config inside
    heads = _required(config, "num_attention_heads")
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None)
    head_dim_v = getattr(config, "v_head_dim", None)
    if getattr(config, "qk_rope_head_dim", None):  # MLA: queries/keys carry the rope part as well
        head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    if not head_dim:
        head_dim = _required(config, "hidden_size") // heads
    window = getattr(config, "sliding_window", None)
    types = list(getattr(config, "layer_types", None) or [])
    sliding = bool(window) and (not types or "sliding_attention" in types)
    full = not sliding or not types or "full_attention" in types
    if sliding and not types and getattr(config, "model_type", "") in ("gemma2", "gemma3_text", "gemma3"):
        full = True  # these alternate sliding and full layers
    return aot.ModelProfile(name=getattr(config, "model_type", None) or "model", head_dim=int(head_dim),
                            num_heads=int(heads), num_kv_heads=int(kv_heads),
                            head_dim_v=int(head_dim_v) if head_dim_v else None, sliding=sliding, full=full,
                            softcap=bool(getattr(config, "attn_logit_softcapping", None)),
                            causal=getattr(config, "model_type", "") not in _ENCODERS)


_ENCODERS = ("bert", "roberta", "xlm-roberta", "modernbert", "distilbert")  # bidirectional attention


def _required(config, name: str):
    value = getattr(config, name, None)
    if not value:
        raise ValueError(f"the model config has no {name}: pass the shapes explicitly (--head-dim, --heads, ...)")
    return value


def warmup(profile: aot.ModelProfile, arch: Arch, dtypes=("bfloat16",), training: bool = True,
           progress=sys.stderr) -> dict:
    """Compile (or load) every kernel of ``profile`` for ``arch`` into the disk cache; returns
    compile_cache's counters for this run (compiled, aot_hits, disk_hits, ...)."""
    configs = aot.model_configs(arch, profile, dtypes, training)
    if not configs:
        raise ValueError(f"no {arch.value} kernel configuration for {profile}: check the head dims and dtype")
    before = compile_cache.stats()
    start = time.perf_counter()
    for i, cfg in enumerate(configs, 1):
        _GETTERS[aot.kind_of(cfg)](cfg)
        if progress is not None:
            done = int(30 * i / len(configs))
            print(f"\r[{'#' * done}{'.' * (30 - done)}] {i}/{len(configs)} kernels, "
                  f"{time.perf_counter() - start:5.1f} s", end="", file=progress, flush=True)
    if progress is not None:
        print(file=progress)
    after = compile_cache.stats()
    return {k: after[k] - before[k] for k in after}


def _arch(name: str | None) -> Arch:
    if name:
        return Arch.parse(name)
    import torch

    if not torch.cuda.is_available():
        raise ValueError("no GPU here: name the compile target with --arch (sm_90a, sm_100a, sm_103a)")
    return dispatch.arch_for_device(torch.device("cuda", torch.cuda.current_device()))


def _profile(args) -> aot.ModelProfile:
    if args.model:
        import transformers

        return profile_from_config(transformers.AutoConfig.from_pretrained(args.model))
    if not (args.head_dim and args.heads):
        raise ValueError("give --model, or --head-dim and --heads (and --kv-heads, --head-dim-v, --sliding, "
                         "--softcap)")
    return aot.ModelProfile("explicit", args.head_dim, args.heads, args.kv_heads or args.heads,
                            head_dim_v=args.head_dim_v, sliding=args.sliding, full=not args.only_sliding,
                            softcap=args.softcap, causal=not args.bidirectional)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="transformers model id or folder (its config.json is read)")
    parser.add_argument("--head-dim", type=int)
    parser.add_argument("--head-dim-v", type=int, default=None)
    parser.add_argument("--heads", type=int, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    parser.add_argument("--sliding", action="store_true", help="the model has sliding-window layers")
    parser.add_argument("--only-sliding", action="store_true", help="... and no full causal layers")
    parser.add_argument("--softcap", action="store_true", help="the model uses a logit softcap")
    parser.add_argument("--bidirectional", action="store_true", help="an encoder (no causal mask)")
    parser.add_argument("--dtype", action="append", choices=aot.DTYPES, help="repeatable (default: bfloat16)")
    parser.add_argument("--no-backward", action="store_true", help="inference only: skip the backward kernels")
    parser.add_argument("--arch", help="compile target (default: this machine's GPU)")
    args = parser.parse_args(argv)
    try:
        arch, profile = _arch(args.arch), _profile(args)
    except ValueError as exc:
        print(f"flash_attn4.warmup: {exc}", file=sys.stderr)
        return 2
    print(f"flash_attn4.warmup: {profile} on {arch.value}", file=sys.stderr)
    counts = warmup(profile, arch, tuple(args.dtype or ("bfloat16",)), training=not args.no_backward)
    print(f"compiled {counts['compiled']}, shipped {counts['aot_hits']}, already on disk {counts['disk_hits']} "
          f"(disk cache: {compile_cache.settings.cache_dir()})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
