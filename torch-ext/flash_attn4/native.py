"""Precompiled kernels as shared libraries, loaded without importing the DSL (docs/AOT.md).

The DSL's own loader (``cutlass.runtime.load_module``) links an exported object file in-process with
MLIR's execution engine, so it needs ``import cutlass`` first: on the H100 host (2026-12-05) that
path took 2.5-3.5 s from ``import flash_attn4`` to the first forward result of a shipped kernel. The
shipped set is therefore linked once, at build time, into one shared library per kernel
(``link``). Its only undefined symbols are the DSL runtime's (``libcute_dsl_runtime.so``: CUDA
library loading and launches) and TVM-FFI's, so after loading those two with RTLD_GLOBAL,
``tvm_ffi.load_module`` finds the kernel's TVM-FFI entry (``__tvm_ffi_<name>``) in the library and
returns the same callable the DSL's loader would: 0.17-0.20 s to the first result there
(``scripts/aot_so_probe.py`` at efd6cd4), and ``cutlass`` is never imported.

The runtime library comes in one flavour per CUDA major version (``nvidia_cutlass_dsl/cu12/lib``,
``cu13/lib``); ``runtime_library`` applies the rule the DSL applies when it is imported (the newest
flavour installed whose major version the driver supports), so both loaders use the same library.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import subprocess
import threading
from pathlib import Path

RUNTIME_LIBRARY = "libcute_dsl_runtime.so"
SUFFIX = ".so"

_lock = threading.Lock()
_preloaded: list[ctypes.CDLL] = []  # kept alive: the kernels' symbols resolve against them


class NativeLoadError(RuntimeError):
    """A shared-library kernel cannot be loaded here (no DSL runtime for this driver, no driver)."""


def link(obj: str | os.PathLike, out: str | os.PathLike) -> None:
    """Link an exported kernel object into a shared library (build time; needs a C compiler)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise NativeLoadError("no C compiler to link the precompiled kernels with: install gcc, or set CC")
    done = subprocess.run([cc, "-shared", "-o", os.fspath(out), os.fspath(obj)], capture_output=True, text=True)
    if done.returncode != 0:
        raise NativeLoadError(f"{cc} -shared failed on {obj}: {done.stderr.strip()[-2000:]}")


def _driver_cuda_version() -> int:
    """cuDriverGetVersion, e.g. 13000 for CUDA 13.0 (libcuda is loaded already in a CUDA process)."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        status = libcuda.cuDriverGetVersion(ctypes.byref(version))
    except (OSError, AttributeError) as e:
        raise NativeLoadError(f"no CUDA driver ({e})") from None
    if status != 0:
        raise NativeLoadError(f"cuDriverGetVersion failed ({status})")
    return version.value


def runtime_library(driver_version: int | None = None) -> Path:
    """The DSL runtime library the DSL itself would load on this machine, found without importing it."""
    explicit = os.environ.get("CUTE_DSL_LIBS", "")  # the DSL's own override, honoured the same way
    for path in filter(None, explicit.split(os.pathsep)):
        if Path(path).name == RUNTIME_LIBRARY and Path(path).is_file():
            return Path(path)
    spec = importlib.util.find_spec("cutlass")  # locates the package; imports nothing
    if spec is None or spec.origin is None:
        raise NativeLoadError("nvidia-cutlass-dsl is not installed")
    root = next((p for p in Path(spec.origin).parents if p.name == "nvidia_cutlass_dsl"), None)
    if root is None:
        raise NativeLoadError(f"cutlass at {spec.origin} is not inside an nvidia_cutlass_dsl wheel")
    flavours = sorted((int(p.name[2:]) for p in root.glob("cu[0-9]*")
                       if p.name[2:].isdigit() and (p / "lib" / RUNTIME_LIBRARY).is_file()), reverse=True)
    major = (driver_version if driver_version is not None else _driver_cuda_version()) // 1000
    supported = [n for n in flavours if n <= major]
    if not supported:
        raise NativeLoadError(f"no DSL runtime for a CUDA {major} driver (installed: "
                              f"{', '.join(f'cu{n}' for n in flavours) or 'none'})")
    return root / f"cu{supported[0]}" / "lib" / RUNTIME_LIBRARY


def _preload(driver_version: int | None) -> None:
    with _lock:
        if _preloaded:
            return
        import tvm_ffi

        for lib in (runtime_library(driver_version), tvm_ffi.libinfo.find_libtvm_ffi()):
            _preloaded.append(ctypes.CDLL(os.fspath(lib), mode=ctypes.RTLD_GLOBAL))


def load(path: str | os.PathLike, name: str, driver_version: int | None = None):
    """The TVM-FFI function ``name`` of the shared-library kernel at ``path``. ``driver_version``
    (cuDriverGetVersion's number) stands in for the driver's where there is none (CPU tests)."""
    _preload(driver_version)
    import tvm_ffi

    return tvm_ffi.load_module(os.fspath(path))[name]
