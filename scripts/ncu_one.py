#!/usr/bin/env python3
"""One attention call inside a profiler window, for Nsight Compute: warms the implementation up
(compiles, fills caches), then runs exactly one forward, or one backward, between
cudaProfilerStart and Stop, so that `--profile-from-start off` profiles only its kernels.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --section ComputeWorkloadAnalysis python scripts/ncu_one.py --impl ours --shape 2,16,8192,128
    ... python scripts/ncu_one.py --impl fa4-upstream --mode bwd --shape 2,16,8192,128 --causal

--impl fa4-upstream needs flash-attn-4 importable (flash_attn.cute); for comparison only.
"""

from __future__ import annotations

import argparse


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", choices=("ours", "fa4-upstream"), default="ours")
    p.add_argument("--mode", choices=("fwd", "bwd"), default="fwd")
    p.add_argument("--shape", default="2,16,8192,128", help="batch,heads,seqlen,head_dim")
    p.add_argument("--causal", action="store_true")
    args = p.parse_args()

    import torch

    if args.impl == "ours":
        from flash_attn4 import flash_attn_func
    else:
        from flash_attn.cute import flash_attn_func
    b, h, s, d = (int(x) for x in args.shape.split(","))
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=args.mode == "bwd")
               for _ in range(3))
    dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)

    def forward():
        out = flash_attn_func(q, k, v, causal=args.causal)
        return out[0] if isinstance(out, tuple) else out

    def once():
        if args.mode == "fwd":
            with torch.no_grad():
                forward()
            return None
        out = forward()
        return lambda: torch.autograd.grad(out, (q, k, v), dout)

    for _ in range(3):
        step = once()
        if step is not None:
            step()
    torch.cuda.synchronize()
    step = once()  # a backward's forward runs outside the window
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    if step is None:
        once()
    else:
        step()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
