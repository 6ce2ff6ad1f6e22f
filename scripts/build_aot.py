#!/usr/bin/env python3
"""Build the precompiled kernel set (flash_attn4.aot) on the CPU: cross-compile every configuration of
aot.shipped_configs for each arch, export it as an object file, link that into a shared library
(flash_attn4/native.py: a process loads it without importing the DSL; needs a C compiler, cc or
$CC), write the manifest.

    python scripts/build_aot.py --out build/aot                       # sm_90a and sm_100a, all cores
    python scripts/build_aot.py --arch sm_90a --out /tmp/fa4_aot -j 16
    python scripts/build_aot.py --list                                # the configurations only
    python scripts/build_aot.py --shard 1/4 --out /tmp/fa4_aot         # every 4th configuration (CI)

The output folder is what scripts/build_hub.py --aot-dir copies into the Hub tree as <module>/aot, or
what FLASH_ATTN4_AOT_DIR points at. Entries use the disk cache's naming under the fingerprint of the
sources they were compiled from, so an edited kernel never picks up an old object. Exit 1 when any
configuration fails to compile (the others are still written).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "torch-ext"))

from flash_attn4 import aot, compile_cache, native  # noqa: E402
from flash_attn4.fa4_kernels.arch import Arch  # noqa: E402

DEFAULT_ARCHS = ("sm_90a", "sm_100a")
COMPILERS = {"fwd": "compile_forward", "bwd": "compile_backward", "bwd_pre": "compile_backward_preprocess",
             "bwd_post": "compile_backward_postprocess", "combine": "compile_combine", "append": "compile_append",
             "split_kv": "compile_split_kv"}


def _entry_name(kind: str, key: tuple, fingerprint: str) -> str:
    return compile_cache.entry_path(kind, key, fingerprint).with_suffix(native.SUFFIX).name


def build_one(cfg, folder: str, fingerprint: str) -> tuple[str, float, int]:
    """Compile ``cfg`` (no JIT engine: export only), link it into a shared library in ``folder``
    (flash_attn4/native.py: loaded without the DSL); returns (file name, seconds, bytes)."""
    from flash_attn4.fa4_kernels import compile as kernels_compile

    kind, key = aot.kind_of(cfg), cfg.key()
    path = Path(folder) / _entry_name(kind, key, fingerprint)
    start = time.perf_counter()
    fn = getattr(kernels_compile, COMPILERS[kind])(cfg, jit_engine=False)
    with tempfile.TemporaryDirectory() as tmp_dir:
        obj = Path(tmp_dir) / "kernel.o"
        fn.export_to_c(str(obj), function_name=compile_cache.EXPORT_NAME)
        compile_cache.write_atomic(path, lambda tmp: native.link(obj, tmp))

    def sidecar(tmp: str) -> None:
        Path(tmp).write_text(json.dumps({"kind": kind, "key": list(key), "fingerprint": fingerprint}, indent=1))

    compile_cache.write_atomic(path.with_suffix(".json"), sidecar)
    return path.name, time.perf_counter() - start, path.stat().st_size


def _models_of(arch: Arch, dtypes) -> dict[tuple, list[str]]:
    """(kind,) + key -> the profiles whose calls dispatch to it (for the manifest and docs/AOT.md)."""
    users: dict[tuple, list[str]] = {}
    for p in aot.MODEL_PROFILES:
        for cfg in aot.model_configs(arch, p, dtypes):
            users.setdefault((aot.kind_of(cfg),) + cfg.key(), []).append(p.name)
    return users


def sharded(configs: list, shard: tuple[int, int] | None) -> list:
    """Shard (k, n) of ``configs``: every n-th one from the k-th (all of them for None). The n shards
    of a list partition it."""
    return configs if shard is None else configs[shard[0]::shard[1]]


def parse_shard(text: str) -> tuple[int, int]:
    """'K/N' -> (K, N) with 0 <= K < N; ValueError otherwise."""
    k, _, n = text.partition("/")
    try:
        k, n = int(k), int(n)
    except ValueError:
        raise ValueError(f"--shard wants K/N with integers 0 <= K < N, got {text!r}") from None
    if not 0 <= k < n:
        raise ValueError(f"--shard wants K/N with integers 0 <= K < N, got {text!r}")
    return k, n


def build(out: Path, archs: list[Arch], jobs: int, only: int | None = None, dtypes=aot.SHIPPED_DTYPES,
          shard: tuple[int, int] | None = None) -> int:
    """Compile the shipped set (its first ``only`` configurations of each arch, of those the
    ``shard``) into ``out``; 1 when any failed. A sharded set says so in its manifest: it is a
    check that those kernels build (CI), not a set to ship (the rest would compile on first use)."""
    fingerprint = compile_cache.source_fingerprint()
    folder = out / fingerprint
    folder.mkdir(parents=True, exist_ok=True)
    entries, failures, total = [], 0, time.perf_counter()
    work = []
    for arch in archs:
        users = _models_of(arch, dtypes)
        for cfg in sharded(aot.shipped_configs(arch, dtypes=dtypes)[:only], shard):
            work.append((arch, cfg, users.get((aot.kind_of(cfg),) + cfg.key(), [])))
    # Spawned workers, not forked: a caller that has compiled kernels in its own process (the tests
    # do) holds the DSL's threads and locks, and a forked child deadlocked on one (a JIT-cache
    # finalizer waiting forever). They import this module by name, so its folder goes on the path
    # they inherit.
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.append(here)
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(build_one, cfg, str(folder), fingerprint): (arch, cfg, users)
                   for arch, cfg, users in work}
        for i, future in enumerate(as_completed(futures), 1):
            arch, cfg, users = futures[future]
            try:
                name, seconds, size = future.result()
            except Exception as exc:  # report every failure, then fail
                failures += 1
                print(f"[{i}/{len(work)}] FAILED {aot.kind_of(cfg)} {cfg.key()}: {type(exc).__name__}: {exc}",
                      flush=True)
                continue
            entries.append({"arch": arch.value, "kind": aot.kind_of(cfg), "key": list(cfg.key()), "file": name,
                            "bytes": size, "models": users})
            print(f"[{i}/{len(work)}] {seconds:6.2f} s {size / 1024:6.0f} KiB  {arch.value} {aot.kind_of(cfg)} "
                  f"{', '.join(cfg.key()[1:])}", flush=True)
    entries.sort(key=lambda e: (e["arch"], e["kind"], e["key"]))
    manifest = {"fingerprint": fingerprint,
                "nvidia-cutlass-dsl": compile_cache._package_version("nvidia-cutlass-dsl"),
                "apache-tvm-ffi": compile_cache._package_version("apache-tvm-ffi"),
                "archs": [a.value for a in archs], "dtypes": list(dtypes), "entries": entries}
    if shard is not None:
        manifest["shard"] = f"{shard[0]}/{shard[1]}"

    (out / aot.MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    size = sum(e["bytes"] for e in entries)
    what = f" (shard {shard[0]}/{shard[1]} of the shipped set)" if shard is not None else ""
    print(f"{len(entries)}/{len(work)} kernels{what} for {', '.join(a.value for a in archs)} in "
          f"{time.perf_counter() - total:.1f} s ({jobs} processes), {size / 2**20:.1f} MiB, in {folder}")
    return 1 if failures else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", action="append", help=f"compile target, repeatable (default: {DEFAULT_ARCHS})")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "build" / "aot", help="output folder")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="compile processes")
    parser.add_argument("--dtype", action="append", choices=aot.DTYPES,
                        help=f"dtype to ship, repeatable (default: {aot.SHIPPED_DTYPES})")
    parser.add_argument("--only", type=int, default=None, help="the first N configurations of each arch only")
    parser.add_argument("--shard", help="K/N: every N-th configuration from the K-th only (a check that "
                        "they build, as CI does per commit; not a set to ship)")
    parser.add_argument("--list", action="store_true", help="print the configurations, compile nothing")
    args = parser.parse_args(argv)
    try:
        archs = [Arch.parse(a) for a in (args.arch or DEFAULT_ARCHS)]
        shard = None if args.shard is None else parse_shard(args.shard)
    except ValueError as exc:
        print(f"build_aot: {exc}", file=sys.stderr)
        return 2
    dtypes = tuple(args.dtype or aot.SHIPPED_DTYPES)
    if args.list:
        for arch in archs:
            for cfg in sharded(aot.shipped_configs(arch, dtypes=dtypes)[:args.only], shard):
                print(arch.value, aot.kind_of(cfg), ", ".join(cfg.key()[1:]))
        return 0
    return build(args.out, archs, max(1, args.jobs), args.only, dtypes, shard)


if __name__ == "__main__":
    sys.exit(main())
