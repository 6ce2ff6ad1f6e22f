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
from flash_attn4.fa4_kernels.config import SplitKVConfig
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
    """The check's split-KV problem (the pipeline: the split kernel and its combine) and its seqused_q
    problem (rows past seqused_q unspecified) pass with the real kernels; the caller's result is right."""
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
    forward = cfgs[0].forward if isinstance(cfgs[0], SplitKVConfig) else cfgs[0]
    assert isinstance(cfgs[0], SplitKVConfig) == forward.split_kv == name.startswith("split")
    assert forward.has_seqused_q == name.startswith("padded")
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


# ---- the backward ----

BACKWARD_CASES = {
    # name: (shapes (b, sq, sk, hq, hk, d, dv) or varlen, flash_attn options)
    "d64 sink": ((2, 257, 300, 6, 2, 64, 64), dict()),
    "d128 causal": ((2, 257, 300, 4, 4, 128, 128), dict(causal=True)),
    "d128 local softcap deterministic": ((2, 257, 300, 4, 2, 128, 128),
                                         dict(window_size=(64, 16), softcap=3.0, deterministic=True)),
    "d256 causal (split head dim)": ((2, 257, 300, 2, 1, 256, 256), dict(causal=True)),
    "varlen seqused_k causal deterministic": ("varlen", dict(causal=True, deterministic=True)),
}


def backward_verdicts():
    from flash_attn4.fa4_kernels.config import BackwardConfig

    return {key[1]: verdict for key, verdict in selfcheck._verdicts.items() if isinstance(key[1], BackwardConfig)}


def run_backward_case(name):
    """A user's forward and backward of a named case; returns (leaves, dout, reference kwargs)."""
    shapes, opts = BACKWARD_CASES[name]
    opts = dict(opts)
    if shapes == "varlen":
        q, k, v, cu_q, cu_k = varlen_inputs(4, 2, 128)
        used = torch.tensor([300, 0, 61], dtype=torch.int32, device=DEVICE)
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        ref_kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=used, causal=opts["causal"])
        out = flash_attn_varlen_func(*leaves, seqused_k=used, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **opts)
    else:
        b, sq, sk, hq, hk, d, dv = shapes
        leaves = [t.requires_grad_() for t in (rand(b, sq, hq, d), rand(b, sk, hk, d), rand(b, sk, hk, dv))]
        if name.endswith("sink"):
            leaves.append(torch.randn(hq, device=DEVICE).requires_grad_())
            opts["learnable_sink"] = leaves[3]
        out = flash_attn_func(*leaves[:3], **opts)
        ref_kw = {key: val for key, val in opts.items() if key != "deterministic"}
    dout = torch.randn_like(out)
    out.backward(dout)
    return leaves, dout, ref_kw


