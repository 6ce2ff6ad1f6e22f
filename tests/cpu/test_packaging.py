"""The Hub packaging: build.toml, the tree `make build` writes, and the pip package.

The built tree is checked against what kernels 0.17.2 itself reads (its build.toml parser, metadata
parser, digest and dependency allow-list), not against copies of its rules.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

# kernels is a dev extra; the GPU machine runs `pytest tests -m gpu` without it, and collection must
# not fail there.
kernels = pytest.importorskip("kernels", reason="the kernels package (dev extra) is not installed")
from kernels._rust import Backend, Build, Digest, DigestAlgorithm, Metadata  # noqa: E402
from kernels.archs import _supports_cuda_capability  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG = tomllib.loads((REPO_ROOT / "build.toml").read_text())
MODULE = CONFIG["general"]["name"].replace("-", "_")
# Packages the shipped code must never import by absolute name: the module itself and its kernels
# (the Hub loads the module under a unique name; an absolute import would pick up another copy or
# fail), and the upstream projects this one is written independently of.
FORBIDDEN_IMPORTS = {MODULE, "fa4_kernels", "flash_attn", "quack"}


def _load_build_hub():
    spec = importlib.util.spec_from_file_location("build_hub", REPO_ROOT / "scripts" / "build_hub.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build_hub = _load_build_hub()


def _source_files(module_dir: Path) -> dict[str, Path]:
    """Python files of the module as the source tree shows them (symlinks followed, no bytecode)."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(module_dir, followlinks=True):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for name in filenames:
            if name.endswith((".py", ".pyi")):
                path = Path(dirpath) / name
                found[path.relative_to(module_dir).as_posix()] = path
    return found


def _public_names(source: str) -> set[str]:
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return {n for n in names if not n.startswith("_")}


