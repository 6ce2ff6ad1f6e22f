"""Shared test setup.

- The source tree is importable without installing: ``torch-ext`` (for ``flash_attn4``) and the
  repository root (for ``fa4_kernels``, ``scripts``, ``benchmarks``) go first on ``sys.path``.
- Tests marked ``gpu`` need an sm90 (Hopper) or sm100-family (Blackwell) CUDA GPU; elsewhere they are
  skipped with the reason. They run the kernels of whatever family the GPU is (dispatch picks them),
  so the same suite tests sm90 on an H100/H200 and sm100 on a B200 or B300. Those also marked ``backward``
  are skipped, with the reason, on a family without a backward kernel, and where the backward raises
  a NotImplementedError that tests/unsupported.py lists for the GPU's arch (pytest_runtest_call).
- ``hub_build``: the Hub tree as ``make build`` writes it, built once per session into a temp folder.
- The static SASS tests' compiles (scripts/sass_stats_lib.py) are shared by every test process of a
  run (pytest-xdist workers): the controlling process names one folder for them, so that a kernel
  two workers both test is compiled once.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

for _path in (REPO_ROOT, REPO_ROOT / "torch-ext"):  # torch-ext ends up first
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from scripts.sass_stats_lib import SHARED_CACHE_ENV  # noqa: E402 (needs the path above)


def gpu_skip_reason() -> str | None:
    """Why `gpu` tests cannot run here, or None when they can."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (torch.cuda.is_available() is False)"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0) and major != 10:
        return f"needs an sm90 or sm100-family GPU, this one is sm{major}{minor}"
    return None


def backward_skip_reason() -> str | None:
    """Why tests of the backward pass cannot run on this GPU (its family has no backward kernel yet,
    e.g. Blackwell today), or None when they can."""
    import torch

    from flash_attn4.fa4_kernels.arch import IMPLEMENTED, Arch

    arch = Arch.for_capability(*torch.cuda.get_device_capability())
    if "backward" not in IMPLEMENTED.get(arch, ()):
        return f"no {arch.value} backward kernel yet (flash-attn4 issue: Blackwell backward)"
    return None


def pytest_configure(config):
    # Set before xdist starts its workers, which inherit it; a worker or an outer run keeps its own.
    if not hasattr(config, "workerinput") and not os.environ.get(SHARED_CACHE_ENV):
        config._fa4_sass_cache = tempfile.mkdtemp(prefix="fa4_sass_shared_")
        os.environ[SHARED_CACHE_ENV] = config._fa4_sass_cache


def pytest_unconfigure(config):
    folder = getattr(config, "_fa4_sass_cache", None)
    if folder is not None:
        os.environ.pop(SHARED_CACHE_ENV, None)
        shutil.rmtree(folder, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = gpu_skip_reason()
    if reason is not None:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=reason))
        return
    backward_items = [item for item in gpu_items if item.get_closest_marker("backward") is not None]
    reason = backward_skip_reason() if backward_items else None
    if reason is not None:
        for item in backward_items:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def hub_build(tmp_path_factory) -> Path:
    """Folder holding ``build/torch-cuda/``, made by ``make build AOT=`` (so the Makefile is exercised too;
    without the precompiled kernels, minutes of compiling that tests/cpu/test_aot.py covers on a small set)."""
    root = tmp_path_factory.mktemp("hub")
    build_dir = root / "build"
    done = subprocess.run(
        ["make", "-s", "-C", str(REPO_ROOT), "build", "AOT=", f"BUILD_DIR={build_dir}", f"PYTHON={sys.executable}"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, f"make build failed:\n{done.stdout}\n{done.stderr}"
    return root
