"""The custom op, its fake implementation, torch.compile and autograd - on CPU.

What these tests prove and what they do not: the real kernel needs a GPU, so here the compile step is
replaced by a *torch stand-in* that implements the kernel call convention (ForwardConfig docstring) with
tests/reference.py, and CPU tensors are let through the device check. That exercises everything of the
torch layer around the kernel - validation, mask canonicalisation, the op schema, dispatch to a
ForwardConfig, the compile cache, the argument order of the kernel call, output allocation, the fake
implementation, torch.compile tracing and the autograd formula (with a torch stand-in for the
backward kernel). It says nothing about the kernel's numerics
(tests/gpu does that).
"""

from __future__ import annotations

import pytest
import torch

from flash_attn4 import compile_cache, dispatch, flash_attn_func, flash_attn_varlen_func, ops, validate
from flash_attn4._ops import add_op_namespace_prefix
from flash_attn4.fa4_kernels.arch import KERNELS, Arch
from flash_attn4.fa4_kernels.config import BackwardConfig
from tests.reference import _mask as reference_mask
from tests.reference import attention_ref, attention_used_into, random_cu_seqlens, unpage

BF16 = torch.bfloat16


def torch_kernel(cfg, calls):
    """A stand-in for compile_forward(cfg): same call convention, computed with the reference."""

    def run(q, k, v, out, lse, cu_q, cu_k, seqused_q, seqused_k, page_table, sink, softmax_scale, softcap,
            window_left, window_right, max_seqlen_q):
        calls.append(cfg)
        assert (seqused_q is not None) == cfg.has_seqused_q
        assert (page_table is not None) == (cfg.page_size > 0)
        if page_table is not None:  # the keys as a packed or padded batch, as the kernel reads them through the table
            assert cu_k is None and k.shape[1] == v.shape[1] == cfg.page_size and page_table.dtype == torch.int32
            k, v, cu_k = unpage(k, v, page_table, seqused_k, batched=not cfg.varlen)
        assert isinstance(softmax_scale, float) and isinstance(softcap, float)
        assert all(isinstance(x, int) for x in (window_left, window_right, max_seqlen_q))
        assert (cu_q is not None) == (cu_k is not None) == cfg.varlen
        assert (seqused_k is not None) == cfg.has_seqused_k
        assert (sink is not None) == cfg.has_sink
        assert sink is None or sink.dtype == torch.float32
        # A packing kernel takes the real heads (a padded group's dummy heads are only tile rows).
        assert cfg.pack_gqa == 1 or q.shape[-2] // k.shape[-2] == cfg.query_heads_per_group
        assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        assert out.is_contiguous() and lse.is_contiguous() and lse.dtype == torch.float32
        if cfg.varlen:
            assert max_seqlen_q >= int((cu_q[1:] - cu_q[:-1]).max())
        else:
            assert max_seqlen_q == q.shape[1]
        window = (window_left, window_right) if cfg.local else (-1, -1)
        opts = dict(softmax_scale=softmax_scale, causal=cfg.causal, window_size=window,
                    softcap=softcap if cfg.has_softcap else 0.0, learnable_sink=sink)
        if seqused_q is not None:  # rows past a sequence's used queries stay as they are
            attention_used_into(out, lse, q, k, v, seqused_q=seqused_q, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                seqused_k=seqused_k, **opts)
            return
        o, l = attention_ref(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=seqused_k, **opts)
        out.copy_(o)
        lse.copy_(l)

    return run


@pytest.fixture
def cpu_kernel(monkeypatch):
    """CPU tensors pass validation, dispatch says sm90, compiling yields the torch stand-in.
    Returns the list of configs the stand-in was called with."""
    calls = []
    monkeypatch.setattr(validate, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(dispatch, "arch_for_device", lambda device, kernel="forward": Arch.SM90)
    monkeypatch.setattr(compile_cache, "_compile_forward", lambda cfg, **_: torch_kernel(cfg, calls))
    monkeypatch.setenv("FLASH_ATTN4_DISABLE_DISK_CACHE", "1")
    compile_cache.clear()
    yield calls
    compile_cache.clear()


def rand_qkv(b, sq, sk, hq, hk, d, dv=None, dtype=BF16):
    dv = d if dv is None else dv
    return (torch.randn(b, sq, hq, d, dtype=dtype), torch.randn(b, sk, hk, d, dtype=dtype),
            torch.randn(b, sk, hk, dv, dtype=dtype))


def rand_varlen(batch, max_len, hq, hk, d, allow_zero=True):
    cu_q = random_cu_seqlens(batch, max_len, allow_zero=allow_zero)
    cu_k = random_cu_seqlens(batch, max_len, allow_zero=allow_zero)
    q = torch.randn(int(cu_q[-1]), hq, d, dtype=BF16)
    k = torch.randn(int(cu_k[-1]), hk, d, dtype=BF16)
    v = torch.randn(int(cu_k[-1]), hk, d, dtype=BF16)
    return q, k, v, cu_q, cu_k


def test_op_is_registered_in_the_build_namespace():
    name = add_op_namespace_prefix("fwd")
    ns, op = name.split("::")
    packet = getattr(getattr(torch.ops, ns), op)
    schema = packet.default._schema
    assert not any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    assert [r.type.kind() for r in schema.returns] == ["TensorType", "TensorType"]


# ---- fake implementation ----


def test_fake_shapes_batched_match_real(cpu_kernel):
    from torch._subclasses.fake_tensor import FakeTensorMode

    b, sq, sk, hq, hk, d, dv = 2, 17, 33, 6, 2, 64, 32
    with FakeTensorMode():
        q = torch.empty(b, sq, hq, d, dtype=BF16, device="cuda")
        k = torch.empty(b, sk, hk, d, dtype=BF16, device="cuda")
        v = torch.empty(b, sk, hk, dv, dtype=BF16, device="cuda")
        out_f, lse_f = flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert out_f.shape == (b, sq, hq, dv) and out_f.dtype == BF16 and out_f.device.type == "cuda"
    assert lse_f.shape == (b, hq, sq) and lse_f.dtype == torch.float32 and lse_f.device.type == "cuda"
    out, lse = flash_attn_func(*rand_qkv(b, sq, sk, hq, hk, d, dv), causal=True, return_lse=True)
    assert out.shape == out_f.shape and out.stride() == out_f.stride()
    assert lse.shape == lse_f.shape and lse.stride() == lse_f.stride()


def test_fake_shapes_varlen_match_real(cpu_kernel):
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v, cu_q, cu_k = rand_varlen(4, 20, 8, 1, 128)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, return_lse=True)
    with FakeTensorMode() as mode:
        fq, fk, fv, fcq, fck = (mode.from_tensor(t) for t in (q, k, v, cu_q, cu_k))
        out_f, lse_f = flash_attn_varlen_func(fq, fk, fv, fcq, fck, max_seqlen_q=20, return_lse=True)
    assert out_f.shape == out.shape == (q.shape[0], 8, 128) and out_f.stride() == out.stride()
    assert lse_f.shape == lse.shape == (8, q.shape[0]) and lse_f.dtype == torch.float32


def test_opcheck(cpu_kernel):
    """torch.library.opcheck: schema, fake vs real implementation, autograd registration, AOT dispatch."""
    q, k, v = rand_qkv(2, 9, 13, 4, 2, 64)
    sink = torch.randn(4)
    ns, name = add_op_namespace_prefix("fwd").split("::")
    op = getattr(getattr(torch.ops, ns), name)
    torch.library.opcheck(op, (q, k, v, None, None, None, sink, 0.125, 0.0, True, -1, 0, 9, 13, False))
    vq, vk, vv, cu_q, cu_k = rand_varlen(3, 12, 4, 2, 64, allow_zero=False)
    max_q = int((cu_q[1:] - cu_q[:-1]).max())
    torch.library.opcheck(op, (vq, vk, vv, cu_q, cu_k, None, None, 0.1, 5.0, False, 3, 2, max_q, -1, True))


def test_opcheck_bwd(cpu_backward):
    """The backward op: schema, fake vs real implementation (with the torch stand-in kernel)."""
    q, k, v = rand_qkv(2, 9, 13, 4, 2, 64)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    ns, name = add_op_namespace_prefix("bwd").split("::")
    op = getattr(getattr(torch.ops, ns), name)
    dout = torch.randn_like(out)
    torch.library.opcheck(op, (dout, q, k, v, out, lse, None, None, None, 0.125, 0.0, True, -1, 0, 9, 13, False),
                          test_utils=("test_schema", "test_faketensor"))


