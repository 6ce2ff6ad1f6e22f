#!/usr/bin/env python3
"""Attention throughput (forward, or --mode bwd): flash-attn4 against the usual comparators, side by
side in one run.

    python benchmarks/bench.py                 # full grid (several minutes)
    python benchmarks/bench.py --quick         # a representative subset
    python benchmarks/bench.py --only ours,cudnn --headdims 128 --seqlens 8192

Cases (bf16 unless --dtype fp16):
- grid: head_dim {64, 128, 256} x causal {no, yes} x seqlen {1k, 2k, 4k, 8k, 16k}, heads = 2048 / head_dim,
  batch = 16384 / seqlen (16k tokens per call);
- gqa: 32 query heads over 8 KV heads, head_dim 128 (or each of --headdims), the same seqlens;
- varlen: packed sequences of random lengths (256..4096, 16k tokens), 16 heads, head_dim 128;
- decode: few queries against a long KV cache (decoding, chunked prefill): 32 query heads over 8 KV
  heads, head_dim 128 (or each of --headdims), batch 16, seqlen_q {1, 8, 32, 128, 512} against 8k
  keys, no mask (not in the default set: --cases decode).

Implementations (each skipped with a note when unavailable or unsupported for a case):
- ours: flash_attn4.flash_attn_func / flash_attn_varlen_func;
- cudnn: torch SDPA restricted to the cuDNN backend;
- sdpa-flash: torch SDPA restricted to its FlashAttention-2 backend;
- sdpa-flash-fa4: the same SDPA call with flash-attn4's torch attention provider activated (our
  kernels through ATen's flash ops: activate_flash_attention_impl("flash-attn4"));
- flex: torch.compile'd flex_attention (causal, GQA and packed sequences through block masks);
- fa4-upstream: flash-attn-4's flash_attn.cute.flash_attn_func, only when it is importable.

Timing: every implementation is warmed up (compiles included) before timing; then the
implementations are interleaved (A B C ... A B C ...) for --rounds rounds, each round timing each one
with triton.testing.do_bench (median, L2 flushed between calls) or, without triton, CUDA events;
the figure kept is the median over rounds of those per-round medians. Differences under ~3% are noise
(shared/device/README.md). FLOPs = 4 * b * hq * sq * sk * d, halved when causal (varlen: summed over
sequences). Every output is compared with ours (max abs difference) so that a broken comparator, or a
broken kernel, shows up next to its number.

--mode bwd times the backward pass alone (the forward runs once outside timing; each timed call is
torch.autograd.grad of q, k, v with retain_graph), FLOPs = 2.5 x forward. Ours runs only where its
backward does (head dims up to 128, d == dv); otherwise its rows say n/a with the reason.

Writes bench-<mode>-<timestamp>.{csv,json,md,png} under --out (default benchmarks/results/, git-ignored;
no PNG without matplotlib) and prints the markdown table with ratio columns (ours / each comparator).
Exit status: 0 when ours ran every case, 1 when it failed on any, 2 without a CUDA GPU.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import platform
import statistics
import subprocess
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results"

SEQLENS = (1024, 2048, 4096, 8192, 16384)
DECODE_SEQLENS_Q = (1, 8, 32, 128, 512)
HEAD_DIMS = (64, 128, 256)
TOKENS = 16384
HIDDEN = 2048  # heads * head_dim for the grid
IMPL_ORDER = ("ours", "cudnn", "sdpa-flash", "sdpa-flash-fa4", "flex", "fa4-upstream")


# --------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    group: str  # grid | gqa | varlen | decode
    batch: int
    hq: int
    hk: int
    seqlen: int  # per sequence (varlen: the longest); the keys' length where seqlen_q is set
    head_dim: int
    causal: bool
    seqlens: tuple[int, ...] = ()  # varlen only: every sequence's length
    seqlen_q: int = 0  # decode only: the queries' length (0: seqlen)

    @property
    def sq(self) -> int:
        return self.seqlen_q or self.seqlen

    @property
    def name(self) -> str:
        mask = "causal" if self.causal else "full"
        if self.group == "varlen":
            return f"varlen n={len(self.seqlens)} tok={sum(self.seqlens)} h{self.hq} d{self.head_dim} {mask}"
        heads = f"h{self.hq}" if self.hq == self.hk else f"h{self.hq}/{self.hk}"
        lengths = f"s{self.seqlen}" if not self.seqlen_q else f"sq{self.seqlen_q} sk{self.seqlen}"
        return f"{self.group} b{self.batch} {heads} {lengths} d{self.head_dim} {mask}"

    def flops(self) -> float:
        """Forward FLOPs: 4 * hq * sq * sk * d per sequence (two matmuls), halved when causal."""
        if self.group == "varlen":
            total = sum(4.0 * self.hq * s * s * self.head_dim for s in self.seqlens)
        else:
            total = 4.0 * self.batch * self.hq * self.sq * self.seqlen * self.head_dim
        return total / 2 if self.causal else total


def varlen_lengths(total: int, low: int, high: int, seed: int) -> tuple[int, ...]:
    import random

    rng = random.Random(seed)
    lengths = []
    while sum(lengths) < total:
        lengths.append(rng.randint(low, high))
    lengths[-1] -= sum(lengths) - total
    if lengths[-1] < low // 2:  # fold a tiny tail into the previous sequence
        tail = lengths.pop()
        lengths[-1] += tail
    return tuple(lengths)


def build_cases(args) -> list[Case]:
    seqlens = args.seqlens or ((2048, 8192) if args.quick else SEQLENS)
    head_dims = args.headdims or ((64, 128) if args.quick else HEAD_DIMS)
    causals = {"both": (False, True), "causal": (True,), "full": (False,)}[args.masks]
    groups = args.cases or ("grid", "gqa", "varlen")
    cases = []
    if "grid" in groups:
        for d in head_dims:
            for causal in causals:
                for s in seqlens:
                    h = HIDDEN // d
                    cases.append(Case("grid", max(1, TOKENS // s), h, h, s, d, causal))
    gqa_head_dims = args.headdims or (128,)
    if "gqa" in groups:
        for d in gqa_head_dims:
            for causal in causals:
                for s in (seqlens if not args.quick else (8192,)):
                    cases.append(Case("gqa", max(1, TOKENS // s), 32, 8, s, d, causal))
    if "varlen" in groups and (args.headdims is None or 128 in args.headdims):
        lengths = varlen_lengths(TOKENS, 256, 4096, args.seed)
        for causal in (causals if not args.quick else (True,)):
            cases.append(Case("varlen", len(lengths), 16, 16, max(lengths), 128, causal, lengths))
    if "decode" in groups:
        for d in gqa_head_dims:
            for sq in DECODE_SEQLENS_Q:
                cases.append(Case("decode", 16, 32, 8, 8192, d, False, seqlen_q=sq))
    return cases


# --------------------------------------------------------------------------------------------
# Implementations. Each turns (case, inputs) into a zero-argument callable returning the output in
# (batch, seqlen, heads, head_dim) (varlen: (total, heads, head_dim)), or raises Unsupported.
# --mode bwd derives a ``bwd`` preparer from each ``fwd`` one (_backward_of).
# --------------------------------------------------------------------------------------------


class Unsupported(Exception):
    """This implementation does not run this case (the reason is reported, not an error)."""


@dataclass
class Inputs:
    q: "torch.Tensor"  # (b, s, hq, d) or (total, hq, d)
    k: "torch.Tensor"
    v: "torch.Tensor"
    cu_seqlens: "torch.Tensor | None" = None  # int32 (n + 1,)
    max_seqlen: int = 0


def _backward_of(prepare_fwd):
    """A backward preparer from a forward one: run the forward once with q, k, v requiring grad
    (outside timing), then time torch.autograd.grad of q, k, v (retaining the graph); returns dq."""
    def prepare(case: Case, x: Inputs):
        import torch

        xg = Inputs(*(t.detach().requires_grad_() for t in (x.q, x.k, x.v)), x.cu_seqlens, x.max_seqlen)
        out = prepare_fwd(case, xg)()
        if not out.requires_grad:
            raise Unsupported("no autograd through this implementation")
        dout = torch.randn_like(out)
        leaves = (xg.q, xg.k, xg.v)

        def run():
            return torch.autograd.grad(out, leaves, dout, retain_graph=True)[0]

        try:
            run()
        except NotImplementedError as exc:  # e.g. our backward before it is enabled
            raise Unsupported(str(exc).splitlines()[0][:120]) from None
        return run
    return prepare


@dataclass
class Impl:
    name: str
    available: Callable[[], str | None]  # None if usable, else why not
    fwd: Callable[[Case, Inputs], Callable]
    notes: dict = field(default_factory=dict)  # case name -> note (e.g. "kv expanded")
    bwd_prepare: Callable[[Case, Inputs], Callable] | None = None  # else autograd through fwd

    @property
    def bwd(self) -> Callable[[Case, Inputs], Callable]:
        return self.bwd_prepare or _backward_of(self.fwd)


def _import_ours():
    try:
        import flash_attn4
    except ImportError:
        sys.path.insert(0, str(REPO_ROOT / "torch-ext"))
        import flash_attn4
    return flash_attn4


def _ours_available():
    try:
        _import_ours()
    except Exception as exc:  # report, do not hide: ours missing is worth a loud note
        return f"import flash_attn4 failed: {exc}"
    return None


def _ours_fwd(case: Case, x: Inputs):
    fa = _import_ours()
    if case.group == "varlen":
        return lambda: fa.flash_attn_varlen_func(x.q, x.k, x.v, x.cu_seqlens, x.cu_seqlens, max_seqlen_q=x.max_seqlen,
                                                 max_seqlen_k=x.max_seqlen, causal=case.causal)
    return lambda: fa.flash_attn_func(x.q, x.k, x.v, causal=case.causal)


def _parse_variant(text: str) -> tuple[str, dict]:
    """'NAME:field=value,field=value' -> (NAME, overrides of fa4_kernels' ForwardConfig, or of its
    BackwardConfig with --mode bwd)."""
    import importlib

    name, _, spec = text.partition(":")
    config = importlib.import_module(_import_ours().__name__ + ".fa4_kernels.config")
    overrides = config.parse_overrides(spec)
    if not name or not overrides:
        raise argparse.ArgumentTypeError(f"--variant wants NAME:field=value[,field=value], got {text!r}")
    return name, overrides


def _variant_fwd(overrides: dict):
    """Our kernel with ForwardConfig fields overridden (A/B of kernel switches such as pingpong,
    rescale_threshold, exp2_emulated_eighths, tile_n), compiled and called directly with the
    kernel call convention (docs/CONTRACTS.md); "ours" (dispatch's own choice) is the baseline."""
    def prepare(case: Case, x: Inputs):
        import importlib

        import torch

        if case.group == "varlen":
            raise Unsupported("variants run batched cases only")
        package = _import_ours().__name__
        dispatch = importlib.import_module(package + ".dispatch")
        compile_forward = importlib.import_module(package + ".fa4_kernels.compile").compile_forward
        b, sq, hq, _ = x.q.shape
        ratio = hq // x.k.shape[2]
        if overrides.get("pack_gqa", 1) not in (1, ratio):
            raise Unsupported(f"pack_gqa={overrides['pack_gqa']} needs {overrides['pack_gqa']} query heads per KV "
                              f"head, the case has {ratio}")
        base = dispatch.forward_config(
            dispatch.arch_for_device(x.q.device), dispatch.dtype_name(x.q.dtype), x.q.shape[-1], x.v.shape[-1],
            causal=case.causal, local=False, has_softcap=False, varlen=False, has_seqused_k=False, has_sink=False,
            qhead_per_kvhead=ratio)
        kernel = compile_forward(base.replace(**overrides))
        out = x.q.new_empty(b, sq, hq, x.v.shape[-1])
        lse = torch.empty(b, hq, sq, dtype=torch.float32, device=x.q.device)
        scale = x.q.shape[-1] ** -0.5
        # (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table, learnable_sink): none
        return lambda: (kernel(x.q, x.k, x.v, out, lse, None, None, None, None, None, None, scale, 1.0, -1, -1, sq),
                        out)[1]
    return prepare


def _variant_bwd(overrides: dict):
    """Our backward with BackwardConfig fields overridden (e.g. num_stages, deterministic), through
    the backward op with the dispatch choice replaced for the duration of each call; the forward
    runs once, outside timing. "ours" (autograd through the same op) is the baseline."""
    def prepare(case: Case, x: Inputs):
        import importlib

        import torch

        if case.group == "varlen":
            raise Unsupported("variants run batched cases only")
        fa = _import_ours()
        dispatch = importlib.import_module(fa.__name__ + ".dispatch")
        ops = importlib.import_module(fa.__name__ + ".ops")
        validate = importlib.import_module(fa.__name__ + ".validate")
        out, lse = fa.flash_attn_func(x.q, x.k, x.v, causal=case.causal, return_lse=True)
        dout = torch.randn_like(out)
        causal, _, left, right = validate.canonical_mask(case.causal, -1, -1)
        # "ops.NAME=value" overrides a module-level switch of ops.py (e.g. PREPROCESS_KERNEL) instead
        # of a BackwardConfig field.
        switches = {k[len("ops."):]: v for k, v in overrides.items() if k.startswith("ops.")}
        fields = {k: v for k, v in overrides.items() if not k.startswith("ops.")}
        unknown = [name for name in switches if not hasattr(ops, name)]
        if unknown:
            raise ValueError(f"ops.py has no switch {unknown}")
        deterministic = bool(fields.get("deterministic", False))
        base = dispatch.backward_config(
            dispatch.arch_for_device(x.q.device, kernel="backward"), dispatch.dtype_name(x.q.dtype), x.q.shape[-1],
            x.v.shape[-1], causal=case.causal, local=False, has_softcap=False, varlen=False, has_seqused_k=False,
            deterministic=deterministic)
        cfg = base.replace(**fields)
        chosen = dispatch.backward_config
        saved = {name: getattr(ops, name) for name in switches}

        def run():
            dispatch.backward_config = lambda *args, **kwargs: cfg
            for name, value in switches.items():
                setattr(ops, name, value)
            try:
                return ops.bwd(dout, x.q, x.k, x.v, out, lse, None, None, None, x.q.shape[-1] ** -0.5, 0.0,
                               causal, left, right, x.q.shape[1], x.k.shape[1], deterministic)[0]
            finally:
                dispatch.backward_config = chosen
                for name, value in saved.items():
                    setattr(ops, name, value)
        return run
    return prepare


def _sdpa_available(backend_name: str):
    def check():
        import torch
        from torch.nn.attention import SDPBackend  # noqa: F401

        if backend_name == "CUDNN_ATTENTION" and not torch.backends.cudnn.is_available():
            return "cuDNN is not available"
        return None

    return check


def _sdpa_fwd(backend_name: str, impl_notes: dict):
    def prepare(case: Case, x: Inputs):
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if case.group == "varlen":
            raise Unsupported("no packed-sequence (varlen) entry point")
        backend = getattr(SDPBackend, backend_name)
        q, k, v = (t.transpose(1, 2) for t in (x.q, x.k, x.v))  # (b, h, s, d) views of (b, s, h, d)

        def run(q=q, k=k, v=v, gqa=case.hq != case.hk):
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=case.causal, enable_gqa=gqa)
            return out.transpose(1, 2)

        if case.hq != case.hk:
            try:
                run()
            except RuntimeError:
                # This backend has no native GQA: give it KV heads expanded beforehand (outside timing).
                rep = case.hq // case.hk
                k2, v2 = (t.repeat_interleave(rep, dim=1) for t in (k, v))
                impl_notes[case.name] = "kv expanded"
                return lambda: run(q, k2, v2, False)
        return run

    return prepare


