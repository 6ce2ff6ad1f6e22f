"""Compile kernels without a GPU: fake tensors with symbolic sizes, the target named explicitly.

    python -m flash_attn4.fa4_kernels.compile --arch sm_90a   # compiles the kernel set, prints seconds each
    python -m fa4_kernels.compile --arch sm_90a --list       # (from the repository root) names it only

An arch without kernels (no entry in arch.KERNELS) is an error: exit status 2.

``compile_forward(cfg)`` is also what the torch layer calls on a real GPU: the compiled TVM-FFI
function then takes torch tensors directly and runs on the current CUDA stream. Sizes (batch,
sequence lengths, head counts) and strides other than the unit head-dim stride stay symbolic, so
one compiled kernel serves every problem size.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from typing import Optional

from .arch import KERNELS, Arch, describe_implemented, kernels_for
from .config import (AppendConfig, BackwardConfig, CombineConfig, ForwardConfig, PostprocessConfig, PreprocessConfig,
                     SplitKVConfig)
from .tiles import backward_grid, backward_schedule, backward_tiles, forward_grid, forward_schedule, forward_tiles


def _cutlass_dtype(name: str):
    from .dtypes import CUTLASS_DTYPES  # imports the DSL: only when compiling

    return CUTLASS_DTYPES[name]


def _fake_tokens(dtype, lead: int, dim: int):
    """(lead symbolic sizes..., dim) with dim contiguous: q/k/v/out-like tensors, (b, s, h, dim) or
    packed (total, h, dim); the backward's dQ accumulator, (b, h, rows, 128) or (h, rows, 128), alike.
    Strides are 64-bit multiples of 8 elements (16 bytes at 16 bits), the base 16-byte aligned."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    return make_fake_tensor(dtype, tuple(cute.sym_int() for _ in range(lead)) + (dim,),
                            tuple(cute.sym_int(64, divisibility=8) for _ in range(lead)) + (1,), assumed_align=16)


def _fake_rows(lead: int, padded: bool):
    """float32 (lead symbolic sizes..., rows) with rows contiguous: LSE-like tensors. ``padded``:
    the row count is a multiple of 4 and the base 16-byte aligned (what TMA needs)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    stride = (lambda: cute.sym_int(64, divisibility=4)) if padded else (lambda: cute.sym_int(64))
    return make_fake_tensor(cutlass.Float32, tuple(cute.sym_int() for _ in range(lead + 1)),
                            tuple(stride() for _ in range(lead)) + (1,), assumed_align=16 if padded else 4)


def _fake_vector(dtype):
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    return make_fake_tensor(dtype, (cute.sym_int(),), (1,), assumed_align=4)


def _fake_page_table():
    """int32 (batch, max_pages), row-major."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    return make_fake_tensor(cutlass.Int32, (cute.sym_int(), cute.sym_int()), (cute.sym_int(64), 1), assumed_align=4)


def _fake_tensors(cfg: ForwardConfig, partials: Optional[bool] = None, has_sink: Optional[bool] = None):
    """The forward call convention's tensors for ``cfg``; ``partials=False`` gives a split-KV
    config's final out and lse instead of its partials, ``has_sink`` overrides cfg.has_sink (both for
    compile_split_kv)."""
    import cutlass

    dtype = _cutlass_dtype(cfg.dtype)
    lead = 2 if cfg.varlen else 3  # (total, h) or (b, s, h)
    q = _fake_tokens(dtype, lead, cfg.head_dim)
    kv_lead = 3 if cfg.page_size else lead  # a paged cache: (num_pages, page_size, h)
    k, v = (_fake_tokens(dtype, kv_lead, dim) for dim in (cfg.head_dim, cfg.head_dim_v))
    # Split-KV: float32 partials with a leading split mode (ForwardConfig.split_kv).
    split = 1 if (cfg.split_kv if partials is None else partials) else 0
    o = _fake_tokens(cutlass.Float32 if split else dtype, lead + split, cfg.head_dim_v)
    lse = _fake_rows((1 if cfg.varlen else 2) + split, padded=False)
    cu_q, cu_k = (_fake_vector(cutlass.Int32), _fake_vector(cutlass.Int32)) if cfg.varlen else (None, None)
    if cfg.page_size:
        cu_k = None  # the lengths are seqused_k; the page table says where the keys are
    seqused_q = _fake_vector(cutlass.Int32) if cfg.has_seqused_q else None
    seqused_k = _fake_vector(cutlass.Int32) if cfg.has_seqused_k else None
    page_table = _fake_page_table() if cfg.page_size else None
    sink = _fake_vector(cutlass.Float32) if (cfg.has_sink if has_sink is None else has_sink) else None
    return q, k, v, o, lse, cu_q, cu_k, seqused_q, seqused_k, page_table, sink