# ---- end to end through the public API with the stand-in ----


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (5, -1)), (False, (4, 2)),
                                           (False, (-1, 0))])
@pytest.mark.parametrize("sq,sk", [(7, 7), (5, 19), (19, 5)])
def test_public_api_matches_reference(cpu_kernel, causal, window, sq, sk):
    q, k, v = rand_qkv(2, sq, sk, 4, 2, 64)
    sink = torch.randn(4)
    out, lse = flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=3.0, learnable_sink=sink,
                               return_lse=True)
    ref, ref_lse = attention_ref(q, k, v, causal=causal, window_size=window, softcap=3.0, learnable_sink=sink)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)
    cfg = cpu_kernel[-1]
    assert cfg.causal == (causal and window[0] < 0 or window == (-1, 0))
    assert cfg.has_softcap and cfg.has_sink and not cfg.varlen


def test_varlen_matches_reference(cpu_kernel):
    q, k, v, cu_q, cu_k = rand_varlen(5, 16, 6, 3, 64)
    lens_k = cu_k[1:] - cu_k[:-1]
    used = (lens_k * torch.rand(5)).to(torch.int32)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, seqused_k=used, causal=True, return_lse=True)
    ref, ref_lse = attention_ref(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=used)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)
    assert cpu_kernel[-1].varlen and cpu_kernel[-1].has_seqused_k


def test_pack_gqa_must_match_the_head_ratio(cpu_kernel, monkeypatch):
    """A kernel packing g query heads per KV head runs only on inputs with exactly that ratio."""
    chosen = dispatch.forward_config
    monkeypatch.setattr(dispatch, "forward_config", lambda *a, **k: chosen(*a, **k).replace(pack_gqa=4))
    q, k, v = rand_qkv(2, 5, 9, 8, 2, 64)
    flash_attn_func(q, k, v)
    assert cpu_kernel[-1].pack_gqa == 4
    q, k, v = rand_qkv(2, 5, 9, 4, 2, 64)
    with pytest.raises(ValueError, match="packs 4 query heads per KV head .* but the inputs have 2"):
        flash_attn_func(q, k, v)


def test_returns_out_only_by_default(cpu_kernel):
    out = flash_attn_func(*rand_qkv(1, 3, 3, 2, 2, 64))
    assert isinstance(out, torch.Tensor)


def test_non_contiguous_inputs_are_copied_not_rejected(cpu_kernel):
    q, k, v = rand_qkv(2, 11, 11, 4, 4, 64)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # (b, s, h, d) view of a (b, h, s, d) buffer
    kt = k.transpose(-1, -2).contiguous().transpose(-1, -2)  # last dim not unit-stride
    out = flash_attn_func(qt, kt, v)
    torch.testing.assert_close(out, flash_attn_func(q, k, v))


def test_empty_problems(cpu_kernel):
    # no keys: every row fully masked -> out 0, lse -inf, kernel not called
    q, k, v = rand_qkv(2, 5, 0, 4, 2, 64)
    out, lse = flash_attn_func(q, k, v, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    # no keys with a sink: lse is the sink logit
    sink = torch.randn(4)
    out, lse = flash_attn_func(q, k, v, learnable_sink=sink, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(lse, sink[None, :, None].expand(2, 4, 5))
    # no queries / no batch
    assert flash_attn_func(*rand_qkv(0, 5, 5, 4, 2, 64)).shape == (0, 5, 4, 64)
    assert flash_attn_func(*rand_qkv(2, 0, 5, 4, 2, 64)).shape == (2, 0, 4, 64)
    cu = torch.zeros(3, dtype=torch.int32)
    vq = torch.randn(0, 4, 64, dtype=BF16)
    assert flash_attn_varlen_func(vq, vq[:, :2], vq[:, :2], cu, cu).shape == (0, 4, 64)
    assert cpu_kernel == []


# ---- compile key and compile count ----


def test_lengths_and_batch_never_recompile(cpu_kernel):
    for b, sq, sk in [(1, 1, 1), (3, 17, 40), (2, 128, 7), (5, 64, 64)]:
        flash_attn_func(*rand_qkv(b, sq, sk, 4, 1, 64), causal=True)
    for batch in (1, 4, 9):
        q, k, v, cu_q, cu_k = rand_varlen(batch, 30, 4, 1, 64)
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_seqlen_q=torch.tensor(30), causal=True)
    stats = compile_cache.stats()
    assert stats["compiled"] == 2, stats  # one batched, one varlen
    assert len({c.key() for c in cpu_kernel}) == 2
    assert stats["memory_hits"] == len(cpu_kernel) - 2


def test_cu_seqlens_check_is_read_at_call_time(cpu_kernel, monkeypatch):
    q, k, v, cu_q, cu_k = rand_varlen(3, 10, 2, 2, 64, allow_zero=False)
    bad_cu_q = cu_q.clone()
    bad_cu_q[-1] -= 1  # last offset no longer equals total_q
    max_q = int((cu_q[1:] - cu_q[:-1]).max())
    monkeypatch.setenv("FLASH_ATTN4_CHECK_CU_SEQLENS", "0")
    flash_attn_varlen_func(q, k, v, bad_cu_q, cu_k, max_seqlen_q=max_q)  # unchecked: runs
    monkeypatch.setenv("FLASH_ATTN4_CHECK_CU_SEQLENS", "1")
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\] must equal"):
        flash_attn_varlen_func(q, k, v, bad_cu_q, cu_k, max_seqlen_q=max_q)
    flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_seqlen_q=max_q)  # good metadata passes the check


# ---- torch.compile ----


def test_torch_compile_fullgraph_matches_eager(cpu_kernel):
    def attn(q, k, v, sink):
        out = flash_attn_func(q, k, v, causal=True, learnable_sink=sink)
        return out.float().sum(-1) * 2

    compiled = torch.compile(attn, fullgraph=True, backend="aot_eager")
    q, k, v = rand_qkv(2, 12, 20, 4, 2, 64)
    sink = torch.randn(4)
    torch.testing.assert_close(compiled(q, k, v, sink), attn(q, k, v, sink))


def test_torch_compile_varlen_fullgraph(cpu_kernel):
    def attn(q, k, v, cu_q, cu_k):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_seqlen_q=16, window_size=(3, 1), return_lse=True)

    compiled = torch.compile(attn, fullgraph=True, backend="aot_eager")
    args = rand_varlen(3, 16, 4, 4, 64, allow_zero=False)
    for got, want in zip(compiled(*args), attn(*args)):
        torch.testing.assert_close(got, want)


def test_torch_compile_dynamic_lengths_trace_once(cpu_kernel):
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")

    def attn(q, k, v):
        return flash_attn_func(q, k, v, causal=True)

    compiled = torch.compile(attn, fullgraph=True, backend=counter, dynamic=True)
    # sizes chosen distinct from each other and from b/h/d so duck sizing does not tie them together
    counts = []
    for sq, sk in [(9, 11), (13, 29), (40, 17)]:
        q, k, v = rand_qkv(3, sq, sk, 6, 2, 64)
        torch.testing.assert_close(compiled(q, k, v), attn(q, k, v))
        counts.append(counter.frame_count)
    # the first call may take more than one attempt (dynamo restarts analysis); new lengths add none
    assert counts[0] >= 1 and counts[1:] == [counts[0]] * 2, counts
    assert compile_cache.stats()["compiled"] == 1


def test_op_body_is_not_traced_when_called_eagerly_under_compile(cpu_kernel):
    """An op called from a frame dynamo runs eagerly inside a compiled region: its Python implementation
    must run with frame evaluation off (as torch.library.custom_op's do), not be compiled as a frame."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    q, k, v = rand_qkv(2, 9, 13, 4, 2, 64)

    @torch._dynamo.disable(recursive=False)
    def eager_part(q, k, v):  # this frame is skipped, what it calls is not
        return ops.fwd(q, k, v, None, None, None, None, 0.125, 0.0, True, -1, 0, 9, 13, False)[0]

    def f(q, k, v):
        return eager_part(q * 2, k, v) + 1

    torch._dynamo.reset()
    got = torch.compile(f, backend=counter)(q, k, v)
    torch.testing.assert_close(got, f(q, k, v))
    assert counter.frame_count == 2, counter.frame_count  # f before and after eager_part; no op body
    assert len(cpu_kernel) == 2


_EAGER_PROCESS = """
import sys
import torch
from flash_attn4 import compile_cache, dispatch, flash_attn_func, validate
from flash_attn4.fa4_kernels.arch import Arch
from tests.cpu import test_ops as t

