"""The first-use self-check (flash_attn4/selfcheck.py) with real kernels, forced on for sm90 with
FLASH_ATTN4_SELF_CHECK=1: real configurations pass it; a kernel made wrong after the fact (a row
off, nothing written) raises SelfCheckError naming the GPU; a first use inside CUDA graph capture
asks for a warm-up. Prints, per configuration, the check's wall time on its first call against a
plain first call (compile included) and a steady call (run with -s to see it).
"""

from __future__ import annotations

import time

import pytest
import torch

from flash_attn4 import compile_cache, flash_attn_func, flash_attn_varlen_func, selfcheck, settings
from tests.gpu.helpers import DEVICE, rand, seed_from_urandom
from tests.reference import assert_close_fa_rule, attention_ref, max_abs_diff

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def forced_on(monkeypatch):
    monkeypatch.setattr(selfcheck, "SEED", seed_from_urandom())  # the check's problem is fresh too
    monkeypatch.setenv(settings.SELF_CHECK, "1")
    selfcheck.clear()  # verdicts of earlier tests in this process would hide the check
    yield
    selfcheck.clear()


def varlen_inputs(hq, hk, d, lens_q=(200, 0, 77), lens_k=(333, 50, 61)):
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q = rand(int(cu_q[-1]), hq, d)
    k, v = rand(int(cu_k[-1]), hk, d), rand(int(cu_k[-1]), hk, d)
    return q, k, v, cu_q, cu_k


def case(name):
    """(call, reference kwargs, inputs) of a named configuration: a user call with its own sizes."""
    if name.startswith("varlen"):
        q, k, v, cu_q, cu_k = varlen_inputs(4, 2, 128)
        used = torch.tensor([300, 0, 61], dtype=torch.int32, device=DEVICE)
        kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=used, causal=name.endswith("causal"))
        return (lambda: flash_attn_varlen_func(q, k, v, return_lse=True, **kw)), kw, (q, k, v)
    hq, hk, d = {"d64": (4, 4, 64), "d128 causal": (4, 4, 128), "local": (4, 2, 128),
                 "softcap+sink": (6, 2, 64), "gqa pack 4": (8, 2, 128), "d256 causal": (2, 1, 256)}[name]
    q, k, v = rand(2, 257, hq, d), rand(2, 300, hk, d), rand(2, 300, hk, d)
    kw = {"d64": {}, "d128 causal": dict(causal=True), "local": dict(window_size=(64, 16)),
          "softcap+sink": dict(softcap=3.0, learnable_sink=torch.randn(hq, device=DEVICE)),
          "gqa pack 4": dict(causal=True), "d256 causal": dict(causal=True)}[name]
    return (lambda: flash_attn_func(q, k, v, return_lse=True, **kw)), kw, (q, k, v)


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return result, time.perf_counter() - t0


CASES = ["d64", "d128 causal", "varlen seqused_k", "varlen seqused_k causal", "local", "softcap+sink",
         "gqa pack 4", "d256 causal"]


@pytest.mark.parametrize("name", CASES)
def test_real_sm90_configurations_pass(monkeypatch, name):
    call, ref_kw, (q, k, v) = case(name)
    # a plain first call (compile or cache load, launch) with the check off
    monkeypatch.setenv(settings.SELF_CHECK, "0")
    _, plain_first = timed(call)
    _, steady = timed(call)
    # the same configuration's first use with the check forced on (the kernel is compiled already)
    monkeypatch.setenv(settings.SELF_CHECK, "1")
    selfcheck.clear()
    (out, lse), checked_first = timed(call)
    cfgs = [key[1] for key, verdict in selfcheck._verdicts.items() if verdict == "passed"]
    assert len(cfgs) == 1, selfcheck._verdicts
    report = selfcheck.report(cfgs[0], q.device)
    assert report.ok and report.out_err <= report.out_allowed and report.lse_err <= report.lse_allowed
    ms = lambda s: f"{s * 1e3:.1f} ms"  # noqa: E731
    print(f"\n[selfcheck] {name}: plain first call {ms(plain_first)} (compile or load, launch), steady "
          f"{ms(steady)}, first call with the check {ms(checked_first)}; the check {ms(report.total_s)} "
          f"(problem {ms(report.build_s)}, references queued {ms(report.reference_s)}, comparison "
          f"{ms(report.compare_s)}); {report.summary()}; {report.problem}")
    call()  # settled: no second check
    assert len(selfcheck._reports) == 1
    # and the caller's own result is right
    out_ref, lse_ref = attention_ref(q, k, v, **ref_kw)
    out_pt, _ = attention_ref(q, k, v, upcast=False, **ref_kw)
    assert_close_fa_rule(out, out_ref, out_pt, atol=2 * max_abs_diff(out_ref.to(q.dtype), out_ref) + 1e-6)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref))


