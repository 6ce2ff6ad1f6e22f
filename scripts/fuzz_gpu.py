#!/usr/bin/env python3
"""Bounded GPU fuzzing of the public functions (needs an sm90/sm100 GPU; `make fuzz-gpu`).

    python scripts/fuzz_gpu.py --valid 2000 --invalid 500 --seed 0 [--time-limit 540]

1. ``--valid`` random valid problems (batched or varlen with empty sequences; d 64/128/256 and 192/128;
   MHA/GQA/MQA; bf16/fp16; lengths 0..700; causal, sliding windows, softcap, learnable sinks,
   split-KV; a fifth of the batched calls without a sink also run the backward) against
   tests/reference.py under the GPU tests' rules (out and LSE as tests/gpu/test_fwd.py checks them,
   dq/dk/dv as tests/gpu/test_bwd.py does), with fresh outputs poisoned (NaN) so an unwritten element fails;
2. ``--invalid`` random invalid calls (one argument of a valid call broken, or malformed varlen
   metadata under FLASH_ATTN4_CHECK_CU_SEQLENS=1): each must raise ValueError, TypeError or
   NotImplementedError, nothing else;
3. a sanity call afterwards: a valid problem, checked, then torch.cuda.synchronize(), so that a
   corrupted CUDA context shows.

Problems are drawn from ``--templates`` random kernel configurations (head dims, heads, dtype, mask
kind, softcap, sink, layout, split-KV), so that the kernels compiled stay bounded; lengths, batch,
window sizes and the inputs are random for every problem. Prints the counts and the first
failures; exit status 1 on any mismatch or unclean error, 0 otherwise. With --time-limit, problems
stop being drawn when it is reached (the counts say how many ran).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "torch-ext")]
from flash_attn4 import flash_attn_func, flash_attn_varlen_func, ops  # noqa: E402
from tests.reference import assert_close_fa_rule, attention_ref, max_abs_diff  # noqa: E402

CLEAN = (ValueError, TypeError, NotImplementedError)
HEAD_DIMS = [(64, 64), (128, 128), (256, 256), (192, 128)]
HEADS = [(1, 1), (4, 4), (6, 2), (8, 1)]


# ---- problems ----


def random_template(rng: random.Random) -> dict:
    """What decides which kernels compile: head dims, heads, dtype, mask kind, softcap, sink, layout, split."""
    return dict(dims=rng.choice(HEAD_DIMS), heads=rng.choice(HEADS), dtype=rng.choice([torch.bfloat16, torch.float16]),
                mask=rng.choice(["none", "causal", "causal", "local"]), softcap=rng.choice([0.0, 0.0, 15.0]),
                sink=rng.random() < 0.2, batched=rng.random() < 0.5, num_splits=rng.choice([1, 1, 0, 3]))


def random_problem(rng: random.Random, max_len: int = 700, device: str = "cuda", template: dict | None = None) -> dict:
    """A random valid call: {"fn", "args", "kwargs", "ref" (attention_ref kwargs), "bwd"}; sizes, lengths
    and window sizes are random, the rest comes from ``template`` (a random one by default)."""
    t = template or random_template(rng)
    (d, dv), (hq, hk), dtype, softcap, num_splits = t["dims"], t["heads"], t["dtype"], t["softcap"], t["num_splits"]
    causal, window = t["mask"] == "causal", (-1, -1)
    if t["mask"] == "local":
        window = rng.choice([(rng.choice([0, 1, 17, 128]), rng.choice([0, 5, 64, -1])), (-1, rng.choice([1, 33]))])
    sink = torch.randn(hq, device=device) if t["sink"] else None
    # the backward of batched calls without a sink (test_bwd.py's rule then needs no per-case allowance)
    bwd = rng.random() < 0.2 and sink is None

    def rand(*shape):
        return torch.randn(*shape, device=device, dtype=torch.float32).to(dtype)

    opts = dict(causal=causal, window_size=window, softcap=softcap, learnable_sink=sink)
    if t["batched"]:
        b = rng.randint(1, 4)
        sq, sk = rng.randint(1, max_len), rng.randint(1, max_len)
        q, k, v = rand(b, sq, hq, d), rand(b, sk, hk, d), rand(b, sk, hk, dv)
        return dict(fn=flash_attn_func, args=(q, k, v), kwargs=dict(opts, num_splits=num_splits, return_lse=True),
                    ref=dict(opts), bwd=bwd)
    b = rng.randint(1, 5)
    lens_q = [0 if rng.random() < 0.15 else rng.randint(1, max_len) for _ in range(b)]
    lens_k = [0 if rng.random() < 0.15 else rng.randint(1, max_len) for _ in range(b)]
    cu_q = torch.tensor([0] + lens_q, device=device).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device=device).cumsum(0).to(torch.int32)
    q, k, v = rand(sum(lens_q), hq, d), rand(sum(lens_k), hk, d), rand(sum(lens_k), hk, dv)
    kwargs = dict(opts, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), num_splits=num_splits, return_lse=True)
    return dict(fn=flash_attn_varlen_func, args=(q, k, v, cu_q, cu_k), kwargs=kwargs,
                ref=dict(opts, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k), bwd=False)


def check_problem(p: dict) -> None:
    """Run the call (and the backward when p["bwd"]) and assert it matches the reference under the
    GPU tests' rules (tests/gpu/test_fwd.py's check, tests/gpu/test_bwd.py's gradient rule)."""
    q, k, v = p["args"][:3]
    if p["bwd"]:
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = p["fn"](q, k, v, *p["args"][3:], **p["kwargs"])
    lse = lse.detach()
    with torch.no_grad():
        out_ref, lse_ref = attention_ref(q, k, v, upcast=True, **p["ref"])
        out_pt, _ = attention_ref(q, k, v, upcast=False, **p["ref"])
    assert not torch.isnan(out).any(), "NaN in out"
    atol = 2 * max_abs_diff(out_ref.to(q.dtype), out_ref) + 1e-6
    assert_close_fa_rule(out.detach(), out_ref, out_pt, atol=atol)
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref)), "lse -inf pattern differs"
    assert max_abs_diff(lse[finite], lse_ref[finite]) <= 2e-3, "lse differs"
    if p["bwd"]:
        from tests.gpu.test_bwd import assert_grads_close, reference_grads

        dout = torch.randn_like(out)
        got = dict(zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), dout)))
        opts = {name: value for name, value in p["ref"].items() if name != "learnable_sink"}  # None here
        ref = reference_grads(q.detach(), k.detach(), v.detach(), dout, upcast=True, **opts)
        pt = reference_grads(q.detach(), k.detach(), v.detach(), dout, upcast=False, **opts)
        assert_grads_close(got, ref, pt)