def _set_provider(active: bool) -> None:
    """Our torch attention provider activated (True) or PyTorch's flash kernels back (False)."""
    import torch

    attention = torch.nn.attention
    if not hasattr(attention, "current_flash_attention_impl"):
        if active:
            raise Unsupported(f"torch {torch.__version__} has no flash-attention provider registry")
        return
    current = attention.current_flash_attention_impl()
    if active and current != "flash-attn4":
        _import_ours()  # registers the provider
        attention.activate_flash_attention_impl("flash-attn4")
    elif not active and current == "flash-attn4":
        attention.restore_flash_attention_impl()


def _with_provider(prepare, active: bool):
    """``prepare`` whose runs (and preparation) first put the provider in the state the row names:
    sdpa-flash and sdpa-flash-fa4 are timed interleaved, and ATen picks the kernel at call time (the
    backward's too). Only a timed batch's first call switches; later ones find it set."""
    def prepared(case: Case, x: Inputs):
        _set_provider(active)
        run = prepare(case, x)

        def timed():
            _set_provider(active)
            return run()
        return timed
    return prepared


def _sdpa_flash_impl(name: str, provider: bool) -> Impl:
    notes = {}
    fwd = _sdpa_fwd("FLASH_ATTENTION", notes)
    return Impl(name, _sdpa_available("FLASH_ATTENTION"), _with_provider(fwd, provider), notes,
                _with_provider(_backward_of(fwd), provider))


