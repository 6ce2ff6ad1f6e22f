"""Host time of a cached call: many back-to-back calls on a small problem, per public path.

    python scripts/host_time.py [--calls 2000]          # GPU: real kernels, beside SDPA (cuDNN)
    python scripts/host_time.py --noop [--calls 20000]  # CPU: the compiled kernels are no-ops
    python scripts/host_time.py --in-model [--noop]     # the attention call inside a model's decode

GPU mode: the kernels take a few microseconds, so the host's Python and launch work is what is
measured; beside PyTorch SDPA (cuDNN) on a comparable problem, and transformers' own "sdpa"
attention call on the adapter's decode problem (torch picks its backend). ``--noop`` needs no GPU: CPU tensors
pass the device check, the device reports an H200 (sm_90, 132 SMs) and every compiled kernel is a
Python no-op (the callable compile_cache hands out), so everything of a call but the launch itself
runs: validation, dispatch, config and kernel lookup, allocations, KV-cache metadata and append
(CPU ops). What it leaves out: tvm-ffi's argument conversion and launch, torch's CUDA caching
allocator (CPU allocations instead) and the CUDA-only checks (stream capture queries).

Prints microseconds per call: wall time and the calling thread's CPU time (steadier on a shared
host), each the best of five runs. ``--profile NAME`` runs one path under cProfile instead.

``--in-model`` times the attention function itself where it really runs: greedy decoding of
bench_decode's Llama-style model (1.1B shape, random weights; ``--noop``: a narrow one, with the
attention's shapes, for the CPU) with each implementation's attention function wrapped in a clock.
Per decode-step call (the prefill's calls left out) it prints the median wall time; the mean, which
is what a step pays per layer (it counts the one call per step whose cache length is new, whose
validation and launch plan are made afresh); and the median thread CPU time (steadier on a shared
host). Between two layers' calls the model runs its other ops, so the call's code and data are no
longer warm: its host time there is what a token pays, and for Python-heavy code it is a multiple
of the back-to-back loop's (about 2.3x for our call on the development CPU). GPU: "fa4" beside
"sdpa", interleaved; ``--noop``: "fa4" only (SDPA would compute on the CPU).

GPU mode adds the GPU's own time per call: the stream is held by ``torch.cuda._sleep`` while 100
calls are queued, then they run back to back between two events, so the host is out of that number.
A row whose wall time is close to its GPU time is GPU-bound: its wall time is not host time (the
16k-key KV-cache call with num_splits=1 runs one CTA per KV head, 8 CTAs streaming 64 MiB: its ~165 us
on the H100 is the kernel). "gaps" marks a GPU time the host could not keep ahead of (queuing took
longer than the sleep): then it is an upper bound.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

# FLASH_ATTN4_TREE=path/to/torch-ext measures another checkout's layer (before/after runs).
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [os.environ.get("FLASH_ATTN4_TREE", str(ROOT / "torch-ext")), str(ROOT)]

H200_SMS = 132


def per_call_us(fn, calls: int, sync) -> tuple[float, float]:
    """(wall, CPU time of this thread) per call in microseconds, each the best of five runs: other
    processes on a shared host add wall time, never remove it; the thread's CPU time is what the
    call itself costs the host."""
    for _ in range(20):
        fn()
    sync()
    wall = cpu = float("inf")
    for _ in range(5):
        start, start_cpu = time.perf_counter(), time.thread_time()
        for _ in range(calls):
            fn()
        sync()
        wall = min(wall, (time.perf_counter() - start) / calls * 1e6)
        cpu = min(cpu, (time.thread_time() - start_cpu) / calls * 1e6)
    return wall, cpu


def gpu_us(fn, calls: int = 100) -> tuple[float, bool]:
    """(GPU time per call in microseconds, whether the host kept ahead): ``calls`` calls queued behind
    a sleeping kernel, timed by events around them once they run back to back."""
    import torch

    events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    best, ahead = float("inf"), False
    for _ in range(3):
        torch.cuda.synchronize()
        events[0].record()
        torch.cuda._sleep(200_000_000)  # ~0.1 s at ~2 GHz: longer than queuing the calls
        events[1].record()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        queued_ms = (time.perf_counter() - start) * 1e3
        events[2].record()
        torch.cuda.synchronize()
        gpu = events[1].elapsed_time(events[2]) * 1e3 / calls
        if gpu < best:
            best, ahead = gpu, queued_ms < events[0].elapsed_time(events[1])
    return best, ahead


def install_noop_kernels():
    """CPU stand-ins at the lowest level: the device is an H200 as far as the layer can tell, and
    every kernel the compile cache hands out does nothing. Returns the package."""
    os.environ["FLASH_ATTN4_DISABLE_DISK_CACHE"] = "1"
    os.environ["FLASH_ATTN4_DISABLE_AOT"] = "1"
    import flash_attn4 as fa
    from flash_attn4 import compile_cache, device_info, ops, validate

    validate.DEVICE_TYPES = ("cuda", "cpu")
    real_index = device_info.device_index
    info = device_info.DeviceInfo(0, "no-op H200", (9, 0), H200_SMS)
    device_info.device_index = lambda device: 0 if str(device) == "cpu" else real_index(device)
    device_info._query = lambda index: info  # get_device_info's per-index lookup

    def noop(*args):
        return None

    for name in ("_compile_forward", "_compile_combine", "_compile_split_kv", "_compile_backward",
                 "_compile_backward_preprocess", "_compile_backward_postprocess", "_compile_append"):
        setattr(compile_cache, name, lambda cfg, **_: noop)
    ops.APPEND_KERNEL_DEVICES = ("cuda", "cpu")  # the KV-cache append as on a GPU: one (no-op) kernel call
    compile_cache.clear()
    return fa


class _Module:
    """What transformers' attention functions read of their module (the 1.1B model's 16/4 heads)."""
    is_causal = True
    training = False
    num_key_value_groups = 4


def paths(fa, dev: str, gpu: bool) -> dict:
    """name -> (call, needs_grad, scope): the public paths at decode-like sizes, each timed inside
    its scope (a context manager factory)."""
    import torch

    from flash_attn4 import transformers_adapter as adapter

    bf16 = torch.bfloat16
    b, hq, hk, d = 1, 32, 8, 128
    s_small, s_cache = 256, 16384

    def rand(*shape, **kw):
        return torch.randn(*shape, device=dev, dtype=bf16, **kw)

    q, k, v = rand(b, 1, hq, d), rand(b, s_small, hk, d), rand(b, s_small, hk, d)
    qg, kg, vg = (rand(*t.shape, requires_grad=True) for t in (q, k, v))
    dout = rand(*q.shape)
    k_cache, v_cache = rand(b, s_cache, hk, d), rand(b, s_cache, hk, d)
    k1, v1 = rand(b, 1, hk, d), rand(b, 1, hk, d)
    lens = torch.full((b,), s_cache - 1, dtype=torch.int32, device=dev)
    full = torch.full((b,), s_cache, dtype=torch.int32, device=dev)
    cu_q = torch.tensor([0, 1], dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0, s_small], dtype=torch.int32, device=dev)
    table = torch.arange(s_small // 16, dtype=torch.int32, device=dev)[None]
    pages_k, pages_v = k.view(-1, 16, hk, d), v.view(-1, 16, hk, d)
    # transformers' layout (B, H, S, D): a 1.1B Llama's decode step (16/4 heads) on a dynamic cache
    # (no mask) and on a static cache (padding mask: the unused tail is False)
    tq, tk, tv = rand(b, 16, 1, d), rand(b, 4, s_cache, d), rand(b, 4, s_cache, d)
    mask = torch.arange(s_cache, device=dev)[None] < s_cache - 100
    # several sequences: 4 x 4k caches (the append's rows view), and a left-padded batch of 2 on the adapter
    q4, k4, v4 = rand(4, 1, hq, d), rand(4, 1, hk, d), rand(4, 1, hk, d)
    k_cache4, v_cache4 = rand(4, 4096, hk, d), rand(4, 4096, hk, d)
    lens4 = torch.tensor([4095, 100, 2000, 7], dtype=torch.int32, device=dev)
    tq2, tk2, tv2 = rand(2, 16, 1, d), rand(2, 4, 4096, d), rand(2, 4, 4096, d)
    keys = torch.arange(4096, device=dev)[None]
    left_mask = (keys >= torch.tensor([[0], [37]], device=dev)) & (keys < 4000)
    module = _Module()
    # the SDPA op's (B, H, S, D) with equal heads (ATen's flash ops take no GQA)
    sq_, sk_, sv_ = q.transpose(1, 2), k.repeat_interleave(hq // hk, 2).transpose(1, 2), \
        v.repeat_interleave(hq // hk, 2).transpose(1, 2)
    calls = {
        "flash_attn_func": (lambda: fa.flash_attn_func(q, k, v), False),
        "flash_attn_func requires_grad": (lambda: fa.flash_attn_func(qg, kg, vg), True),
        "flash_attn_func forward+backward": (lambda: fa.flash_attn_func(qg, kg, vg).backward(dout), True),
        "flash_attn_func num_splits=0": (lambda: fa.flash_attn_func(q, k, v, num_splits=0), False),
        "flash_attn_varlen_func": (lambda: fa.flash_attn_varlen_func(
            q[0], k[0], v[0], cu_q, cu_k, max_seqlen_q=1, max_seqlen_k=s_small), False),
        "flash_attn_varlen_func paged": (lambda: fa.flash_attn_varlen_func(
            q[0], pages_k, pages_v, cu_q, None, max_seqlen_q=1, seqused_k=cu_k[1:], page_table=table), False),
        "kvcache 16k append 1": (lambda: fa.flash_attn_with_kvcache(
            q, k_cache, v_cache, k1, v1, cache_seqlens=lens), False),
        "kvcache 16k no append": (lambda: fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=full),
                                  False),
        "kvcache 16k num_splits=1": (lambda: fa.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=full, num_splits=1), False),
        "kvcache 4x4k append 1": (lambda: fa.flash_attn_with_kvcache(
            q4, k_cache4, v_cache4, k4, v4, cache_seqlens=lens4), False),
        "adapter decode (dynamic cache)": (lambda: adapter.attention_forward(
            module, tq, tk, tv, None, scaling=d ** -0.5), False),
        "adapter decode (padding mask)": (lambda: adapter.attention_forward(
            module, tq, tk, tv, mask, scaling=d ** -0.5), False),
        "adapter decode (left padding)": (lambda: adapter.attention_forward(
            module, tq2, tk2, tv2, left_mask, scaling=d ** -0.5), False),
        "sdpa flash op via our provider": (lambda: torch.ops.aten._scaled_dot_product_flash_attention(
            sq_, sk_, sv_, 0.0, False), False, _provider_scope(gpu)),
    }
    if gpu:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
        calls["sdpa cudnn (reference)"] = (lambda: _sdpa(F, sdpa_kernel, SDPBackend.CUDNN_ATTENTION, qs, ks, vs),
                                           False)
        # What "sdpa" runs in the model where the adapter's decode call runs (torch picks the backend).
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        calls["transformers sdpa decode (reference)"] = (lambda: sdpa_attention_forward(
            module, tq, tk, tv, None, scaling=d ** -0.5), False)
        # The op our provider serves, on PyTorch's own flash kernel (the provider inactive).
        calls["sdpa flash op, PyTorch's (reference)"] = (lambda: torch.ops.aten._scaled_dot_product_flash_attention(
            sq_, sk_, sv_, 0.0, False), False)
    return {name: call if len(call) == 3 else (*call, contextlib.nullcontext) for name, call in calls.items()}


def _provider_scope(gpu: bool):
    """A context in which our attention provider serves ATen's flash ops: on a GPU activated through
    torch's registry (then F.scaled_dot_product_attention's flash backend is ours too, so only
    while the path runs); with no-op kernels installed under the CPU dispatch key (ATen's flash ops
    have no CPU kernel of their own)."""
    import torch

    from flash_attn4 import torch_provider

    @contextlib.contextmanager
    def scope():
        if gpu:
            torch.nn.attention.activate_flash_attention_impl(torch_provider.PROVIDER_NAME)
            try:
                yield
            finally:
                torch.nn.attention.restore_flash_attention_impl()
        else:
            handle = torch_provider.install("CPU")
            try:
                yield
            finally:
                handle.remove()

    return scope


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=None, help="calls per timed run (default 2000 GPU, 20000 --noop)")
    p.add_argument("--noop", action="store_true", help="CPU only: no-op kernels, measure the torch layer")
    p.add_argument("--only", default="", help="comma-separated substrings of the path names to run")
    p.add_argument("--profile", default="", help="run the first path matching this under cProfile")
    p.add_argument("--in-model", action="store_true", help="the attention call's host time inside a decode step")
    p.add_argument("--prompt-len", type=int, default=16384, help="--in-model: prompt tokens (the cache length)")
    p.add_argument("--new-tokens", type=int, default=32, help="--in-model: decode steps per generate")
    p.add_argument("--rounds", type=int, default=3, help="--in-model: generates per implementation, interleaved")
    args = p.parse_args(argv)
    import torch

    if args.noop:
        fa = install_noop_kernels()
        dev, sync = "cpu", (lambda: None)
        header = f"no-op kernels on the CPU ({os.cpu_count()} cores), torch {torch.__version__}"
    else:
        import flash_attn4 as fa

        dev, sync = "cuda", torch.cuda.synchronize
        header = f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    if args.in_model:
        return in_model(dev, sync, header, ("fa4",) if args.noop else ("fa4", "sdpa"), narrow=args.noop,
                        prompt_len=args.prompt_len, new_tokens=args.new_tokens, rounds=args.rounds)
    calls = args.calls or (20000 if args.noop else 2000)
    todo = paths(fa, dev, gpu=not args.noop)
    if args.only:
        todo = {n: c for n, c in todo.items() if any(s in n for s in args.only.split(","))}
    if args.profile:
        return _profile(todo, args.profile, calls)
    print(f"{header}; {calls} back-to-back calls, best of 5")
    for name, (fn, grad, scope) in todo.items():
        try:
            with scope(), (torch.enable_grad() if grad else torch.inference_mode()):
                wall, cpu = per_call_us(fn, calls, sync)
                device = ""
                if not args.noop:
                    try:
                        gpu, ahead = gpu_us(fn)
                        device = f" {gpu:7.1f} us/call GPU{'' if ahead else ' (gaps)'}"
                    except Exception as exc:  # noqa: BLE001 - the wall/CPU numbers still stand
                        device = f"     GPU n/a ({type(exc).__name__})"
            print(f"{name:40s} {wall:7.1f} us/call wall {cpu:7.1f} us/call CPU{device}")
        except Exception as exc:  # a path an older tree lacks (A/B runs against a checkout)
            print(f"{name:40s}     n/a ({type(exc).__name__}: {str(exc)[:60]})")
    return 0


def in_model(dev: str, sync, header: str, attns: tuple, narrow: bool, prompt_len: int, new_tokens: int,
             rounds: int) -> int:
    """--in-model: per implementation, the host time of its attention function per decode-step call
    and the median step time, over ``rounds`` interleaved greedy generates after a warm-up."""
    import statistics

    import torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from benchmarks import bench_decode
    from flash_attn4 import transformers_adapter

    transformers_adapter.register()
    shape = dict(bench_decode.LLAMA_1B)
    if narrow:  # the attention's heads and head dim, a CPU's worth of everything else
        shape.update(vocab_size=1024, hidden_size=256, intermediate_size=512)
    model = bench_decode.build_model(shape, dev, torch.bfloat16, 0, prompt_len + new_tokens + 8)
    layers = shape["num_hidden_layers"]
    input_ids = torch.randint(0, shape["vocab_size"], (1, prompt_len), device=dev)
    stamps: list[tuple[int, int]] = []  # (wall, thread CPU) ns per call
    for name in attns:
        ALL_ATTENTION_FUNCTIONS[name] = _clocked(ALL_ATTENTION_FUNCTIONS[name], stamps)
    calls: dict = {name: [] for name in attns}
    steps: dict = {name: [] for name in attns}
    print(f"{header}; attention calls inside greedy decoding: {layers} layers, {prompt_len}-token prompt, "
          f"{new_tokens} new tokens, {rounds} rounds{' (narrow model, no-op kernels)' if narrow else ''}")
    for round_ in range(rounds + 1):  # round 0 warms up (compiles, plans)
        for name in attns:
            stamps.clear()
            step_ms, _ = bench_decode.generate_once(model, name, input_ids, new_tokens, "dynamic", sync)
            if round_:
                calls[name] += stamps[layers:]  # the prefill's calls left out
                steps[name] += step_ms
    for name in attns:
        us = [wall / 1e3 for wall, _ in calls[name]]
        cpu = statistics.median(cpu / 1e3 for _, cpu in calls[name])
        print(f"{name:6s} attention call {statistics.median(us):7.1f} us host (mean {statistics.fmean(us):.1f}, "
              f"p90 {statistics.quantiles(us, n=10)[-1]:.1f}, thread CPU {cpu:.1f}, {len(us)} calls); "
              f"step {statistics.median(steps[name]):.2f} ms")
    return 0


def _clocked(fn, stamps: list):
    """``fn`` appending its own (wall, thread CPU) time in ns to ``stamps`` per call."""
    def clocked(*args, **kwargs):
        start, start_cpu = time.perf_counter_ns(), time.thread_time_ns()
        result = fn(*args, **kwargs)
        stamps.append((time.perf_counter_ns() - start, time.thread_time_ns() - start_cpu))
        return result

    return clocked


def _profile(todo: dict, name: str, calls: int) -> int:
    import cProfile
    import pstats

    import torch

    fn, grad, scope = next(c for n, c in todo.items() if name in n)
    with scope(), (torch.enable_grad() if grad else torch.inference_mode()):
        for _ in range(20):
            fn()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    return 0


def _sdpa(F, sdpa_kernel, backend, q, k, v):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


if __name__ == "__main__":
    sys.exit(main())
