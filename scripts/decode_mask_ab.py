#!/usr/bin/env python3
"""One-query decode steps sent causal against sent unmasked: the same attention (one
bottom-right-aligned query sees every key), two kernels. GPU time per flash_attn_func call
(num_splits=0, triton's do_bench, L2 flushed), the two interleaved over rounds, and the outputs
compared bit for bit. Session 30 switched the transformers adapter to causal (the shipped kernels):

    python scripts/decode_mask_ab.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "torch-ext"))

# (batch, keys, query heads, KV heads, head dim): issue 21's decode rows and the 1.1B model's step
PROBLEMS = [(1, 65536, 32, 8, 128), (8, 16384, 32, 8, 128), (32, 8192, 28, 4, 128), (1, 16384, 16, 4, 128)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    import torch
    from triton.testing import do_bench

    from flash_attn4 import flash_attn_func

    print(torch.cuda.get_device_name())
    for b, sk, h, hk, d in PROBLEMS:
        q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        same = torch.equal(flash_attn_func(q, k, v, causal=True, num_splits=0),
                           flash_attn_func(q, k, v, causal=False, num_splits=0))
        times = {False: [], True: []}
        for _ in range(args.rounds):
            for causal in times:
                times[causal].append(do_bench(lambda: flash_attn_func(q, k, v, causal=causal, num_splits=0),
                                              warmup=20, rep=100))
        unmasked, causal = (statistics.median(times[c]) * 1e3 for c in (False, True))
        print(f"b{b} sk{sk} h{h}/{hk} d{d}: unmasked {unmasked:.1f} us, causal {causal:.1f} us, "
              f"causal / unmasked {causal / unmasked:.3f}; outputs {'bit-equal' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
