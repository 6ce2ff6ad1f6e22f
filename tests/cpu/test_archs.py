"""The per-arch registry (fa4_kernels/arch.py: KERNELS): what shared code may assume about an arch,
how it refuses one without kernels, and that nothing outside an arch's package reaches into it."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flash_attn4.fa4_kernels import arch as arch_mod
from flash_attn4.fa4_kernels import tiles
from flash_attn4.fa4_kernels.arch import KERNELS, Arch
from flash_attn4.fa4_kernels.config import BackwardConfig, ForwardConfig, PostprocessConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = REPO_ROOT / "torch-ext" / "flash_attn4"
# Sub-packages of fa4_kernels that belong to one architecture.
ARCH_PACKAGES = {"sm90", "sm100"}


@pytest.fixture
def without_kernels(monkeypatch) -> list[Arch]:
    """The targets without kernels, to check how they are refused. Every target has kernels now, so
    one (sm_103a) is taken out of the registry for the test; a loop over none would check nothing."""
    missing = [arch for arch in Arch if arch not in KERNELS]
    if not missing:
        monkeypatch.delitem(KERNELS, Arch.SM103)
        missing = [Arch.SM103]
    return missing


def test_implemented_is_derived_from_the_registry():
    for arch in (Arch.SM90, Arch.SM100, Arch.SM103):  # every target trains (its backward reaches users)
        assert arch_mod.IMPLEMENTED[arch] == ("forward", "backward"), arch
    for arch in Arch:
        assert arch_mod.IMPLEMENTED[arch] == (KERNELS[arch].kernels if arch in KERNELS else ())


@pytest.mark.parametrize("kernel", ["forward", "backward"])
def test_registry_refuses_an_arch_without_kernels_naming_it_and_what_exists(kernel, without_kernels):
    for arch in without_kernels:
        with pytest.raises(NotImplementedError) as info:
            arch_mod.kernels_for(arch, kernel)
        msg = str(info.value)
        assert arch.value in msg and f"no {kernel} kernel" in msg
        assert "sm_90a: forward, backward" in msg  # what exists


def test_shared_tile_lookup_refuses_an_arch_without_rules(without_kernels):
    for arch in without_kernels:
        with pytest.raises(NotImplementedError, match=arch.value):
            tiles.forward_tiles(arch, 128, 128, False, False)
        with pytest.raises(NotImplementedError, match=arch.value):
            tiles.forward_schedule(arch, 128, 128, False, 1)
        with pytest.raises(NotImplementedError, match=arch.value):
            tiles.backward_tiles(arch, 128, 128, False, False, False)


def test_shared_lookup_returns_the_arch_rules():
    from flash_attn4.fa4_kernels.sm90 import tiles as sm90_tiles

    assert tiles.forward_tiles(Arch.SM90, 64, 64, True, False) == sm90_tiles.forward_tiles(64, 64, True, False)
    assert tiles.forward_schedule(Arch.SM90, 128, 128, True, 4) == sm90_tiles.forward_schedule(128, 128, True, 4)
    assert (tiles.backward_tiles(Arch.SM90, 128, 128, False, False, False)
            == sm90_tiles.backward_tiles(128, 128, False, False, False))


def test_a_rules_module_without_a_rule_is_named(monkeypatch):
    """An arch entry whose tiles.py lacks backward_tiles (a forward-only arch) says so."""
    entry = arch_mod.ArchKernels("sm90", forward="fwd:FlashAttentionForwardSm90", backward="bwd:X")
    monkeypatch.setitem(KERNELS, Arch.SM100, entry)
    rules = type("Rules", (), {})()
    monkeypatch.setattr(arch_mod.ArchKernels, "rules", lambda self: rules)
    with pytest.raises(NotImplementedError, match="sm_100a has no backward_tiles rule"):
        tiles.backward_tiles(Arch.SM100, 128, 128, False, False, False)


def test_tile_rules_are_the_arch_not_the_shared_config(without_kernels):
    """The Hopper tile rules run for sm90 configs only: the shared configs take any tiles for an
    arch whose rules do not forbid them (compile then refuses an arch without kernels)."""
    with pytest.raises(ValueError, match="sm90 backward tiles"):
        BackwardConfig(arch=Arch.SM90, dtype="bfloat16", head_dim=128, head_dim_v=128, tile_m=96)
    with pytest.raises(ValueError, match="query blocks"):
        PostprocessConfig(arch=Arch.SM90, dtype="bfloat16", head_dim=128, tile_m=96)
    with pytest.raises(ValueError, match="pack_gqa must divide 64"):
        ForwardConfig(arch=Arch.SM90, dtype="bfloat16", head_dim=128, head_dim_v=128, pack_gqa=3)
    for arch in without_kernels:
        assert BackwardConfig(arch=arch, dtype="bfloat16", head_dim=128, head_dim_v=128, tile_m=96).tile_m == 96
        assert PostprocessConfig(arch=arch, dtype="bfloat16", head_dim=128, tile_m=96).tile_m == 96
        assert ForwardConfig(arch=arch, dtype="bfloat16", head_dim=128, head_dim_v=128, pack_gqa=3).pack_gqa == 3
    with pytest.raises(ValueError, match="pack_gqa must be >= 1"):
        ForwardConfig(arch=Arch.SM100, dtype="bfloat16", head_dim=128, head_dim_v=128, pack_gqa=0)


def test_compile_refuses_an_arch_without_kernels(without_kernels):
    compile_mod = pytest.importorskip("flash_attn4.fa4_kernels.compile")
    for arch in without_kernels:
        assert compile_mod.kernel_set(arch) == [] and compile_mod.backward_kernel_set(arch) == []
        with pytest.raises(NotImplementedError, match=arch.value):
            compile_mod.compile_forward(ForwardConfig(arch=arch, dtype="bfloat16", head_dim=128, head_dim_v=128))
        with pytest.raises(NotImplementedError, match=arch.value):
            compile_mod.compile_backward(BackwardConfig(arch=arch, dtype="bfloat16", head_dim=128, head_dim_v=128))


def test_compile_main_is_an_error_for_an_arch_without_kernels(capsys, without_kernels):
    compile_mod = pytest.importorskip("flash_attn4.fa4_kernels.compile")
    for arch in without_kernels:
        assert compile_mod.main(["--arch", arch.value]) != 0
        err = capsys.readouterr().err
        assert f"no kernels for {arch.value}" in err and "sm_90a" in err
    assert compile_mod.main(["--arch", "sm_80"]) != 0
    assert "unknown arch 'sm_80'" in capsys.readouterr().err


def _run_compile_module(module: str, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT / "torch-ext"), str(REPO_ROOT)]))
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True)


def test_compile_module_runs_from_any_directory(tmp_path):
    """`python -m flash_attn4.fa4_kernels.compile` (what the Makefile runs) works outside the
    repository; `python -m fa4_kernels.compile` from its root. --list names the set, compiling nothing."""
    for module, cwd in (("flash_attn4.fa4_kernels.compile", tmp_path), ("fa4_kernels.compile", REPO_ROOT)):
        done = _run_compile_module(module, cwd, "--arch", "sm_90a", "--list")
        assert done.returncode == 0, done.stderr[-3000:]
        lines = done.stdout.splitlines()
        assert len(lines) > 20 and lines[0].startswith("fwd bfloat16 d=128/128"), done.stdout
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert "-m flash_attn4.fa4_kernels.compile" in makefile


def _imports(path: Path) -> list[tuple[int, str]]:
    """(relative level, dotted module) of every import in a file, 'from . import x' as module 'x'."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(0, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.module:
                found.append((node.level, node.module))
            else:
                found += [(node.level, alias.name) for alias in node.names]
    return found


def test_shared_modules_import_no_arch_package():
    """Outside fa4_kernels/<arch>/, nothing imports an arch's modules: the torch layer and the shared
    kernels reach them only through the registry (arch.py), by name."""
    kernels_dir = PACKAGE / "fa4_kernels"
    shared = [p for p in PACKAGE.rglob("*.py")
              if "__pycache__" not in p.parts and not ARCH_PACKAGES & set(p.relative_to(kernels_dir).parts[:1]
                                                                          if p.is_relative_to(kernels_dir) else ())]
    assert (PACKAGE / "ops.py") in shared and (kernels_dir / "compile.py") in shared
    offenders = [(p.relative_to(PACKAGE).as_posix(), level, module) for p in shared
                 for level, module in _imports(p) if ARCH_PACKAGES & set(module.split("."))]
    assert offenders == []
    # ... and names no arch in code: no `Arch.SM90` branches (the registry table aside).
    for p in shared:
        if p == kernels_dir / "arch.py":
            continue
        tree = ast.parse(p.read_text())
        attrs = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                 and n.value.id == "Arch"]
        assert not set(attrs) & {a.name for a in Arch}, (p, attrs)
