#!/usr/bin/env python3
"""Decode with and without split-KV on a GPU: microseconds per flash_attn_func call (one query token
against a long cache, bf16, non-causal) with num_splits=1 (one CTA per output tile) and num_splits=0
(the automatic choice, printed), and the largest difference between the two outputs.

    PYTHONPATH=$PWD/torch-ext python scripts/splitkv_check.py
    PYTHONPATH=$PWD/torch-ext python scripts/splitkv_check.py --problem 2,1,131072,64,8,128
    PYTHONPATH=$PWD/torch-ext python scripts/splitkv_check.py --problem 32,1,8192,28,4,128 --splits 1,2,3,4,8,0

A problem is b,s_q,s_k,h,h_kv,d. Times are the median of triton.testing.do_bench when triton is
installed, else of CUDA-event-timed batches; K and V bytes over the time give the bandwidth.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

DEFAULT_PROBLEMS = ["1,1,131072,32,8,128", "16,1,8192,32,8,128"]


def bench_us(fn) -> float:
    try:
        from triton.testing import do_bench

        return do_bench(fn, warmup=50, rep=300, return_mode="median") * 1e3
    except ImportError:
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / 10)
        return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problem", action="append", help="b,s_q,s_k,h,h_kv,d (repeatable)")
    parser.add_argument("--splits", default="1,0", help="split counts to time, 0 = automatic (default 1,0); "
                        "outputs are compared with the first")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("splitkv_check: needs a CUDA GPU", file=sys.stderr)
        return 2
    from flash_attn4 import device_info, dispatch, flash_attn_func
    from flash_attn4.fa4_kernels.arch import Arch

    sms = device_info.get_device_info(0).sm_count
    print(f"{torch.cuda.get_device_name()}, {sms} SMs")
    for spec in args.problem or DEFAULT_PROBLEMS:
        b, sq, sk, h, hk, d = map(int, spec.split(","))
        q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16)
        cfg = dispatch.forward_config(Arch.SM90, "bfloat16", d, d, causal=False, local=False, has_softcap=False,
                                      varlen=False, has_seqused_k=False, has_sink=False, qhead_per_kvhead=h // hk)
        auto = dispatch.num_splits_heuristic(batch=b, num_heads=h, num_heads_kv=hk, seqlen_q=sq, seqlen_k=sk,
                                             tile_m=cfg.tile_m, tile_n=cfg.tile_n, pack_gqa=cfg.pack_gqa, num_sms=sms)
        kv_bytes = 2 * k.numel() * k.element_size()
        outs = {}
        for num_splits in map(int, args.splits.split(",")):
            outs[num_splits] = flash_attn_func(q, k, v, num_splits=num_splits)
            us = bench_us(lambda: flash_attn_func(q, k, v, num_splits=num_splits))
            label = f"num_splits=0 (auto: {auto})" if num_splits == 0 else f"num_splits={num_splits}"
            print(f"({spec}) {label:24s} {us:9.1f} us  {kv_bytes / us / 1e3:7.0f} GB/s", flush=True)
        first, *rest = outs
        for other in rest:
            diff = (outs[other].float() - outs[first].float()).abs().max().item()
            print(f"({spec}) max |out(num_splits={other}) - out(num_splits={first})| = {diff:.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