# ---- invalid calls ----


BREAKS = ["q_dtype", "k_dtype", "head_dim", "heads", "window", "softcap", "sink_shape", "num_splits", "dropout",
          "flag", "cpu_k", "scale_nan", "v_rows"]
VARLEN_BREAKS = ["cu_dtype", "cu_length", "cu_values"]


def break_one(p: dict, rng: random.Random, device: str, what: str | None = None):
    """(what, args, kwargs, env) of p with one argument broken (``what``, or a random one)."""
    args, kwargs = list(p["args"]), dict(p["kwargs"])
    q, k, v = args[:3]
    varlen = p["fn"] is flash_attn_varlen_func
    what = what or rng.choice(BREAKS + (VARLEN_BREAKS if varlen else []))
    env = {}
    if what == "q_dtype":
        args[0] = q.float()
    elif what == "k_dtype":
        args[1] = k.half() if k.dtype == torch.bfloat16 else k.bfloat16()
    elif what == "head_dim":
        args[0] = q[..., :12].contiguous()
    elif what == "heads":
        args[1] = torch.cat([k, k[..., :1, :]], dim=-2)
    elif what == "window":
        kwargs["window_size"] = (-2, 0)
    elif what == "softcap":
        kwargs["softcap"] = -1.0
    elif what == "sink_shape":
        kwargs["learnable_sink"] = torch.randn(q.shape[-2] + 1, device=device)
    elif what == "num_splits":
        kwargs["num_splits"] = 100_000
    elif what == "dropout":
        kwargs["dropout_p"] = 0.1
    elif what == "flag":
        kwargs["return_lse"] = "no"
    elif what == "cpu_k":
        args[1] = k.cpu() if device != "cpu" else k.to("meta")
    elif what == "scale_nan":
        kwargs["softmax_scale"] = math.nan
    elif what == "v_rows":  # one key row more than k
        extra = list(v.shape)
        extra[-3] = 1
        args[2] = torch.cat([v, torch.randn(extra, device=v.device).to(v.dtype)], dim=-3)
    elif what == "cu_dtype":
        args[3] = args[3].long()
    elif what == "cu_length":
        args[4] = torch.cat([args[4], args[4][-1:]])
    elif what == "cu_values":  # not ending at the total: caught by the opt-in value check
        args[3] = args[3].clone()
        args[3][-1] += 1
        env["FLASH_ATTN4_CHECK_CU_SEQLENS"] = "1"
    return what, args, kwargs, env