def i32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("name", ["split-KV gqa causal", "padded batch seqused_q causal"])
def test_real_sm90_split_kv_and_seqused_q_configurations_pass(name):
    """The check's split-KV problem (float32 partials merged in float64) and its seqused_q problem
    (rows past seqused_q unspecified) pass with the real kernels; the caller's result is right."""
    with torch.no_grad():
        if name.startswith("split"):
            q, k, v = rand(2, 5, 8, 128), rand(2, 700, 2, 128), rand(2, 700, 2, 128)
            out = flash_attn_func(q, k, v, causal=True, num_splits=3)
            rows = [(b, 5, 700) for b in range(2)]
        else:
            q, k, v = rand(3, 9, 4, 128), rand(3, 300, 2, 128), rand(3, 300, 2, 128)
            used_q, used_k = [9, 1, 4], [300, 17, 128]
            out = flash_attn_varlen_func(q, k, v, None, None, seqused_q=i32(used_q), seqused_k=i32(used_k),
                                         causal=True)
            rows = list(zip(range(3), used_q, used_k))
    cfgs = [key[1] for key, verdict in selfcheck._verdicts.items() if verdict == "passed"]
    assert len(cfgs) == 1, selfcheck._verdicts
    assert cfgs[0].split_kv == name.startswith("split") and cfgs[0].has_seqused_q == name.startswith("padded")
    report = selfcheck.report(cfgs[0], q.device)
    assert report.ok and report.out_err <= report.out_allowed and report.lse_err <= report.lse_allowed
    print(f"\n[selfcheck] {name}: the check {report.total_s * 1e3:.1f} ms; {report.summary()}; {report.problem}")
    for b, nq, nk in rows:
        ref, _ = attention_ref(q[b:b + 1, :nq], k[b:b + 1, :nk], v[b:b + 1, :nk], causal=True)
        pt, _ = attention_ref(q[b:b + 1, :nq], k[b:b + 1, :nk], v[b:b + 1, :nk], causal=True, upcast=False)
        assert_close_fa_rule(out[b:b + 1, :nq], ref, pt, atol=2 * max_abs_diff(ref.to(q.dtype), ref) + 1e-6)


class Wrong:
    """A real compiled kernel whose output is spoiled after it ran."""

    def __init__(self, kernel, how):
        self.kernel, self.how = kernel, how

    def __call__(self, q, k, v, out, lse, *rest):
        if self.how != "nothing written":
            self.kernel(q, k, v, out, lse, *rest)
        if self.how == "one row off":
            out.view(-1, out.shape[-1])[-1] += 0.25  # the last row of the last head


@pytest.mark.parametrize("how", ["one row off", "nothing written"])
def test_wrong_kernel_raises_naming_the_gpu(monkeypatch, how):
    real = compile_cache.get_forward_kernel
    wrapped = {}
    monkeypatch.setattr(compile_cache, "get_forward_kernel",
                        lambda cfg: wrapped.setdefault(cfg, Wrong(real(cfg), how)))
    q, k, v = rand(2, 100, 4, 128), rand(2, 100, 4, 128), rand(2, 100, 4, 128)
    with pytest.raises(selfcheck.SelfCheckError) as info:
        flash_attn_func(q, k, v)
    message = str(info.value)
    print(f"\n[selfcheck] {how}:\n{message}")
    assert torch.cuda.get_device_name() in message and "compute capability 9.0" in message
    assert "ForwardConfig(arch=sm_90a, dtype=bfloat16, head_dim=128" in message
    assert "FLASH_ATTN4_SELF_CHECK=0" in message and selfcheck.ISSUE_TRACKER in message
    with pytest.raises(selfcheck.SelfCheckError):  # and again, without a relaunch
        flash_attn_func(q, k, v)


def test_first_use_inside_graph_capture_asks_for_a_warm_up(monkeypatch):
    q, k, v = rand(1, 64, 2, 64), rand(1, 64, 2, 64), rand(1, 64, 2, 64)
    monkeypatch.setenv(settings.SELF_CHECK, "0")
    flash_attn_func(q, k, v, causal=True)  # compiled (loading a module is not allowed during capture)
    monkeypatch.setenv(settings.SELF_CHECK, "1")
    selfcheck.clear()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="during CUDA graph capture"):
        with torch.cuda.graph(graph):
            flash_attn_func(q, k, v, causal=True)
    # the warm-up call checks it; then it can be captured and replayed
    expected = flash_attn_func(q, k, v, causal=True)
    assert [v_ for v_ in selfcheck._verdicts.values()] == ["passed"]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_func(q, k, v, causal=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
