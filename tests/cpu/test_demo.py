"""scripts/demo.py's load step: the route line it prints reads as information where falling back to an
import by path is expected (a torch without CUDA), and as a warning only where kernels failed on a
CUDA torch. Uses the session's Hub build."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.conftest import REPO_ROOT

pytest.importorskip("kernels", reason="the kernels package (dev extra) is not installed")


def _demo():
    spec = importlib.util.spec_from_file_location("fa4_demo_under_test", REPO_ROOT / "scripts" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def variant(hub_build):
    return hub_build / "build" / "torch-cuda"


def test_fallback_under_a_torch_without_cuda_is_not_reported_as_an_error(variant, monkeypatch):
    import kernels

    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(kernels, "get_local_kernel", lambda *a, **k: pytest.fail("kernels must not be asked"))
    module, route = _demo().load(variant)
    assert callable(module.flash_attn_func)
    assert "has no CUDA" in route and torch.__version__ in route
    assert not any(word in route.lower() for word in ("refused", "error", "warning", "failed"))


def test_a_kernels_failure_on_a_cuda_torch_is_a_warning_with_the_reason(variant, monkeypatch):
    import kernels

    def refuse(*args, **kwargs):
        raise FileNotFoundError("first line\nno variant for this system")

    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(kernels, "get_local_kernel", refuse)
    module, route = _demo().load(variant)
    assert callable(module.flash_attn_func)
    assert "warning: kernels could not load the build (FileNotFoundError: no variant for this system)" in route
