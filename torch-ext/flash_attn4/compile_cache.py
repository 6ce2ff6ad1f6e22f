"""Compiled kernels: an in-process dict in front of a persistent on-disk cache.

Lookup order for a ForwardConfig: memory (keyed by ``cfg.key()``, which contains the arch) -> the
precompiled set shipped with the package (read-only, ``aot``; same fingerprint rule) -> disk ->
compile. The disk cache is on by default; settings.py documents the folders and the switches.

Disk format. CuTe DSL's TVM-FFI compiled function can ``export_to_c(path.o, function_name=...)``: a
relocatable object holding the host launcher and the embedded device code. ``cutlass.runtime.load_module
(path.o, enable_tvm_ffi=True)`` links it in-process (LLVM JITLink, against the DSL runtime libraries) and
returns ``tvm_ffi.Function`` objects by name, so no system compiler or linker is needed. The entry lives at

    <cache dir>/<fingerprint>/<kind>-<sha256(key)[:32]>.o    (+ .json sidecar with the readable key)

where the fingerprint hashes every .py file of fa4_kernels plus the nvidia-cutlass-dsl and tvm-ffi
versions: editing a kernel or upgrading the DSL moves to a fresh folder; stale folders are never read.

Concurrency: an entry is written to a temporary file in the same folder and published with
``os.replace`` (atomic on POSIX), so a reader sees a whole file or none. A per-entry ``fcntl`` lock
makes a second process wait for the first one's compile instead of compiling the same kernel again
(e.g. eight ranks of one job starting together); if the lock cannot be had within LOCK_TIMEOUT_S the
process compiles on its own, which is still correct. Threads of one process share one lock.
A new kernel is compiled without an in-process JIT engine, written, and loaded from its entry like any
later process would. Integrity: the sidecar records the sha256 of the object file and is published
before it; an entry is loaded only when its bytes match (a flipped bit in an object file still links
and would run). A corrupt, truncated, unrecorded or unloadable entry is logged, removed and recompiled; a failed export
or load costs a second compile, with a JIT engine and in memory only, as every later kernel of that
process then compiles. A folder that cannot be written (read-only, full) or locked still serves the entries it holds;
what cannot be written is compiled in memory. Temporary files of a killed writer are removed by the
next holder of the entry's lock. Nothing on disk is ever required for correctness.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable

from . import settings
from .fa4_kernels.config import ForwardConfig

EXPORT_NAME = "fa4_kernel"
LOCK_TIMEOUT_S = 300.0

_memory: dict[tuple, Callable] = {}  # (kind,) + cfg.key() -> compiled function: the cache itself
_by_cfg: dict[tuple, Callable] = {}  # (kind, cfg) -> the same functions, a faster index for hot calls
_lock = threading.RLock()
_stats: Counter = Counter()
_fingerprint: str | None = None
_disk_failed = False  # a compiled kernel could not be written or loaded back: memory only from then on
# Called by clear(): caches built on top of the kernels (ops' launch plans) forget them with it.
_clear_hooks: list[Callable[[], None]] = []


# ---- fingerprint ----


def _kernels_root() -> Path:
    # fa4_kernels may be a namespace package (no __file__); resolve() also sees through a symlinked copy.
    return (Path(__file__).resolve().parent / "fa4_kernels").resolve()


def _package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def source_fingerprint(root: Path | None = None) -> str:
    """sha256 over the fa4_kernels sources (relative path + bytes of every .py file, sorted) and the
    versions of nvidia-cutlass-dsl and apache-tvm-ffi. Computed once per process for the default root."""
    global _fingerprint
    if root is None and _fingerprint is not None:
        return _fingerprint
    base = root if root is not None else _kernels_root()
    h = hashlib.sha256()
    for dist in ("nvidia-cutlass-dsl", "apache-tvm-ffi"):
        h.update(f"{dist}=={_package_version(dist)}\n".encode())
    for src in sorted(base.rglob("*.py")):
        if "__pycache__" in src.parts or not src.is_file():
            continue
        data = src.read_bytes()
        h.update(src.relative_to(base).as_posix().encode() + b"\0" + str(len(data)).encode() + b"\0")
        h.update(data)
    digest = h.hexdigest()[:24]
    if root is None:
        _fingerprint = digest
    return digest


# ---- disk layout ----


def entry_path(kind: str, key: tuple, fingerprint: str | None = None) -> Path:
    """Where the object file of a compile key lives (depends on settings.cache_dir at call time)."""
    fp = fingerprint or source_fingerprint()
    digest = hashlib.sha256(repr((kind,) + tuple(key)).encode()).hexdigest()[:32]
    return settings.cache_dir() / fp / f"{kind}-{digest}.o"


@contextlib.contextmanager
def _file_lock(path: Path, timeout: float):
    """Exclusive advisory lock on ``path`` (a .lock file); yields True if held, False on timeout or
    when the lock file cannot be opened (a read-only or full folder: entries there are still read)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no cross-process lock, atomic replace still keeps files whole
        yield False
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        settings.get_logger().debug("cannot open cache lock %s (%s); going on without it", path, e)
        yield False
        return
    try:
        deadline = time.monotonic() + timeout
        held = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
                break
            except OSError:
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
        try:
            yield held
        finally:
            if held:
                fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def write_atomic(path: Path, writer: Callable[[str], None]) -> None:
    """Call ``writer(tmp_path)`` for a temp file next to ``path``, then publish it with os.replace."""
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        writer(tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a shared FLASH_ATTN4_CACHE_DIR should be readable
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class CacheEntryError(RuntimeError):
    """A disk-cache entry whose bytes are not the ones its sidecar recorded (or without a record)."""


def _sha256_file(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _export(fn, path: Path, key: tuple) -> None:
    """Object file to a temp file, its sha256 into the sidecar, the sidecar published, then the object:
    whoever sees the object file also finds the record its bytes are checked against."""
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        fn.export_to_c(tmp, function_name=EXPORT_NAME)
        record = {"key": list(key), "fingerprint": path.parent.name, "sha256": _sha256_file(tmp),
                  "size": os.path.getsize(tmp)}

        def write_sidecar(sidecar_tmp: str) -> None:
            with open(sidecar_tmp, "w") as f:
                json.dump(record, f, indent=1)

        write_atomic(path.with_suffix(".json"), write_sidecar)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a shared FLASH_ATTN4_CACHE_DIR should be readable
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _verify(path: Path) -> None:
    """CacheEntryError unless ``path``'s bytes have the size and sha256 its sidecar recorded."""
    try:
        record = json.loads(path.with_suffix(".json").read_text())
        want, size = record["sha256"], record["size"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CacheEntryError(f"no integrity record ({type(e).__name__}: {e})") from None
    if os.path.getsize(path) != size:
        raise CacheEntryError(f"size {os.path.getsize(path)} != recorded {size} (truncated?)")
    if _sha256_file(path) != want:
        raise CacheEntryError("sha256 differs from the recorded one (corrupt)")


def _remove_stale_temps(path: Path) -> None:
    """Temp files of this entry left by a writer that was killed (called with the entry's lock held)."""
    for pattern in (path.name + ".*.tmp", path.with_suffix(".json").name + ".*.tmp"):
        for tmp in path.parent.glob(pattern):
            with contextlib.suppress(OSError):
                tmp.unlink()


def _load(path: Path):
    from cutlass.runtime import load_module  # the DSL is imported only when a kernel is needed

    module = load_module(str(path), enable_tvm_ffi=True)
    return module[EXPORT_NAME]


# ---- compile ----


def _kernel_compiler(name: str) -> Callable:
    """``fa4_kernels.compile.<name>``, imported on the first compile (it imports the DSL)."""
    def compile_fn(cfg, *, jit_engine: bool = True):
        from .fa4_kernels import compile as kernels_compile

        return getattr(kernels_compile, name)(cfg, jit_engine=jit_engine)

    return compile_fn


_compile_forward = _kernel_compiler("compile_forward")
_compile_backward = _kernel_compiler("compile_backward")
_compile_backward_preprocess = _kernel_compiler("compile_backward_preprocess")
_compile_backward_postprocess = _kernel_compiler("compile_backward_postprocess")
_compile_combine = _kernel_compiler("compile_combine")
_compile_split_kv = _kernel_compiler("compile_split_kv")
_compile_append = _kernel_compiler("compile_append")


def _timed_compile(kind: str, cfg, compile_fn: Callable, jit_engine: bool = True):
    log = settings.get_logger()
    t0 = time.perf_counter()
    fn = compile_fn(cfg, jit_engine=jit_engine)
    dt = time.perf_counter() - t0
    _stats["compiled"] += 1
    level = logging.WARNING if dt >= settings.slow_compile_seconds() else logging.INFO
    log.log(level, "compiling %s kernel for %s took %.2f s", kind, _describe(cfg), dt)
    return fn


def _describe(cfg) -> str:
    try:
        return ", ".join(part for part in cfg.key()[1:])
    except Exception:  # pragma: no cover - cfg without key()
        return repr(cfg)


def get_kernel(kind: str, cfg, compile_fn: Callable):
    """The compiled function for ``cfg`` (anything with ``.key()``), compiling at most once per process
    and, with the disk cache on, at most once per machine and kernel-source fingerprint.
    ``compile_fn(cfg, jit_engine=...)``: with ``jit_engine=False`` its result need only be exportable."""
    try:  # fast path: the config object itself (hashing a frozen dataclass is cheaper than key())
        fn = _by_cfg.get((kind, cfg))
    except TypeError:  # unhashable config
        fn = None
    if fn is not None:
        _stats["memory_hits"] += 1
        return fn
    key = cfg.key()
    mem_key = (kind,) + tuple(key)
    with _lock:
        fn = _memory.get(mem_key)
        if fn is None:
            fn = _get_uncached(kind, cfg, key, compile_fn)
            _memory[mem_key] = fn
        else:
            _stats["memory_hits"] += 1
        try:
            _by_cfg[(kind, cfg)] = fn
        except TypeError:
            pass
    return fn


def _get_uncached(kind: str, cfg, key: tuple, compile_fn: Callable):
    log = settings.get_logger()
    fn = _load_shipped(kind, key)
    if fn is not None:
        return fn
    if not settings.disk_cache_enabled() or _disk_failed:
        return _timed_compile(kind, cfg, compile_fn)
    try:
        path = entry_path(kind, key)
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.warning("flash-attn4 disk cache unavailable (%s); compiling in memory only", e)
        return _timed_compile(kind, cfg, compile_fn)

    with _file_lock(path.with_suffix(".lock"), LOCK_TIMEOUT_S) as held:
        if not held:
            log.debug("cache lock %s not acquired; compiling without it", path)
        else:
            _remove_stale_temps(path)
        if path.exists():
            try:
                _verify(path)
                fn = _load(path)
                _stats["disk_hits"] += 1
                log.info("loaded %s kernel from %s", kind, path)
                return fn
            except Exception as e:  # corrupt or incompatible entry: drop it and rebuild
                _stats["disk_errors"] += 1
                log.warning("could not load cached kernel %s (%s: %s); recompiling", path, type(e).__name__, e)
                for stale in (path, path.with_suffix(".json")):
                    with contextlib.suppress(OSError):
                        stale.unlink()
        return _compile_to_disk(kind, cfg, key, compile_fn, path)


def _load_shipped(kind: str, key: tuple):
    """The kernel from the shipped precompiled set (aot.py), or None: not shipped, switched off,
    built from other sources, or not loadable (then the disk cache or a compile takes over)."""
    from . import aot, native

    name = entry_path(kind, key).with_suffix(native.SUFFIX).name
    try:
        path = aot.shipped_entry(kind, key, name, source_fingerprint())
    except OSError:
        return None
    if path is None:
        return None
    try:
        fn = native.load(path, EXPORT_NAME)  # linked at build time: no DSL import (native.py)
    except Exception as e:  # read-only: never removed, only passed over
        _stats["aot_errors"] += 1
        settings.get_logger().warning("could not load shipped kernel %s (%s: %s)", path, type(e).__name__, e)
        return None
    _stats["aot_hits"] += 1
    return fn


def _compile_to_disk(kind: str, cfg, key: tuple, compile_fn: Callable, path: Path):
    """Compile without an in-process JIT engine, write the entry and run what was written: building
    the engine would generate the host code a second time (about 0.2 s of a first call), and the
    first process then runs the very file that later ones load."""
    global _disk_failed
    compiled = _timed_compile(kind, cfg, compile_fn, jit_engine=False)
    try:
        _export(compiled, path, key)
        fn = _load(path)
    except Exception as e:  # the compile itself is fine: redo it with an engine, in memory only
        _stats["disk_errors"] += 1
        settings.get_logger().warning("could not write or load kernel cache entry %s (%s: %s); compiling again, "
                                      "and kernels of this process from now on, without the disk cache",
                                      path, type(e).__name__, e)
        with contextlib.suppress(OSError):
            path.unlink()
        _disk_failed = True  # so that every later kernel does not pay two compiles
        return _timed_compile(kind, cfg, compile_fn)
    _stats["disk_writes"] += 1
    return fn


def get_backward_preprocess_kernel(cfg):
    """The compiled preprocessing kernel of the backward for a PreprocessConfig."""
    return get_kernel("bwd_pre", cfg, _compile_backward_preprocess)


def get_backward_postprocess_kernel(cfg):
    """The compiled postprocessing kernel of the backward (dQ from its accumulator) for a
    PostprocessConfig."""
    return get_kernel("bwd_post", cfg, _compile_backward_postprocess)


def get_combine_kernel(cfg):
    """The compiled split-KV combine kernel for a CombineConfig (call convention: combine.py)."""
    return get_kernel("combine", cfg, _compile_combine)


def get_split_kv_kernel(cfg):
    """The compiled split-KV forward with its combine, one host function, for a SplitKVConfig (call
    convention: fa4_kernels/split_kv.py)."""
    return get_kernel("split_kv", cfg, _compile_split_kv)


def get_append_kernel(cfg):
    """The compiled KV-cache append kernel for an AppendConfig (call convention: kv_append.py)."""
    return get_kernel("append", cfg, _compile_append)


def get_backward_kernel(cfg):
    """The compiled backward kernel for a BackwardConfig (call convention: its docstring)."""
    return get_kernel("bwd", cfg, _compile_backward)


def get_forward_kernel(cfg: ForwardConfig):
    """The compiled forward kernel for ``cfg`` (call convention: ForwardConfig's docstring)."""
    return get_kernel("fwd", cfg, _compile_forward)


def stats() -> dict:
    """Counters since start (or the last clear): compiled, memory_hits, aot_hits, aot_errors, disk_hits,
    disk_writes, disk_errors."""
    return {k: _stats[k] for k in ("compiled", "memory_hits", "aot_hits", "aot_errors", "disk_hits", "disk_writes",
                                   "disk_errors")}


def clear(memory: bool = True, counters: bool = True) -> None:
    """Forget in-process kernels (and a failure of the disk cache) and/or counters; the disk cache
    itself is left alone."""
    global _disk_failed
    with _lock:
        if memory:
            _memory.clear()
            _by_cfg.clear()
            _disk_failed = False
            for hook in _clear_hooks:
                hook()
        if counters:
            _stats.clear()
