"""Where a decode step's time goes: greedy decoding of bench_decode's Llama-style model (1.1B shape,
random weights) under torch.profiler, per attn_implementation, after a warm-up generate.

    python scripts/profile_decode_model.py [--prompt-len 16384] [--new-tokens 8] [--attn fa4,sdpa]

Prints, per implementation: the host ops by self CPU time, the GPU kernels by device time (both per
generated token), and the host-device synchronisations (cudaStreamSynchronize, cudaMemcpy* device to
host, cudaDeviceSynchronize) per token: a sync inside a layer stops the host from running ahead of
the GPU, so each one adds the GPU's queue to the step time. ``--cprofile``: the Python functions of
one more generate by own time (cProfile; the prefill's calls are in it too), to see which of a
step's host work one implementation adds. Needs a CUDA GPU and transformers.
"""

from __future__ import annotations

import argparse
import sys
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
    for attn in [a.strip() for a in args.attn.split(",") if a.strip()]:
        bench_decode.generate_once(model, attn, ids, args.new_tokens, "dynamic", sync)  # warm-up
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


if __name__ == "__main__":
    sys.exit(main())