def run_invalid(p: dict, rng: random.Random, device: str = "cuda"):
    """None when the broken call raised a clean error, else a description of what happened."""
    what, args, kwargs, env = break_one(p, rng, device)
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        p["fn"](*args, **kwargs)
        return f"{what}: accepted"
    except CLEAN:
        return None
    except Exception as e:  # noqa: BLE001 - what the fuzzing looks for
        return f"{what}: {type(e).__name__}: {e}"
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# ---- driver ----


def describe(p: dict) -> str:
    shapes = [tuple(t.shape) for t in p["args"][:3]]
    opts = {k: v for k, v in p["kwargs"].items() if k not in ("learnable_sink",)}
    return f"{p['fn'].__name__} {shapes} {p['args'][0].dtype} sink={p['kwargs']['learnable_sink'] is not None} " \
           f"bwd={p['bwd']} {opts}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--valid", type=int, default=2000)
    ap.add_argument("--invalid", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-len", type=int, default=700)
    ap.add_argument("--time-limit", type=float, default=0.0, help="seconds; 0 = none")
    ap.add_argument("--templates", type=int, default=24,
                    help="kernel configurations the problems are drawn from (each compiles once)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("fuzz_gpu: needs a CUDA GPU", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    ops._poison_outputs_for_tests = True  # NaN/+inf in fresh outputs: an unwritten element fails the check
    start = time.monotonic()

    def out_of_time():
        return args.time_limit and time.monotonic() - start > args.time_limit

    counts = dict(valid_ok=0, valid_bad=0, bwd_ok=0, invalid_clean=0, invalid_unclean=0)
    failures = []
    templates = [random_template(rng) for _ in range(args.templates)]
    for i in range(args.valid):
        if out_of_time():
            print(f"time limit: stopped after {i} valid problems", flush=True)
            break
        p = random_problem(rng, args.max_len, template=rng.choice(templates))
        try:
            check_problem(p)
            counts["valid_ok"] += 1
            counts["bwd_ok"] += p["bwd"]
        except Exception as e:  # noqa: BLE001
            counts["valid_bad"] += 1
            failures.append(f"valid #{i}: {describe(p)}: {type(e).__name__}: {e}")
            if not isinstance(e, AssertionError):
                failures[-1] += "\n" + traceback.format_exc(limit=3)
        if (i + 1) % 100 == 0:
            print(f"{i + 1} valid: {counts} ({time.monotonic() - start:.0f} s)", flush=True)
    for i in range(args.invalid):
        if out_of_time():
            print(f"time limit: stopped after {i} invalid calls", flush=True)
            break
        problem = random_problem(rng, min(args.max_len, 200), template=rng.choice(templates))
        bad = run_invalid(problem, rng)
        if bad is None:
            counts["invalid_clean"] += 1
        else:
            counts["invalid_unclean"] += 1
            failures.append(f"invalid #{i}: {describe(problem)}: {bad}")
    sanity = "ok"
    try:
        check_problem(random_problem(rng, 300, template=rng.choice(templates)))
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        sanity = f"FAILED: {type(e).__name__}: {e}"
    print(f"fuzz_gpu seed={args.seed}: {counts}; sanity call after the invalid ones: {sanity}; "
          f"{time.monotonic() - start:.0f} s on {torch.cuda.get_device_name()}")
    for f in failures[:20]:
        print("FAIL", f)
    return 0 if not failures and sanity == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
