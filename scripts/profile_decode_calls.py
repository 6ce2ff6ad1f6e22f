#!/usr/bin/env python3
"""Where a decode call's time goes: the kernels of flash_attn_func(num_splits=0) on decode problems
under torch.profiler (each kernel's own CUDA time over 20 calls), and the call's time back to back
(CUDA events around 50 calls). Kernel time well under the call's time means gaps between launches.

    python scripts/profile_decode_calls.py
    python scripts/profile_decode_calls.py --problem 32,1,8192,28,4,128

A problem is b,s_q,s_cache,h,h_kv,d (bf16, non-causal). A programmatic-dependent (PDL) kernel's
profiled time includes its wait for the kernel before it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path[:0] = [str(Path(__file__).resolve().parent.parent / "torch-ext")]

import flash_attn4 as fa  # noqa: E402

PROBLEMS = ["32,1,8192,28,4,128", "8,1,16384,32,8,128", "1,1,65536,32,8,128"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--problem", action="append", help="b,s_q,s_cache,h,h_kv,d")
    args = p.parse_args()
    for spec in args.problem or PROBLEMS:
        b, sq, sk, h, hk, d = map(int, spec.split(","))
        q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        call = lambda: fa.flash_attn_func(q, k, v, num_splits=0)  # noqa: E731
        for _ in range(5):
            call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                call()
            torch.cuda.synchronize()
        print(f"b,s_q,s_cache,h,h_kv,d = {spec}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=6, max_name_column_width=60))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            call()
        end.record()
        torch.cuda.synchronize()
        print(f"us per call, back to back: {start.elapsed_time(end) * 1000 / 50:.1f}\n")


if __name__ == "__main__":
    main()