def _compile(kernel, *args, arch: Arch, jit_engine: bool):
    """cute.compile for ``arch`` with the TVM-FFI calling convention, the CUDA stream (every
    kernel's last argument) taken from the caller's environment at run time. ``jit_engine=False`` skips
    building the in-process JIT engine: the result can then only be exported (``export_to_c``) and
    loaded from the object file, which is what the disk cache does anyway; building the engine
    as well would generate the host code twice. Also hides the DSL's note that fully unrolled
    loops compile slowly: the kernels unroll their per-fragment loops on purpose, and users should
    not see the note on a first call."""
    import cutlass.cute as cute
    from cutlass.base_dsl.ast_helpers import DSLOptimizationWarning

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DSLOptimizationWarning)
        stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
        return cute.compile(kernel, *args, stream, options=f"--enable-tvm-ffi --gpu-arch {arch.value}",
                            no_jit_engine=not jit_engine)


def compile_forward(cfg: ForwardConfig, *, jit_engine: bool = True):
    """Compile the forward kernel for ``cfg`` (no GPU needed); returns the TVM-FFI callable
    with the call convention documented on ``ForwardConfig`` (``jit_engine``: see ``_compile``)."""
    import cutlass

    entry = kernels_for(cfg.arch, "forward")
    return _compile(
        entry.load(entry.forward)(cfg), *_fake_tensors(cfg),
        cutlass.Float32(1.0), cutlass.Float32(1.0),  # softmax_scale, softcap
        cutlass.Int32(-1), cutlass.Int32(-1),  # window_left, window_right
        cutlass.Int32(1),  # max_seqlen_q
        arch=cfg.arch, jit_engine=jit_engine,
    )