_FLEX = {}


def _flex_available():
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError as exc:
        return f"flex_attention unavailable: {exc}"
    return None


def _flex_fwd(case: Case, x: Inputs):
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in _FLEX:
        # One compiled function for every shape: raise the recompile limit so later shapes do not fall
        # back to the (much slower) eager path.
        for attr in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, attr):
                setattr(torch._dynamo.config, attr, 1024)
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    fn = _FLEX["fn"]
    device = x.q.device
    if case.group == "varlen":
        total = x.q.shape[0]
        doc = torch.repeat_interleave(
            torch.arange(len(case.seqlens), device=device),
            torch.tensor(case.seqlens, device=device),
        )

        def mask_mod(b, h, qi, ki):
            same = doc[qi] == doc[ki]
            return (same & (qi >= ki)) if case.causal else same

        block_mask = create_block_mask(mask_mod, B=None, H=None, Q_LEN=total, KV_LEN=total, device=device)
        q, k, v = (t.unsqueeze(0).transpose(1, 2) for t in (x.q, x.k, x.v))
    else:
        block_mask = None
        if case.causal:
            def causal(b, h, qi, ki):
                return qi >= ki

            block_mask = create_block_mask(causal, B=None, H=None, Q_LEN=case.seqlen, KV_LEN=case.seqlen,
                                           device=device)
        q, k, v = (t.transpose(1, 2) for t in (x.q, x.k, x.v))
    gqa = case.hq != case.hk

    def run():
        out = fn(q, k, v, block_mask=block_mask, enable_gqa=gqa)
        out = out.transpose(1, 2)
        return out[0] if case.group == "varlen" else out

    return run


