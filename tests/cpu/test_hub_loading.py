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
import re
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


# A fake Hub for the project-lock flow: HfApi's network methods answered from a folder laid out as
# the Hub repository (remote/<commit>/build/...), downloads written into the HF cache the way
# huggingface_hub writes them. Everything else in `kernels lock` / `kernels download` is the real
# code; HF_HUB_OFFLINE=1 stays set, so any network call this fake does not answer fails the test.
FAKE_HUB = """
import json, os, shutil
from fnmatch import fnmatch
from pathlib import Path
from types import SimpleNamespace
from huggingface_hub import HfApi, constants
from huggingface_hub.file_download import repo_folder_name
from huggingface_hub.hf_api import GitRefInfo, GitRefs, RepoFolder

REMOTE = Path(os.environ["FAKE_HUB_REMOTE"])
BRANCHES = json.loads(os.environ["FAKE_HUB_BRANCHES"])
TRUSTED = json.loads(os.environ["FAKE_HUB_TRUSTED_ORGS"])
CALLS = Path(os.environ["FAKE_HUB_CALLS"])

def _log(name, **kw):
    with CALLS.open("a") as f:
        f.write(json.dumps({"call": name, **{k: str(v) for k, v in kw.items()}}) + "\\n")

def _snapshot(repo_id, revision, cache_dir):
    repo = Path(cache_dir or constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="kernel")
    return repo / "snapshots" / revision

def get_organization_overview(self, organization, *a, **kw):
    _log("get_organization_overview", organization=organization)
    return SimpleNamespace(name=organization, trustedKernelPublisher=organization in TRUSTED)

def list_repo_refs(self, repo_id, *a, **kw):
    _log("list_repo_refs", repo_id=repo_id)
    branches = [GitRefInfo(name=b, ref=f"refs/heads/{b}", target_commit=c) for b, c in BRANCHES.items()]
    return GitRefs(branches=branches, converts=[], tags=[])

def list_repo_tree(self, repo_id, path_in_repo=None, *, revision=None, **kw):
    _log("list_repo_tree", repo_id=repo_id, path=path_in_repo, revision=revision)
    folder = REMOTE / revision / (path_in_repo or "")
    return [RepoFolder(path=str(e.relative_to(REMOTE / revision)), oid=revision) for e in folder.iterdir() if e.is_dir()]

def hf_hub_download(self, repo_id, filename, *, revision=None, cache_dir=None, **kw):
    _log("hf_hub_download", repo_id=repo_id, filename=filename, revision=revision)
    target = _snapshot(repo_id, revision, cache_dir) / filename
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(REMOTE / revision / filename, target)
    return str(target)

def snapshot_download(self, repo_id, *, revision=None, cache_dir=None, allow_patterns=None, **kw):
    _log("snapshot_download", repo_id=repo_id, revision=revision, allow=allow_patterns)
    root = REMOTE / revision
    for path in root.rglob("*"):
        rel = str(path.relative_to(root))
        if path.is_file() and any(fnmatch(rel, p) for p in allow_patterns or ["*"]):
            target = _snapshot(repo_id, revision, cache_dir) / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
    return str(_snapshot(repo_id, revision, cache_dir))

for _name in ("get_organization_overview", "list_repo_refs", "list_repo_tree", "hf_hub_download", "snapshot_download"):
    setattr(HfApi, _name, globals()[_name])
"""

KERNELS_CLI = """
import sys
from kernels.cli import main
sys.argv = ["kernels", *{argv!r}]
main()
"""


@pytest.fixture
def fake_hub(tmp_path, hub_build) -> dict:
    """The Hub repository REPO_ID as the Hub holds it: branch v<VERSION> -> commit -> build/."""
    commit = hashlib.sha1(b"flash-attn4 fake hub commit").hexdigest()
    remote = tmp_path / "remote"
    shutil.copytree(hub_build / "build", remote / commit / "build")
    project = tmp_path / "project"
    project.mkdir()
    # The README's project-lock section, as a user's pyproject.toml.
    (project / "pyproject.toml").write_text(
        f'[project]\nname = "uses-fa4"\nversion = "0.1"\n\n[tool.kernels.dependencies]\n"{REPO_ID}" = {VERSION}\n'
    )
    return {"commit": commit, "remote": remote, "project": project, "cache": tmp_path / "empty-hf-cache",
            "calls": tmp_path / "hub-calls.jsonl"}


def _hub_env(hub: dict, trusted_orgs: list[str]) -> dict[str, str]:
    return {
        **_cache_env(hub["cache"]),
        "FAKE_HUB_REMOTE": str(hub["remote"]),
        "FAKE_HUB_BRANCHES": json.dumps({f"v{VERSION}": hub["commit"]}),
        "FAKE_HUB_TRUSTED_ORGS": json.dumps(trusted_orgs),
        "FAKE_HUB_CALLS": str(hub["calls"]),
    }