def compile_split_kv(cfg: SplitKVConfig, *, jit_engine: bool = True):
    """Compile a split-KV forward with its combine as one host function (no GPU needed; call
    convention in split_kv.py)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    from .config import WORKSPACE_ALIGN
    from .split_kv import SplitKVForward

    q, k, v, o, lse, *metadata = _fake_tensors(cfg.forward, partials=False, has_sink=cfg.combine.has_sink)
    workspace = make_fake_tensor(cutlass.Float32, (cute.sym_int(), cute.sym_int()),
                                 (cute.sym_int(64, divisibility=WORKSPACE_ALIGN), 1), assumed_align=32)
    return _compile(
        SplitKVForward(cfg), q, k, v, o, lse, workspace, *metadata,
        cutlass.Float32(1.0), cutlass.Float32(1.0),  # softmax_scale, softcap
        cutlass.Int32(-1), cutlass.Int32(-1),  # window_left, window_right
        cutlass.Int32(1),  # max_seqlen_q
        arch=cfg.forward.arch, jit_engine=jit_engine,
    )


def compile_backward(cfg: BackwardConfig, *, jit_engine: bool = True):
    """Compile the backward kernel for ``cfg`` (no GPU needed); call convention on BackwardConfig."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    entry = kernels_for(cfg.arch, "backward", compiled=True)
    kernel = entry.load(entry.backward)(cfg)
    row = entry.load(entry.dq_accum_layout)(cfg).row
    dtype, f32, i32 = _cutlass_dtype(cfg.dtype), cutlass.Float32, cutlass.Int32
    lead = 2 if cfg.varlen else 3  # (total, h) or (b, s, h)
    rows_lead = 1 if cfg.varlen else 2  # lse_log2 / dpsum: (h, total_pad) or (b, h, s_pad)
    d, dv = cfg.head_dim, cfg.head_dim_v
    cu_q, cu_k = (_fake_vector(i32), _fake_vector(i32)) if cfg.varlen else (None, None)
    seqused_k = _fake_vector(i32) if cfg.has_seqused_k else None
    sym = cute.sym_int
    semaphore = (make_fake_tensor(i32, (sym(), sym(), sym(), 2), (sym(64), sym(64), 2, 1), assumed_align=4)
                 if cfg.deterministic else None)
    args = (_fake_tokens(dtype, lead, d), _fake_tokens(dtype, lead, d), _fake_tokens(dtype, lead, dv),
            _fake_tokens(dtype, lead, dv), _fake_rows(rows_lead, padded=True), _fake_rows(rows_lead, padded=True),
            _fake_tokens(f32, lead, row), _fake_tokens(dtype, lead, d), _fake_tokens(dtype, lead, dv),
            cu_q, cu_k, seqused_k, semaphore)
    return _compile(kernel, *args,
                    cutlass.Float32(1.0), cutlass.Float32(1.0),  # softmax_scale, softcap
                    cutlass.Int32(-1), cutlass.Int32(-1),  # window_left, window_right
                    cutlass.Int32(1),  # max_seqlen_k
                    arch=cfg.arch, jit_engine=jit_engine)


def compile_backward_preprocess(cfg: PreprocessConfig, *, jit_engine: bool = True):
    """Compile the backward's preprocessing kernel (no GPU needed; call convention in
    bwd_preprocess.py). Architecture-independent code, compiled for ``cfg.arch``."""
    from .bwd_preprocess import BackwardPreprocess

    dtype = _cutlass_dtype(cfg.dtype)
    out, dout = (_fake_tokens(dtype, 3, cfg.head_dim_v) for _ in range(2))  # (b, s, h, dv)
    lse, dpsum, lse_log2 = (_fake_rows(2, padded=False) for _ in range(3))  # (b, h, s), (b, h, s_pad)
    return _compile(BackwardPreprocess(cfg), out, dout, lse, dpsum, lse_log2, arch=cfg.arch, jit_engine=jit_engine)


def compile_backward_postprocess(cfg: PostprocessConfig, *, jit_engine: bool = True):
    """Compile the backward's postprocessing kernel (no GPU needed; call convention in the arch's
    bwd_postprocess module): dQ from its float32 accumulator."""
    import cutlass

    entry = kernels_for(cfg.arch, "backward", compiled=True)
    row = entry.load(entry.dq_accum_layout)(cfg).row
    lead = 2 if cfg.varlen else 3
    accum, dq = _fake_tokens(cutlass.Float32, lead, row), _fake_tokens(_cutlass_dtype(cfg.dtype), lead, cfg.head_dim)
    cu_q = _fake_vector(cutlass.Int32) if cfg.varlen else None
    return _compile(entry.load(entry.bwd_postprocess)(cfg), accum, dq, cu_q, cutlass.Float32(1.0), cutlass.Int32(1),
                    arch=cfg.arch, jit_engine=jit_engine)


