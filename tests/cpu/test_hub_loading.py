"""Loading the built kernel through `kernels` 0.17.2, offline, the ways users do.

Every load runs in a fresh interpreter: huggingface_hub and kernels read HF_HUB_OFFLINE, HF_HUB_CACHE
and LOCAL_KERNELS when they are imported, and a loaded kernel stays in the process. The interpreter
starts in an empty folder without PYTHONPATH, so the source tree is not importable there and a stray
absolute import of the module would show.

This machine's torch is a CPU build. kernels picks a build variant by the backend torch was built
for (`torch.version.cuda`), so on CPU torch it rightly refuses `torch-cuda` (checked below) and
`backend="cuda"` is refused too ("system supported backends: cpu"). The loads therefore emulate a
CUDA build of torch on a machine without a GPU by setting `torch.version.cuda` before kernels runs:
exactly the situation of a CUDA torch on a GPU-less host. `torch.cuda.is_available()` stays False,
so kernels' architecture check (check_arch, left on) has no device to compare against and passes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG = tomllib.loads((REPO_ROOT / "build.toml").read_text())
REPO_ID = CONFIG["general"]["hub"]["repo-id"]
VERSION = CONFIG["general"]["version"]
CUDA_VERSION = CONFIG["general"]["cuda"]["minver"]
OWN_PACKAGES = ("flash_attn4", "fa4_kernels")

EMULATE_CUDA_TORCH = f"""
import torch
torch.version.cuda = {CUDA_VERSION!r}
assert not torch.cuda.is_available()
"""

REPORT = """
import importlib, json, sys
def report(module):
    has_kernels_attr = hasattr(module, "fa4_kernels")
    kernels_pkg = importlib.import_module(module.__name__ + ".fa4_kernels")
    print("RESULT " + json.dumps({
        "name": module.__name__,
        "file": module.__file__,
        "funcs": [callable(getattr(module, f, None)) for f in ("flash_attn_func", "flash_attn_varlen_func")],
        "has_kernels_attr": has_kernels_attr,
        "kernels_file": kernels_pkg.__file__,
        "source_modules": sorted(m for m in sys.modules if m.split(".")[0] in %r),
    }))