def _kernels_cli(hub: dict, trusted_orgs: list[str], *argv: str, prefix: str = "") -> subprocess.CompletedProcess:
    code = FAKE_HUB + textwrap.dedent(prefix) + KERNELS_CLI.format(argv=list(argv))
    return run_python(code, hub["project"], _hub_env(hub, trusted_orgs), emulate_cuda=True)


def _hub_calls(hub: dict) -> list[str]:
    return [json.loads(line)["call"] for line in hub["calls"].read_text().splitlines()]


def _readme_lock_workaround() -> str:
    """The README's Python lines that run `kernels lock .` with REPO_ID trusted by the user."""
    readme = (REPO_ROOT / "README.md").read_text()
    [block] = re.findall(r"```python\n(# lock_trusting_repo\.py.*?)```", readme, re.S)
    return block


def _load_locked_kernel(hub: dict) -> dict:
    # The user's program after `kernels download .`: the real Hub is not faked here, and load_kernel
    # must not need it (HF_HUB_OFFLINE=1 makes any network call fail).
    done = run_python(
        f"""
        from pathlib import Path
        from kernels import load_kernel
        module = load_kernel({REPO_ID!r}, lockfile=Path("kernels.lock"))
        report(module)
        """,
        hub["project"],
        _cache_env(hub["cache"]),
    )
    return result_of(done)


def _assert_lock_names_the_branch_commit(hub: dict) -> None:
    [entry] = json.loads((hub["project"] / "kernels.lock").read_text())
    assert entry["dependency"] == {"repo-id": REPO_ID, "version": VERSION}
    assert entry["lock"]["commit"] == hub["commit"]


def test_project_lock_flow_with_a_trusted_publisher(fake_hub):
    # The README's commands verbatim: `kernels lock .`, `kernels download .`, then load_kernel.
    org = REPO_ID.split("/")[0]
    locked = _kernels_cli(fake_hub, [org], "lock", ".")
    assert locked.returncode == 0, locked.stderr
    _assert_lock_names_the_branch_commit(fake_hub)
    assert _hub_calls(fake_hub)[0] == "get_organization_overview", "kernels lock checks the publisher first"

    downloaded = _kernels_cli(fake_hub, [org], "download", ".")
    assert downloaded.returncode == 0, downloaded.stderr
    assert "snapshot_download" in _hub_calls(fake_hub)

    variant = fake_hub["cache"] / f"kernels--{REPO_ID.replace('/', '--')}" / "snapshots" / fake_hub["commit"]
    assert_loaded_from(_load_locked_kernel(fake_hub), variant / "build" / "torch-cuda")


def test_kernels_lock_refuses_an_untrusted_publisher(fake_hub):
    # kernels 0.17.2 `lock` has no trust option: an org without the Hub's trusted-kernel-publisher
    # status is refused, and no lock file is written.
    done = _kernels_cli(fake_hub, [], "lock", ".")
    assert done.returncode != 0
    assert f"Kernel repository '{REPO_ID}' is not from a trusted publisher" in done.stderr
    assert not (fake_hub["project"] / "kernels.lock").exists()


def test_readme_lock_workaround_trusts_exactly_the_named_repo(fake_hub):
    # The README's workaround for an untrusted org: the same `kernels lock .`, with REPO_ID (and only
    # it) on kernels' own trust allowlist. The org stays untrusted on the fake Hub.
    script = _readme_lock_workaround()
    assert f'"{REPO_ID}"' in script
    done = run_python(FAKE_HUB + script, fake_hub["project"], _hub_env(fake_hub, []))
    assert done.returncode == 0, done.stderr
    _assert_lock_names_the_branch_commit(fake_hub)
    assert "get_organization_overview" not in _hub_calls(fake_hub), "the named repo needs no publisher check"

    downloaded = _kernels_cli(fake_hub, [], "download", ".")
    assert downloaded.returncode == 0, downloaded.stderr
    variant = fake_hub["cache"] / f"kernels--{REPO_ID.replace('/', '--')}" / "snapshots" / fake_hub["commit"]
    assert_loaded_from(_load_locked_kernel(fake_hub), variant / "build" / "torch-cuda")

    # Another repository is still checked: the workaround widens trust by one name only.
    other = script.replace(f'"{REPO_ID}"', '"someone-else/other-kernel"', 1)
    (fake_hub["project"] / "kernels.lock").unlink()
    refused = run_python(FAKE_HUB + other, fake_hub["project"], _hub_env(fake_hub, []))
    assert refused.returncode != 0
    assert "is not from a trusted publisher" in refused.stderr


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