@pytest.mark.parametrize("name", list(BACKWARD_CASES))
def test_real_sm90_backward_configurations_pass(name):
    """Forced on, the backward's check runs the real preprocessing, main kernel and postprocessing on
    its problem and passes; the configuration is checked once; the caller's gradients are right."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    leaves, dout, ref_kw = run_backward_case(name)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    verdicts = backward_verdicts()
    assert list(verdicts.values()) == ["passed"], verdicts
    (cfg,) = verdicts
    report = selfcheck.report(cfg, leaves[0].device)
    assert report.ok and all(err <= allowed for err, allowed in report.grads.values()), report.failures
    print(f"\n[selfcheck] backward {name}: first forward + backward with both checks {first * 1e3:.1f} ms; the "
          f"backward's check {report.total_s * 1e3:.1f} ms (problem {report.build_s * 1e3:.1f} ms, references "
          f"{report.reference_s * 1e3:.1f} ms, comparison {report.compare_s * 1e3:.1f} ms); {report.summary()}; "
          f"{report.problem}")
    reports = len(selfcheck._reports)
    run_backward_case(name)  # a second use of the same configurations: no second check
    assert len(selfcheck._reports) == reports
    # the caller's gradients, against float32 autograd of the reference (the suite's rule)
    grads = [t.grad for t in leaves]
    q, k, v = (t.detach() for t in leaves[:3])
    sink = leaves[3].detach() if len(leaves) > 3 else None
    # Each leaf its own tensor: sink is float32, so sink.float() would be sink itself, a leaf the
    # bf16 reference's backward below (through sink.clone()) would add its gradient into.
    ref_leaves = [t.float().requires_grad_() for t in (q, k, v)] + ([sink.clone().requires_grad_()] if sink is not None
                                                                   else [])
    kw = {key: val for key, val in ref_kw.items() if key != "learnable_sink"}
    out_ref, _ = attention_ref(*ref_leaves[:3], learnable_sink=ref_leaves[3] if sink is not None else None, **kw)
    out_ref.backward(dout.float())
    pt_leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([sink.clone().requires_grad_()]
                                                                   if sink is not None else [])
    out_pt, _ = attention_ref(*pt_leaves[:3], learnable_sink=pt_leaves[3] if sink is not None else None,
                              upcast=False, **kw)
    out_pt.backward(dout)
    for got, r, pt, gname in zip(grads, ref_leaves, pt_leaves, ("dq", "dk", "dv", "dsink")):
        atol = 2 * max_abs_diff(r.grad.to(got.dtype).float(), r.grad) + 1e-4 * float(r.grad.abs().max()) + 1e-5
        if gname == "dsink":  # rowsum(dO * O) with O in bf16, as in tests/gpu/test_bwd.py's dsink_rounding
            weight = ((dout.float() * out_ref.detach()) ** 2).sum(-1).transpose(1, 2)
            _, lse = attention_ref(q.float(), k.float(), v.float(), learnable_sink=sink.float(), **kw)
            per_head = (torch.exp(sink.float()[None, :, None] - lse) ** 2 * weight).sum((0, 2))
            atol += 6 * float(per_head.max().sqrt()) * torch.finfo(q.dtype).eps / (2 * 3 ** 0.5)
        assert_close_fa_rule(got, r.grad, pt.grad, atol=atol, name=gname)


class WrongBackward:
    """A real compiled backward kernel whose dK is spoiled after it ran, or that writes nothing."""

    def __init__(self, kernel, how):
        self.kernel, self.how = kernel, how

    def __call__(self, q, k, v, dout, lse_log2, dpsum, dq_accum, dk, dv, *rest):
        if self.how != "nothing written":
            self.kernel(q, k, v, dout, lse_log2, dpsum, dq_accum, dk, dv, *rest)
        if self.how == "dK scaled":
            dk.mul_(1.05)


@pytest.mark.parametrize("how", ["dK scaled", "nothing written"])
def test_wrong_backward_kernel_raises_naming_the_gpu(monkeypatch, how):
    real = compile_cache.get_backward_kernel
    wrapped = {}
    monkeypatch.setattr(compile_cache, "get_backward_kernel",
                        lambda cfg: wrapped.setdefault(cfg, WrongBackward(real(cfg), how)))
    q, k, v = (rand(2, 100, 4, 128).requires_grad_() for _ in range(3))
    out = flash_attn_func(q, k, v)  # the forward's check passes
    with pytest.raises(selfcheck.SelfCheckError) as info:
        out.backward(torch.randn_like(out))
    message = str(info.value)
    print(f"\n[selfcheck] backward {how}:\n{message}")
    assert torch.cuda.get_device_name() in message and "compute capability 9.0" in message
    assert "BackwardConfig(arch=sm_90a, dtype=bfloat16, head_dim=128" in message
    assert "FLASH_ATTN4_SELF_CHECK=0" in message and selfcheck.ISSUE_TRACKER in message
    assert q.grad is None and k.grad is None and v.grad is None
    with pytest.raises(selfcheck.SelfCheckError):  # and again, without a relaunch
        flash_attn_func(q, k, v).backward(torch.ones_like(out))


def test_backward_check_is_off_on_sm90_by_default(monkeypatch):
    monkeypatch.delenv(settings.SELF_CHECK)
    selfcheck.clear()
    q, k, v = (rand(1, 64, 2, 64).requires_grad_() for _ in range(3))
    flash_attn_func(q, k, v, causal=True).backward(torch.randn(1, 64, 2, 64, device=DEVICE, dtype=q.dtype))
    assert list(backward_verdicts().values()) == ["not required"] and not selfcheck._reports
