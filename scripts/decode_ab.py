#!/usr/bin/env python3
"""A/B of forward-kernel choices on the decode benchmark's problems, in one process on one GPU:
each variant overrides ForwardConfig fields (or a dispatch constant) for every forward call, and
the variants and cuDNN are timed interleaved (A B C, A B C, ...), median of each.

    PYTHONPATH=$PWD/torch-ext:$PWD python scripts/decode_ab.py \\
        --variant st3:num_stages=3 --variant fill:dispatch.NEAR_BEST=0.95 --variant nopdl:combine.pdl=false

A variant's fields: ForwardConfig fields, dispatch constants (dispatch.NAME) or CombineConfig fields
(combine.FIELD). "base" (dispatch's own choice) always runs. A variant whose fields a problem's kernel cannot build
(ValueError from ForwardConfig) runs that problem with the base kernel and says so. Prints a
markdown table: microseconds, and each variant's time over base's (< 1 is faster).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent.parent / "torch-ext")]

from benchmarks import bench_decode  # noqa: E402
import flash_attn4 as fa  # noqa: E402
from flash_attn4 import dispatch, ops  # noqa: E402
from flash_attn4.fa4_kernels.config import parse_overrides  # noqa: E402

_ORIGINAL_FORWARD_CONFIG = dispatch.forward_config
_ORIGINAL_COMBINE_CONFIG = dispatch.combine_config
_ORIGINAL_CONSTANTS = {}
_fell_back: set = set()
MAX_HEAD_DIM = 128  # --max-head-dim: variants apply to kernels up to this head dim (shared memory)


def _use(name: str, overrides: dict) -> None:
    """Route every forward call through ``overrides`` until the next _use (plans cleared)."""
    fields = {k: v for k, v in overrides.items() if "." not in k}
    constants = {k[len("dispatch."):]: v for k, v in overrides.items() if k.startswith("dispatch.")}
    combine_fields = {k[len("combine."):]: v for k, v in overrides.items() if k.startswith("combine.")}
    for key, value in _ORIGINAL_CONSTANTS.items():
        setattr(dispatch, key, value)
    for key, value in constants.items():
        _ORIGINAL_CONSTANTS.setdefault(key, getattr(dispatch, key))
        setattr(dispatch, key, value)

    def forward_config(*args, **kwargs):
        cfg = _ORIGINAL_FORWARD_CONFIG(*args, **kwargs)
        if not fields or max(cfg.head_dim, cfg.head_dim_v) > MAX_HEAD_DIM:
            return cfg
        try:
            return cfg.replace(**fields)
        except ValueError:
            _fell_back.add((name, cfg.head_dim))
            return cfg

    def combine_config(*args, **kwargs):
        return _ORIGINAL_COMBINE_CONFIG(*args, **kwargs).replace(**combine_fields)

    dispatch.forward_config = forward_config
    dispatch.combine_config = combine_config
    dispatch._fullest_split.cache_clear()
    ops._PLANS.clear()


def _time_us(fn) -> float:
    from triton.testing import do_bench

    return 1000.0 * do_bench(fn, warmup=25, rep=50, return_mode="median")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", action="append", default=[], help="NAME:field=value[,field=value]")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--problems", default="all", help="comma-separated indexes into the decode set, or all")
    p.add_argument("--max-head-dim", type=int, default=MAX_HEAD_DIM,
                   help="variants apply to kernels up to this head dim; larger ones run the base kernel")
    args = p.parse_args()
    globals()["MAX_HEAD_DIM"] = args.max_head_dim
    variants = {"base": {}}
    for text in args.variant:
        name, _, spec = text.partition(":")
        variants[name] = parse_overrides(spec)  # dispatch.NAME / combine.FIELD / a ForwardConfig field
    problems = bench_decode.PROBLEMS if args.problems == "all" else [
        bench_decode.PROBLEMS[int(i)] for i in args.problems.split(",")]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; variants {variants}")
    header = "| problem | " + " | ".join(f"{n} us" for n in variants) + " | cudnn us | " + \
             " | ".join(f"{n}/base" for n in variants if n != "base") + " | base/cudnn time |"
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for prob in problems:
        x = bench_decode.make_inputs(prob, torch.bfloat16, 0)
        q, k, v = x["q"], x["k"], x["v"]
        runners = {}
        ref = None
        for name, overrides in variants.items():
            _use(name, overrides)
            out = fa.flash_attn_func(q, k, v, causal=prob.causal, num_splits=0)
            torch.cuda.synchronize()
            if ref is None:
                ref = out
            diff = (out.float() - ref.float()).abs().max().item()
            assert diff < 2e-2, f"{name} differs from base by {diff} on {prob.name}"
            runners[name] = (overrides, lambda: fa.flash_attn_func(q, k, v, causal=prob.causal, num_splits=0))
        cudnn = bench_decode._sdpa("CUDNN_ATTENTION")(prob, x, {})
        cudnn()
        times = {name: [] for name in [*variants, "cudnn"]}
        for _ in range(args.rounds):
            for name, (overrides, fn) in runners.items():
                _use(name, overrides)
                fn()
                times[name].append(_time_us(fn))
            times["cudnn"].append(_time_us(cudnn))
        med = {n: statistics.median(t) for n, t in times.items()}
        row = [prob.name, *(f"{med[n]:.1f}" for n in variants), f"{med['cudnn']:.1f}",
               *(f"{med[n] / med['base']:.3f}" for n in variants if n != "base"),
               f"{med['base'] / med['cudnn']:.3f}"]
        lines.append("| " + " | ".join(row) + " |")
        print(lines[-1], flush=True)
        _use("base", {})
        del x, q, k, v, runners
        torch.cuda.empty_cache()
    print("\n".join(lines))
    if _fell_back:
        print("variants that fell back to the base kernel (fields not buildable):", sorted(_fell_back))
    return 0


if __name__ == "__main__":
    sys.exit(main())