def _absolute_imports(path: Path) -> list[str]:
    """Top-level packages that `path` imports by absolute name (import statements and import_module calls)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(node.module)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                if not node.args[0].value.startswith("."):
                    found.append(node.args[0].value)
    return found


@pytest.fixture(scope="module")
def variant(hub_build) -> Path:
    return hub_build / "build" / "torch-cuda"


# --- build.toml ------------------------------------------------------------------------------------


def test_build_toml_is_accepted_by_kernels_parser():
    build = Build.open(REPO_ROOT)  # kernels' own (Rust) build.toml parser; raises on schema errors
    assert build.general.backends == [Backend.CUDA]
    general = CONFIG["general"]
    assert general["name"] == "flash-attn4"
    assert general["version"] == 1
    assert general["edition"] == 5
    assert general["license"] == "BSD-3-Clause"
    assert general["cuda"]["minver"] == "12.8"
    assert "nvidia-cutlass-dsl" in general["cuda"]["python-depends"]
    org, name = general["hub"]["repo-id"].split("/")
    assert org and name == "flash-attn4"
    assert CONFIG["torch-noarch"]["cuda_capabilities"] == ["9.0a", "10.0f"]


def test_python_depends_are_allowed_by_kernels_and_installed_by_pip():
    allowed = json.loads((Path(kernels.__file__).parent / "python_depends.json").read_text())
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    from packaging.requirements import Requirement

    pip_deps = {Requirement(d).name for d in pyproject["project"]["dependencies"]}
    general = CONFIG["general"]
    declared = [(d, allowed["general"]) for d in general.get("python-depends", [])]
    declared += [(d, {**allowed["general"], **allowed["backends"]["cuda"]}) for d in general["cuda"]["python-depends"]]
    for dep, table in declared:
        assert dep in table, f"kernels refuses to load a kernel depending on {dep!r}"
        for package in table[dep]["python"]:
            assert package["pkg"] in pip_deps, f"{package['pkg']} (for {dep}) missing from pyproject dependencies"


def test_declared_capabilities_are_exactly_the_dispatched_ones():
    # What kernels' arch check accepts (from metadata) must agree with the capabilities that
    # fa4_kernels maps to a kernel family.
    from fa4_kernels.arch import Arch

    capabilities = CONFIG["torch-noarch"]["cuda_capabilities"]
    for cap in [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (10, 3), (11, 0), (12, 0), (12, 1)]:
        assert _supports_cuda_capability(capabilities, cap) == (Arch.for_capability(*cap) is not None), cap


# --- the built tree --------------------------------------------------------------------------------


def test_build_writes_one_cuda_variant(hub_build):
    assert sorted(p.name for p in (hub_build / "build").iterdir()) == ["torch-cuda"]


def test_tree_is_the_module_flat_with_its_kernels_inside(variant, tmp_path):
    source = _source_files(REPO_ROOT / "torch-ext" / MODULE)
    shipped = {p.relative_to(variant).as_posix() for p in variant.rglob("*") if p.is_file()}
    assert shipped == set(source) | {"_ops.py", "metadata.json"}
    assert {"__init__.py", "fa4_kernels/__init__.py", "fa4_kernels/arch.py", "fa4_kernels/config.py"} <= shipped
    assert not [p for p in variant.rglob("*") if p.is_symlink()]
    assert not [p for p in variant.rglob("*") if p.name == "__pycache__" or p.suffix == ".pyc"]

    # Contents are copies of the source. Compared on a build made just now: the session's build may
    # predate an edit to the working tree.
    [fresh] = build_hub.build(REPO_ROOT, tmp_path / "build", "0000000")
    for rel, path in source.items():
        if rel != "_ops.py":
            assert (fresh / rel).read_bytes() == path.read_bytes(), rel


def test_shipped_code_has_no_absolute_self_or_upstream_imports(variant):
    offenders = {}
    for path in sorted(variant.rglob("*.py")):
        bad = [name for name in _absolute_imports(path) if name.split(".")[0] in FORBIDDEN_IMPORTS]
        if bad:
            offenders[path.relative_to(variant).as_posix()] = bad
    assert not offenders


def test_metadata_is_read_by_kernels(variant):
    general = CONFIG["general"]
    metadata = Metadata.read_from_file(variant / "metadata.json")
    assert str(metadata.name) == general["name"]
    assert metadata.version == general["version"]
    assert metadata.license == general["license"]
    assert metadata.python_depends == general.get("python-depends", []) + general["cuda"]["python-depends"]
    assert metadata.kernel_depends == []
    assert metadata.backend.backend_type == Backend.CUDA
    assert metadata.backend.archs == CONFIG["torch-noarch"]["cuda_capabilities"]
    # The digest lists every shipped file but metadata.json and agrees with kernels' own hashing.
    shipped = {p.relative_to(variant).as_posix() for p in variant.rglob("*") if p.is_file()}
    assert set(metadata.digest.files) == shipped - {"metadata.json"}
    metadata.digest.validate(Digest.hash_variant(DigestAlgorithm.SHA256, variant))


def _git_revision_id() -> str | None:
    """HEAD's tree id, first 7 hex digits (kernel-builder's unique id: the tree, not the commit), with
    "_dirty" when tracked files have changes; None without a commit."""
    commit = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD^{tree}"], capture_output=True, text=True)
    if commit.returncode != 0:
        return None
    status = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True, text=True, check=True,
    )
    return commit.stdout.strip()[:7] + ("_dirty" if status.stdout.strip() else "")


def test_ops_namespace_is_the_git_tree_id(tmp_path):
    # Built here rather than taken from the session's build: in a shared checkout a commit can land
    # in between. Git is read before and after, and the build retried if the two disagree.
    for attempt in range(3):
        before = _git_revision_id()
        if before is None:
            pytest.skip("the source tree is not a git checkout with a commit")
        [variant] = build_hub.build(REPO_ROOT, tmp_path / f"build{attempt}")
        if _git_revision_id() == before:
            break
    metadata = json.loads((variant / "metadata.json").read_text())
    assert metadata["id"] == f"_{MODULE}_cuda_{before}"


def test_generated_ops_py_replaces_the_dev_namespace(variant, monkeypatch):
    import torch

    built = (variant / "_ops.py").read_text()
    dev = REPO_ROOT / "torch-ext" / MODULE / "_ops.py"
    if dev.exists():
        assert _public_names(dev.read_text()) <= _public_names(built), "the build drops names the dev _ops.py has"
    assert {"ops", "add_op_namespace_prefix"} <= _public_names(built)

    # Under a CUDA build of torch the namespace is the metadata id (emulated: torch here is a CPU build).
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    spec = importlib.util.spec_from_file_location("_fa4_ops_under_test", variant / "_ops.py")
    ops_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ops_module)
    ops_id = json.loads((variant / "metadata.json").read_text())["id"]
    assert ops_module._OPS_NAME == ops_id
    assert ops_module.add_op_namespace_prefix("fwd") == f"{ops_id}::fwd"
    assert ops_module.ops is getattr(torch.ops, ops_id)


def test_built_module_imports_under_a_unique_name(variant, tmp_path):
    # As kernels loads it: the package under an arbitrary name, with no source tree on sys.path.
    script = f"""