def compile_combine(cfg: CombineConfig, *, jit_engine: bool = True):
    """Compile the split-KV combine kernel (no GPU needed; call convention in combine.py).
    Architecture-independent code, compiled for ``cfg.arch``."""
    import cutlass

    from .combine import SplitKVCombine

    dtype = cutlass.Float32 if cfg.dtype == "float32" else _cutlass_dtype(cfg.dtype)
    out_partial = _fake_tokens(cutlass.Float32, 4, cfg.head_dim_v)  # (splits, b, s, h, dv)
    lse_partial = _fake_rows(3, padded=False)  # (splits, b, h, s)
    out, lse = _fake_tokens(dtype, 3, cfg.head_dim_v), _fake_rows(2, padded=False)
    sink = _fake_vector(cutlass.Float32) if cfg.has_sink else None
    return _compile(SplitKVCombine(cfg), out_partial, lse_partial, out, lse, sink, arch=cfg.arch,
                    jit_engine=jit_engine)


def combine_kernel_set(arch: Arch) -> list[CombineConfig]:
    """The combine kernels CI compiles for an arch with a forward: the common head dims, the
    16-bit outputs and the float32 one flash_attn_combine may return."""
    if arch not in KERNELS:
        return []
    return [CombineConfig(arch=arch, dtype="bfloat16", head_dim_v=128),
            CombineConfig(arch=arch, dtype="float16", head_dim_v=64),
            CombineConfig(arch=arch, dtype="float32", head_dim_v=200),
            CombineConfig(arch=arch, dtype="bfloat16", head_dim_v=64, has_sink=True)]


def compile_append(cfg: AppendConfig, *, jit_engine: bool = True):
    """Compile the KV-cache append kernel (no GPU needed; call convention in kv_append.py).
    Architecture-independent code, compiled for ``cfg.arch``."""
    import cutlass

    from .kv_append import KVAppend

    dtype, i32 = _cutlass_dtype(cfg.dtype), cutlass.Int32
    k, v = (_fake_tokens(dtype, 3, dim) for dim in (cfg.head_dim, cfg.head_dim_v))  # (b, s_new, hk, dim)
    # (b_cache, s_cache, hk, dim), or paged (num_pages, page_size, hk, dim)
    k_cache, v_cache = (_fake_tokens(dtype, 3, dim) for dim in (cfg.head_dim, cfg.head_dim_v))
    rows = _fake_vector(i32) if cfg.has_rows else None
    page_table = _fake_page_table() if cfg.paged else None
    return _compile(KVAppend(cfg), k, v, k_cache, v_cache, _fake_vector(i32), rows, page_table, _fake_vector(i32),
                    arch=cfg.arch, jit_engine=jit_engine)


def append_kernel_set(arch: Arch) -> list[AppendConfig]:
    """The KV-cache append kernels CI compiles for an arch with a forward: contiguous rows with and
    without cache_batch_idx, and paged."""
    if arch not in KERNELS:
        return []
    return [AppendConfig(arch=arch, dtype="bfloat16", head_dim=128, head_dim_v=128),
            AppendConfig(arch=arch, dtype="float16", head_dim=192, head_dim_v=128, has_rows=True),
            AppendConfig(arch=arch, dtype="bfloat16", head_dim=64, head_dim_v=64, paged=True)]


def backward_kernel_set(arch: Arch) -> list[BackwardConfig | PreprocessConfig | PostprocessConfig]:
    """Backward configurations CI compiles: the arch's BACKWARD_KERNEL_SET (tiles.py) with the tiles
    and grid dispatch picks (an entry's ``cluster_m`` overrides the grid rule's), the postprocessing of each of their dQ tilings and the preprocessing; empty for
    an arch without a backward."""
    entry = KERNELS.get(arch)
    if entry is None or "backward" not in entry.compiled_kernels:
        return []

    def cfg(d=128, dv=128, **flags):
        mask = {f: flags.get(f, False) for f in ("causal", "local", "has_softcap")}
        fields = {**backward_tiles(arch, d, dv, **mask), **backward_schedule(arch, d, dv, flags.get("varlen", False))}
        # The grid rule's CTA pairs, unless the entry names cluster_m (1: the single-CTA kernel a
        # pair falls back to, with its own stages).
        if flags.pop("cluster_m", None) is None:
            fields.update(backward_grid(arch, d, dv, mask["causal"], mask["local"], flags.get("varlen", False),
                                        flags.get("deterministic", False)))
        return BackwardConfig(arch=arch, dtype="bfloat16", head_dim=d, head_dim_v=dv, **flags, **fields)

    mains = [cfg(**problem) for problem in entry.rules().BACKWARD_KERNEL_SET]
    # Postprocessing: each dQ tiling (80-query blocks transposed, 128 split by rows, 64 by columns),
    # batched and varlen.
    posts = {c.postprocess() for c in mains}
    return [*mains, *sorted(posts, key=lambda c: c.key()),
            PreprocessConfig(arch=arch, dtype="bfloat16", head_dim_v=128)]


