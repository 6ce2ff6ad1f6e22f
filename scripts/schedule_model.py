#!/usr/bin/env python3
"""A model of the causal tile order's tail: how busy the SMs stay when tiles are handed out in a
given order, without a GPU.

Each tile costs its KV blocks (forward: a query tile sees keys up to its diagonal) or its query
blocks (backward: a KV tile is seen by queries from its diagonal on), plus one for the fixed
per-tile work; the tiles go, in order, to whichever of the SMs frees first. The busy share is the
total cost over the SM count, divided by the time the last SM finishes (1.0: no tail).

    python scripts/schedule_model.py                 # forward and backward, the bench's grid
    python scripts/schedule_model.py --sms 114       # an H100 PCIe

Orders, as fa4_kernels/scheduler.py builds them: the launch order (backward default), and the
longest-first order within L2 groups of heads (24 MB of K/V, or Q/dO, per group) with the partial
group last (the forward until 2026-12-03) or first (the forward now, and BackwardConfig.longest_first).
"""

from __future__ import annotations

import argparse
import heapq
import math

L2_BUDGET_BYTES = 24 * 1024 * 1024  # fa4_kernels/sm90/tiles.py (what the sm90 kernels pass the scheduler)


def busy_share(costs: list[float], sms: int) -> float:
    finish = [0.0] * sms
    for cost in costs:
        heapq.heappush(finish, heapq.heappop(finish) + cost)
    return sum(costs) / sms / max(finish)


def group_sizes(pairs: int, bytes_per_pair: int, small_first: bool) -> list[int]:
    group = max(1, min(L2_BUDGET_BYTES // bytes_per_pair, pairs))
    sizes = [group] * (pairs // group) + ([pairs % group] if pairs % group else [])
    return sizes[-1:] + sizes[:-1] if small_first and pairs % group else sizes


def grouped_order(block_costs: list[float], sizes: list[int]) -> list[float]:
    """Longest-first within each group: all of the group's heads at the costliest block, then the next."""
    by_cost = sorted(block_costs, reverse=True)
    return [c for heads in sizes for c in by_cost for _ in range(heads)]


def forward_rows(sms: int):
    # (seqlen, head dim, batch, heads, tile_m, tile_n): bench.py's grid at 16k tokens per batch
    for s, d, b, h, tm, tn in [(1024, 256, 16, 8, 128, 80), (4096, 256, 4, 8, 128, 80), (8192, 256, 2, 8, 128, 80),
                               (16384, 256, 1, 8, 128, 80), (1024, 128, 16, 16, 128, 128),
                               (4096, 128, 4, 16, 128, 128), (16384, 128, 1, 16, 128, 128),
                               (4096, 64, 4, 32, 192, 128), (16384, 64, 1, 32, 192, 128)]:
        blocks = [math.ceil(min((m + 1) * tm, s) / tn) + 1 for m in range(math.ceil(s / tm))]
        pairs, per_pair = b * h, s * 2 * d * 2
        last = busy_share(grouped_order(blocks, group_sizes(pairs, per_pair, False)), sms)
        first = busy_share(grouped_order(blocks, group_sizes(pairs, per_pair, True)), sms)
        yield f"fwd d={d} {s // 1024}k causal", last, first


def backward_rows(sms: int):
    for s, d, b, h, tm, tn in [(4096, 64, 4, 32, 128, 128), (8192, 64, 2, 32, 128, 128),
                               (4096, 128, 4, 16, 80, 128), (8192, 128, 2, 16, 80, 128),
                               (16384, 128, 1, 16, 80, 128), (4096, 256, 4, 8, 64, 64)]:
        nm = math.ceil(s / tm)
        blocks = [nm - (n * tn) // tm + 1 for n in range(math.ceil(s / tn))]
        pairs, per_pair = b * h, s * 2 * d * 2
        launch = busy_share([c for _ in range(pairs) for c in blocks], sms)
        first = busy_share(grouped_order(blocks, group_sizes(pairs, per_pair, True)), sms)
        yield f"bwd d={d} {s // 1024}k causal", launch, first


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sms", type=int, default=132, help="SM count (H100 SXM / H200: 132)")
    args = p.parse_args()
    print("| case | fwd: partial group last; bwd: launch order | longest-first, partial group first |"
          "\n|---|---:|---:|")
    for name, default, alternative in (*forward_rows(args.sms), *backward_rows(args.sms)):
        print(f"| {name} | {default:.3f} | {alternative:.3f} |")


if __name__ == "__main__":
    main()