import importlib, importlib.util, json, sys
spec = importlib.util.spec_from_file_location("_fa4_unique_name_test", {str(variant / "__init__.py")!r})
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
kernels_pkg = importlib.import_module(spec.name + ".fa4_kernels")
print(json.dumps({{
    "funcs": [callable(getattr(module, f, None)) for f in ("flash_attn_func", "flash_attn_varlen_func")],
    "kernels_file": kernels_pkg.__file__,
    "leaked": sorted(m for m in sys.modules if m.split(".")[0] in {sorted(FORBIDDEN_IMPORTS)!r}),
}}))
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["funcs"] == [True, True]
    assert Path(result["kernels_file"]).is_relative_to(variant)
    assert result["leaked"] == []


def test_the_same_build_imported_twice_gets_two_op_namespaces(variant, tmp_path):
    # A Hub download and a LOCAL_KERNELS copy of one build (or one folder imported by path under two
    # names) share the generated namespace; the second import must not fail on torch.library's
    # "registered multiple times" and must run its own ops.
    script = f"""
import importlib.util, json, sys, torch
def load(name):
    spec = importlib.util.spec_from_file_location(name, {str(variant / "__init__.py")!r})
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return sys.modules[name + ".ops"]
first, second = load("_fa4_first_copy"), load("_fa4_second_copy")
names = ("fwd", "bwd", "combine", "fwd_kvcache")
print(json.dumps({{
    "namespaces": [first._NAMESPACE, second._NAMESPACE],
    "own_ops": [getattr(m, n) is getattr(getattr(torch.ops, m._NAMESPACE), n).default
                for m in (first, second) for n in names],
}}))
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    first, second = result["namespaces"]
    assert second == first + "_2"
    assert all(result["own_ops"])


# --- scripts/build_hub.py on a made-up kernel ------------------------------------------------------


def _toy_kernel(root: Path) -> Path:
    root.mkdir()
    (root / "build.toml").write_text(
        '[general]\nname = "toy-kernel"\nversion = 3\nedition = 5\nlicense = "MIT"\nbackends = ["cuda"]\n'
        '[general.cuda]\npython-depends = ["nvidia-cutlass-dsl"]\n'
        '[torch-noarch]\ncuda_capabilities = ["9.0a"]\n'
    )
    module = root / "torch-ext" / "toy_kernel"
    module.mkdir(parents=True)
    (module / "__init__.py").write_text("from .lib.impl import f\n")
    (module / "_ops.py").write_text("ops = None  # dev namespace\n")
    (module / "notes.txt").write_text("not python: kernel-builder's source filter drops it\n")
    lib = root / "lib"
    (lib / "__pycache__").mkdir(parents=True)
    (lib / "__init__.py").write_text("")
    (lib / "impl.py").write_text("def f():\n    return 1\n")
    (lib / "impl.pyi").write_text("def f() -> int: ...\n")
    (lib / "__pycache__" / "impl.cpython-311.pyc").write_bytes(b"bytecode")
    (module / "lib").symlink_to("../../lib")
    return root


def test_build_script_dereferences_symlinks_and_filters_files(tmp_path):
    root = _toy_kernel(tmp_path / "src")
    [variant] = build_hub.build(root, tmp_path / "out", "abc1234")
    assert variant == tmp_path / "out" / "torch-cuda"
    files = {p.relative_to(variant).as_posix() for p in variant.rglob("*") if p.is_file()}
    assert files == {"__init__.py", "_ops.py", "metadata.json", "lib/__init__.py", "lib/impl.py", "lib/impl.pyi"}
    assert not (variant / "lib").is_symlink()
    ops_py = (variant / "_ops.py").read_text()
    assert '_KERNEL = "toy_kernel"' in ops_py and '_BUILD_ID = "abc1234"' in ops_py
    metadata = Metadata.read_from_file(variant / "metadata.json")
    assert metadata.id == "_toy_kernel_cuda_abc1234"
    assert metadata.version == 3 and metadata.license == "MIT"
    assert metadata.backend.archs == ["9.0a"]
    metadata.digest.validate(Digest.hash_variant(DigestAlgorithm.SHA256, variant))

    # A rebuild replaces the variant: files gone from the source are gone from the build.
    (root / "lib" / "impl.pyi").unlink()
    build_hub.build(root, tmp_path / "out", "abc1234")
    assert not (variant / "lib" / "impl.pyi").exists()


def test_build_script_refuses_a_dangling_symlink(tmp_path):
    root = _toy_kernel(tmp_path / "src")
    shutil.rmtree(root / "lib")
    with pytest.raises(build_hub.BuildError, match="dangling symlink"):
        build_hub.build(root, tmp_path / "out", "abc1234")


def test_unique_id_outside_git_is_random(tmp_path):
    env_free = tmp_path / "not-a-repo"
    env_free.mkdir()
    ids = {build_hub.unique_id(env_free) for _ in range(3)}
    assert len(ids) == 3
    assert all(i.isalnum() and i.islower() for i in ids)


# --- the pip package -------------------------------------------------------------------------------


@pytest.mark.slow
def test_wheel_ships_the_kernels_inside_the_package(tmp_path):
    # Build from a copy so that setuptools' own build/ does not mix with the Hub build/.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE", "fa4_kernels", "torch-ext"):
        path = REPO_ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy(path, src / name)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"), str(src)],
        capture_output=True, text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    [wheel] = (tmp_path / "dist").glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for rel in _source_files(REPO_ROOT / "torch-ext" / MODULE):
        assert f"{MODULE}/{rel}" in names
    assert not [n for n in names if n.startswith("fa4_kernels/")], "fa4_kernels must ship inside the package only"


# --- dependencies ------------------------------------------------------------------------------------

PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())


def _requirement(name: str, group: str | None = None):
    from packaging.requirements import Requirement

    lines = PYPROJECT["project"]["optional-dependencies"][group] if group else PYPROJECT["project"]["dependencies"]
    [found] = [Requirement(line) for line in lines if Requirement(line).name == name]
    return found


def test_dsl_is_pinned_to_one_version_with_both_toolkit_flavours():
    import importlib.metadata

    dsl = _requirement("nvidia-cutlass-dsl")
    [spec] = dsl.specifier
    assert spec.operator == "==", "the kernels are validated against one DSL version: pin it exactly"
    assert importlib.metadata.version("nvidia-cutlass-dsl") == spec.version
    # cu13 beside the default cu12: the DSL picks the flavour by the driver at import (README).
    assert dsl.extras == {"cu13"}
    assert any('extra == "cu13"' in r for r in importlib.metadata.requires("nvidia-cutlass-dsl")), (
        "this DSL version has no cu13 extra any more"
    )


def _upper_and_lower(specifier) -> tuple[str | None, str | None]:
    lower = [s.version for s in specifier if s.operator == ">="]
    upper = [s.version for s in specifier if s.operator == "<"]
    assert len(lower) == len(upper) == 1 and len(specifier) == 2, f"{specifier}: want one >= and one <"
    return lower[0], upper[0]


def test_tvm_ffi_range_admits_the_installed_version_and_excludes_the_next_minor():
    import importlib.metadata

    from packaging.version import Version

    spec = _requirement("apache-tvm-ffi").specifier
    lower, upper = _upper_and_lower(spec)
    assert importlib.metadata.version("apache-tvm-ffi") in spec
    assert Version(upper) <= Version("0.2"), "a new tvm-ffi minor may change the ABI"
    assert Version(lower) >= Version("0.1.15.post2"), "nothing older than the validated version"


def test_nvdisasm_range_sits_inside_the_dsls_own_bounds():
    import importlib.metadata

    from packaging.requirements import Requirement
    from packaging.version import Version

    ours = _requirement("nvidia-cuda-nvdisasm", "dev").specifier
    assert importlib.metadata.version("nvidia-cuda-nvdisasm") in ours
    [dsl] = [
        Requirement(r) for r in importlib.metadata.requires("nvidia-cutlass-dsl-libs-base")
        if Requirement(r).name == "nvidia-cuda-nvdisasm"
    ]
    lower, upper = _upper_and_lower(ours)
    dsl_lower, dsl_upper = _upper_and_lower(dsl.specifier)
    assert Version(lower) >= Version(dsl_lower) and Version(upper) <= Version(dsl_upper)


# --- the tree kernel-builder would write ---------------------------------------------------------------
# kernel-builder (huggingface/kernels, kernel-builder/src/pyproject/, torch noarch) writes _ops.py into
# torch-ext/<module>/, then copies every file of that folder (bytecode excepted, directory symlinks
# not followed) into build/torch-<backend>/ for each backend of build.toml, and metadata-<backend>.json
# to build/torch-<backend>/metadata.json; `kernel-builder hash` then adds the digest.
# Metadata keys: kernels-data/src/metadata.rs. Differences that remain: docs/DEVELOPMENT.md.
KERNEL_BUILDER_METADATA_REQUIRED = {"name", "id", "version", "license", "python-depends", "kernel-depends", "backend"}
KERNEL_BUILDER_METADATA_OPTIONAL = {"upstream", "source", "digest", "provenance"}


def _kernel_builder_noarch_files(module_dir: Path) -> set[str]:
    files = set()
    for dirpath, dirnames, filenames in os.walk(module_dir):  # like Path.rglob: no directory symlinks
        dirnames[:] = [d for d in dirnames if d != "__pycache__" and not (Path(dirpath) / d).is_symlink()]
        files |= {(Path(dirpath) / f).relative_to(module_dir).as_posix() for f in filenames if not f.endswith(".pyc")}
    return files | {"_ops.py", "metadata.json"}


def test_variants_are_kernel_builders_one_per_backend(hub_build):
    expected = {f"torch-{backend}" for backend in CONFIG["general"]["backends"]}
    assert {p.name for p in (hub_build / "build").iterdir()} == expected


def test_file_list_is_kernel_builders_noarch_copy(variant):
    shipped = {p.relative_to(variant).as_posix() for p in variant.rglob("*") if p.is_file()}
    assert shipped == _kernel_builder_noarch_files(REPO_ROOT / "torch-ext" / MODULE)


def test_metadata_keys_are_kernel_builders(variant):
    metadata = json.loads((variant / "metadata.json").read_text())
    assert KERNEL_BUILDER_METADATA_REQUIRED <= set(metadata)
    assert set(metadata) <= KERNEL_BUILDER_METADATA_REQUIRED | KERNEL_BUILDER_METADATA_OPTIONAL
    assert set(metadata["backend"]) == {"type", "archs"}
    assert metadata["backend"]["type"] == variant.name.removeprefix("torch-")
    # kernel-builder's noarch archs are build.toml's cuda_capabilities as written; its id is
    # _<python name>_<backend>_<unique id>.
    assert metadata["backend"]["archs"] == CONFIG["torch-noarch"]["cuda_capabilities"]
    assert metadata["id"].startswith(f"_{MODULE}_{metadata['backend']['type']}_")
    assert metadata["name"] == CONFIG["general"]["name"]