def kernel_set(arch: Arch) -> list[ForwardConfig]:
    """The forward configurations CI compiles for an arch: its FORWARD_KERNEL_SET (tiles.py), each
    with the tiles and schedule dispatch picks for it (an entry's ``cluster_m`` overrides the
    grid rule's: the single-CTA kernel a CTA pair falls back to); empty for an arch without kernels."""
    entry = KERNELS.get(arch)
    if entry is None:
        return []

    def cfg(d=128, dv=128, causal=False, local=False, qhead_per_kvhead=1, pack_group=0, dtype="bfloat16", **flags):
        varlen, split_kv = flags.get("varlen", False) or flags.get("has_seqused_q", False), flags.get("split_kv", False)
        grid = forward_grid(arch, d, dv, causal, local, varlen, split_kv,
                            has_seqused_k=flags.get("has_seqused_k", False), has_sink=flags.get("has_sink", False),
                            paged=flags.get("page_size", 0) > 0)
        if "cluster_m" in flags:
            grid["cluster_m"] = flags.pop("cluster_m")
        tiles = forward_tiles(arch, d, dv, causal, local, page_size=flags.get("page_size", 0))
        return ForwardConfig(arch=arch, dtype=dtype, head_dim=d, head_dim_v=dv,
                             causal=causal, local=local, **flags, **tiles,
                             **forward_schedule(arch, d, dv, varlen, qhead_per_kvhead, split_kv=split_kv,
                                                pack_group=pack_group), **grid)

    # Once each (with pairs switched off (sm100/tiles.TWO_CTA), a cluster_m=1 entry repeats its class's).
    return list(dict.fromkeys(cfg(**problem) for problem in entry.rules().FORWARD_KERNEL_SET))


def split_kv_kernel_set(arch: Arch) -> list[SplitKVConfig]:
    """The split-KV forwards of the arch's kernel set as the one-call pipelines the torch layer runs
    (split_kv.py), each with its combine: the first one's adds a learnable sink."""
    return _split_kv_pipelines(arch, kernel_set(arch))


def _split_kv_pipelines(arch: Arch, forwards: list[ForwardConfig]) -> list[SplitKVConfig]:
    splits = [cfg for cfg in forwards if cfg.split_kv]
    return [SplitKVConfig(forward=cfg, combine=CombineConfig(arch=arch, dtype=cfg.dtype, head_dim_v=cfg.head_dim_v,
                                                             has_sink=i == 0))
            for i, cfg in enumerate(splits)]


def compile_set(arch: Arch) -> list:
    """Everything ``main`` compiles for an arch: the forward set (its split-KV kernels inside their
    pipelines, which compile them), the backward, combine and append kernels."""
    forwards = kernel_set(arch)
    return ([cfg for cfg in forwards if not cfg.split_kv] + _split_kv_pipelines(arch, forwards)
            + backward_kernel_set(arch) + combine_kernel_set(arch) + append_kernel_set(arch))


_COMPILERS = {ForwardConfig: compile_forward, BackwardConfig: compile_backward,
              PreprocessConfig: compile_backward_preprocess, PostprocessConfig: compile_backward_postprocess,
              CombineConfig: compile_combine, AppendConfig: compile_append, SplitKVConfig: compile_split_kv}


