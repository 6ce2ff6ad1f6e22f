"""Cost of the first-use self-check (flash_attn4/selfcheck.py) without its kernel launch: building
the problem (always on the CPU), computing the references and comparing, per forward configuration,
on ``--device`` (the check itself uses the kernel's device: cuda there), in one fresh process, so
the first configuration also pays the math libraries' warm-up. The kernel's output is stood in for by
the reference itself. Prints wall ms and, in brackets, the process's CPU ms.

    python scripts/selfcheck_cost.py [--device cuda] [--threads 1] [--repeat 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "torch-ext"), str(ROOT)]

import torch  # noqa: E402

from flash_attn4 import dispatch, selfcheck  # noqa: E402
from flash_attn4.fa4_kernels.arch import Arch  # noqa: E402

CASES = [  # (label, head_dim, head_dim_v, q heads per KV head, flags)
    ("d64", 64, 64, 1, {}),
    ("d128 causal", 128, 128, 1, dict(causal=True)),
    ("d256 causal", 256, 256, 1, dict(causal=True)),
    ("d192/128", 192, 128, 1, {}),
    ("d128 GQA 8 packed", 128, 128, 8, {}),
    ("d128 local softcap sink", 128, 128, 1, dict(local=True, has_softcap=True, has_sink=True)),
    ("d128 varlen seqused_k causal", 128, 128, 4, dict(varlen=True, has_seqused_k=True, causal=True)),
    ("d256 varlen local softcap sink", 256, 256, 1, dict(varlen=True, local=True, has_softcap=True, has_sink=True)),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--device", default="cpu", help="where the references and the comparison run")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, references on {device}; "
          f"wall ms (process CPU ms)")
    print(f"{'configuration':32s} {'problem, q/kv heads':>20s} {'build':>15s} {'reference':>17s} {'compare':>15s}")
    for label, d, dv, ratio, flags in CASES:
        base = dict(causal=False, local=False, has_softcap=False, varlen=False, has_seqused_k=False, has_sink=False)
        base.update(flags)
        cfg = dispatch.forward_config(Arch.SM90, "bfloat16", d, dv, qhead_per_kvhead=ratio, **base)
        for rep in range(args.repeat):
            times = []
            clock = (time.perf_counter(), time.process_time())
            p = selfcheck.build_forward_problem(cfg)
            clock = _lap(clock, times)
            ref = selfcheck.reference_forward(p, device)
            _sync(device)
            clock = _lap(clock, times)
            selfcheck.compare_forward(p, ref.out.to(p.q.dtype), ref.lse.float(), ref)
            _sync(device)
            _lap(clock, times)
            shape = f"{tuple(p.q.shape[:-2])} {p.q.shape[-2]}/{p.k.shape[-2]}"
            cells = [f"{w * 1e3:6.1f} ({c * 1e3:6.1f})" for w, c in times]
            print(f"{label if rep == 0 else '':32s} {shape:>20s} " + " ".join(f"{x:>16s}" for x in cells))


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _lap(clock, times):
    now = (time.perf_counter(), time.process_time())
    times.append((now[0] - clock[0], now[1] - clock[1]))
    return now


if __name__ == "__main__":
    main()
