#!/usr/bin/env python3
"""Decode tiles A/B in one run: the d = 128 decode problems of issue 21 (one query token, bf16,
non-causal) through flash_attn_func (num_splits=0, the automatic split), with dispatch's
ForwardConfig as chosen and with tile overrides, against cuDNN SDPA. The question it answers: is a
decode CTA that streams K/V alone on its SM limited by the bytes in flight (two stages of 128-key
tiles), so that a third stage or longer tiles (shared memory freed by storing O from registers)
raise the bandwidth? Interleaved rounds of triton.testing.do_bench medians (L2 not flushed: the
caches are far larger than L2); prints us, % of HBM peak, the ratio to the base choice and to
cuDNN, and the largest difference from the base output.

    python benchmarks/decode_tiles_ab.py
    python benchmarks/decode_tiles_ab.py --variant st3:num_stages=3,tma_store_o=false --problem 32,8192,28,4
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from flash_attn4 import dispatch, flash_attn_func, ops
from flash_attn4.fa4_kernels import config

PROBLEMS = ["32,8192,28,4", "32,8192,32,4", "8,16384,32,8", "1,65536,32,8", "2,131072,64,8"]
VARIANTS = ["st3:num_stages=3,tma_store_o=false", "n176:tile_n=176,tma_store_o=false",
            "n192:tile_n=192,tma_store_o=false"]
HBM_TBPS = {"H200": 4.8, "H100": 3.35}  # peak by device name (SXM parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--problem", action="append", help="b,s_cache,h,h_kv (d = 128, one query)")
    p.add_argument("--variant", action="append", help="NAME:field=value,... (ForwardConfig overrides)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    chosen = dispatch.forward_config
    variants = {"base": {}}
    for text in args.variant or VARIANTS:
        name, _, spec = text.partition(":")
        variants[name] = config.parse_overrides(spec)

    def use(overrides):
        dispatch.forward_config = lambda *a, **k: chosen(*a, **k).replace(**overrides)
        ops._PLANS.clear()  # cached launch plans hold the config they were made with

    gpu = torch.cuda.get_device_name()
    peak = next((tbps for part, tbps in HBM_TBPS.items() if part in gpu), HBM_TBPS["H200"])
    print(f"{gpu}; d = 128, s_q = 1, bf16, num_splits = 0; % HBM of {peak} TB/s")
    print("| b, s_cache, h/h_kv | impl | us | % HBM | base / this | cuDNN / this | max diff |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for spec in args.problem or PROBLEMS:
        b, sk, h, hk = map(int, spec.split(","))
        q = torch.randn(b, 1, h, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, sk, hk, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        gbytes = 2 * 2 * b * sk * hk * 128 / 1e9
        fns, outs = {}, {}
        for name, overrides in variants.items():
            use(overrides)
            fns[name] = lambda: flash_attn_func(q, k, v, num_splits=0)
            outs[name] = fns[name]()
        use({})

        def cudnn():
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

        ref = cudnn().transpose(1, 2)
        times = {name: [] for name in [*variants, "cudnn"]}
        for _ in range(args.rounds):
            for name in variants:
                use(variants[name])
                times[name].append(do_bench(fns[name], warmup=20, rep=200, return_mode="median"))
            times["cudnn"].append(do_bench(cudnn, warmup=20, rep=200, return_mode="median"))
        use({})
        us = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        for name in times:
            diff = (outs.get(name, ref).float() - outs["base"].float()).abs().max().item()
            print(f"| {b}, {sk // 1024}k, {h}/{hk} | {name} | {us[name]:.1f} | "
                  f"{100 * gbytes / us[name] * 1e3 / peak:.0f}% | {us['base'] / us[name]:.2f} | "
                  f"{us['cudnn'] / us[name]:.2f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