def _upstream_available():
    try:
        from flash_attn.cute import flash_attn_func  # noqa: F401
    except Exception as exc:
        return f"flash_attn.cute not importable ({type(exc).__name__}: {exc})"
    return None


def _upstream_fwd(case: Case, x: Inputs):
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    def first(out):
        return out[0] if isinstance(out, tuple) else out

    if case.group == "varlen":
        return lambda: first(flash_attn_varlen_func(x.q, x.k, x.v, cu_seqlens_q=x.cu_seqlens, cu_seqlens_k=x.cu_seqlens,
                                                    max_seqlen_q=x.max_seqlen, max_seqlen_k=x.max_seqlen,
                                                    causal=case.causal))
    return lambda: first(flash_attn_func(x.q, x.k, x.v, causal=case.causal))


def make_impls() -> dict[str, Impl]:
    cudnn_notes = {}
    return {
        "ours": Impl("ours", _ours_available, _ours_fwd),
        "cudnn": Impl("cudnn", _sdpa_available("CUDNN_ATTENTION"), _sdpa_fwd("CUDNN_ATTENTION", cudnn_notes),
                      cudnn_notes),
        "sdpa-flash": _sdpa_flash_impl("sdpa-flash", provider=False),
        "sdpa-flash-fa4": _sdpa_flash_impl("sdpa-flash-fa4", provider=True),
        "flex": Impl("flex", _flex_available, _flex_fwd),
        "fa4-upstream": Impl("fa4-upstream", _upstream_available, _upstream_fwd),
    }


