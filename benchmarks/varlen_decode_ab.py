#!/usr/bin/env python3
"""Varlen decoding, GQA-packed against unpacked, in one run: 16 sequences of 1-128 queries against
8k keys each, 32 query / 8 KV heads, head dims 64/128/256 (bench.py's variants run batched cases
only). Three interleaved rounds of triton.testing.do_bench medians; prints TFLOP/s, the ratio and
the largest difference between the two outputs.

    python benchmarks/varlen_decode_ab.py
"""

import statistics

import torch
from triton.testing import do_bench
from flash_attn4 import dispatch, flash_attn_varlen_func

chosen = dispatch.forward_config


def run_with(g):
    dispatch.forward_config = lambda *a, **k: chosen(*a, **k).replace(pack_gqa=g)


for d in (64, 128, 256):
    for sq in (1, 8, 32, 128):
        b, sk, hq, hk = 16, 8192, 32, 8
        cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device="cuda")
        cu_k = torch.arange(0, (b + 1) * sk, sk, dtype=torch.int32, device="cuda")
        q = torch.randn(b * sq, hq, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b * sk, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        fns, outs = {}, {}
        for g in (1, 4):
            run_with(g)
            fns[g] = lambda: flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_seqlen_q=sq, max_seqlen_k=sk)
            outs[g] = fns[g]()
        diff = (outs[1].float() - outs[4].float()).abs().max().item()
        times = {1: [], 4: []}
        for _ in range(3):
            for g in (1, 4):
                run_with(g)
                times[g].append(do_bench(fns[g], warmup=10, rep=50, return_mode="median"))
        t1, t4 = statistics.median(times[1]), statistics.median(times[4])
        fl = 4 * b * hq * sq * sk * d
        print(f"varlen decode b{b} h{hq}/{hk} sq{sq} sk{sk} d{d}: unpacked {fl/t1/1e9:.0f} packed {fl/t4/1e9:.0f} "
              f"TFLOP/s, packed/unpacked {t1/t4:.2f}, max|diff| {diff:.1e}", flush=True)