""" % (OWN_PACKAGES,)


def run_python(code: str, cwd: Path, env: dict[str, str], emulate_cuda: bool = True) -> subprocess.CompletedProcess:
    clean = {
        k: v
        for k, v in os.environ.items()
        if k != "PYTHONPATH" and not k.startswith("HF_") and k not in ("LOCAL_KERNELS", "KERNELS_CACHE")
    }
    clean.update({"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", **env})
    prelude = EMULATE_CUDA_TORCH if emulate_cuda else ""
    source = prelude + REPORT + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", source], cwd=cwd, env=clean, capture_output=True, text=True)


def result_of(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stderr
    [line] = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):])


def assert_loaded_from(result: dict, variant: Path) -> None:
    assert result["funcs"] == [True, True], "flash_attn_func / flash_attn_varlen_func missing or not callable"
    assert result["has_kernels_attr"], "the module does not expose fa4_kernels"
    assert Path(result["file"]).resolve().is_relative_to(variant.resolve())
    assert Path(result["kernels_file"]).resolve().is_relative_to(variant.resolve())
    assert result["name"] not in OWN_PACKAGES, "kernels loads the module under a unique name"
    assert result["source_modules"] == [], "something imported the module by its absolute name"


@pytest.fixture
def work(tmp_path) -> Path:
    folder = tmp_path / "cwd"
    folder.mkdir()
    return folder


@pytest.fixture
def hub_cache(tmp_path, hub_build) -> tuple[Path, str]:
    """An HF cache holding the kernel as `get_kernel` leaves it: branch v<VERSION> -> a snapshot."""
    cache = tmp_path / "hf-cache"
    org, name = REPO_ID.split("/")
    repo_dir = cache / f"kernels--{org}--{name}"
    commit = hashlib.sha1(b"flash-attn4 offline test snapshot").hexdigest()  # any 40-hex commit id
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / f"v{VERSION}").write_text(commit)
    shutil.copytree(hub_build / "build", repo_dir / "snapshots" / commit / "build")
    return cache, commit


def _cache_env(cache: Path) -> dict[str, str]:
    return {"HF_HUB_CACHE": str(cache), "HF_HOME": str(cache.parent / "hf-home")}


def test_get_kernel_by_version_from_the_offline_cache(hub_cache, work):
    cache, commit = hub_cache
    done = run_python(
        f"""
        from kernels import get_kernel, get_loaded_kernels
        module = get_kernel({REPO_ID!r}, version={VERSION}, trust_remote_code=True)
        report(module)
        [loaded] = get_loaded_kernels()
        assert loaded.module is module
        assert loaded.repo_info is None or loaded.repo_info.revision == {commit!r}
        """,
        work,
        _cache_env(cache),
    )
    variant = cache / f"kernels--{REPO_ID.replace('/', '--')}" / "snapshots" / commit / "build" / "torch-cuda"
    assert_loaded_from(result_of(done), variant)


def test_cpu_torch_gets_no_cuda_variant(hub_cache, work):
    # Without the emulation kernels refuses, naming the variant and the reason: this is why the
    # other loads emulate a CUDA build of torch.
    cache, _ = hub_cache
    done = run_python(
        f"""
        from kernels import get_kernel
        get_kernel({REPO_ID!r}, version={VERSION}, trust_remote_code=True)
        """,
        work,
        _cache_env(cache),
        emulate_cuda=False,
    )
    assert done.returncode != 0
    assert "FileNotFoundError" in done.stderr
    assert "torch-cuda" in done.stderr and "cpu" in done.stderr


def test_get_kernel_with_an_unknown_version_fails_with_kernels_error(hub_cache, work):
    cache, _ = hub_cache
    done = run_python(
        f"""
        from kernels import get_kernel
        get_kernel({REPO_ID!r}, version={VERSION + 1}, trust_remote_code=True)
        """,
        work,
        _cache_env(cache),
    )
    assert done.returncode != 0
    assert f"ValueError: Version {VERSION + 1} not found, available versions: {VERSION}" in done.stderr


def test_local_kernels_override_loads_the_build_folder(hub_build, work, tmp_path):
    # LOCAL_KERNELS maps the repo id to a folder holding build/<variant>/ (e.g. a checkout after
    # `make build`); the HF cache is empty, so nothing else could satisfy the load.
    env = _cache_env(tmp_path / "empty-cache")
    env["LOCAL_KERNELS"] = f"{REPO_ID}={hub_build}"
    done = run_python(
        f"""
        from kernels import get_kernel
        report(get_kernel({REPO_ID!r}, version={VERSION}))
        """,
        work,
        env,
    )
    assert_loaded_from(result_of(done), hub_build / "build" / "torch-cuda")


def test_get_local_kernel_loads_the_build_folder(hub_build, work, tmp_path):
    done = run_python(
        f"""
        from pathlib import Path
        from kernels import get_local_kernel
        report(get_local_kernel(Path({str(hub_build)!r})))
        """,
        work,
        _cache_env(tmp_path / "empty-cache"),
    )
    assert_loaded_from(result_of(done), hub_build / "build" / "torch-cuda")


def test_load_kernel_from_a_lockfile(hub_cache, work, tmp_path):
    # `kernels lock` needs the Hub (publisher trust check, branch list, file listing), which this
    # machine cannot reach. The lock file is therefore written the way `kernels lock` writes it: the
    # project's [tool.kernels.dependencies] read as kernels' CLI reads them, each version resolved to
    # the commit of its v<N> branch (here: the seeded cache's refs/v<N>, i.e. what the Hub answered
    # when the kernel was downloaded), serialized with kernels' own KernelLocks.to_json.
    cache, commit = hub_cache
    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text(
        f'[project]\nname = "uses-fa4"\nversion = "0.1"\n\n[tool.kernels.dependencies]\n"{REPO_ID}" = {VERSION}\n'
    )
    done = run_python(
        f"""
        import tomllib
        from pathlib import Path
        from huggingface_hub import constants
        from huggingface_hub.file_download import repo_folder_name
        from kernels import load_kernel
        from kernels._rust import KernelDependency, KernelLock, KernelLocks, KernelVersion

        project = Path({str(project)!r})
        deps = tomllib.loads((project / "pyproject.toml").read_text())["tool"]["kernels"]["dependencies"]
        locks = {{}}
        for repo_id, version in deps.items():
            refs = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="kernel") / "refs"
            commit = (refs / f"v{{version}}").read_text().strip()
            locks[KernelDependency(repo_id=repo_id, version=KernelVersion.Version(version))] = KernelLock(commit=commit)
        (project / "kernels.lock").write_text(KernelLocks(locks=locks).to_json())

        module = load_kernel({REPO_ID!r}, lockfile=project / "kernels.lock")
        report(module)
        """,
        work,
        _cache_env(cache),
    )
    variant = cache / f"kernels--{REPO_ID.replace('/', '--')}" / "snapshots" / commit / "build" / "torch-cuda"
    assert_loaded_from(result_of(done), variant)
    [entry] = json.loads((project / "kernels.lock").read_text())
    assert entry["dependency"] == {"repo-id": REPO_ID, "version": VERSION}
    assert entry["lock"]["commit"] == commit


def test_loading_the_hub_module_registers_fa4_with_transformers(hub_cache, work):
    # The README's transformers usage: with transformers imported first, get_kernel makes
    # attn_implementation="fa4" work, served by the functions of the module that was loaded (not by
    # some other copy of flash_attn4).
    cache, _ = hub_cache
    done = run_python(
        f"""
        from transformers import AttentionInterface, AttentionMaskInterface
        from kernels import get_kernel
        module = get_kernel({REPO_ID!r}, version={VERSION}, trust_remote_code=True)
        report(module)
        attention = AttentionInterface._global_mapping.get("fa4")
        mask = AttentionMaskInterface._global_mapping.get("fa4")
        print("REGISTERED " + json.dumps({{
            "attention": getattr(attention, "__module__", None),
            "mask": getattr(mask, "__module__", None),
            "package": module.__name__,
        }}))
        """,
        work,
        _cache_env(cache),
    )
    result_of(done)
    [line] = [line for line in done.stdout.splitlines() if line.startswith("REGISTERED ")]
    registered = json.loads(line[len("REGISTERED "):])
    assert registered["attention"] is not None, 'loading the module did not register attn_implementation="fa4"'
    assert registered["mask"] is not None, 'loading the module did not register a mask function for "fa4"'
    assert registered["attention"].split(".")[0] == registered["package"]
    assert registered["mask"].split(".")[0] == registered["package"]
