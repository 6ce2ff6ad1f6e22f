"""Host time of a cached call: wall time of many back-to-back calls on a tiny problem (its kernels
take a few microseconds, so the host's Python and launch work is what is measured), per public path,
beside PyTorch SDPA (cuDNN) on the same problem.

    python scripts/host_time.py [--calls 2000]

Prints microseconds per call: wall time and the calling thread's CPU time (steadier on a shared host). Needs a CUDA GPU (the paths launch real kernels)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# FLASH_ATTN4_TREE=path/to/torch-ext measures another checkout's layer (before/after runs).
sys.path[:0] = [os.environ.get("FLASH_ATTN4_TREE", str(Path(__file__).resolve().parents[1] / "torch-ext"))]


def per_call_us(fn, calls: int) -> tuple[float, float]:
    """(wall, CPU time of this thread) per call in microseconds, each the best of five runs: other
    processes on a shared host add wall time, never remove it; the thread's CPU time is what the
    call itself costs the host."""
    import torch

    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    wall = cpu = float("inf")
    for _ in range(5):
        start, start_cpu = time.perf_counter(), time.thread_time()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        wall = min(wall, (time.perf_counter() - start) / calls * 1e6)
        cpu = min(cpu, (time.thread_time() - start_cpu) / calls * 1e6)
    return wall, cpu


def main(argv=None) -> int:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flash_attn4 as fa

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args(argv)
    dev, bf16 = "cuda", torch.bfloat16
    b, hq, hk, d, s_cache = 1, 32, 8, 128, 256
    q = torch.randn(b, 1, hq, d, device=dev, dtype=bf16)
    k = torch.randn(b, s_cache, hk, d, device=dev, dtype=bf16)
    v = torch.randn_like(k)
    lens = torch.full((b,), s_cache - 1, dtype=torch.int32, device=dev)
    cu_q = torch.tensor([0, 1], dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0, s_cache], dtype=torch.int32, device=dev)
    used = torch.full((b,), s_cache, dtype=torch.int32, device=dev)
    table = torch.arange(s_cache // 16, dtype=torch.int32, device=dev)[None]
    pages_k, pages_v = k.view(-1, 16, hk, d), v.view(-1, 16, hk, d)
    k1, v1 = torch.randn(b, 1, hk, d, device=dev, dtype=bf16), torch.randn(b, 1, hk, d, device=dev, dtype=bf16)
    qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
    paths = {
        "flash_attn_func": lambda: fa.flash_attn_func(q, k, v, num_splits=1),
        "flash_attn_func num_splits=0": lambda: fa.flash_attn_func(q, k, v, num_splits=0),
        "flash_attn_func num_splits=2": lambda: fa.flash_attn_func(q, k, v, num_splits=2),
        "flash_attn_varlen_func": lambda: fa.flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, max_seqlen_q=1,
                                                                    max_seqlen_k=s_cache, num_splits=1),
        "flash_attn_with_kvcache (append 1)": lambda: fa.flash_attn_with_kvcache(q, k, v, k1, v1, cache_seqlens=lens,
                                                                                 num_splits=1),
        "flash_attn_with_kvcache paged": lambda: fa.flash_attn_with_kvcache(q, pages_k, pages_v, cache_seqlens=used,
                                                                            page_table=table, num_splits=1),
        "sdpa cudnn (reference)": lambda: _sdpa(F, sdpa_kernel, SDPBackend.CUDNN_ATTENTION, qs, ks, vs),
    }
    with torch.inference_mode():
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.calls} back-to-back calls, best of 5")
        for name, fn in paths.items():
            try:
                wall, cpu = per_call_us(fn, args.calls)
                print(f"{name:40s} {wall:7.1f} us/call wall {cpu:7.1f} us/call CPU")
            except Exception as exc:  # a path an older tree lacks (A/B runs against a checkout)
                print(f"{name:40s}     n/a ({type(exc).__name__}: {str(exc)[:60]})")
    return 0


def _sdpa(F, sdpa_kernel, backend, q, k, v):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


if __name__ == "__main__":
    sys.exit(main())