def _describe(cfg) -> str:
    if isinstance(cfg, SplitKVConfig):
        return f"split-KV pipeline: {_describe(cfg.forward)} + {_describe(cfg.combine)}"
    if isinstance(cfg, PreprocessConfig):
        return f"bwd preprocess {cfg.dtype} dv={cfg.head_dim_v}"
    if isinstance(cfg, AppendConfig):
        return (f"kv append {cfg.dtype} d={cfg.head_dim}/{cfg.head_dim_v}" + (" paged" if cfg.paged else "")
                + (" rows" if cfg.has_rows else ""))
    if isinstance(cfg, CombineConfig):
        return f"combine {cfg.dtype} dv={cfg.head_dim_v}" + (" sink" if cfg.has_sink else "")
    if isinstance(cfg, PostprocessConfig):
        return f"bwd postprocess {cfg.dtype}"
    if isinstance(cfg, BackwardConfig):
        return (f"bwd {cfg.dtype} d={cfg.head_dim}/{cfg.head_dim_v} tile={cfg.tile_m}x{cfg.tile_n} "
                f"causal={cfg.causal} local={cfg.local} varlen={cfg.varlen} softcap={cfg.has_softcap} "
                f"deterministic={cfg.deterministic}" + (f" cluster_m={cfg.cluster_m}" if cfg.cluster_m > 1 else ""))
    return (f"fwd {cfg.dtype} d={cfg.head_dim}/{cfg.head_dim_v} tile={cfg.tile_m}x{cfg.tile_n} causal={cfg.causal} "
            f"local={cfg.local} varlen={cfg.varlen} softcap={cfg.has_softcap} sink={cfg.has_sink} "
            f"pack_gqa={cfg.pack_gqa}" + (f" pack_gqa_heads={cfg.pack_gqa_heads}" if cfg.pack_gqa_heads else "")
            + (" split_kv" if cfg.split_kv else "")
            + (f" cluster_m={cfg.cluster_m}" if cfg.cluster_m > 1 else ""))


def _compile_one(cfg) -> tuple[float, str]:
    """(seconds, "ok" or the failure) of compiling one configuration; a worker process's task."""
    start = time.perf_counter()
    try:
        _COMPILERS[type(cfg)](cfg, jit_engine=False)  # compiling is what is checked here
        status = "ok"
    except Exception as exc:  # report every failing configuration, then fail
        status = f"FAILED: {type(exc).__name__}: {exc}"
    return time.perf_counter() - start, status


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90a", help="compile target (sm_90a, sm_100a, sm_103a)")
    parser.add_argument("--only", type=int, default=None, help="compile only the first N configurations")
    parser.add_argument("--list", action="store_true", help="print the kernel set without compiling it")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1,
                        help="compile processes (default: one per CPU; each compile is single-threaded)")
    args = parser.parse_args(argv)
    try:
        arch = Arch.parse(args.arch)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    configs = compile_set(arch)
    if not configs:
        print(f"error: flash-attn4 has no kernels for {arch.value}; implemented: {describe_implemented()}",
              file=sys.stderr)
        return 2
    configs = configs[: args.only]
    if args.list:
        for cfg in configs:
            print(_describe(cfg))
        return 0
    failures = 0
    total = time.perf_counter()
    jobs = max(1, min(args.jobs, len(configs)))
    if jobs == 1:
        results = map(_compile_one, configs)
    else:
        # spawned, not forked (scripts/build_aot.py says why)
        pool = ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"))
        results = pool.map(_compile_one, configs)  # in the set's order, as they finish
    for cfg, (seconds, status) in zip(configs, results):
        failures += status != "ok"
        print(f"{seconds:7.2f} s  {_describe(cfg)}  {status}", flush=True)
    if jobs > 1:
        pool.shutdown()
    print(f"{len(configs) - failures}/{len(configs)} kernels compiled for {arch.value} "
          f"in {time.perf_counter() - total:.1f} s ({jobs} processes)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
