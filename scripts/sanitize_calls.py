#!/usr/bin/env python3
"""Small forward + backward calls over the kernel layouts, for compute-sanitizer (needs a GPU).

    make sanitize     # memcheck, racecheck, synccheck and initcheck in turn, each must be clean
    compute-sanitizer --report-api-errors no --tool memcheck python scripts/sanitize_calls.py
    compute-sanitizer --tool racecheck python scripts/sanitize_calls.py
    compute-sanitizer --tool initcheck python scripts/sanitize_calls.py --thread-stored-o

Shapes are small (the sanitizers slow kernels down by orders of magnitude) and odd (not multiples
of the tiles), and cover forward + backward of: 128-query blocks at d=64 (causal, GQA 4/2), d=128
with sk > sq (MQA-like 2/1) and with deterministic dQ, the split-head-dim layout (d=256, and 192/128
with softcap), local windows (batched GQA and varlen), varlen with an empty sequence; then
forward-only calls: split-KV with its combine kernel, a KV-cache append + decode step, and a
head ratio (7) packed in padded groups. The API errors memcheck reports by
default are the driver probing entry points (cuGetProcAddress), not errors of ours: hence
--report-api-errors no. Prints one line per call; a sanitizer finding makes compute-sanitizer exit
non-zero. Last run on the H200 (2026-12-04, at 8776f91): memcheck 0 errors, racecheck 0 hazards.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "torch-ext"))
from flash_attn4 import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache  # noqa: E402


def leaf(*shape):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16).requires_grad_()


def batched(d, dv, sq, sk, hq, hk, **kwargs):
    q, k, v = leaf(1, sq, hq, d), leaf(1, sk, hk, d), leaf(1, sk, hk, dv)
    out = flash_attn_func(q, k, v, **kwargs)
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    print(f"ok: d={d}/{dv} sq={sq} sk={sk} heads={hq}/{hk} {kwargs}", flush=True)


def main() -> int:
    if "--thread-stored-o" in sys.argv[1:]:
        # initcheck does not see TMA stores: every element of an O the forward stores by TMA
        # (tma_store_o, batched calls) reads as uninitialized in the backward's preprocessing (H100,
        # 2026-12-05: 48640 16-byte reads, exactly the batched calls' O), and so does every element
        # of a dK or dV the backward stores by TMA (tma_store_dkv, batched calls) when it is copied
        # to the host (H100, 2026-12-07: 29904 reads, the first a 74,240-byte dK). With both stored
        # by threads the same calls are checked for real.
        from flash_attn4 import dispatch, ops

        forward, backward = dispatch.forward_config, dispatch.backward_config
        dispatch.forward_config = lambda *a, **k: forward(*a, **k).replace(tma_store_o=False)
        dispatch.backward_config = lambda *a, **k: backward(*a, **k).replace(tma_store_dkv=False)
        ops._PLANS.clear()
    torch.manual_seed(0)
    batched(64, 64, 300, 290, 4, 2, causal=True)
    batched(64, 64, 256, 256, 2, 2)
    batched(128, 128, 130, 257, 2, 1)
    batched(128, 128, 200, 200, 2, 2, causal=True, deterministic=True)
    batched(256, 256, 130, 150, 2, 1, causal=True)
    batched(192, 128, 100, 150, 2, 2, softcap=5.0)
    batched(128, 128, 201, 333, 4, 2, window_size=(48, 16))  # local, GQA
    cu = torch.tensor([0, 70, 70, 233], dtype=torch.int32, device="cuda")
    q, k, v = leaf(233, 4, 64), leaf(233, 2, 64), leaf(233, 2, 64)
    out = flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen_q=163, max_seqlen_k=163, causal=True)
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    print("ok: varlen d=64 with an empty sequence", flush=True)
    out = flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen_q=163, max_seqlen_k=163, window_size=(20, 3))
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    print("ok: varlen d=64 local window (20, 3)", flush=True)
    forward_only()
    return 0


def forward_only() -> None:
    """Split-KV (partial outputs + the combine kernel) and a KV-cache append + decode (contiguous and
    paged), no backward."""
    with torch.no_grad():
        q, k, v = leaf(2, 3, 8, 128), leaf(2, 1000, 2, 128), leaf(2, 1000, 2, 128)
        flash_attn_func(q, k, v, causal=True, num_splits=3)
        torch.cuda.synchronize()
        print("ok: split-KV d=128 sq=3 sk=1000 GQA 8/2, 3 splits", flush=True)
        k_cache, v_cache = leaf(2, 300, 2, 128).detach(), leaf(2, 300, 2, 128).detach()
        seqlens = torch.tensor([17, 250], dtype=torch.int32, device="cuda")
        flash_attn_with_kvcache(q.detach(), k_cache, v_cache, k=leaf(2, 3, 2, 128).detach(),
                                v=leaf(2, 3, 2, 128).detach(), cache_seqlens=seqlens, causal=True)
        torch.cuda.synchronize()
        print("ok: kvcache append 3 tokens + decode, d=128, GQA 8/2", flush=True)
        # The same over shuffled pages of 16 (eight page boxes per K/V tile), unsplit and split.
        table = torch.randperm(40, device="cuda").to(torch.int32).view(2, 20)
        k_pages, v_pages = leaf(40, 16, 2, 128).detach(), leaf(40, 16, 2, 128).detach()
        for num_splits in (1, 3):
            flash_attn_with_kvcache(q.detach(), k_pages, v_pages, k=leaf(2, 3, 2, 128).detach(),
                                    v=leaf(2, 3, 2, 128).detach(), cache_seqlens=seqlens, page_table=table,
                                    causal=True, num_splits=num_splits)
            torch.cuda.synchronize()
        print("ok: paged kvcache (pages of 16) append 3 tokens + decode, d=128, GQA 8/2, 1 and 3 splits", flush=True)
        # Ratio 7 packed in groups of 8 (sm90: ForwardConfig.pack_gqa_heads): the last KV head's dummy
        # rows must not read past q (its own allocation, caching off) nor write past out.
        q7, k7, v7 = leaf(2, 3, 14, 128).detach(), leaf(2, 500, 2, 128).detach(), leaf(2, 500, 2, 128).detach()
        for num_splits in (1, 3):
            flash_attn_func(q7, k7, v7, causal=True, num_splits=num_splits)
            torch.cuda.synchronize()
            print(f"ok: GQA 14/2 (ratio 7) decode-sized sq=3, {num_splits} split(s)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
