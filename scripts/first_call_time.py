#!/usr/bin/env python3
"""How long a new process takes to its first attention result (the forward compile, or the disk
cache hit), split into importing and the first call. Needs a GPU.

    FLASH_ATTN4_CACHE_DIR=$(mktemp -d) python scripts/first_call_time.py   # cold: compiles
    FLASH_ATTN4_CACHE_DIR=<same dir>   python scripts/first_call_time.py   # second process: cache

Each run prints one line per configuration: import time (once), first call, second call.
"""

from __future__ import annotations

import argparse
import sys
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--headdims", default="64,128", help="comma-separated head dims (default 64,128)")
    args = p.parse_args()

    start = time.perf_counter()
    import torch

    import flash_attn4

    imported = time.perf_counter() - start
    print(f"import torch + flash_attn4: {imported:.2f} s")
    for d in (int(x) for x in args.headdims.split(",")):
        q, k, v = (torch.randn(2, 1024, 8, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        times = []
        for _ in range(2):
            start = time.perf_counter()
            flash_attn4.flash_attn_func(q, k, v, causal=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        print(f"d={d} causal forward: first call {times[0]:.2f} s, second {times[1] * 1e3:.1f} ms")
    print(f"kernel cache: {flash_attn4.compile_cache.stats()}; torch._dynamo imported: {'torch._dynamo' in sys.modules}")


if __name__ == "__main__":
    main()
