#!/usr/bin/env python3
"""Small forward + backward calls over the kernel layouts, for compute-sanitizer (needs a GPU).

    compute-sanitizer --report-api-errors no --tool memcheck python scripts/sanitize_calls.py
    compute-sanitizer --tool racecheck python scripts/sanitize_calls.py

Shapes are small (the sanitizers slow kernels down by orders of magnitude) and cover: 128-query
blocks at d=64, d=128 with sk > sq and with deterministic dQ, the split-head-dim layout (d=256, and
192/128 with softcap), and varlen with an empty sequence. The API errors memcheck reports by
default are the driver probing entry points (cuGetProcAddress), not errors of ours: hence
--report-api-errors no. Prints one line per call; a sanitizer finding makes compute-sanitizer exit
non-zero. Last run on the H200 (2026-12-04, at 8776f91): memcheck 0 errors, racecheck 0 hazards.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "torch-ext"))
from flash_attn4 import flash_attn_func, flash_attn_varlen_func  # noqa: E402


def leaf(*shape):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16).requires_grad_()


def batched(d, dv, sq, sk, hq, hk, **kwargs):
    q, k, v = leaf(1, sq, hq, d), leaf(1, sk, hk, d), leaf(1, sk, hk, dv)
    out = flash_attn_func(q, k, v, **kwargs)
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    print(f"ok: d={d}/{dv} sq={sq} sk={sk} heads={hq}/{hk} {kwargs}", flush=True)


def main() -> int:
    torch.manual_seed(0)
    batched(64, 64, 300, 290, 4, 2, causal=True)
    batched(64, 64, 256, 256, 2, 2)
    batched(128, 128, 130, 257, 2, 1)
    batched(128, 128, 200, 200, 2, 2, causal=True, deterministic=True)
    batched(256, 256, 130, 150, 2, 1, causal=True)
    batched(192, 128, 100, 150, 2, 2, softcap=5.0)
    cu = torch.tensor([0, 70, 70, 233], dtype=torch.int32, device="cuda")
    q, k, v = leaf(233, 4, 64), leaf(233, 2, 64), leaf(233, 2, 64)
    out = flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen_q=163, max_seqlen_k=163, causal=True)
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    print("ok: varlen d=64 with an empty sequence", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