validate.DEVICE_TYPES = ("cuda", "cpu")
dispatch.arch_for_device = lambda device, kernel="forward": Arch.SM90
compile_cache._compile_forward = lambda cfg, **_: t.torch_kernel(cfg, [])
compile_cache._compile_backward = lambda cfg, **_: t.torch_backward_kernel(cfg, [])
compile_cache._compile_backward_preprocess = lambda cfg, **_: t.torch_preprocess_kernel(cfg, [])
compile_cache._compile_backward_postprocess = lambda cfg, **_: t.torch_postprocess_kernel(cfg, [])
q, k, v = (torch.randn(2, 9, 4, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
flash_attn_func(q, k, v, causal=True).float().square().sum().backward()
assert q.grad is not None and bool(q.grad.isfinite().all()), "the backward ran"
print("torch._dynamo" in sys.modules)
"""


def test_eager_calls_do_not_import_dynamo():
    """A process that never uses torch.compile does not pay for importing torch._dynamo (about a
    second) on its first forward and backward."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    # the package from this checkout, installed or not (`tests` from the root, flash_attn4 from torch-ext)
    path = os.pathsep.join([str(root), str(root / "torch-ext")])
    env = dict(os.environ, FLASH_ATTN4_DISABLE_DISK_CACHE="1", PYTHONPATH=path)
    run = subprocess.run([sys.executable, "-c", _EAGER_PROCESS], capture_output=True, text=True, env=env, cwd=root)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "False", "torch._dynamo was imported by an eager forward and backward"


# ---- autograd ----


def sm100_block_positions(tile_m: int, d: int, chunk: int = 32) -> torch.Tensor:
    """(row, col) of a query block -> its position in the block of the sm100 dq_accum, as
    sm100/dq_accum.py documents it (written out here, not read from DqChunks): columns in chunks of
    32, each chunk a (tile_m * 32)-float slab; in it, column group j of 4 floats at j * 4 * tile_m,
    row t at 4 t within the group."""
    t = torch.arange(tile_m)[:, None]
    col = torch.arange(d)[None, :]
    return (col // chunk) * chunk * tile_m + (col % chunk) // 4 * 4 * tile_m + 4 * t + col % 4


def dq_accum_positions(cfg, q: torch.Tensor, cu_q) -> torch.Tensor:
    """Where each dQ element (q's shape) sits in the flattened dq_accum, written out here from the
    layout sm90/dq_accum.py documents, not through ops._dq_accum_index, so that the stand-in kernels
    below do not share its mistakes: per head, query block after query block (varlen sequence b
    from block cu_q[b] // tile_m + b), and inside a block the inverse of DqTiling.block_order (sm90)
    or sm100_block_positions (sm100)."""
    from flash_attn4.fa4_kernels.sm90.dq_accum import DqTiling

    tile_m, d = cfg.tile_m, cfg.head_dim
    if cfg.arch is Arch.SM90:
        order = DqTiling(tile_m, d).block_order()
        where = [0] * len(order)
        for position, element in enumerate(order):
            where[element] = position
        where = torch.tensor(where).view(tile_m, d)  # (row of the block, col) -> position in the block
    else:
        where = sm100_block_positions(tile_m, d)
    block = tile_m * d
    index = torch.empty(q.shape, dtype=torch.long)
    if cu_q is None:
        batch, sq, hq = q.shape[:3]
        blocks = -(-sq // tile_m)
        for b in range(batch):
            for t in range(sq):
                for h in range(hq):
                    index[b, t, h] = ((b * hq + h) * blocks + t // tile_m) * block + where[t % tile_m]
        return index
    cu = [int(x) for x in cu_q]
    hq, blocks = q.shape[1], q.shape[0] // tile_m + len(cu) - 1
    for b in range(len(cu) - 1):
        for t in range(cu[b + 1] - cu[b]):
            for h in range(hq):
                first = h * blocks + cu[b] // tile_m + b
                index[cu[b] + t, h] = (first + t // tile_m) * block + where[t % tile_m]
    return index


def torch_backward_kernel(cfg, calls):
    """A stand-in for compile_backward(cfg): same call convention (BackwardConfig docstring) and the
    same math as the kernel, from the inputs the torch layer prepares (LSE in log2 units, rowsum(dout *
    out), row-padded; a zeroed fp32 dQ accumulator; dK and dV written whole)."""

    def one_sequence(q, k, v, dout, lse_log2, dpsum, softmax_scale, softcap, window):
        """q (s, hq, d) ... -> dq_acc (s, hq, d), dk, dv (s, hk, d); lse_log2 / dpsum (hq, s)."""
        sq, hq, sk, hk = q.shape[0], q.shape[1], k.shape[0], k.shape[1]
        g = hq // hk
        qf, dof = q.float().transpose(0, 1), dout.float().transpose(0, 1)  # (hq, s, d)
        kf, vf = (t.float().repeat_interleave(g, 1).transpose(0, 1) for t in (k, v))
        visible = reference_mask(sq, sk, cfg.causal, window, q.device)
        s = (qf @ kf.transpose(-1, -2)) * softmax_scale
        grad_scale = torch.ones_like(s)
        if cfg.has_softcap:
            t = torch.tanh(s / softcap)
            s, grad_scale = softcap * t, 1 - t * t
        p = torch.exp2(s * 1.4426950408889634 - lse_log2[..., None]).masked_fill(~visible, 0.0)
        ds = p * (dof @ vf.transpose(-1, -2) - dpsum[..., None]) * grad_scale
        dq = (ds @ kf).transpose(0, 1)  # dQ / softmax_scale, as the kernel leaves it
        dk = (ds.transpose(-1, -2) @ qf * softmax_scale).transpose(0, 1).unflatten(1, (hk, g)).sum(2)
        dv = (p.transpose(-1, -2) @ dof).transpose(0, 1).unflatten(1, (hk, g)).sum(2)
        return dq, dk, dv

    def run(q, k, v, dout, lse_log2, dpsum, dq_acc, dk, dv, cu_q, cu_k, seqused_k, semaphore, softmax_scale,
            softcap, window_left, window_right, max_seqlen_k):
        calls.append(cfg)
        assert (cu_q is not None) == (cu_k is not None) == cfg.varlen
        assert (seqused_k is not None) == cfg.has_seqused_k and (semaphore is not None) == cfg.deterministic
        assert isinstance(softmax_scale, float) and isinstance(softcap, float) and isinstance(max_seqlen_k, int)
        assert lse_log2.shape == dpsum.shape and lse_log2.dtype == dpsum.dtype == torch.float32
        assert lse_log2.shape[-1] % 4 == 0 and lse_log2.is_contiguous(), "rows padded for TMA strides"
        assert dq_acc.dtype == torch.float32 and not dq_acc.any(), "the dQ accumulator must arrive zeroed"
        # dq_accum in query blocks of tile_m * d floats (rows of 128), a varlen sequence from block
        # cu_q[b] // tile_m + b on (fa4_kernels/sm90/dq_accum.py), written out independently here
        block_rows = cfg.tile_m * cfg.head_dim // 128
        if cfg.varlen:
            blocks = q.shape[0] // cfg.tile_m + cu_q.shape[0] - 1
            assert dq_acc.shape == (q.shape[1], blocks * block_rows, 128)
        else:
            assert dq_acc.shape == (q.shape[0], q.shape[2], -(-q.shape[1] // cfg.tile_m) * block_rows, 128)
        assert dk.dtype == k.dtype and dv.dtype == v.dtype
        window = (window_left, window_right) if cfg.local else (-1, -1)
        dq = torch.zeros(q.shape, dtype=torch.float32)  # in q's layout, then into dq_acc's order
        if not cfg.varlen:
            assert max_seqlen_k == k.shape[1]
            for b in range(q.shape[0]):
                sq = q.shape[1]
                dq[b], dk[b], dv[b] = one_sequence(q[b], k[b], v[b], dout[b], lse_log2[b, :, :sq], dpsum[b, :, :sq],
                                                   softmax_scale, softcap, window)
            dq_acc.view(-1).index_add_(0, dq_accum_positions(cfg, q, None).flatten(), dq.flatten())
            return
        assert max_seqlen_k >= int((cu_k[1:] - cu_k[:-1]).max())
        for b in range(cu_q.shape[0] - 1):
            q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
            if seqused_k is not None:
                k1 = k0 + int(seqused_k[b])
            if k1 == k0:
                continue  # no key to write (past seqused_k the op's zeros stand)
            if q1 == q0:  # keys that no query sees: the kernel writes zero gradients
                dk[k0:k1], dv[k0:k1] = 0, 0
                continue
            r0 = (q0 + 3 * b) // 4 * 4  # the packed row layout, written out independently of seqlen.py
            assert r0 % 4 == 0 and r0 + q1 - q0 <= lse_log2.shape[-1]
            rows = slice(r0, r0 + q1 - q0)
            dq[q0:q1], dk[k0:k1], dv[k0:k1] = one_sequence(q[q0:q1], k[k0:k1], v[k0:k1], dout[q0:q1],
                                                           lse_log2[:, rows], dpsum[:, rows], softmax_scale, softcap,
                                                           window)
        dq_acc.view(-1).index_add_(0, dq_accum_positions(cfg, q, cu_q).flatten(), dq.flatten())

    return run


@pytest.fixture
def cpu_backward(cpu_kernel, monkeypatch):
    """cpu_kernel plus the backward stand-ins (main, pre- and postprocessing kernels); returns the
    BackwardConfigs the main one was called with."""
    calls = []
    monkeypatch.setattr(compile_cache, "_compile_backward", lambda cfg, **_: torch_backward_kernel(cfg, calls))
    monkeypatch.setattr(compile_cache, "_compile_backward_preprocess",
                        lambda cfg, **_: torch_preprocess_kernel(cfg, []))
    monkeypatch.setattr(compile_cache, "_compile_backward_postprocess",
                        lambda cfg, **_: torch_postprocess_kernel(cfg, []))
    return calls


def _reference_grads(inputs, dout, **kwargs):
    """Float32 reference gradients of the inputs that are not None. Random varlen lengths (with
    seqused_k) can leave no query a visible key; the output then depends on no input and every
    gradient is zero."""
    leaves = [t.detach().float().requires_grad_() if t is not None else None for t in inputs]
    q, k, v, sink = leaves
    ref, _ = attention_ref(q, k, v, learnable_sink=sink, **kwargs)
    given = [t for t in leaves if t is not None]
    grads = (torch.autograd.grad(ref, given, dout.float(), allow_unused=True) if ref.requires_grad
             else [None] * len(given))
    grads = iter(torch.zeros_like(t) if g is None else g for t, g in zip(given, grads))
    return [next(grads) if t is not None else None for t in leaves]


@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                   (False, (3, 1), 0.0), (True, (-1, -1), 4.0)])
@pytest.mark.parametrize("heads", [(2, 2), (4, 2)])
@pytest.mark.parametrize("with_sink", [False, True])
def test_backward_plumbing_matches_reference_gradients(cpu_backward, causal, window, softcap, heads, with_sink):
    hq, hk = heads
    q, k, v = (t.requires_grad_() for t in rand_qkv(2, 7, 9, hq, hk, 64))
    sink = torch.randn(hq, requires_grad=True) if with_sink else None
    out = flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap, learnable_sink=sink)
    dout = torch.randn_like(out)
    out.backward(dout)
    want = _reference_grads((q, k, v, sink), dout, causal=causal, window_size=window, softcap=softcap)
    for got, ref in zip((q.grad, k.grad, v.grad), want):
        assert got.dtype == BF16 and got.shape == ref.shape
        torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)
    if with_sink:
        assert sink.grad.dtype == torch.float32
        # from the bf16 output (rowsum(dO * O)): a sum with cancellation, so an absolute tolerance
        torch.testing.assert_close(sink.grad, want[3], atol=2e-2, rtol=2e-2)
    (cfg,) = cpu_backward
    assert cfg.causal == causal and cfg.local == (window != (-1, -1)) and cfg.has_softcap == (softcap > 0)
    assert not cfg.varlen and not cfg.deterministic


def test_varlen_backward_through_autograd(cpu_backward):
    qv, kv, vv, cu_q, cu_k = rand_varlen(3, 9, 4, 2, 64)
    for t in (qv, kv, vv):
        t.requires_grad_()
    out = flash_attn_varlen_func(qv, kv, vv, cu_q, cu_k, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    want = _reference_grads((qv.detach(), kv.detach(), vv.detach(), None), dout, causal=True,
                            cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    for got, ref in zip((qv.grad, kv.grad, vv.grad), want):
        torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)
    (cfg,) = cpu_backward
    assert cfg.varlen and cfg.causal


@pytest.mark.parametrize("with_seqused", [False, True])
def test_varlen_bwd_op_plumbing(cpu_backward, with_seqused):
    """The bwd op's varlen arguments (seqused_k, deterministic, max_seqlen_k left to the op) reach
    the kernel in its call convention, and give the reference gradients."""
    qv, kv, vv, cu_q, cu_k = rand_varlen(4, 9, 4, 2, 64)
    used = ((cu_k[1:] - cu_k[:-1]) * torch.rand(4)).to(torch.int32) if with_seqused else None
    out, lse = flash_attn_varlen_func(qv, kv, vv, cu_q, cu_k, seqused_k=used, causal=True, return_lse=True)
    dout = torch.randn_like(out)
    max_q = int((cu_q[1:] - cu_q[:-1]).max())
    dq, dk, dv = ops.bwd(dout, qv, kv, vv, out, lse, cu_q, cu_k, used, 64 ** -0.5, 0.0, True, -1, 0, max_q, -1, True)
    want = _reference_grads((qv, kv, vv, None), dout, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                            seqused_k=used)
    for got, ref in zip((dq, dk, dv), want):
        torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)
    (cfg,) = cpu_backward
    assert cfg.varlen and cfg.deterministic and cfg.has_seqused_k == with_seqused


@pytest.mark.parametrize("lens", [[10, 20, 15, 16, 28], [0, 7, 0, 1, 64, 3], [5], [4, 4, 4]])
def test_packed_rows_are_aligned_disjoint_and_in_order(lens):
    """The backward's packed LSE/rowsum layout: every sequence starts on a 16-byte boundary, its rows
    keep their order and values, sequences do not overlap, and everything else is 0."""
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    rows = torch.randn(3, sum(lens)) + 5  # never 0
    packed = ops._packed_rows(rows, cu)
    assert packed.shape[-1] % 4 == 0
    taken = torch.zeros(packed.shape[-1], dtype=torch.bool)
    for b, (q0, q1) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        start = (q0 + 3 * b) // 4 * 4
        assert start % 4 == 0
        torch.testing.assert_close(packed[:, start:start + q1 - q0], rows[:, q0:q1], rtol=0, atol=0)
        assert not taken[start:start + q1 - q0].any(), f"sequence {b} overlaps an earlier one"
        taken[start:start + q1 - q0] = True
    assert (packed[:, ~taken] == 0).all()


def _check_causal_backward_at_head_dims(cpu_backward, d: int, dv: int):
    """Gradients of a small causal problem at head dims d/dv against the reference, in the inputs'
    shapes; returns the one BackwardConfig the (emulated) kernel ran."""
    q, k, v = rand_qkv(1, 7, 9, 4, 2, d)
    v = torch.randn(1, 9, 2, dv, dtype=q.dtype)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = flash_attn_func(q, k, v, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    want = _reference_grads((q.detach(), k.detach(), v.detach(), None), dout, causal=True)
    for got, ref, x in zip((q.grad, k.grad, v.grad), want, (q, k, v)):
        assert got.shape == x.shape
        torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)
    (cfg,) = cpu_backward
    return cfg


@pytest.mark.parametrize("d,dv", [(192, 128), (256, 256)])
def test_split_head_dim_backward(cpu_backward, d, dv):
    """Head dims above 128 and d != dv reach the split-head-dim kernel configuration and give the
    reference gradients."""
    cfg = _check_causal_backward_at_head_dims(cpu_backward, d, dv)
    assert cfg.split_head_dim and (cfg.head_dim, cfg.head_dim_v) == (d, dv)


@pytest.mark.parametrize("d,dv,kernel_dims", [(72, 72, (80, 80)), (128, 72, (128, 80)), (24, 24, (32, 32))])
def test_backward_pads_head_dims_the_kernel_does_not_take(cpu_backward, d, dv, kernel_dims):
    """Head dims that are not multiples of 16 (or below 32) reach the kernel zero-padded and come back
    with the reference gradients, in the inputs' shapes."""
    cfg = _check_causal_backward_at_head_dims(cpu_backward, d, dv)
    assert (cfg.head_dim, cfg.head_dim_v) == kernel_dims


def _reference_grads_with_lse(inputs, dout, dlse, **kwargs):
    """Float32 reference gradients of sum(out * dout) + sum(lse * dlse) (lse's -inf rows excluded)."""
    leaves = [t.detach().float().requires_grad_() if t is not None else None for t in inputs]
    q, k, v, sink = leaves
    ref, lse = attention_ref(q, k, v, learnable_sink=sink, **kwargs)
    loss = (ref.float() * dout.float()).sum() + torch.where(torch.isfinite(lse), lse * dlse, 0.0).sum()
    given = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad(loss, given, allow_unused=True))
    return [next(grads) if t is not None else None for t in leaves]


@pytest.mark.parametrize("with_sink", [False, True])
@pytest.mark.parametrize("use_out", [True, False])
def test_gradients_through_the_returned_lse(cpu_backward, with_sink, use_out):
    """A loss on the LSE (ring attention merges chunks by their LSEs) reaches q, k (and the sink)
    through D - dlse in place of D = rowsum(dO * O); with the LSE alone, dO is zero."""
    q, k, v = (t.requires_grad_() for t in rand_qkv(2, 7, 9, 4, 2, 64))
    sink = torch.randn(4, requires_grad=True) if with_sink else None
    out, lse = flash_attn_func(q, k, v, causal=True, learnable_sink=sink, return_lse=True)
    dout = torch.randn_like(out) if use_out else torch.zeros_like(out)
    dlse = torch.randn_like(lse)
    loss = (lse * dlse).sum() + ((out.float() * dout.float()).sum() if use_out else 0.0)
    loss.backward()
    want = _reference_grads_with_lse((q, k, v, sink), dout, dlse, causal=True)
    for name, got, ref in zip("qkvs", (q.grad, k.grad, v.grad, sink.grad if with_sink else None), want):
        if ref is None:
            continue
        assert got is not None, name
        torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2, msg=f"d{name}")
    assert len(cpu_backward) == 1


def test_varlen_gradients_through_the_returned_lse(cpu_backward):
    """Packed rows: dlse (hq, total_q) moved to each sequence's aligned start like the LSE."""
    qv, kv, vv, cu_q, cu_k = rand_varlen(3, 9, 4, 2, 64)
    for t in (qv, kv, vv):
        t.requires_grad_()
    out, lse = flash_attn_varlen_func(qv, kv, vv, cu_q, cu_k, causal=True, return_lse=True)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    ((out.float() * dout.float()).sum() + torch.where(torch.isfinite(lse), lse * dlse, 0.0).sum()).backward()
    want = _reference_grads_with_lse((qv, kv, vv, None), dout, dlse, causal=True, cu_seqlens_q=cu_q,
                                     cu_seqlens_k=cu_k)
    for got, ref in zip((qv.grad, kv.grad, vv.grad), want):
        torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)


def test_backward_traces_under_torch_compile(cpu_backward):
    q, k, v = (t.requires_grad_() for t in rand_qkv(1, 6, 6, 2, 2, 64))
    fn = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, causal=True).float().square().sum(),
                       fullgraph=True, backend="aot_eager")
    fn(q, k, v).backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    flash_attn_func(q, k, v, causal=True).float().square().sum().backward()
    for got, want in zip(grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(got, want)


def test_inference_mode(cpu_kernel):
    q, k, v = (t.requires_grad_() for t in rand_qkv(1, 6, 6, 2, 2, 64))
    with torch.inference_mode():
        out = flash_attn_func(q, k, v)
    assert not out.requires_grad


# ---- reference self-checks (the GPU tests trust tests/reference.py) ----


@pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs")
@pytest.mark.parametrize("sq,sk", [(9, 9), (5, 23), (23, 5), (1, 17)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hk", [(4, 4), (6, 2), (4, 1)])
def test_reference_matches_sdpa(sq, sk, causal, hq, hk):
    """Against torch's SDPA in float32; causal uses torch's own bottom-right bias (causal_lower_right)."""
    from torch.nn.attention.bias import causal_lower_right
    import torch.nn.functional as F

    b, d = 2, 32
    q, k, v = (torch.randn(b, s, h, d) for s, h in ((sq, hq), (sk, hk), (sk, hk)))
    scale = float(torch.empty(()).uniform_(0.1, 0.3))
    out, lse = attention_ref(q, k, v, softmax_scale=scale, causal=causal)
    mask = causal_lower_right(sq, sk) if causal else None
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    if causal and sq > sk:  # SDPA gives NaN for rows that see nothing; compare only the others
        rows = slice(sq - sk, None)
    else:
        rows = slice(None)
    want = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=hq != hk)
    torch.testing.assert_close(out[:, rows], want.transpose(1, 2)[:, rows], atol=1e-5, rtol=1e-5)
    if causal and sq > sk:
        assert (out[:, : sq - sk] == 0).all() and torch.isneginf(lse[:, :, : sq - sk]).all()


@pytest.mark.parametrize("with_sink", [False, True])
def test_reference_lse_normalises_probabilities(with_sink):
    b, sq, sk, h, d = 2, 11, 19, 4, 16
    q, k, v = torch.randn(b, sq, h, d), torch.randn(b, sk, h, d), torch.randn(b, sk, h, d)
    sink = torch.randn(h) if with_sink else None
    out, lse = attention_ref(q, k, v, softcap=2.0, window_size=(6, 3), learnable_sink=sink)
    s = 2.0 * torch.tanh(torch.einsum("bqhd,bkhd->bhqk", q, k) * d ** -0.5 / 2.0)
    i = torch.arange(sq)[:, None] + sk - sq
    j = torch.arange(sk)[None, :]
    s = s.masked_fill(~((j >= i - 6) & (j <= i + 3)), float("-inf"))
    p = torch.exp(s - lse[..., None])
    total = p.sum(-1) + (torch.exp(sink[None, :, None] - lse) if with_sink else 0)
    torch.testing.assert_close(total, torch.ones_like(total))
    torch.testing.assert_close(out, torch.einsum("bhqk,bkhd->bqhd", p, v))


def test_reference_window_by_brute_force():
    sq, sk, left, right = 7, 12, 2, 1
    q, k, v = torch.randn(1, sq, 1, 8), torch.randn(1, sk, 1, 8), torch.randn(1, sk, 1, 8)
    out, _ = attention_ref(q, k, v, window_size=(left, right))
    for i in range(sq):
        keys = [j for j in range(sk) if i + sk - sq - left <= j <= i + sk - sq + right]
        s = torch.stack([(q[0, i, 0] * k[0, j, 0]).sum() for j in keys]) / 8 ** 0.5
        want = (torch.softmax(s, 0)[:, None] * v[0, keys, 0]).sum(0)
        torch.testing.assert_close(out[0, i, 0], want)


def test_reference_varlen_equals_per_sequence_batched():
    cu_q = random_cu_seqlens(4, 12)
    cu_k = random_cu_seqlens(4, 12)
    q, k, v = (torch.randn(int(cu[-1]), 4, 16) for cu in (cu_q, cu_k, cu_k))
    k = k[:, :2]
    v = v[:, :2]
    used = ((cu_k[1:] - cu_k[:-1]) * torch.rand(4)).int()
    out, lse = attention_ref(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=used)
    for i in range(4):
        qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i]) + int(used[i]))
        o, l = attention_ref(q[qs][None], k[ks][None], v[ks][None], causal=True)
        torch.testing.assert_close(out[qs], o[0])
        torch.testing.assert_close(lse[:, qs], l[0])


