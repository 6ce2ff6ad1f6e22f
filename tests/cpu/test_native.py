"""native.py: which DSL runtime library a shared-library kernel is loaded against (the DSL's own rule,
applied without importing it), and linking errors that say what to do. Loading real kernels this way
is tested in test_aot.py (and on the GPU by tests/gpu/test_cold_start.py)."""

from pathlib import Path

import pytest

from flash_attn4 import native


def _fake_wheel(tmp_path: Path, flavours) -> Path:
    """An nvidia_cutlass_dsl tree with cu{N}/lib runtimes and a cutlass package to find."""
    root = tmp_path / "site" / "nvidia_cutlass_dsl"
    package = root / "dsl_packages" / "cutlass"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise AssertionError('cutlass imported')\n")
    for n in flavours:
        (root / f"cu{n}" / "lib").mkdir(parents=True)
        (root / f"cu{n}" / "lib" / native.RUNTIME_LIBRARY).write_bytes(b"\x7fELF")
    (root / "cu11" / "lib").mkdir(parents=True)  # a folder without the library is not a flavour
    return root


@pytest.fixture
def fake_wheel(tmp_path, monkeypatch):
    root = _fake_wheel(tmp_path, (12, 13))
    monkeypatch.syspath_prepend(str(root / "dsl_packages"))
    monkeypatch.delitem(__import__("sys").modules, "cutlass", raising=False)
    monkeypatch.delenv("CUTE_DSL_LIBS", raising=False)
    return root


@pytest.mark.parametrize("driver,flavour", [(12090, 12), (12000, 12), (13000, 13), (13040, 13), (14010, 13)])
def test_newest_flavour_the_driver_supports(fake_wheel, driver, flavour):
    assert native.runtime_library(driver) == fake_wheel / f"cu{flavour}" / "lib" / native.RUNTIME_LIBRARY


def test_no_flavour_for_an_old_driver(fake_wheel):
    with pytest.raises(native.NativeLoadError, match=r"no DSL runtime for a CUDA 11 driver \(installed: cu13, cu12\)"):
        native.runtime_library(11080)


def test_cute_dsl_libs_overrides_like_the_dsl(fake_wheel, tmp_path, monkeypatch):
    own = tmp_path / "mine" / native.RUNTIME_LIBRARY
    own.parent.mkdir()
    own.write_bytes(b"\x7fELF")
    monkeypatch.setenv("CUTE_DSL_LIBS", f"/nowhere/libother.so:{own}")
    assert native.runtime_library(12090) == own


def test_the_installed_wheel_is_found():
    lib = native.runtime_library(99000)
    assert lib.is_file() and lib.parent.parent.parent.name == "nvidia_cutlass_dsl"


def test_link_errors_name_the_compiler_and_the_fix(tmp_path, monkeypatch):
    bad = tmp_path / "k.o"
    bad.write_bytes(b"not an object file")
    with pytest.raises(native.NativeLoadError, match=r"-shared failed on .*k\.o"):
        native.link(bad, tmp_path / "k.so")
    monkeypatch.setenv("CC", "")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(native.NativeLoadError, match="install gcc, or set CC"):
        native.link(bad, tmp_path / "k.so")
