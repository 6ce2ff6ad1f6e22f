"""Context parallelism on several GPUs through flash-attn4's PyTorch provider (issue 22 item 3).

    torchrun --nproc-per-node 2 scripts/cp_run.py                       # check + benchmark, 64k tokens
    torchrun --nproc-per-node 2 scripts/cp_run.py --seqlen 16384 --no-bench

Every rank builds the same random q, k, v, dout (b, h, s, d) in bf16. Then, per causal setting:

1. check: PyTorch's ``context_parallel`` (ring attention, head-tail load balancing) runs
   ``F.scaled_dot_product_attention`` under the flash backend with our provider active, forward and
   backward; ``context_parallel_unshard`` gathers the output and gradients, which rank 0 compares
   with a float32 reference (SDPA's memory-efficient backend on one GPU) under the test suite's rule:
   the error is at most twice that of the same computation in bf16 on one GPU (our kernel, full
   sequence) plus a small absolute term. It also asserts that our kernels served the calls.
2. benchmark: the forward + backward of the whole sequence on one GPU against the same on all ranks
   with context parallelism, in tokens per second (median of several timed steps after warm-up).

Prints one JSON line per case on rank 0; exit status 1 if a check failed. tests/gpu/test_context_parallel.py
runs the one-GPU emulation of the same ring; tests/gpu/test_context_parallel_2gpu.py launches this
script when two GPUs are visible.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "torch-ext"), str(REPO)]

import flash_attn4  # noqa: E402  (registers the provider)
from flash_attn4 import torch_provider  # noqa: E402


def _counting_provider():
    """Count the calls that reach our kernels (the provider's two seams)."""
    counts = {"forward": 0, "backward": 0}
    for seam, key in (("_run_forward", "forward"), ("_run_backward", "backward")):
        fn = getattr(torch_provider, seam)

        def counted(*args, _fn=fn, _key=key, **kwargs):
            counts[_key] += 1
            return _fn(*args, **kwargs)

        setattr(torch_provider, seam, counted)
    return counts


def _inputs(args, device):
    gen = torch.Generator(device=device).manual_seed(args.seed)  # the same tensors on every rank
    shape = (args.batch, args.heads, args.seqlen, args.head_dim)
    return [torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16) for _ in range(4)]


def _attention(q, k, v, dout, causal, backend):
    """Output and gradients of SDPA under ``backend`` (fresh leaves)."""
    from torch.nn.attention import sdpa_kernel

    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def _context_parallel_step(mesh, q, k, v, dout, causal, unshard=True):
    from torch.distributed.tensor.experimental import context_parallel
    try:  # torch 2.13 keeps it here (and re-exports it from _attention)
        from torch.distributed.tensor.experimental._context_parallel._attention import context_parallel_unshard
    except ImportError:
        from torch.distributed.tensor.experimental._attention import context_parallel_unshard
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cq, ck, cv, cdout = (t.clone() for t in (q, k, v, dout))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), context_parallel(
            mesh, buffers=[cq, ck, cv, cdout], buffer_seq_dims=[2, 2, 2, 2]):
        for t in (cq, ck, cv):
            t.requires_grad_()
        out = F.scaled_dot_product_attention(cq, ck, cv, is_causal=causal)
        out.backward(cdout)
        if not unshard:
            return None
        return context_parallel_unshard(mesh, [out.detach(), cq.grad, ck.grad, cv.grad], [2, 2, 2, 2])


def _timed(fn, steps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=65536)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=int.from_bytes(os.urandom(4), "little"))
    parser.add_argument("--no-bench", action="store_true")
    args = parser.parse_args()

    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.attention import SDPBackend, activate_flash_attention_impl, restore_flash_attention_impl

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda")
    if args.seqlen % (2 * world):
        raise SystemExit(f"--seqlen must be a multiple of 2 x {world} ranks (head-tail load balancing)")
    # every rank draws the same seed: rank 0's
    seed = torch.tensor([args.seed], device=device)
    dist.broadcast(seed, 0)
    args.seed = int(seed.item())
    mesh = init_device_mesh("cuda", (world,))
    counts = _counting_provider()
    failed = False
    for causal in {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]:
        q, k, v, dout = _inputs(args, device)
        activate_flash_attention_impl(torch_provider.PROVIDER_NAME)
        try:
            before = dict(counts)
            got = _context_parallel_step(mesh, q, k, v, dout, causal)
            served = {key: counts[key] - before[key] for key in counts}
            ours_one_gpu = _attention(q, k, v, dout, causal, SDPBackend.FLASH_ATTENTION)
        finally:
            restore_flash_attention_impl()
        result = {"world": world, "causal": causal, "seqlen": args.seqlen, "heads": args.heads,
                  "head_dim": args.head_dim, "seed": args.seed, "served_by_ours": served}
        if rank == 0:
            ref = _attention(*(t.float() for t in (q, k, v, dout)), causal, SDPBackend.EFFICIENT_ATTENTION)
            names = ("out", "dq", "dk", "dv")
            errors = {}
            for name, g, o, r in zip(names, got, ours_one_gpu, ref):
                err, base = (g.float() - r).abs().max().item(), (o.float() - r).abs().max().item()
                errors[name] = {"cp": err, "one_gpu": base, "ok": err <= 2 * base + 1e-5 * r.abs().max().item()}
            ok = all(e["ok"] for e in errors.values()) and served["forward"] > 0 and served["backward"] > 0
            failed |= not ok
            result.update(errors=errors, ok=ok)
            del ref
        if not args.no_bench:
            activate_flash_attention_impl(torch_provider.PROVIDER_NAME)
            try:
                cp_s = _timed(lambda: _context_parallel_step(mesh, q, k, v, dout, causal, unshard=False),
                              args.steps)
                one_s = _timed(lambda: _attention(q, k, v, dout, causal, SDPBackend.FLASH_ATTENTION), args.steps)
            finally:
                restore_flash_attention_impl()
            tokens = args.batch * args.seqlen
            result.update(one_gpu_tokens_per_s=tokens / one_s, cp_tokens_per_s=tokens / cp_s,
                          speedup=one_s / cp_s, one_gpu_ms=one_s * 1e3, cp_ms=cp_s * 1e3)
        if rank == 0:
            print(json.dumps(result), flush=True)
    ok = torch.tensor([0 if failed else 1], device=device)
    dist.broadcast(ok, 0)
    dist.destroy_process_group()
    return 0 if ok.item() else 1


if __name__ == "__main__":
    sys.exit(main())