def test_reference_low_precision_path_differs_but_is_close():
    q, k, v = (torch.randn(1, 64, 2, 64, dtype=BF16) for _ in range(3))
    ref, _ = attention_ref(q, k, v, upcast=True)
    pt, _ = attention_ref(q, k, v, upcast=False)
    assert ref.dtype == pt.dtype == BF16
    from tests.reference import max_abs_diff

    assert 0 < max_abs_diff(pt, ref) < 0.1


def test_fa_rule_helper():
    from tests.reference import assert_close_fa_rule

    ref = torch.randn(100)
    pt = ref + 0.01 * torch.randn(100)
    assert_close_fa_rule(ref + 0.005 * torch.randn(100).clamp(-1, 1), ref, pt, atol=1e-2)
    with pytest.raises(AssertionError):
        assert_close_fa_rule(ref + 1.0, ref, pt, atol=1e-3)
    bad = ref.clone()
    bad[3] = float("nan")
    with pytest.raises(AssertionError):
        assert_close_fa_rule(bad, ref, pt, atol=1e-3)


# ---- the benchmark's kernel variants (benchmarks/bench.py --variant), through the stand-ins ----


def test_bench_variant_specs_parse_to_config_overrides():
    import argparse

    from benchmarks import bench

    assert bench._parse_variant("m80:tile_m=80,causal=true,rescale_threshold=8.0,ops.PREPROCESS_KERNEL=False") == (
        "m80", {"tile_m": 80, "causal": True, "rescale_threshold": 8.0, "ops.PREPROCESS_KERNEL": False})
    with pytest.raises(argparse.ArgumentTypeError, match="NAME:field=value"):
        bench._parse_variant("m80:")
    with pytest.raises(ValueError):
        bench._parse_variant("m80:tile_m=eighty")


