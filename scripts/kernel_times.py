#!/usr/bin/env python3
"""Where an attention call's GPU time goes, kernel by kernel: runs a forward or a backward of each
implementation several times under torch.profiler and prints each kernel's mean time per call, so
that a gap between two implementations can be placed (main kernel, pre/postprocess, memsets).

    python scripts/kernel_times.py --mode bwd --shape 4,32,4096,64 --impl ours,fa4-upstream
    python scripts/kernel_times.py --mode bwd --variant e2:exp_eighths_under_dp=2   # ours, A/B

--impl fa4-upstream needs flash-attn-4 importable (flash_attn.cute); for comparison only. A
``--variant NAME:field=value,...`` runs ours with those Forward/BackwardConfig fields changed.
"""

from __future__ import annotations

import argparse
import contextlib
from collections import defaultdict


def _attention(impl: str):
    if impl == "ours":
        from flash_attn4 import flash_attn_func
    else:
        from flash_attn.cute import flash_attn_func
    return flash_attn_func


@contextlib.contextmanager
def _config_overrides(mode: str, fields: dict):
    """Dispatch's choice for ``mode`` with ``fields`` replaced, while the block runs."""
    from flash_attn4 import dispatch

    name = "forward_config" if mode == "fwd" else "backward_config"
    chosen = getattr(dispatch, name)
    setattr(dispatch, name, lambda *args, **kwargs: chosen(*args, **kwargs).replace(**fields))
    try:
        yield
    finally:
        setattr(dispatch, name, chosen)


def kernel_times(impl: str, mode: str, shape: tuple, causal: bool, calls: int, fields: dict | None = None) -> dict:
    if fields:
        with _config_overrides(mode, fields):
            return kernel_times(impl, mode, shape, causal, calls)
    import torch
    from torch.profiler import ProfilerActivity, profile

    attn = _attention(impl)
    b, h, s, d = shape
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=mode == "bwd")
               for _ in range(3))
    dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)

    def forward():
        out = attn(q, k, v, causal=causal)
        return out[0] if isinstance(out, tuple) else out

    outs = []
    for _ in range(calls + 2):  # forwards outside the window when timing backwards
        if mode == "fwd":
            outs.append(None)
        else:
            outs.append(forward())
    for i in range(2):  # warm-up: compiles, caches
        if mode == "fwd":
            with torch.no_grad():
                forward()
        else:
            torch.autograd.grad(outs[i], (q, k, v), dout)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            if mode == "fwd":
                with torch.no_grad():
                    forward()
            else:
                torch.autograd.grad(outs[2 + i], (q, k, v), dout)
        torch.cuda.synchronize()
    totals = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time / calls
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", default="ours,fa4-upstream", help="comma-separated: ours, fa4-upstream")
    p.add_argument("--mode", choices=("fwd", "bwd"), default="bwd")
    p.add_argument("--shape", action="append", help="batch,heads,seqlen,head_dim (repeatable)")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--variant", action="append", default=[], help="NAME:field=value,... (repeatable)")
    args = p.parse_args()
    from flash_attn4.fa4_kernels.config import parse_overrides

    runs = [(impl, impl, None) for impl in args.impl.split(",")]
    for text in args.variant:
        name, _, fields = text.partition(":")
        runs.append((f"ours[{name}]", "ours", parse_overrides(fields)))
    for text in args.shape or ["4,32,4096,64"]:
        shape = tuple(int(x) for x in text.split(","))
        print(f"\n== {args.mode} shape (b,h,s,d)={shape} causal={args.causal}: mean us per call")
        for label, impl, fields in runs:
            try:
                times = kernel_times(impl, args.mode, shape, args.causal, args.calls, fields)
            except Exception as e:  # a variant that does not compile (shared memory) or is refused
                print(f"-- {label}: failed: {type(e).__name__}: {str(e)[:300]}")
                continue
            print(f"-- {label}: total {sum(times.values()):.1f} us")
            for name, us in times.items():
                if us >= 0.5:
                    print(f"  {us:9.1f}  {name[:110]}")


if __name__ == "__main__":
    main()
