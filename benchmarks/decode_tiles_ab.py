#!/usr/bin/env python3
"""Decode A/B in one run: the decode benchmark's problems (bench_decode.PROBLEMS, or --problem)
through flash_attn_func (num_splits=0, the automatic split) with dispatch's choices and with
variants, against cuDNN SDPA. A variant overrides ForwardConfig fields (tiles, stages, ...),
dispatch constants (``dispatch.NAME``, e.g. the split heuristic's NEAR_BEST) or CombineConfig fields
(``combine.FIELD``, e.g. pdl) for every call. Interleaved rounds (base, variants, cuDNN; again) of
triton.testing.do_bench medians (L2 not flushed: the caches are far larger than L2); prints us, the
K+V bandwidth as % of the device's HBM peak, each variant's time over base's (< 1: faster), base's
over cuDNN's, and checks every variant's output against base's.

    python benchmarks/decode_tiles_ab.py --variant st3:num_stages=3,tma_store_o=false
    python benchmarks/decode_tiles_ab.py --variant nopdl:combine.pdl=false --problems 0,1,2,4 --rounds 7
    python benchmarks/decode_tiles_ab.py --variant fill:dispatch.NEAR_BEST=0.95 --problem 1,1,65536,32,8,128
    python benchmarks/decode_tiles_ab.py --call paged256 --problems 5 --max-head-dim 256 --variant t80:tile_n=80

``--call`` picks the call every variant makes: ``func`` (flash_attn_func, the default) or one of
bench_decode's flash_attn_with_kvcache rows: ``kvcache`` (the dense cache), ``paged256``, ``paged16``
(the cache in shuffled pages of that many tokens).

Field variants apply to kernels up to --max-head-dim (shared memory); larger ones run base's kernel.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "torch-ext")]

from benchmarks import bench_decode  # noqa: E402
from flash_attn4 import dispatch, flash_attn_func, ops  # noqa: E402
from flash_attn4.fa4_kernels import config  # noqa: E402

HBM_TBPS = {"H200": 4.8, "H100": 3.35}  # peak by device name (SXM parts)
_CHOSEN = {"forward_config": dispatch.forward_config, "combine_config": dispatch.combine_config}
_CONSTANTS: dict = {}
CALLS = {"kvcache": bench_decode._ours_kvcache, "paged256": bench_decode._ours_paged(256),
         "paged16": bench_decode._ours_paged(16)}


def use(overrides: dict, max_head_dim: int) -> None:
    """Route every call through ``overrides`` (cached launch plans cleared: they hold their config)."""
    fields = {k: v for k, v in overrides.items() if "." not in k}
    combine = {k.partition(".")[2]: v for k, v in overrides.items() if k.startswith("combine.")}
    for name, value in _CONSTANTS.items():
        setattr(dispatch, name, value)
    for key, value in overrides.items():
        if key.startswith("dispatch."):
            name = key.partition(".")[2]
            _CONSTANTS.setdefault(name, getattr(dispatch, name))
            setattr(dispatch, name, value)

    def forward_config(*args, **kwargs):
        cfg = _CHOSEN["forward_config"](*args, **kwargs)
        return cfg.replace(**fields) if fields and max(cfg.head_dim, cfg.head_dim_v) <= max_head_dim else cfg

    dispatch.forward_config = forward_config
    dispatch.combine_config = lambda *a, **k: _CHOSEN["combine_config"](*a, **k).replace(**combine)
    dispatch._fullest_split.cache_clear()
    ops._PLANS.clear()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--problem", action="append", help="b,s_q,s_cache,h,h_kv,d (else the decode set)")
    p.add_argument("--problems", help="indexes into the decode set, comma-separated")
    p.add_argument("--variant", action="append", default=[], help="NAME:field=value,... (see above)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-head-dim", type=int, default=128)
    p.add_argument("--call", default="func", choices=("func", *CALLS))
    args = p.parse_args()
    variants = {"base": {}}
    for text in args.variant:
        name, _, spec = text.partition(":")
        variants[name] = config.parse_overrides(spec)
    problems = list(bench_decode.PROBLEMS)
    if args.problems:
        problems = [problems[int(i)] for i in args.problems.split(",")]
    if args.problem:
        problems = [bench_decode.Problem(*map(int, spec.split(","))) for spec in args.problem]

    gpu = torch.cuda.get_device_name()
    peak = next((tbps for part, tbps in HBM_TBPS.items() if part in gpu), HBM_TBPS["H200"])
    print(f"{gpu}, torch {torch.__version__}; bf16, num_splits = 0, call {args.call}; % HBM: K+V bytes of "
          f"{peak} TB/s; variants {variants}")
    names = [*variants, "cudnn"]
    print("| problem | " + " | ".join(f"{n} us" for n in names) + " | base % HBM | " +
          " | ".join(f"{n} / base" for n in variants if n != "base") + " | base / cuDNN |")
    print("|---|" + "---:|" * (len(names) + len(variants) + 1))
    for prob in problems:
        x = bench_decode.make_inputs(prob, torch.bfloat16, 0)
        q, k, v = x["q"], x["k"], x["v"]
        fns, outs = {}, {}
        for name, overrides in variants.items():
            use(overrides, args.max_head_dim)
            if args.call == "func":
                fns[name] = lambda: flash_attn_func(q, k, v, causal=prob.causal, num_splits=0)
            else:  # the same inputs (a paged call: the same pages and table) for every variant
                fns[name] = fns["base"] if name != "base" else CALLS[args.call](prob, x, {})
            outs[name] = fns[name]()
            diff = (outs[name].float() - outs["base"].float()).abs().max().item()
            assert diff < 2e-2, f"{name} differs from base by {diff:.1e} on {prob.name}"
        use({}, args.max_head_dim)
        fns["cudnn"] = bench_decode._sdpa("CUDNN_ATTENTION")(prob, x, {})
        fns["cudnn"]()
        times = {name: [] for name in names}
        for _ in range(args.rounds):
            for name in names:
                use(variants.get(name, {}), args.max_head_dim)
                times[name].append(1e3 * do_bench(fns[name], warmup=20, rep=100, return_mode="median"))
        use({}, args.max_head_dim)
        us = {name: statistics.median(t) for name, t in times.items()}
        hbm = 100 * prob.kv_bytes() / (us["base"] * 1e-6) / (peak * 1e12)
        row = [prob.name, *(f"{us[n]:.1f}" for n in names), f"{hbm:.0f}%",
               *(f"{us[n] / us['base']:.3f}" for n in variants if n != "base"), f"{us['base'] / us['cudnn']:.3f}"]
        print("| " + " | ".join(row) + " |", flush=True)
        del x, fns, outs  # (q, k, v: replaced by the next problem's)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