def test_bench_backward_variant_compiles_the_overridden_config_and_matches_ours(cpu_backward):
    from benchmarks import bench

    case = bench.Case(group="grid", batch=2, hq=4, hk=2, seqlen=9, head_dim=64, causal=True)
    q, k, v = rand_qkv(2, 9, 9, 4, 2, 64)
    x = bench.Inputs(q, k, v)
    torch.manual_seed(1)  # both preparers draw dout right after their forward
    dq_variant = bench._variant_bwd({"num_stages": 3})(case, x)()
    assert [c.num_stages for c in cpu_backward] == [3]
    torch.manual_seed(1)
    dq_ours = bench.Impl("ours", lambda: None, bench._ours_fwd).bwd(case, x)()
    assert cpu_backward[-1].num_stages == BackwardConfig.num_stages
    torch.testing.assert_close(dq_variant, dq_ours)
    assert dispatch.backward_config.__name__ == "backward_config", "the dispatch choice must be restored"


def test_bench_backward_variant_sets_ops_switches_only_while_it_runs(cpu_backward, monkeypatch):
    from benchmarks import bench

    calls = []
    monkeypatch.setattr(compile_cache, "_compile_backward_postprocess",
                        lambda cfg, **_: torch_postprocess_kernel(cfg, calls))
    case = bench.Case(group="grid", batch=2, hq=4, hk=2, seqlen=9, head_dim=64, causal=True)
    x = bench.Inputs(*rand_qkv(2, 9, 9, 4, 2, 64))
    run = bench._variant_bwd({"ops.POSTPROCESS_KERNEL": False})(case, x)
    assert ops.POSTPROCESS_KERNEL is True
    run()
    assert calls == [] and ops.POSTPROCESS_KERNEL is True, "switch used during the call, restored after"
    with pytest.raises(ValueError, match="no switch"):
        bench._variant_bwd({"ops.NO_SUCH_SWITCH": True})(case, x)


