"""torch integration on a real GPU: torch.compile(fullgraph=True) (forward, and forward + backward), CUDA
graphs, streams, autograd without a switch, max_seqlen given as a 0-d tensor."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from flash_attn4 import compile_cache, flash_attn_func, flash_attn_varlen_func, ops
from tests.gpu.helpers import DEVICE, rand, seed_from_urandom
from tests.reference import attention_ref, assert_close_fa_rule

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def fresh_seed():
    seed_from_urandom()


def qkv(b=2, sq=257, sk=301, hq=8, hk=2, d=128):
    return rand(b, sq, hq, d), rand(b, sk, hk, d), rand(b, sk, hk, d)


def assert_matches_reference(out, q, k, v, **kw):
    out_ref, _ = attention_ref(q, k, v, upcast=True, **kw)
    out_pt, _ = attention_ref(q, k, v, upcast=False, **kw)
    assert_close_fa_rule(out, out_ref, out_pt, atol=1e-5)


# ---- torch.compile ----


def test_torch_compile_fullgraph_matches_eager():
    torch._dynamo.reset()

    def block(x, w_o, q, k, v):
        attn = flash_attn_func(q, k, v, causal=True)
        return x + attn.flatten(-2) @ w_o

    compiled = torch.compile(block, fullgraph=True)
    q, k, v = qkv()
    x = rand(2, 257, 64)
    w_o = rand(8 * 128, 64) * 0.02
    got = compiled(x, w_o, q, k, v)
    want = block(x, w_o, q, k, v)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_torch_compile_varlen_and_lse():
    torch._dynamo.reset()

    def attn(q, k, v, cu_q, cu_k):
        out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_seqlen_q=300, causal=True, return_lse=True)
        return out * 2, lse.exp()

    compiled = torch.compile(attn, fullgraph=True)
    cu = torch.tensor([0, 100, 100, 400], dtype=torch.int32, device=DEVICE)
    q, k, v = rand(400, 8, 64), rand(400, 2, 64), rand(400, 2, 64)
    (out_c, p_c), (out_e, p_e) = compiled(q, k, v, cu, cu), attn(q, k, v, cu, cu)
    assert torch.equal(out_c, out_e)  # same kernel, same inputs, exact *2: bitwise
    torch.testing.assert_close(p_c, p_e)  # exp may be lowered differently by inductor


def test_torch_compile_dynamic_lengths_no_recompile():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, causal=True), fullgraph=True,
                             backend=counter, dynamic=True)
    counts = []
    kernel_compiles = []
    for sq, sk in [(97, 131), (250, 390), (1111, 1203)]:
        q, k, v = qkv(b=3, sq=sq, sk=sk, hq=6, hk=2, d=128)
        torch.testing.assert_close(compiled(q, k, v), flash_attn_func(q, k, v, causal=True), atol=0, rtol=0)
        counts.append(counter.frame_count)
        kernel_compiles.append(compile_cache.stats()["compiled"])
    assert counts[1:] == [counts[0]] * 2, counts
    assert kernel_compiles[1:] == [kernel_compiles[0]] * 2, kernel_compiles


# ---- CUDA graphs and streams ----


def test_cuda_graph_capture_and_replay():
    q, k, v = qkv()
    static = [t.clone() for t in (q, k, v)]
    flash_attn_func(*static, causal=True)  # compile and warm up outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        flash_attn_func(*static, causal=True)
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = flash_attn_func(*static, causal=True)

    for _ in range(2):  # new data into the captured buffers, replay, compare with eager
        fresh = qkv()
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        eager = flash_attn_func(*fresh, causal=True)
        assert torch.equal(static_out, eager)
        assert_matches_reference(static_out, *fresh, causal=True)


def test_cuda_graph_varlen_default_max_seqlen():
    """max_seqlen_q=None during capture must not sync: the op uses total_q as a bound."""
    cu = torch.tensor([0, 37, 37, 300], dtype=torch.int32, device=DEVICE)
    q, k, v = rand(300, 4, 64), rand(300, 4, 64), rand(300, 4, 64)
    flash_attn_varlen_func(q, k, v, cu, cu, causal=True)  # warm up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_varlen_func(q, k, v, cu, cu, causal=True)
    graph.replay()
    torch.cuda.synchronize()
    assert_matches_reference(out, q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)


def test_runs_on_the_current_stream():
    """Launched on a side stream that first waits on a long GPU job writing q: a kernel on the wrong stream
    would read q before it is ready."""
    q0, k, v = qkv(b=1, sq=512, sk=512)
    q = torch.zeros_like(q0)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # ~tens of ms of spinning on the side stream
        q.copy_(q0)
        out = flash_attn_func(q, k, v)
    side.synchronize()
    assert torch.equal(out, flash_attn_func(q0, k, v))


def test_torch_compile_reduce_overhead():
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, causal=True), mode="reduce-overhead",
                       fullgraph=True)
    q, k, v = qkv()
    for _ in range(3):  # warm-up runs, then CUDA-graph replays
        got = fn(q, k, v).clone()
    assert torch.equal(got, flash_attn_func(q, k, v, causal=True))


# ---- autograd ----


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@pytest.mark.backward
def test_backward_runs_and_forward_matches_inference():
    """Training works out of the box; the forward with requires_grad inputs gives the same output as
    without autograd."""
    q, k, v = (t.requires_grad_() for t in qkv(b=1, sq=64, sk=64))
    out = flash_attn_func(q, k, v, causal=True)
    assert out.requires_grad and not torch.isnan(out).any()
    out.float().square().sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and t.grad.shape == t.shape and torch.isfinite(t.grad).all()
    with torch.inference_mode():
        assert torch.equal(flash_attn_func(q, k, v, causal=True), out.detach())


@pytest.mark.backward
def test_torch_compile_fullgraph_backward_matches_eager():
    """A compiled attention block (fused QKV projection -> flash_attn_func -> output projection -> loss),
    fullgraph, then .backward(): AOTAutograd traces the op's backward. Every gradient must match eager
    (same kernels; inductor may fuse and round the surrounding ops differently) and the attention inputs' gradients
    must satisfy the FA rule against the float32 reference."""
    torch._dynamo.reset()
    b, s, dm, hq, hk, d = 2, 257, 256, 8, 2, 128

    def block(x, w_qkv, w_o):
        qkv_ = (x @ w_qkv).view(b, s, hq + 2 * hk, d)
        q, k, v = qkv_.split([hq, hk, hk], dim=2)
        attn = flash_attn_func(q, k, v, causal=True)
        y = x + attn.flatten(-2) @ w_o
        return y.float().square().mean()

    x0, w_qkv0, w_o0 = rand(b, s, dm), rand(dm, (hq + 2 * hk) * d) * dm ** -0.5, rand(hq * d, dm) * 0.02
    compiled = torch.compile(block, fullgraph=True)
    results = {}
    for name, fn in (("compiled", compiled), ("eager", block)):
        x, w_qkv, w_o = (t.detach().clone().requires_grad_() for t in (x0, w_qkv0, w_o0))
        loss = fn(x, w_qkv, w_o)
        loss.backward()
        results[name] = (loss.detach(), {"x": x.grad, "w_qkv": w_qkv.grad, "w_o": w_o.grad})
    (loss_c, grads_c), (loss_e, grads_e) = results["compiled"], results["eager"]
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-3, atol=0)
    for name in grads_e:
        assert grads_c[name] is not None and torch.isfinite(grads_c[name]).all(), name
        assert _rel_l2(grads_c[name], grads_e[name]) < 2e-2, (name, _rel_l2(grads_c[name], grads_e[name]))

    # the attention part alone, compiled, against the reference
    torch._dynamo.reset()
    q0, k0, v0 = qkv(b=2, sq=257, sk=301, hq=8, hk=2)
    dout = rand(*q0.shape)
    attn_c = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, causal=True), fullgraph=True)
    q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
    attn_c(q, k, v).backward(dout)
    qe, ke, ve = (t.clone().requires_grad_() for t in (q0, k0, v0))
    flash_attn_func(qe, ke, ve, causal=True).backward(dout)
    refs = {}
    for upcast in (True, False):
        qr, kr, vr = (t.detach().clone().float().requires_grad_() if upcast else t.detach().clone().requires_grad_()
                      for t in (q0, k0, v0))
        out_r, _ = attention_ref(qr, kr, vr, causal=True, upcast=upcast)
        out_r.backward(dout.float() if upcast else dout)
        refs[upcast] = (qr.grad, kr.grad, vr.grad)
    for i, name in enumerate(("dq", "dk", "dv")):
        got, eager = (q, k, v)[i].grad, (qe, ke, ve)[i].grad
        torch.testing.assert_close(got, eager, rtol=1e-2, atol=1e-3 * eager.abs().max().item())
        want = refs[True][i]
        atol = 2 * (want.to(got.dtype).float() - want).abs().max().item() + 1e-5
        assert_close_fa_rule(got, want, refs[False][i], atol=atol, name=name)


@pytest.mark.backward
def test_torch_compile_fullgraph_varlen_backward_matches_eager():
    torch._dynamo.reset()
    cu = torch.tensor([0, 100, 100, 400], dtype=torch.int32, device=DEVICE)
    q0, k0, v0 = rand(400, 8, 64), rand(400, 2, 64), rand(400, 2, 64)
    w = torch.randn(400, 8, 64, device=DEVICE)

    def loss_fn(q, k, v):
        out = flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen_q=300, causal=True)
        return (out.float() * w).sum()

    compiled = torch.compile(loss_fn, fullgraph=True)
    grads = {}
    for name, fn in (("compiled", compiled), ("eager", loss_fn)):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        fn(q, k, v).backward()
        grads[name] = (q.grad, k.grad, v.grad)
    for got, eager in zip(grads["compiled"], grads["eager"]):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, eager, rtol=1e-2, atol=1e-3 * eager.abs().max().item())


# ---- max_seqlen as a 0-d tensor ----


def test_max_seqlen_tensor_no_recompile():
    d = 128
    flash_attn_varlen_func(rand(8, 4, d), rand(8, 2, d), rand(8, 2, d),
                           torch.tensor([0, 8], dtype=torch.int32, device=DEVICE),
                           torch.tensor([0, 8], dtype=torch.int32, device=DEVICE), max_seqlen_q=8, causal=True)
    before = compile_cache.stats()
    for lens in ([5, 90, 33], [300, 1], [17]):
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
        total = int(cu[-1])
        q, k, v = rand(total, 4, d), rand(total, 2, d), rand(total, 2, d)
        max_len = torch.tensor(max(lens), device=DEVICE)  # 0-d CUDA tensor, as transformers passes it
        out = flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen_q=max_len, max_seqlen_k=max_len, causal=True)
        assert_matches_reference(out, q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    after = compile_cache.stats()
    assert after["compiled"] == before["compiled"] and after["disk_hits"] == before["disk_hits"], (before, after)


def test_poison_hook_is_off_by_default():
    assert ops._poison_outputs_for_tests is False


# ---- the kernel cache on disk ----

_CACHE_CHILD = """
import json, sys
import torch
from flash_attn4 import compile_cache, flash_attn_func
torch.manual_seed(int(sys.argv[1]))
q, k, v = (torch.randn(2, 333, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
torch.save(flash_attn_func(q, k, v, causal=True).cpu(), sys.argv[2])
print(json.dumps(compile_cache.stats()))
"""


def test_disk_cache_entry_runs_like_an_in_memory_compile(tmp_path, repo_root):
    """A new kernel is compiled without a JIT engine, written and run from its entry; a second process
    loads that entry. Both must compute exactly what a compile with the disk cache off computes."""
    seed = str(int.from_bytes(os.urandom(4), "little"))
    path = [str(repo_root / "torch-ext"), str(repo_root), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, FLASH_ATTN4_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=os.pathsep.join(path))
    env.pop("FLASH_ATTN4_DISABLE_DISK_CACHE", None)

    def child(name: str):
        out = tmp_path / f"{name}.pt"
        done = subprocess.run([sys.executable, "-c", _CACHE_CHILD, seed, str(out)], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return torch.load(out), json.loads(done.stdout.strip().splitlines()[-1])

    compiled, compiled_stats = child("compiles")
    loaded, loaded_stats = child("loads")
    env["FLASH_ATTN4_DISABLE_DISK_CACHE"] = "1"
    in_memory, in_memory_stats = child("in_memory")
    assert compiled_stats["compiled"] == 1 and compiled_stats["disk_writes"] == 1, compiled_stats
    assert compiled_stats["disk_errors"] == 0, compiled_stats
    assert loaded_stats["compiled"] == 0 and loaded_stats["disk_hits"] == 1, loaded_stats
    assert in_memory_stats["compiled"] == 1 and in_memory_stats["disk_writes"] == 0, in_memory_stats
    assert in_memory.abs().sum() > 0 and torch.isfinite(in_memory).all()
    assert torch.equal(compiled, in_memory) and torch.equal(loaded, in_memory)
