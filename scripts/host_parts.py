"""Host time of the parts of the transformers adapter's decode call, on a GPU: allocations, views,
the split-KV pipeline's TVM-FFI call alone, then each layer on the way to it (ops._run_plan,
ops._forward, flash_attn_func, the adapter), beside transformers' own "sdpa" call and a bare
F.scaled_dot_product_attention on the same problem (a 1.1B Llama's step: 16/4 heads, d = 128,
16k cached keys, batch 1). Best of 7 runs of --calls back-to-back calls, twice (the rounds show how
much the host moves).

    python scripts/host_parts.py [--calls 5000]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "torch-ext")]

import torch  # noqa: E402


def per_call_us(fn, calls: int) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=5000)
    args = p.parse_args()
    import torch.nn.functional as F
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    import flash_attn4 as fa
    from flash_attn4 import ops
    from flash_attn4 import transformers_adapter as adapter

    class Module:  # what the attention functions read of their module
        is_causal, training, num_key_value_groups = True, False, 4

    torch.inference_mode().__enter__()
    d, m, scale = 128, Module(), 128 ** -0.5
    tq = torch.randn(1, 16, 1, d, device="cuda", dtype=torch.bfloat16)
    tk, tv = (torch.randn(1, 4, 16384, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q, k, v = tq.transpose(1, 2), tk.transpose(1, 2), tv.transpose(1, 2)
    adapter.attention_forward(m, tq, tk, tv, None, scaling=scale)  # compiles, plans
    plan = ops._plan(q, k, v, None, None, None, 0.0, True, -1, 0, 1, 16384, 0, None, None)
    out = q.new_empty(plan.out_shape)
    lse = q.new_empty(plan.lse_shape, dtype=torch.float32)
    workspace = None if plan.workspace_shape is None else q.new_empty(plan.workspace_shape, dtype=torch.float32)
    parts = {
        "torch.empty (out's shape, dtype, device)": lambda: torch.empty(plan.out_shape, dtype=q.dtype, device=q.device),
        "q.new_empty (out's shape)": lambda: q.new_empty(plan.out_shape),
        "transpose (a view)": lambda: tq.transpose(1, 2),
        "the kernel call alone (TVM-FFI)": lambda: ops._launch(plan.kernel, q, k, v, out, lse, None, None, None, None,
                                                               None, None, scale, 0.0, -1, 0, 1, workspace),
        "ops._run_plan": lambda: ops._run_plan(plan, q, k, v, None, None, None, None, scale, 0.0, -1, 0, 1, True,
                                               None, None),
        "ops._forward": lambda: ops._forward(q, k, v, None, None, None, None, scale, 0.0, True, -1, 0, 1, 16384, 0),
        "flash_attn_func": lambda: fa.flash_attn_func(q, k, v, softmax_scale=scale, causal=True, num_splits=0),
        "adapter decode call": lambda: adapter.attention_forward(m, tq, tk, tv, None, scaling=scale),
        "transformers sdpa call": lambda: sdpa_attention_forward(m, tq, tk, tv, None, scaling=scale, is_causal=False),
        "F.scaled_dot_product_attention": lambda: F.scaled_dot_product_attention(tq, tk, tv, scale=scale,
                                                                                 enable_gqa=True),
    }
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; split-KV workspace {plan.workspace_shape}; "
          f"us per call, best of 7 x {args.calls}")
    for round_ in range(2):
        print(f"round {round_}")
        for name, fn in parts.items():
            print(f"  {name:42s} {per_call_us(fn, args.calls):7.2f}", flush=True)


if __name__ == "__main__":
    main()