def torch_preprocess_kernel(cfg, calls):
    """A stand-in for compile_backward_preprocess(cfg): its call convention (fa4_kernels/bwd_preprocess.py)."""

    def run(out, dout, lse, dpsum, lse_log2):
        calls.append(cfg)
        assert out.dim() == dout.dim() == 4 and lse.dim() == dpsum.dim() == lse_log2.dim() == 3
        assert out.shape[-1] == cfg.head_dim_v and lse.shape == (out.shape[0], out.shape[2], out.shape[1])
        rows = lse.shape[-1]
        assert dpsum.shape[-1] >= rows and dpsum.shape[-1] % 4 == 0
        dpsum.zero_()
        lse_log2.zero_()
        dpsum[..., :rows] = (dout.float() * out.float()).sum(-1).transpose(1, 2)
        lse_log2[..., :rows] = torch.where(torch.isinf(lse), float("inf"), lse * 1.4426950408889634)

    return run


def _bwd_with_switch(monkeypatch, switch: str, use_kernel: bool, calls: list, *args):
    """ops.bwd(*args) with the ops.py kernel switch set to ``use_kernel``; the stand-in kernel must be
    called exactly when it is on."""
    monkeypatch.setattr(ops, switch, use_kernel)
    grads = ops.bwd(*args)
    assert len(calls) == int(use_kernel), f"{switch}={use_kernel}: the kernel ran {len(calls)} times"
    return grads


@pytest.mark.parametrize("use_kernel", [False, True])
@pytest.mark.parametrize("varlen", [False, True])
def test_backward_rows_from_the_preprocess_kernel_or_torch_give_the_reference_gradients(cpu_backward, monkeypatch,
                                                                                        varlen, use_kernel):
    """ops.PREPROCESS_KERNEL on (the default: the rows reach the kernel in its convention, packed
    inputs as one batch entry) or off (torch computes them): either way the gradients are those of
    the float32 reference through autograd."""
    calls = []
    monkeypatch.setattr(compile_cache, "_compile_backward_preprocess",
                        lambda cfg, **_: torch_preprocess_kernel(cfg, calls))
    if varlen:
        q, k, v, cu_q, cu_k = rand_varlen(3, 9, 4, 2, 64)
        out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
        args = (cu_q, cu_k, None, 0.125, 0.0, True, -1, 0, int((cu_q[1:] - cu_q[:-1]).max()), -1, False)
        ref = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    else:
        q, k, v = rand_qkv(2, 9, 13, 4, 2, 64)
        out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
        args = (None, None, None, 0.125, 0.0, True, -1, 0, 9, 13, False)
        ref = {}
    dout = torch.randn_like(out)
    got = _bwd_with_switch(monkeypatch, "PREPROCESS_KERNEL", use_kernel, calls, dout, q, k, v, out, lse, *args)
    want = _reference_grads((q, k, v, None), dout, causal=True, softmax_scale=0.125, **ref)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g.float(), w, atol=2e-2, rtol=2e-2, msg=lambda m: f"{name}: {m}")
    assert all(c.head_dim_v == 64 and c.dtype == "bfloat16" for c in calls)


def torch_postprocess_kernel(cfg, calls):
    """A stand-in for compile_backward_postprocess(cfg): its call convention (sm90/bwd_postprocess.py)."""

    def run(dq_accum, dq, cu_seqlens_q, softmax_scale, max_seqlen_q):
        calls.append(cfg)
        assert (cu_seqlens_q is not None) == cfg.varlen and dq.shape[-1] == cfg.head_dim
        assert dq_accum.dim() == dq.dim() and dq_accum.shape[-1] == 128 and dq_accum.is_contiguous()
        assert dq_accum.dtype == torch.float32 and dq.dtype == {"bfloat16": torch.bfloat16,
                                                                "float16": torch.float16}[cfg.dtype]
        assert isinstance(softmax_scale, float) and isinstance(max_seqlen_q, int)
        dq.copy_(dq_accum.view(-1)[dq_accum_positions(cfg, dq, cu_seqlens_q)] * softmax_scale)

    return run