# A mode names the preparer each Impl provides and the FLOP multiplier over the forward's FLOPs.
@dataclass(frozen=True)
class Mode:
    name: str
    preparer: str
    flop_factor: float


MODES = {"fwd": Mode("fwd", "fwd", 1.0), "bwd": Mode("bwd", "bwd", 2.5)}
DECODE_MODES = ("decode", "decode-model")  # run by bench_decode.py (issue 21 items 6 and 8)


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


def make_timer(rep_ms: float):
    import torch

    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None

    if do_bench is not None:
        def timer(fn):
            return float(do_bench(fn, warmup=max(rep_ms / 4, 5), rep=rep_ms, return_mode="median"))

        return timer, "triton.testing.do_bench (median, L2 flushed)"

    def timer(fn):
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        iters = max(3, int(rep_ms / max(start.elapsed_time(end), 1e-3)))
        times = []
        for _ in range(iters):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        return statistics.median(times)

    return timer, "CUDA events (median)"


def make_inputs(case: Case, dtype, seed: int) -> Inputs:
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    if case.group == "varlen":
        total = sum(case.seqlens)
        shape_q, shape_kv = (total, case.hq, case.head_dim), (total, case.hk, case.head_dim)
    else:
        shape_q = (case.batch, case.sq, case.hq, case.head_dim)
        shape_kv = (case.batch, case.seqlen, case.hk, case.head_dim)
    q = torch.randn(shape_q, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(shape_kv, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(shape_kv, device="cuda", dtype=dtype, generator=gen)
    if case.group != "varlen":
        return Inputs(q, k, v)
    lengths = torch.tensor((0,) + case.seqlens, device="cuda")
    cu = torch.cumsum(lengths, 0).to(torch.int32)
    return Inputs(q, k, v, cu, max(case.seqlens))


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


def run_case(case: Case, impls: list[Impl], mode: Mode, args, timer) -> list[dict]:
    import torch

    x = make_inputs(case, args.torch_dtype, args.seed)
    rows, runners, outputs = [], {}, {}
    for impl in impls:
        row = dict(case=case.name, group=case.group, batch=case.batch, hq=case.hq, hk=case.hk,
                   seqlen=case.seqlen, seqlen_q=case.sq, head_dim=case.head_dim, causal=case.causal,
                   impl=impl.name, status="ok", note="", ms=None, tflops=None, round_ms=[], max_diff_vs_ours=None)
        rows.append(row)
        try:
            fn = getattr(impl, mode.preparer)(case, x)
            out = fn()  # warm-up: first call compiles where there is anything to compile
            torch.cuda.synchronize()
            fn()
            torch.cuda.synchronize()
            runners[impl.name], outputs[impl.name] = fn, out
            row["note"] = impl.notes.get(case.name, "")
        except Unsupported as exc:
            row.update(status="n/a", note=str(exc))
        except Exception as exc:  # keep going: one failing implementation must not end the run
            row.update(status="error", note=_short(exc))
            if args.verbose:
                traceback.print_exc()
        torch.cuda.synchronize()
    ref = outputs.get("ours")
    for row in rows:
        out = outputs.get(row["impl"])
        if ref is not None and out is not None and out.shape == ref.shape:
            row["max_diff_vs_ours"] = (out.float() - ref.float()).abs().max().item()
    outputs.clear()
    for _ in range(args.rounds):  # interleaved: A B C, A B C, ...
        for row in rows:
            fn = runners.get(row["impl"])
            if fn is None:
                continue
            try:
                row["round_ms"].append(timer(fn))
            except Exception as exc:
                runners.pop(row["impl"])
                row.update(status="error", note=_short(exc))
    flops = case.flops() * mode.flop_factor
    for row in rows:
        if row["status"] == "ok" and row["round_ms"]:
            row["ms"] = statistics.median(row["round_ms"])
            row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
    del x, runners
    torch.cuda.empty_cache()
    return rows


# --------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------


def markdown_table(rows: list[dict], impl_names: list[str], mode: str) -> str:
    cases = list(dict.fromkeys(r["case"] for r in rows))
    by = {(r["case"], r["impl"]): r for r in rows}
    others = [n for n in impl_names if n != "ours"]
    ratio_cols = [f"ours/{n}" for n in others] if "ours" in impl_names else []
    head = [f"case ({mode}, TFLOP/s)"] + impl_names + ratio_cols
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for c in cases:
        cells = [c]
        for n in impl_names:
            r = by.get((c, n))
            if r is None or r["tflops"] is None:
                cells.append("-" if r is None or r["status"] == "n/a" else r["status"])
            else:
                cells.append(f"{r['tflops']:.0f}" + ("*" if r["note"] else ""))
        ours = by.get((c, "ours"))
        for n in others if ratio_cols else []:
            r = by.get((c, n))
            if ours and ours["tflops"] and r and r["tflops"]:
                cells.append(f"{ours['tflops'] / r['tflops']:.2f}")
            else:
                cells.append("-")
        lines.append("| " + " | ".join(cells) + " |")
    notes = sorted({f"{r['impl']}: {r['note']}" for r in rows if r["note"]})
    if notes:
        lines.append("")
        lines.append("Notes (* = measured with a note; errors and n/a):")
        lines.extend(f"- {n}" for n in notes)
    return "\n".join(lines)


def write_plot(rows: list[dict], impl_names: list[str], path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot written"
    cases = list(dict.fromkeys(r["case"] for r in rows))
    by = {(r["case"], r["impl"]): r for r in rows}
    width = 0.8 / max(len(impl_names), 1)
    fig, ax = plt.subplots(figsize=(max(10, 0.55 * len(cases) * max(len(impl_names), 2) / 2), 6))
    for i, name in enumerate(impl_names):
        ys = [(by.get((c, name)) or {}).get("tflops") or 0.0 for c in cases]
        ax.bar([j + i * width for j in range(len(cases))], ys, width, label=name)
    ax.set_xticks([j + width * (len(impl_names) - 1) / 2 for j in range(len(cases))])
    ax.set_xticklabels(cases, rotation=75, ha="right", fontsize=7)
    ax.set_ylabel("TFLOP/s")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def environment() -> dict:
    import torch

    env = dict(
        time=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        python=platform.python_version(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        gpu=torch.cuda.get_device_name(),
        capability=".".join(map(str, torch.cuda.get_device_capability())),
        sm_count=torch.cuda.get_device_properties(0).multi_processor_count,
        cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
    )
    for mod in ("triton", "flash_attn4", "transformers"):
        try:
            env[mod] = getattr(__import__(mod), "__version__", "?")
        except Exception:
            env[mod] = None
    try:
        # "-dirty" when tracked code that runs here differs from the commit (a device copy of a
        # working tree is at the commit its .git was copied at, plus everything changed since; the
        # device recipe leaves the CPU tests and docs behind, which changes no measurement).
        git = ["git", "-C", str(REPO_ROOT)]
        head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no", "--", "torch-ext",
                                      "benchmarks", "scripts", "tests/reference.py"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        env["git"] = (head + ("-dirty" if dirty else "")) or None
    except Exception:
        env["git"] = None
    return env


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def _int_list(text: str) -> tuple[int, ...]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if part:
            out.append(int(float(part[:-1]) * 1024) if part.endswith("k") else int(part))
    return tuple(out)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=sorted(MODES) + list(DECODE_MODES), default="fwd",
                   help="what to time: the forward, or the backward alone; decode and decode-model have their own "
                        "options (benchmarks/bench_decode.py: --mode decode --help)")
    p.add_argument("--quick", action="store_true", help="a representative subset of the cases")
    p.add_argument("--only", type=lambda s: tuple(x.strip() for x in s.split(",") if x.strip()),
                   help=f"comma-separated implementations, from {','.join(IMPL_ORDER)}")
    p.add_argument("--cases", type=lambda s: tuple(x.strip() for x in s.split(",") if x.strip()),
                   help="comma-separated case groups: grid,gqa,varlen,decode (default grid,gqa,varlen)")
    p.add_argument("--headdims", type=_int_list, help="e.g. 64,128 (default 64,128,256)")
    p.add_argument("--seqlens", type=_int_list, help="e.g. 2k,8k (default 1k,2k,4k,8k,16k)")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--masks", choices=("both", "causal", "full"), default="both",
                   help="grid and gqa cases: causal and unmasked (default), or only one of them")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per case (default 5)")
    p.add_argument("--rep-ms", type=float, default=50.0, help="timing budget per measurement (ms)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default benchmarks/results/)")
    p.add_argument("--variant", action="append", type=_parse_variant, default=[],
                   help="A/B our kernel with ForwardConfig overrides, e.g. "
                        "--variant cr:rescale_threshold=8.0 --variant nopp:pingpong=false (repeatable); with "
                        "--mode bwd, BackwardConfig overrides, e.g. --variant st3:num_stages=3, and ops.py "
                        "switches, e.g. --variant torchpre:ops.PREPROCESS_KERNEL=false")
    p.add_argument("--list", action="store_true", help="print the cases and exit (no GPU needed)")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failing implementations")
    args = p.parse_args(argv)
    if args.only:
        unknown = set(args.only) - set(IMPL_ORDER)
        if unknown:
            p.error(f"unknown implementation(s) {sorted(unknown)}; choose from {', '.join(IMPL_ORDER)}")
    if args.cases:
        unknown = set(args.cases) - {"grid", "gqa", "varlen", "decode"}
        if unknown:
            p.error(f"unknown case group(s) {sorted(unknown)}; choose from grid, gqa, varlen, decode")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    return args


def _delegated_mode(argv) -> str | None:
    """--mode decode / decode-model (either spelling) hand the whole command line to bench_decode."""
    for i, arg in enumerate(argv):
        value = arg.partition("=")[2] if arg.startswith("--mode=") else (
            argv[i + 1] if arg == "--mode" and i + 1 < len(argv) else None)
        if value in DECODE_MODES:
            return value
    return None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if _delegated_mode(argv):
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import bench_decode

        return bench_decode.main(argv)
    args = parse_args(argv)
    cases = build_cases(args)
    if args.list:
        for c in cases:
            print(f"{c.name:50s} {c.flops() / 1e12:8.2f} TFLOP")
        return 0
    if not cases:
        print("bench: no case matches the filters", file=sys.stderr)
        return 2
    try:
        import torch
    except ImportError:
        print("bench: torch is not installed", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench: needs a CUDA GPU (torch.cuda.is_available() is False); nothing was measured. "
              "Use --list to see the cases.", file=sys.stderr)
        return 2
    args.torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    mode = MODES[args.mode]

    all_impls = make_impls()
    wanted = [n for n in IMPL_ORDER if not args.only or n in args.only]
    for name, overrides in args.variant:
        all_impls[f"ours[{name}]"] = Impl(f"ours[{name}]", _ours_available, _variant_fwd(overrides),
                                          bwd_prepare=_variant_bwd(overrides))
        wanted.insert(wanted.index("ours") + 1 if "ours" in wanted else 0, f"ours[{name}]")
    impls, skipped = [], {}
    for name in wanted:
        why = all_impls[name].available()
        if why is None:
            impls.append(all_impls[name])
        else:
            skipped[name] = why
            print(f"bench: skipping {name}: {why}", file=sys.stderr)
    if not impls:
        print("bench: no implementation is available", file=sys.stderr)
        return 2
    timer, timer_name = make_timer(args.rep_ms)
    env = environment()
    print(f"bench: {len(cases)} cases x {len(impls)} implementations, {args.rounds} interleaved rounds, "
          f"{args.dtype}, {timer_name}; {env['gpu']} (sm {env['capability']}), torch {env['torch']}",
          flush=True)

    rows = []
    for i, case in enumerate(cases, 1):
        case_rows = run_case(case, impls, mode, args, timer)
        rows.extend(case_rows)
        summary = "  ".join(
            f"{r['impl']}={r['tflops']:.0f}" if r["tflops"] else f"{r['impl']}={r['status']}" for r in case_rows
        )
        print(f"[{i}/{len(cases)}] {case.name}: {summary}", flush=True)

    names = [impl.name for impl in impls]
    table = markdown_table(rows, names, mode.name)
    print()
    print(table)

    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = args.out / f"bench-{mode.name}-{stamp}"
    fields = ["case", "group", "batch", "hq", "hk", "seqlen", "head_dim", "causal", "impl", "status", "ms",
              "tflops", "max_diff_vs_ours", "note"]
    with open(f"{base}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    meta = dict(env, mode=mode.name, dtype=args.dtype, rounds=args.rounds, rep_ms=args.rep_ms, timer=timer_name,
                seed=args.seed, skipped=skipped, flops="4*b*hq*sq*sk*d, /2 causal, x%g for %s" % (
                    mode.flop_factor, mode.name))
    Path(f"{base}.json").write_text(json.dumps(dict(meta=meta, results=rows), indent=1, default=str) + "\n")
    Path(f"{base}.md").write_text(
        f"{env['gpu']}, torch {env['torch']}, {args.dtype}, {timer_name}, median of {args.rounds} interleaved "
        f"rounds, git {env.get('git')}\n\n{table}\n"
    )
    note = write_plot(rows, names, Path(f"{base}.png"))
    print(f"\nbench: wrote {base}.csv, .json, .md" + (", .png" if note is None else f" ({note})"))

    ours_failed = [r["case"] for r in rows if r["impl"] == "ours" and r["status"] != "ok"]
    if "ours" in names and ours_failed:
        print(f"bench: ours did not run {len(ours_failed)} case(s): {ours_failed}", file=sys.stderr)
        return 1
    if "ours" in skipped:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
