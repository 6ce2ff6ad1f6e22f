#!/usr/bin/env python3
"""flash-attn4 end to end, the way a user gets it: the Hub build, loaded as a Hub kernel.

    make demo            # = python scripts/demo.py

1. Builds the Hub tree (``scripts/build_hub.py``, what ``make build`` runs) unless ``--no-build``.
2. Loads ``<build>/torch-cuda`` as a kernel: ``kernels.get_local_kernel`` when the ``kernels`` package
   can load it here; otherwise (no ``kernels``, or a CPU-only torch, which ``kernels`` refuses for a
   CUDA build) by path with importlib under a unique module name, as ``kernels`` itself does. The
   route taken is printed.
3. With an sm90/sm100 GPU: runs attention at a few sizes through the loaded module; prints the max
   error against a float32 reference next to the error of torch SDPA in the same precision, and
   TFLOP/s next to SDPA; then a tiny Llama with ``attn_implementation="fa4"`` when transformers is
   installed. Without one: checks the module's public API and compiles the kernel set that ships in
   the build for ``--arch`` (default sm_90a) with ``python -m fa4_kernels.compile``, which needs no GPU.

Exits non-zero on any failure (build, load, accuracy, compile).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
VARIANT = "torch-cuda"
DEVICE = "cuda"


class DemoError(RuntimeError):
    pass


def say(msg: str = "") -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------------------------
# Build and load
# --------------------------------------------------------------------------------------------


def build(build_dir: Path) -> Path:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "build_hub.py"), "--build-dir", str(build_dir)],
                          cwd=REPO_ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise DemoError(f"build failed (exit {done.returncode}):\n{done.stdout}{done.stderr}")
    variant = build_dir / VARIANT
    if not (variant / "__init__.py").exists():
        raise DemoError(f"build finished but {variant}/__init__.py is missing")
    say(f"[build] {variant} ({sum(1 for p in variant.rglob('*.py'))} .py files) in {time.perf_counter() - start:.1f} s")
    return variant


def import_tree(variant: Path):
    """Import a built variant folder as a package under a name unique to its path."""
    digest = hashlib.sha256(str(variant.resolve()).encode()).hexdigest()[:12]
    name = f"flash_attn4_demo_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, variant / "__init__.py",
                                                  submodule_search_locations=[str(variant)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def load(variant: Path):
    """(module, route description). Where ``kernels`` cannot load the build for a known, harmless
    reason (not installed; a torch without CUDA, for which it looks for no CUDA build) the tree is
    imported by path as ``kernels`` would, and the route says why; only a refusal on a CUDA torch
    is reported as a warning."""
    if importlib.util.find_spec("kernels") is None:
        module = import_tree(variant)
        return module, f"importlib by path as {module.__name__} (the kernels package is not installed)"
    import kernels
    import torch

    if torch.version.cuda is None:
        module = import_tree(variant)
        return module, (f"importlib by path as {module.__name__}, the way kernels imports a build (torch "
                        f"{torch.__version__} has no CUDA, and kernels loads a CUDA build only under a CUDA torch)")
    try:
        module = kernels.get_local_kernel(variant.parent.parent)
        return module, f"kernels.get_local_kernel({variant.parent.parent}) (kernels {kernels.__version__})"
    except Exception as exc:
        why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
    module = import_tree(variant)
    return module, f"importlib by path as {module.__name__}; warning: kernels could not load the build ({why})"


def check_api(fa) -> None:
    for name in ("flash_attn_func", "flash_attn_varlen_func"):
        fn = getattr(fa, name, None)
        if not callable(fn):
            raise DemoError(f"the loaded module has no {name}")
        params = set(inspect.signature(fn).parameters)
        needed = {"softmax_scale", "causal", "window_size", "softcap", "learnable_sink"}
        if not needed <= params:
            raise DemoError(f"{name} lacks parameters {sorted(needed - params)}")
    say("[api] flash_attn_func, flash_attn_varlen_func: signatures as in CONTRACTS.md")
    adapter = getattr(fa, "transformers_adapter", None)
    if adapter is None:
        try:
            adapter = importlib.import_module(fa.__name__ + ".transformers_adapter")
        except ImportError as exc:
            raise DemoError(f"the build has no transformers_adapter: {exc}") from exc
    if importlib.util.find_spec("transformers") is not None:
        name = adapter.register()
        say(f"[api] transformers: attn_implementation={name!r} registered from the built module; "
            f"Hub string {adapter.HUB_ATTN_IMPLEMENTATION!r}")


# --------------------------------------------------------------------------------------------
# Without a GPU: compile what ships
# --------------------------------------------------------------------------------------------


def compile_kernels(variant: Path, arch: str) -> None:
    say(f"[compile] python -m fa4_kernels.compile --arch {arch}  (in {variant}, the copy that ships)")
    env = dict(os.environ, CUTE_DSL_ARCH=arch)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "fa4_kernels.compile", "--arch", arch], cwd=variant, env=env,
                          capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.strip():
            say(f"  {line.strip()}")
    if done.returncode != 0:
        raise DemoError(f"compiling for {arch} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    say(f"[compile] done in {time.perf_counter() - start:.1f} s")


# --------------------------------------------------------------------------------------------
# With a GPU: run it
# --------------------------------------------------------------------------------------------


def _sync():
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _timer():
    """The benchmark's timer (benchmarks/bench.py: triton do_bench median, or CUDA events), with a
    short budget: the demo reports rough TFLOP/s, the benchmark the careful ones."""
    spec = importlib.util.spec_from_file_location("fa4_bench", REPO_ROOT / "benchmarks" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclasses look their module up while it executes
    spec.loader.exec_module(bench)
    timer, _ = bench.make_timer(rep_ms=50.0)
    return timer


def _reference(q, k, v, causal, dtype):
    """SDPA over (b, s, h, d) inputs in ``dtype`` (float32: the math reference)."""
    import torch.nn.functional as F

    rep = q.shape[2] // k.shape[2]
    qt, kt, vt = (t.to(dtype).transpose(1, 2) for t in (q, k, v))
    if rep > 1:
        kt, vt = kt.repeat_interleave(rep, dim=1), vt.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)


def run_attention(fa) -> list[dict]:
    import torch

    timer = _timer()
    cases = [  # (batch, seqlen, q heads, kv heads, head_dim, causal)
        (4, 1024, 16, 16, 64, False),
        (2, 2048, 16, 16, 128, True),
        (1, 4096, 32, 8, 128, True),
        (2, 1000, 8, 8, 256, False),
    ]
    rows, failures = [], []
    say("[run] bf16; error = max |out - float32 SDPA|; pass when ours <= 2 x SDPA-bf16's error + 1e-3")
    for b, s, hq, hk, d, causal in cases:
        gen = torch.Generator(device=DEVICE).manual_seed(b * s + d)
        q = torch.randn(b, s, hq, d, device=DEVICE, dtype=torch.bfloat16, generator=gen)
        k = torch.randn(b, s, hk, d, device=DEVICE, dtype=torch.bfloat16, generator=gen)
        v = torch.randn(b, s, hk, d, device=DEVICE, dtype=torch.bfloat16, generator=gen)
        label = f"b{b} s{s} h{hq}/{hk} d{d} {'causal' if causal else 'full'}"
        try:
            start = time.perf_counter()
            out = fa.flash_attn_func(q, k, v, causal=causal)
            _sync()
            first_ms = (time.perf_counter() - start) * 1e3
            ref = _reference(q, k, v, causal, torch.float32)
            sdpa = _reference(q, k, v, causal, torch.bfloat16)
            err = (out.float() - ref).abs().max().item()
            err_sdpa = (sdpa.float() - ref).abs().max().item()
            del ref
            flops = 4 * b * hq * s * s * d / (2 if causal else 1)
            ms = timer(lambda: fa.flash_attn_func(q, k, v, causal=causal))
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            ms_sdpa = timer(lambda: torch.nn.functional.scaled_dot_product_attention(
                qt, kt, vt, is_causal=causal, enable_gqa=hq != hk))
            ok = bool(torch.isfinite(out).all()) and err <= 2 * err_sdpa + 1e-3
            row = dict(case=label, err=err, err_sdpa=err_sdpa, tflops=flops / ms / 1e9,
                       tflops_sdpa=flops / ms_sdpa / 1e9, first_call_ms=first_ms, ok=ok)
        except Exception as exc:
            row = dict(case=label, ok=False, error=f"{type(exc).__name__}: {exc}")
        rows.append(row)
        if not row["ok"]:
            failures.append(label)
        if "error" in row:
            say(f"  {label:32s} FAILED  {row['error']}")
        else:
            say(f"  {label:32s} err {row['err']:.2e} (sdpa {row['err_sdpa']:.2e})  "
                f"{row['tflops']:6.0f} TFLOP/s (sdpa {row['tflops_sdpa']:4.0f}, x{row['tflops'] / row['tflops_sdpa']:.2f})"
                f"  first call {row['first_call_ms']:.0f} ms  {'ok' if row['ok'] else 'TOO INACCURATE'}")
    row = run_varlen(fa)
    rows.append(row)
    if not row["ok"]:
        failures.append(row["case"])
    if failures:
        raise DemoError(f"attention failed or was inaccurate for: {failures}")
    return rows


def run_varlen(fa) -> dict:
    """Packed sequences of different lengths through flash_attn_varlen_func, checked per sequence."""
    import torch

    lengths, hq, d = (300, 1000, 17, 731), 16, 128
    label = f"varlen {'+'.join(map(str, lengths))} h{hq} d{d} causal"
    try:
        gen = torch.Generator(device=DEVICE).manual_seed(1)
        total = sum(lengths)
        q, k, v = (torch.randn(total, hq, d, device=DEVICE, dtype=torch.bfloat16, generator=gen) for _ in range(3))
        cu = torch.tensor((0,) + tuple(torch.tensor(lengths).cumsum(0).tolist()), device=DEVICE, dtype=torch.int32)
        out = fa.flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen_q=max(lengths), max_seqlen_k=max(lengths),
                                        causal=True)
        err = err_sdpa = 0.0
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            sl = slice(a, b)
            ref = _reference(q[None, sl], k[None, sl], v[None, sl], True, torch.float32)[0]
            sdpa = _reference(q[None, sl], k[None, sl], v[None, sl], True, torch.bfloat16)[0]
            err = max(err, (out[sl].float() - ref).abs().max().item())
            err_sdpa = max(err_sdpa, (sdpa.float() - ref).abs().max().item())
        ok = bool(torch.isfinite(out).all()) and err <= 2 * err_sdpa + 1e-3
        say(f"  {label:32s} err {err:.2e} (sdpa {err_sdpa:.2e})  {'ok' if ok else 'TOO INACCURATE'}")
        return dict(case=label, err=err, err_sdpa=err_sdpa, ok=ok)
    except Exception as exc:
        say(f"  {label:32s} FAILED  {type(exc).__name__}: {exc}")
        return dict(case=label, ok=False, error=f"{type(exc).__name__}: {exc}")


def run_transformers(fa) -> None:
    if importlib.util.find_spec("transformers") is None:
        say("[transformers] not installed: skipped")
        return
    import torch
    import transformers

    adapter = importlib.import_module(fa.__name__ + ".transformers_adapter")
    name = adapter.register()
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=128, pad_token_id=0,
                                   max_position_embeddings=512)
    torch.manual_seed(0)
    models = {}
    for impl in ("sdpa", name):
        model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                                              attn_implementation=impl)
        if models:
            model.load_state_dict(next(iter(models.values())).state_dict())
        models[impl] = model.to(DEVICE, torch.bfloat16).eval()
    ids = torch.randint(3, 256, (2, 48), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :20] = 0  # left padding in the second row
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        out = {impl: m.generate(ids, **kw)[:, ids.shape[1]:] for impl, m in models.items()}
    same = (out[name] == out["sdpa"]).float().mean().item()
    say(f"[transformers] tiny Llama, attn_implementation={name!r}, left-padded batch, 8 greedy tokens: "
        f"{same:.0%} identical to sdpa (random bf16 weights: near ties may differ)")


# --------------------------------------------------------------------------------------------


def gpu_ready() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0) and major != 10:
        return f"sm{major}{minor} is not a supported GPU (sm90, sm100 family)"
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build-dir", type=Path, default=REPO_ROOT / "build")
    p.add_argument("--no-build", action="store_true", help="use the existing <build-dir>/torch-cuda")
    p.add_argument("--arch", default="sm_90a", help="compile target without a GPU (default sm_90a)")
    p.add_argument("--skip-compile", action="store_true", help="without a GPU: stop after loading")
    args = p.parse_args(argv)
    start = time.perf_counter()
    try:
        variant = args.build_dir / VARIANT
        if args.no_build:
            if not (variant / "__init__.py").exists():
                raise DemoError(f"--no-build, but {variant} holds no build (run make build)")
            say(f"[build] using the existing {variant}")
        else:
            variant = build(args.build_dir)
        meta_path = variant / "metadata.json"
        if meta_path.exists():
            meta = json.loads(meta_path.read_text())
            say(f"[build] metadata: name={meta.get('name')} version={meta.get('version')} "
                f"backend={meta.get('backend')}")
        fa, route = load(variant)
        say(f"[load] {route}")
        check_api(fa)
        no_gpu = gpu_ready()
        if no_gpu is None:
            import torch

            say(f"[gpu] {torch.cuda.get_device_name()} (sm {'.'.join(map(str, torch.cuda.get_device_capability()))}),"
                f" torch {torch.__version__}")
            run_attention(fa)
            run_transformers(fa)
        else:
            say(f"[gpu] {no_gpu}: compile-only demo")
            if not args.skip_compile:
                compile_kernels(variant, args.arch)
    except DemoError as exc:
        say(f"demo: FAILED: {exc}")
        return 1
    except Exception as exc:
        import traceback

        traceback.print_exc()
        say(f"demo: FAILED: {type(exc).__name__}: {exc}")
        return 1
    say(f"demo: ok ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