@pytest.mark.parametrize("tile_m,head_dim", [(128, 64), (80, 128), (64, 48)])
@pytest.mark.parametrize("varlen", [False, True])
def test_dq_accum_index_places_every_element_of_dq_once_inside_its_query_block(tile_m, head_dim, varlen):
    """ops._dq_accum_index (the postprocessing's torch reference): dQ element (token, head, col)
    sits in the query block of its token, in dq_accum's blocked order, no two at one place; varlen
    sequences (one empty, lengths no multiple of the block) start at their own blocks."""
    cfg = BackwardConfig(arch=Arch.SM90, dtype="bfloat16", head_dim=head_dim, head_dim_v=head_dim, tile_m=tile_m,
                         varlen=varlen, **({"split_head_dim": True, "tile_n": 64} if head_dim == 48 else {}))
    hq = 3
    if varlen:
        lens = [tile_m + 5, 0, 2 * tile_m, 7]
        cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        q = torch.empty(sum(lens), hq, head_dim)
    else:
        cu, q = None, torch.empty(2, 2 * tile_m + 3, hq, head_dim)
    accum = ops._dq_accum(q, cfg, cu)
    index = ops._dq_accum_index(cfg, q, cu)
    assert index.shape == q.shape
    flat = index.flatten()
    assert flat.unique().numel() == flat.numel() and 0 <= int(flat.min()) and int(flat.max()) < accum.numel()
    block = tile_m * head_dim
    if varlen:  # token t of sequence b, head h: block (cu[b] // tile_m + b + t // tile_m) of head h
        seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        t = torch.arange(q.shape[0]) - cu[:-1].long()[seq]
        blocks_per_head = accum.shape[1] * 128 // block
        want = cu[:-1].long()[seq] // tile_m + seq + t // tile_m
        got = index // block - torch.arange(hq)[None, :, None] * blocks_per_head
        assert (got == want[:, None, None]).all()
    else:  # (b, token, head): block ((b * hq + h) * blocks + token // tile_m)
        blocks = -(-q.shape[1] // tile_m)
        b, t, h = torch.meshgrid(torch.arange(2), torch.arange(q.shape[1]), torch.arange(hq), indexing="ij")
        assert (index // block == ((b * hq + h) * blocks + t // tile_m)[..., None]).all()


@pytest.mark.parametrize("tile_m,head_dim", [(128, 64), (80, 128), (64, 48), (64, 256)])
@pytest.mark.parametrize("varlen", [False, True])
def test_dq_accum_index_matches_the_layout_written_out_by_hand(tile_m, head_dim, varlen):
    """ops._dq_accum_index (vectorised; what the torch fallback reorders dQ by) places every element
    where dq_accum_positions (loops over the documented layout) does."""
    cfg = BackwardConfig(arch=Arch.SM90, dtype="bfloat16", head_dim=head_dim, head_dim_v=head_dim, tile_m=tile_m,
                         varlen=varlen, **({"split_head_dim": True, "tile_n": 64} if head_dim in (48, 256) else {}))
    if varlen:
        cu = torch.tensor([0, tile_m + 5, tile_m + 5, 3 * tile_m + 5, 3 * tile_m + 12], dtype=torch.int32)
        q = torch.empty(int(cu[-1]), 3, head_dim)
    else:
        cu, q = None, torch.empty(2, 2 * tile_m + 3, 3, head_dim)
    assert torch.equal(ops._dq_accum_index(cfg, q, cu), dq_accum_positions(cfg, q, cu))


@pytest.mark.parametrize("use_kernel", [False, True])
def test_dq_from_the_postprocess_kernel_or_torch_gives_the_reference_gradient(cpu_backward, monkeypatch, use_kernel):
    """ops.POSTPROCESS_KERNEL on (the default: dQ comes from the kernel in its convention, scaled once
    by softmax_scale) or off (torch reorders the accumulator): either way dQ is the float32
    reference's through autograd, at a softmax_scale other than the default."""
    calls = []
    monkeypatch.setattr(compile_cache, "_compile_backward_postprocess",
                        lambda cfg, **_: torch_postprocess_kernel(cfg, calls))
    q, k, v = rand_qkv(2, 9, 13, 4, 2, 64)
    scale = float(torch.empty(()).uniform_(0.05, 0.3))
    out, lse = flash_attn_func(q, k, v, causal=True, softmax_scale=scale, return_lse=True)
    dout = torch.randn_like(out)
    args = (None, None, None, scale, 0.0, True, -1, 0, 9, 13, False)
    dq, dk, dv = _bwd_with_switch(monkeypatch, "POSTPROCESS_KERNEL", use_kernel, calls, dout, q, k, v, out, lse, *args)
    want = _reference_grads((q, k, v, None), dout, causal=True, softmax_scale=scale)
    for name, g, w in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        assert g.dtype == BF16 and g.shape == w.shape
        torch.testing.assert_close(g.float(), w, atol=2e-2, rtol=2e-2, msg=lambda m: f"{name}: {m}")
    assert all(c.dtype == "bfloat16" and c.head_dim == 64 for c in calls)


def test_eager_calls_skip_the_dispatcher_and_traced_calls_do_not(cpu_backward, monkeypatch):
    """Eager calls run the op's implementation directly (a third of the host time of a cached call),
    inside the eager autograd Function when an input requires grad; calls inside a dispatch mode or
    a functorch transform, or on tensor subclasses, go through the op, so FakeTensor, torch.func and
    friends still see it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = rand_qkv(2, 33, 40, 4, 2, 64)
    through_op, routes = [], []
    real_fwd, real_route = ops.fwd, ops._route

    def counting_fwd(*args):
        through_op.append(args[0].shape)
        return real_fwd(*args)

    def recording_route(*tensors):
        routes.append(real_route(*tensors))
        return routes[-1]

    monkeypatch.setattr(ops, "fwd", counting_fwd)
    monkeypatch.setattr(ops, "_route", recording_route)
    with torch.no_grad():
        out_direct = flash_attn_func(q, k, v, causal=True)
    out_plain = flash_attn_func(q, k, v, causal=True)  # grad on, nothing requires it
    assert through_op == [] and routes == [ops._Route.DIRECT] * 2 and torch.equal(out_direct, out_plain)
    qg = q.clone().requires_grad_()
    out_grad = flash_attn_func(qg, k, v, causal=True)
    assert through_op == [] and routes[-1] is ops._Route.EAGER_AUTOGRAD
    assert type(out_grad.grad_fn).__name__ == "_EagerForwardBackward"
    assert torch.equal(out_grad.detach(), out_plain)
    out_grad.float().sum().backward()  # the backward, run with grad off, calls its implementation directly
    assert routes[-1] is ops._Route.DIRECT and qg.grad is not None and qg.grad.abs().sum() > 0
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        fake_out = flash_attn_func(fq, fk, fv, causal=True)
    assert len(through_op) == 1 and routes[-1] is ops._Route.THROUGH_OP and fake_out.shape == out_plain.shape
    with torch.no_grad():
        batched = torch.func.vmap(lambda q: flash_attn_func(q[None], k[:1], v[:1], causal=True)[0])(q[:1])
    assert len(through_op) == 2 and routes[-1] is ops._Route.THROUGH_OP
    assert torch.equal(batched, out_plain[:1])
    # An nn.Parameter (a float32 learnable sink, say) dispatches as a plain tensor: no detour.
    sink = torch.nn.Parameter(torch.randn(4))
    out_sink = flash_attn_func(q, k, v, causal=True, learnable_sink=sink)
    assert len(through_op) == 2 and routes[-1] is ops._Route.EAGER_AUTOGRAD
    out_sink.float().sum().backward()
    assert sink.grad is not None and sink.grad.abs().sum() > 0


@pytest.mark.parametrize("varlen", [False, True])
def test_eager_autograd_matches_the_ops_registered_formula(cpu_backward, varlen):
    """The eager autograd Function and torch.library's formula for the op (what torch.compile and
    dispatch modes use) give the same outputs, LSE and gradients: one formula, two wrappers."""
    if varlen:
        q, k, v, cu_q, cu_k = rand_varlen(3, 9, 4, 2, 64, allow_zero=False)
        call = lambda q, k, v, s: flash_attn_varlen_func(q, k, v, cu_q, cu_k, causal=True, learnable_sink=s,
                                                         return_lse=True)
    else:
        q, k, v = rand_qkv(2, 7, 9, 4, 2, 64)
        call = lambda q, k, v, s: flash_attn_func(q, k, v, causal=True, learnable_sink=s, return_lse=True)
    sink = torch.randn(4)
    with torch.no_grad():
        out, lse = call(q, k, v, sink)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    results = []
    for route in (ops._Route.EAGER_AUTOGRAD, ops._Route.THROUGH_OP):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sink)]
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ops, "_route", lambda *tensors, route=route: route)
            got_out, got_lse = call(*leaves)
        assert got_out.grad_fn is not None and torch.equal(got_out, out) and torch.equal(got_lse, lse)
        torch.autograd.backward((got_out, got_lse), (dout, dlse))
        results.append([t.grad for t in leaves])
    for name, eager, registered in zip(("dq", "dk", "dv", "dsink"), *results):
        assert torch.equal(eager, registered), name
    # Not a vacuous agreement: the gradients move (every input, the sink included, gets one).
    assert all(g.abs().sum() > 0 for g in results[0])


@pytest.mark.parametrize("arch,in_kernel", [(Arch.SM90, True), (Arch.SM100, True), (Arch.SM100, False)],
                         ids=["sm_90a", "sm_100a", "sm_100a-no-padded-pack"])
@pytest.mark.parametrize("hq,hk,varlen", [(14, 2, False), (10, 2, True), (6, 2, False), (24, 2, True)])
def test_unpackable_ratios_run_packed_with_dummy_heads(cpu_kernel, monkeypatch, arch, in_kernel, hq, hk, varlen):
    """Head ratios that do not divide 64 (7, 5, 3, 12) with short queries: one packed kernel of the
    next ratio that packs (8, 8, 4, 16), and the result is the unpadded attention (out, lse and a
    learnable sink per real head). Both archs pack the padded groups in the kernel (pack_gqa_heads:
    the real q goes in, nothing is padded or copied); an arch whose rules do not say
    FORWARD_PADDED_PACK (switched off here) runs the heads unpacked, with the same result."""
    monkeypatch.setattr(dispatch, "arch_for_device", lambda device, kernel="forward": arch)
    if not in_kernel:
        monkeypatch.setattr(KERNELS[arch].rules(), "FORWARD_PADDED_PACK", False)
        monkeypatch.setattr(dispatch, "padded_pack", dispatch.padded_pack.__wrapped__)  # not its cached answers
    ratio = hq // hk
    sink = torch.randn(hq)
    if varlen:
        q, k, v, cu_q, cu_k = rand_varlen(3, 9, hq, hk, 64)
        out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, causal=True, learnable_sink=sink, return_lse=True)
        ref_out, ref_lse = attention_ref(q, k, v, causal=True, learnable_sink=sink, cu_seqlens_q=cu_q,
                                         cu_seqlens_k=cu_k)
    else:
        q, k, v = rand_qkv(2, 3, 70, hq, hk, 64)
        out, lse = flash_attn_func(q, k, v, causal=True, learnable_sink=sink, return_lse=True)
        ref_out, ref_lse = attention_ref(q, k, v, causal=True, learnable_sink=sink)
    cfg = cpu_kernel[-1]  # (on sm100 after its first-use self-check's runs of the same kernel)
    assert all(c == cfg for c in cpu_kernel)
    group = dispatch.padded_pack(cfg.arch, 64, 64, varlen, ratio, 9)
    if in_kernel:
        assert cfg.pack_gqa == group > ratio and cfg.pack_gqa_heads == ratio
    else:
        assert group == 0 and cfg.pack_gqa == 1 and cfg.pack_gqa_heads == 0
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape and lse.is_contiguous()
    assert (out.float() - ref_out.float()).abs().max() < 2e-2
    assert torch.allclose(lse, ref_lse, atol=1e-3)
    # Without return_lse: the same output.
    if varlen:
        out_only = flash_attn_varlen_func(q, k, v, cu_q, cu_k, causal=True, learnable_sink=sink)
    else:
        out_only = flash_attn_func(q, k, v, causal=True, learnable_sink=sink)
    assert torch.equal(out_only, out)


@pytest.mark.parametrize("arch", [Arch.SM90, Arch.SM100], ids=lambda a: a.value)
@pytest.mark.parametrize("hq,hk", [(28, 4), (40, 8), (12, 4), (6, 2), (10, 2)])
def test_kernel_packs_padded_groups_without_host_copies(cpu_kernel, monkeypatch, arch, hq, hk):
    """Decode with a ratio that does not divide 64 (7, 5, 3, 3, 5): the kernel gets the caller's
    q and writes the out and lse that are returned (no padded q, no unpadding copy), on the
    launch-plan path and off it; long queries run unpacked (PAD_PACK_MAX_QUERIES). sm100's first-use
    self-check is off here (its launches would count); the test above runs it."""
    monkeypatch.setattr(dispatch, "arch_for_device", lambda device, kernel="forward": arch)
    monkeypatch.setenv("FLASH_ATTN4_SELF_CHECK", "0")
    ratio = hq // hk
    launched = []
    real_launch = ops._launch

    def launch(kernel, q, k, v, out, lse, *rest):
        launched.append((q, out, lse))
        return real_launch(kernel, q, k, v, out, lse, *rest)

    monkeypatch.setattr(ops, "_launch", launch)
    for plan_cache in (True, False):
        monkeypatch.setattr(ops, "PLAN_CACHE", plan_cache)
        launched.clear()
        cpu_kernel.clear()
        q, k, v = rand_qkv(2, 4, 300, hq, hk, 64)
        out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
        ref_out, ref_lse = attention_ref(q, k, v, causal=True)
        assert [(t[0] is q, t[1] is out, t[2] is lse) for t in launched] == [(True, True, True)]
        (cfg,) = cpu_kernel
        assert cfg.pack_gqa == dispatch.padded_pack(cfg.arch, 64, 64, False, ratio, 4) > ratio == cfg.pack_gqa_heads
        assert (out.float() - ref_out.float()).abs().max() < 2e-2 and torch.allclose(lse, ref_lse, atol=1e-3)
    cpu_kernel.clear()
    flash_attn_func(*rand_qkv(1, dispatch.PAD_PACK_MAX_QUERIES + 1, 80, hq, hk, 64))
    assert [(c.pack_gqa, c.pack_gqa_heads) for c in cpu_kernel] == [(1, 0)]


def test_unpackable_ratio_without_query_tokens(cpu_kernel):
    """A varlen call whose sequences have no query token but keys (found by the GPU fuzz: 6/2 heads,
    a sink) takes the dummy-head path too: empty out and lse of the right shapes, no error."""
    hq, hk, d, dv = 6, 2, 64, 32
    sk = int(torch.randint(1, 40, ()))
    q = torch.randn(0, hq, d, dtype=BF16)
    k, v = torch.randn(sk, hk, d, dtype=BF16), torch.randn(sk, hk, dv, dtype=BF16)
    cu_q, cu_k = torch.tensor([0, 0], dtype=torch.int32), torch.tensor([0, sk], dtype=torch.int32)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_seqlen_q=0, max_seqlen_k=sk,
                                      learnable_sink=torch.randn(hq), return_lse=True)
    assert out.shape == (0, hq, dv) and lse.shape == (hq, 0)


def test_unpackable_ratio_with_long_queries_runs_unpacked(cpu_kernel):
    q, k, v = rand_qkv(1, dispatch.PAD_PACK_MAX_QUERIES + 1, 80, 14, 2, 64)
    flash_attn_func(q, k, v)
    assert [cfg.pack_gqa for cfg in cpu_kernel] == [1]


# ---- padded batches: seqused_q, and batched tensors with used lengths ----


def test_varlen_seqused_q_writes_only_the_used_rows(cpu_kernel, monkeypatch):
    """Each sequence's first seqused_q[b] queries of its cu_seqlens_q slot attend (causal aligned to
    that length); the rows past them are left as allocated (poisoned here)."""
    monkeypatch.setattr(ops, "_poison_outputs_for_tests", True)
    q, k, v, cu_q, cu_k = rand_varlen(4, 12, 8, 2, 64, allow_zero=False)
    slots = (cu_q[1:] - cu_q[:-1]).tolist()
    used = torch.tensor([int(torch.randint(0, n + 1, ())) for n in slots], dtype=torch.int32)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_seqlen_q=12, seqused_q=used, causal=True,
                                      return_lse=True)
    (cfg,) = cpu_kernel
    assert cfg.has_seqused_q and cfg.varlen and not cfg.tma_store_o
    for b, n in enumerate(used.tolist()):
        q0, k0, k1 = int(cu_q[b]), int(cu_k[b]), int(cu_k[b + 1])
        if n:
            ro, rl = attention_ref(q[None, q0:q0 + n], k[None, k0:k1], v[None, k0:k1], causal=True)
            assert (out[q0:q0 + n].float() - ro[0].float()).abs().max() < 2e-2
            assert torch.allclose(lse[:, q0:q0 + n], rl[0], atol=1e-3)
        assert out[q0 + n:int(cu_q[b + 1])].isnan().all() and lse[:, q0 + n:int(cu_q[b + 1])].isinf().all()


@pytest.mark.parametrize("hq,hk,with_q,with_k", [(8, 2, True, True), (14, 2, True, False), (4, 4, False, True)])
def test_padded_batch_runs_without_cu_seqlens(cpu_kernel, hq, hk, with_q, with_k):
    """flash_attn_varlen_func(q, k, v, None, None, seqused_q=..., seqused_k=...) on batched tensors:
    sequence b is q[b, :seqused_q[b]] against k[b, :seqused_k[b]] (a 7:1 ratio goes through the padded
    GQA packing)."""
    q, k, v = rand_qkv(3, 6, 40, hq, hk, 64)
    used_q = torch.tensor([6, 1, 3], dtype=torch.int32) if with_q else None
    used_k = torch.tensor([40, 7, 0], dtype=torch.int32) if with_k else None
    with torch.no_grad():
        out, lse = flash_attn_varlen_func(q, k, v, None, None, seqused_q=used_q, seqused_k=used_k, causal=True,
                                          return_lse=True)
    assert out.shape == q.shape[:3] + (64,) and lse.shape == (3, hq, 6)
    cfg = cpu_kernel[-1]
    assert not cfg.varlen and cfg.has_seqused_q == with_q and cfg.has_seqused_k == with_k
    for b in range(3):
        nq = int(used_q[b]) if with_q else 6
        nk = int(used_k[b]) if with_k else 40
        ro, rl = attention_ref(q[b:b + 1, :nq], k[b:b + 1, :nk], v[b:b + 1, :nk], causal=True)
        assert (out[b, :nq].float() - ro[0].float()).abs().max() < 2e-2
        assert torch.allclose(lse[b, :, :nq], rl[0], atol=1e-3)
