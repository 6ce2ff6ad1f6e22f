"""Where a decode step's time goes: greedy decoding of bench_decode's Llama-style model (1.1B shape,
random weights) under torch.profiler, per attn_implementation, after a warm-up generate.

    python scripts/profile_decode_model.py [--prompt-len 16384] [--new-tokens 8] [--attn fa4,sdpa]

Prints, per implementation: the host ops by self CPU time, the GPU kernels by device time (both per
generated token), and the host-device synchronisations (cudaStreamSynchronize, cudaMemcpy* device to
host, cudaDeviceSynchronize) per token: a sync inside a layer stops the host from running ahead of
the GPU, so each one adds the GPU's queue to the step time. ``--cprofile``: the Python functions of
one more generate by own time (cProfile; the prefill's calls are in it too), to see which of a
step's host work one implementation adds. ``--rounds N``: first N interleaved unprofiled generates
per implementation (in --attn's order, after every warm-up), each with its median step time and the
CPU time each thread of the process used meanwhile (Linux /proc): the main thread's against the
process's, so a busy helper thread (a compiler's pool, a runtime's poller) shows. Needs a CUDA GPU
and transformers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "torch-ext")]

SYNC_NAMES = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy ",
              "cudaMemcpyAsync")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-len", type=int, default=16384)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--attn", default="fa4,sdpa")
    p.add_argument("--rows", type=int, default=25, help="table rows per listing")
    p.add_argument("--cprofile", action="store_true", help="also the Python functions by own time")
    p.add_argument("--rounds", type=int, default=0, help="interleaved timed generates first (thread CPU times)")
    p.add_argument("--no-profile", action="store_true", help="only the --rounds")
    args = p.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        print("profile_decode_model: needs a CUDA GPU", file=sys.stderr)
        return 2
    import transformers  # noqa: F401  (importing flash_attn4 then registers "fa4")

    from benchmarks import bench_decode
    from flash_attn4 import transformers_adapter

    transformers_adapter.register()

    model = bench_decode.build_model(bench_decode.LLAMA_1B, "cuda", torch.bfloat16, 0,
                                     args.prompt_len + args.new_tokens + 8)
    ids = torch.randint(0, bench_decode.LLAMA_1B["vocab_size"], (1, args.prompt_len), device="cuda")
    sync = torch.cuda.synchronize
    attns = [a.strip() for a in args.attn.split(",") if a.strip()]
    for attn in attns:
        bench_decode.generate_once(model, attn, ids, args.new_tokens, "dynamic", sync)  # warm-up
    for r in range(args.rounds):
        for attn in attns:
            before, t0 = _thread_cpu(), time.perf_counter()
            steps, _ = bench_decode.generate_once(model, attn, ids, args.new_tokens, "dynamic", sync)
            wall, used = time.perf_counter() - t0, _thread_cpu_since(before)
            main = used.pop(threading.get_native_id(), ("main", 0.0))[1]
            busy = sorted(((cpu, f"{name}({tid})") for tid, (name, cpu) in used.items() if cpu >= 0.01), reverse=True)
            print(f"round {r} {attn}: step median {statistics.median(steps):.2f} ms (min {min(steps):.2f}, max "
                  f"{max(steps):.2f}); generate {wall:.2f} s wall, main thread {main:.2f} s CPU, others "
                  f"{sum(c for c, _ in busy):.2f} s: {', '.join(f'{n} {c:.2f}' for c, n in busy[:6]) or '-'}",
                  flush=True)
    if args.no_profile:
        return 0
    for attn in attns:
        steps, _ = bench_decode.generate_once(model, attn, ids, args.new_tokens, "dynamic", sync)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            bench_decode.generate_once(model, attn, ids, args.new_tokens, "dynamic", sync)
        per = args.new_tokens  # the prefill is in the trace too: its kernels sort to the top by device time
        print(f"\n===== {attn}: decode steps {', '.join(f'{s:.2f}' for s in steps)} ms =====")
        events = prof.key_averages()
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=70))
        print(events.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=70))
        syncs = {e.key: e.count for e in events if any(e.key.startswith(n.strip()) for n in SYNC_NAMES)}
        print(f"{attn}: sync-like runtime calls over {per} tokens (prefill included): {syncs}")
        if args.cprofile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            bench_decode.generate_once(model, attn, ids, args.new_tokens, "dynamic", sync)
            prof.disable()
            stats = pstats.Stats(prof)
            print(f"{attn}: {stats.total_calls / per:.0f} Python function calls per token (prefill included)")
            stats.sort_stats("tottime").print_stats(args.rows)
    return 0


def _thread_cpu() -> dict:
    """{thread id: (name, user + system CPU seconds)} of this process's threads (Linux /proc; empty
    elsewhere)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out = {}
    for task in Path("/proc/self/task").glob("*"):
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(task.name)] = (name, (int(fields[11]) + int(fields[12])) / tick)  # utime, stime
    return out


def _thread_cpu_since(before: dict) -> dict:
    return {tid: (name, cpu - before.get(tid, (name, 0.0))[1]) for tid, (name, cpu) in _thread_cpu().items()}


if __name__ == "__main__":
    sys.exit(main())
