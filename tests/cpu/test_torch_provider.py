"""The PyTorch attention provider (flash_attn4/torch_provider.py) on the CPU.

The real kernels need a GPU, so the provider is installed here under the CPU dispatch key (ATen's
flash ops have no CPU kernel of their own) over the torch stand-in kernels of test_ops (the real ops
layer, a reference computing the kernel's call convention). That runs ATen's real dispatch and
autograd formulas (``_flash_attention_forward`` -> ``_flash_attention_backward``, the SDPA op and its
backward, ``torch.nn.attention.varlen.varlen_attn``) into our argument translation, and checks the
results against the reference. The fallback decisions are checked with a recording stand-in for
PyTorch's captured kernel. Numerics of the real kernels through the provider: tests/gpu/test_torch_provider_gpu.py.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

import flash_attn4  # noqa: F401  (registers the provider)
from flash_attn4 import device_info, dispatch, torch_provider
from tests.cpu.test_ops import _reference_grads, cpu_backward, cpu_kernel  # noqa: F401  (fixtures)
from tests.reference import attention_ref, random_cu_seqlens

BF16 = torch.bfloat16
attention = torch.nn.attention
OPS = ("_flash_attention_forward", "_flash_attention_backward", "_scaled_dot_product_flash_attention",
       "_scaled_dot_product_flash_attention_backward", "_flash_attention_forward_no_dropout_inplace")


MARK = 7.0  # what the stand-in for PyTorch's kernel writes: tells its results from ours


class RecordingKernel:
    """Stands in for PyTorch's captured kernel of ``op``: records each call and returns outputs of the
    op's schema, the first one filled with MARK."""

    def __init__(self, op: str):
        self.op, self.calls = op, []

    def call_boxed(self, keyset, *args, **kwargs):
        self.calls.append((keyset, args, kwargs))
        if self.op.endswith("_backward"):
            q, k, v = args[1:4]
            return torch.full_like(q, MARK), torch.zeros_like(k), torch.zeros_like(v)
        if self.op == "_flash_attention_forward_no_dropout_inplace":
            args[0].fill_(MARK)
            return torch.zeros(args[1].shape[1], args[1].shape[0])
        q = args[0]
        aux = (torch.zeros(2, dtype=torch.uint64), torch.zeros((), dtype=torch.uint64), torch.empty(0, dtype=q.dtype))
        lse = torch.zeros(q.shape[0], q.shape[2], q.shape[1])
        if self.op == "_scaled_dot_product_flash_attention":
            return (torch.full_like(q, MARK), lse, None, None, q.shape[2], args[1].shape[2], *aux)
        return (torch.full_like(q, MARK), lse, *aux)


def from_pytorch(t: torch.Tensor) -> bool:
    return bool((t == MARK).all())


@pytest.fixture
def provider(cpu_backward, monkeypatch):
    """Our kernels installed for ATen's flash ops on CPU, over the stand-in kernels; PyTorch's
    "captured" kernels are RecordingKernels (returned, keyed by op name)."""
    originals = {}
    monkeypatch.setattr(torch_provider, "_capture", lambda name, key: originals.setdefault(name, RecordingKernel(name)))
    # ATen's num_splits=None reaches ops as 0 (automatic): a stand-in H200 for the heuristic, which
    # is told to choose 1 (the stand-in kernels have no split-KV; tests/cpu/test_splitkv_cpu.py has).
    monkeypatch.setattr(device_info, "get_device_info", lambda device: device_info.DeviceInfo(0, "stand-in", (9, 0), 132))
    monkeypatch.setattr(dispatch, "num_splits_heuristic", lambda **kwargs: 1)
    torch_provider._LOGGED.clear()
    handle = torch_provider.install("CPU")
    yield originals
    handle.remove()
    torch_provider._LOGGED.clear()


def cuda_kernel_location(op: str) -> str:
    lines = [line for line in torch._C._dispatch_dump(f"aten::{op}").splitlines() if line.startswith("CUDA:")]
    return lines[0] if lines else ""


def rand(*shape, requires_grad=False):
    return torch.randn(*shape, dtype=BF16).requires_grad_(requires_grad)


def present_ops():
    return [op for op in OPS if hasattr(torch.ops.aten, op)]


# ---- registration ----


def test_import_registers_the_provider_without_activating_it():
    assert torch_provider.PROVIDER_NAME == "flash-attn4"
    assert "flash-attn4" in attention.list_flash_attention_impls()
    assert attention.current_flash_attention_impl() != "flash-attn4"
    assert all("torch_provider" not in cuda_kernel_location(op) for op in present_ops())


def test_activate_then_restore_swaps_our_kernels_in_and_out():
    before = {op: cuda_kernel_location(op) for op in present_ops()}
    attention.activate_flash_attention_impl("flash-attn4")
    try:
        assert attention.current_flash_attention_impl() == "flash-attn4"
        for op in present_ops():
            assert "torch_provider.py" in cuda_kernel_location(op), op
        attention.activate_flash_attention_impl("flash-attn4")  # again: the first registration is dropped first
        assert attention.current_flash_attention_impl() == "flash-attn4"
    finally:
        attention.restore_flash_attention_impl()
    assert attention.current_flash_attention_impl() is None
    assert {op: cuda_kernel_location(op) for op in present_ops()} == before


def test_registration_is_skipped_with_a_debug_log_where_torch_has_no_registry(monkeypatch, caplog):
    monkeypatch.delattr(attention, "register_flash_attention_impl")
    with caplog.at_level(logging.DEBUG, logger="flash_attn4"):
        assert torch_provider.register() is False
    assert any("register_flash_attention_impl" in r.getMessage() for r in caplog.records)


def test_handle_remove_is_idempotent():
    handle = torch_provider.install("CPU")
    assert handle.active
    handle.remove()
    handle.remove()
    assert not handle.active
    with pytest.raises(NotImplementedError):  # no CPU kernel again
        q = rand(1, 4, 2, 32)
        torch.ops.aten._flash_attention_forward(q, q, q, None, None, 4, 4, 0.0, False, False)


# ---- ATen's flash ops served by our forward and backward ----


@pytest.mark.parametrize("causal,window,sq,sk,hq,hk", [
    (False, (None, None), 37, 37, 4, 4),
    (True, (None, None), 29, 45, 6, 2),   # bottom-right causal (FlashAttention's rule), GQA
    (False, (7, 0), 40, 40, 4, 1),        # sliding window, MQA
    (False, (-1, -1), 19, 53, 2, 2),
])
def test_flash_attention_forward_and_backward(provider, causal, window, sq, sk, hq, hk):
    q, k, v = rand(2, sq, hq, 64, requires_grad=True), rand(2, sk, hk, 64, requires_grad=True), rand(2, sk, hk, 64, requires_grad=True)
    scale = 0.3 * torch.rand(()).item() + 0.05
    out, lse, rng, offset, debug = torch.ops.aten._flash_attention_forward(
        q, k, v, None, None, sq, sk, 0.0, causal, False, scale=scale, window_size_left=window[0],
        window_size_right=window[1])
    ref_window = tuple(-1 if w is None else w for w in window)
    out_ref, lse_ref = attention_ref(q.detach(), k.detach(), v.detach(), softmax_scale=scale, causal=causal,
                                     window_size=ref_window)
    torch.testing.assert_close(out, out_ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, lse_ref, atol=1e-3, rtol=1e-3)
    assert lse.dtype == torch.float32 and lse.shape == (2, hq, sq)
    assert rng.shape == (2,) and rng.dtype == torch.uint64 and offset.shape == () and offset.dtype == torch.uint64
    assert debug.numel() == 0
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)  # ATen's formula -> aten::_flash_attention_backward -> ours
    want = _reference_grads((q, k, v, None), dout, softmax_scale=scale, causal=causal, window_size=ref_window)
    for name, got, ref in zip("qkv", grads, want):
        torch.testing.assert_close(got.float(), ref, atol=5e-2, rtol=5e-2, msg=f"d{name}")
    assert all(not calls.calls for calls in provider.values()), "nothing fell back"


def test_flash_attention_forward_packed(provider):
    cu_q, cu_k = random_cu_seqlens(4, 40), random_cu_seqlens(4, 40)
    q, k, v = rand(int(cu_q[-1]), 4, 64), rand(int(cu_k[-1]), 2, 64), rand(int(cu_k[-1]), 2, 64)
    max_q, max_k = (int((cu[1:] - cu[:-1]).max()) for cu in (cu_q, cu_k))
    out, lse, *_ = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False)
    out_ref, lse_ref = attention_ref(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    assert lse.shape == (4, q.shape[0])  # ATen's packed LSE: (heads, total_q)
    torch.testing.assert_close(out, out_ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, lse_ref, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("bhsd_memory", [False, True])
def test_sdpa_flash_op_forward_and_backward(provider, bhsd_memory):
    b, h, s, d = 2, 4, 33, 64
    if bhsd_memory:  # contiguous (b, h, s, d): our (b, s, h, d) output is copied to query's strides
        q, k, v = (rand(b, h, s, d, requires_grad=True) for _ in range(3))
    else:  # transposed views of (b, s, h, d) memory, as attention modules make them
        q, k, v = (rand(b, s, h, d).transpose(1, 2).requires_grad_() for _ in range(3))
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, debug = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, True)
    assert out.stride() == torch.empty_like(q).stride(), "the meta function's strides"
    assert cum_q is None and cum_k is None and (max_q, max_k) == (s, s)
    assert lse.shape == (b, h, s) and lse.dtype == torch.float32
    assert seed.dtype == offset.dtype == torch.uint64 and debug.numel() == 0
    bshd = [t.detach().transpose(1, 2) for t in (q, k, v)]
    out_ref, lse_ref = attention_ref(*bshd, causal=True)
    torch.testing.assert_close(out, out_ref.transpose(1, 2), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, lse_ref, atol=1e-3, rtol=1e-3)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    want = _reference_grads((*bshd, None), dout.transpose(1, 2), causal=True)
    for name, got, ref, inp in zip("qkv", grads, want, (q, k, v)):
        torch.testing.assert_close(got.transpose(1, 2).float(), ref, atol=5e-2, rtol=5e-2, msg=f"d{name}")
        assert got.stride() == torch.empty_like(inp).stride()


@pytest.mark.parametrize("window_size", [(-1, 0), [-1, 0], (-1, -1), (5, 0)])
def test_varlen_attn_forward_and_backward(provider, window_size):
    from torch.nn.attention.varlen import AuxRequest, varlen_attn

    cu = random_cu_seqlens(3, 30, allow_zero=False)
    total, max_len = int(cu[-1]), int((cu[1:] - cu[:-1]).max())
    q, k, v = (rand(total, 4, 64, requires_grad=True) for _ in range(3))
    out, lse = varlen_attn(q, k, v, cu, cu, max_len, max_len, window_size=window_size,
                           return_aux=AuxRequest(lse=True))
    left, right = window_size
    ref_opts = dict(causal=left == -1 and right == 0, window_size=(left, right) if left >= 0 else (-1, -1))
    out_ref, lse_ref = attention_ref(q.detach(), k.detach(), v.detach(), cu_seqlens_q=cu, cu_seqlens_k=cu, **ref_opts)
    torch.testing.assert_close(out, out_ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, lse_ref, atol=1e-3, rtol=1e-3)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    want = _reference_grads((q, k, v, None), dout, cu_seqlens_q=cu, cu_seqlens_k=cu, **ref_opts)
    for name, got, ref in zip("qkv", grads, want):
        torch.testing.assert_close(got.float(), ref, atol=5e-2, rtol=5e-2, msg=f"d{name}")


@pytest.mark.skipif(not hasattr(torch.ops.aten, "_flash_attention_forward_no_dropout_inplace"),
                    reason="torch < 2.13 has no _flash_attention_forward_no_dropout_inplace")
def test_varlen_attn_out_writes_into_the_given_tensor(provider):
    from torch.nn.attention.varlen import AuxRequest, varlen_attn_out

    cu = random_cu_seqlens(3, 30, allow_zero=False)
    total, max_len = int(cu[-1]), int((cu[1:] - cu[:-1]).max())
    q, k, v = (rand(total, 2, 64) for _ in range(3))
    out = torch.full_like(q, float("nan"))
    got, lse = varlen_attn_out(out, q, k, v, cu, cu, max_len, max_len, window_size=(-1, 0),
                               return_aux=AuxRequest(lse=True))
    out_ref, lse_ref = attention_ref(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, out_ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, lse_ref, atol=1e-3, rtol=1e-3)


# ---- argument translation (our forward replaced by a spy) ----


@pytest.fixture
def forward_spy(provider, monkeypatch):
    seen = []

    def spy(q, k, v, **kwargs):
        seen.append(kwargs)
        varlen = kwargs["cu_seqlens_q"] is not None
        lse_shape = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
        return torch.randn(*q.shape[:-1], v.shape[-1]).to(q.dtype), torch.randn(lse_shape)

    monkeypatch.setattr(torch_provider, "_run_forward", spy)
    return seen


@pytest.mark.parametrize("given,expected", [
    (dict(), dict(softmax_scale=1 / math.sqrt(64), causal=False, window_left=-1, window_right=-1, num_splits=0)),
    (dict(scale=0.25, num_splits=1), dict(softmax_scale=0.25, num_splits=1)),
    (dict(num_splits=3), dict(num_splits=3)),
    (dict(window_size_left=-1, window_size_right=0), dict(causal=True, window_left=-1, window_right=0)),
    (dict(window_size_left=16, window_size_right=None), dict(causal=False, window_left=16, window_right=-1)),
])
def test_forward_options_translate(forward_spy, given, expected):
    q = rand(2, 24, 4, 64)
    torch.ops.aten._flash_attention_forward(q, q, q, None, None, 24, 24, 0.0, False, False, **given)
    (seen,) = forward_spy
    assert {key: seen[key] for key in expected} == pytest.approx(expected)
    assert seen["max_seqlen_q"] == seen["max_seqlen_k"] == 24


def test_repeated_calls_are_checked_once(provider, forward_spy, monkeypatch):
    """What the checks derive for an accepted call is kept (a model repeats its calls at every layer
    and step); a call that differs in anything they read is checked again, and a refused call is
    never kept: it falls back every time."""
    checks = []
    real = torch_provider._checked_forward
    monkeypatch.setattr(torch_provider, "_checked_forward", lambda *args: checks.append(args[5:7]) or real(*args))
    original = provider["_flash_attention_forward"]
    q = rand(2, 16, 2, 64)
    for _ in range(3):
        torch.ops.aten._flash_attention_forward(*fwd_args(q), scale=0.5)
    assert len(checks) == 1 and [seen["softmax_scale"] for seen in forward_spy] == [0.5] * 3
    torch.ops.aten._flash_attention_forward(*fwd_args(q), scale=0.25)  # an option
    torch.ops.aten._flash_attention_forward(*fwd_args(q.half()), scale=0.5)  # a dtype
    assert len(checks) == 3 and [seen["softmax_scale"] for seen in forward_spy[3:]] == [0.25, 0.5]
    for bad in (fwd_args(q, dropout_p=0.1), fwd_args(q.float())):  # refused, twice each
        for _ in range(2):
            assert from_pytorch(torch.ops.aten._flash_attention_forward(*bad, scale=0.5)[0])
    assert len(checks) == 7 and len(original.calls) == 4 and len(forward_spy) == 5
    # Packed: the lengths are the call's own, never the first call's.
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    qv = rand(16, 2, 64)
    for cu_q, max_q in ((cu, 11), (torch.tensor([0, 9, 16], dtype=torch.int32), 9)):
        torch.ops.aten._flash_attention_forward(qv, qv, qv, cu_q, cu_q, max_q, max_q, 0.0, False, False)
        assert forward_spy[-1]["cu_seqlens_q"] is cu_q and forward_spy[-1]["max_seqlen_q"] == max_q
    assert len(checks) == 8


def test_causal_flag_zeroes_the_right_window(forward_spy):
    q = rand(1, 24, 2, 64)
    torch.ops.aten._flash_attention_forward(q, q, q, None, None, 24, 24, 0.0, True, False, window_size_left=8,
                                            window_size_right=8)
    assert (forward_spy[0]["window_left"], forward_spy[0]["window_right"]) == (8, 0)


def test_num_splits_ignored_on_an_arch_without_split_kv(forward_spy, monkeypatch, caplog):
    monkeypatch.setattr(torch_provider, "has_split_kv", lambda arch: False)
    q = rand(1, 24, 2, 64)
    with caplog.at_level(logging.DEBUG, logger="flash_attn4"):
        torch.ops.aten._flash_attention_forward(q, q, q, None, None, 24, 24, 0.0, False, False, num_splits=4)
    assert forward_spy[0]["num_splits"] == 1, "ours ran, unsplit"
    assert [r.getMessage() for r in caplog.records] == [
        "flash-attn4 attention provider: num_splits=4 ignored, sm_90a has no split-KV"]


def test_deterministic_algorithms_reach_our_backward(provider, monkeypatch):
    seen = []

    def spy(grad_out, q, k, v, out, lse, **kwargs):
        seen.append(kwargs["deterministic"])
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    monkeypatch.setattr(torch_provider, "_run_backward", spy)
    q = rand(1, 16, 2, 64, requires_grad=True)
    for flag in (False, True):
        previous = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(flag)
        try:
            out = torch.ops.aten._flash_attention_forward(q, q, q, None, None, 16, 16, 0.0, False, False)[0]
            out.sum().backward()
        finally:
            torch.use_deterministic_algorithms(previous)
    assert seen == [False, True]


# ---- fallback to PyTorch's kernel ----


def fwd_args(q, dropout_p=0.0, return_debug_mask=False):
    return (q, q, q, None, None, q.shape[1], q.shape[1], dropout_p, False, return_debug_mask)


@pytest.mark.parametrize("case", ["dropout", "debug_mask", "alibi", "block_table", "float32", "head_dim_8",
                                  "head_dim_12", "no_kernels_for_gpu"])
def test_forward_falls_back_to_pytorch(provider, monkeypatch, case, caplog):
    q = rand(2, 16, 2, 64)
    kwargs, args = {}, fwd_args(q)
    if case == "dropout":
        args = fwd_args(q, dropout_p=0.1)
    elif case == "debug_mask":
        args = fwd_args(q, return_debug_mask=True)
    elif case == "alibi":
        kwargs = dict(alibi_slopes=torch.rand(2, 2))
    elif case == "block_table":
        kwargs = dict(block_table=torch.zeros(2, 1, dtype=torch.int32), seqused_k=torch.full((2,), 16,
                                                                                               dtype=torch.int32))
    elif case == "float32":
        args = fwd_args(q.float())
    elif case == "head_dim_8":
        args = fwd_args(rand(2, 16, 2, 8))
    elif case == "head_dim_12":
        args = fwd_args(rand(2, 16, 2, 12))
    elif case == "no_kernels_for_gpu":
        def no_kernels(device, kernel="forward"):
            raise RuntimeError("flash-attn4 has no kernels for this GPU (compute capability 8.0)")
        monkeypatch.setattr(dispatch, "arch_for_device", no_kernels)
    with caplog.at_level(logging.DEBUG, logger="flash_attn4"):
        for _ in range(2):
            result = torch.ops.aten._flash_attention_forward(*args, **kwargs)
    original = provider["_flash_attention_forward"]
    assert from_pytorch(result[0]) and len(original.calls) == 2
    keyset, passed_args, passed_kwargs = original.calls[0]
    assert passed_args[0] is args[0] and passed_args[7:] == args[7:] and passed_kwargs.keys() == kwargs.keys()
    assert "CPU" in str(keyset)
    logged = [r for r in caplog.records if "_flash_attention_forward runs PyTorch's kernel" in r.getMessage()]
    assert len(logged) == 1, "one log line per reason"


def test_sdpa_with_dropout_falls_back_forward_and_backward(provider):
    q = rand(1, 2, 16, 64)
    assert from_pytorch(torch.ops.aten._scaled_dot_product_flash_attention(q, q, q, 0.2)[0])
    lse = torch.randn(1, 2, 16)
    seed, offset = torch.zeros(2, dtype=torch.uint64), torch.zeros((), dtype=torch.uint64)
    got = torch.ops.aten._scaled_dot_product_flash_attention_backward(q, q, q, q, q, lse, None, None, 16, 16, 0.2,
                                                                      False, seed, offset)
    assert from_pytorch(got[0])
    assert len(provider["_scaled_dot_product_flash_attention"].calls) == 1
    assert len(provider["_scaled_dot_product_flash_attention_backward"].calls) == 1


def test_backward_falls_back_where_the_arch_has_no_backward_kernel(provider, monkeypatch):
    def forward_only(device, kernel="forward"):
        if kernel == "backward":
            raise NotImplementedError("flash-attn4: sm100 backward kernels are not implemented yet")
        return dispatch.Arch.SM90

    monkeypatch.setattr(dispatch, "arch_for_device", forward_only)
    q = rand(1, 16, 2, 64, requires_grad=True)
    out = torch.ops.aten._flash_attention_forward(*fwd_args(q))[0]
    assert not provider["_flash_attention_forward"].calls, "the forward is ours"
    out.sum().backward()
    assert len(provider["_flash_attention_backward"].calls) == 1 and from_pytorch(q.grad)


@pytest.mark.parametrize("d", [160, 192])
def test_sm100_backward_serves_head_dims_it_has_no_kernel_for_padded(provider, monkeypatch, d):
    """On a B200 head dims without an sm_100a kernel of their own (160, 192 = 192 / 192) run on the
    d = dv = 256 CTA pair, zero-padded (dispatch.backward_head_dims): ours, not PyTorch's."""
    monkeypatch.setattr(dispatch, "arch_for_device",
                        lambda device, kernel="forward": dispatch.Arch.SM90 if kernel == "forward" else dispatch.Arch.SM100)
    q = rand(1, 16, 2, d, requires_grad=True)
    out = torch.ops.aten._flash_attention_forward(*fwd_args(q))[0]
    assert not provider["_flash_attention_forward"].calls, "the forward is ours"
    out.sum().backward()
    assert not provider["_flash_attention_backward"].calls and not from_pytorch(q.grad)
    assert q.grad.shape == q.shape


@pytest.mark.parametrize("deterministic", [False, True])
def test_sm100_backward_serves_what_it_implements(provider, monkeypatch, deterministic):
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: deterministic)
    monkeypatch.setattr(dispatch, "arch_for_device",
                        lambda device, kernel="forward": dispatch.Arch.SM90 if kernel == "forward" else dispatch.Arch.SM100)
    q = rand(1, 16, 2, 64, requires_grad=True)
    torch.ops.aten._flash_attention_forward(*fwd_args(q))[0].sum().backward()
    assert not provider["_flash_attention_backward"].calls and not from_pytorch(q.grad)


@pytest.mark.parametrize("bad", ["lse_dtype", "lse_shape", "dropout"])
def test_backward_falls_back_on_what_it_cannot_take(provider, bad):
    q = rand(2, 16, 2, 64)
    lse = torch.randn(2, 2, 16)
    dropout = 0.0
    if bad == "lse_dtype":
        lse = lse.half()
    elif bad == "lse_shape":
        lse = lse[..., :8]
    else:
        dropout = 0.1
    rng, unused = torch.zeros(2, dtype=torch.uint64), torch.zeros((), dtype=torch.uint64)
    got = torch.ops.aten._flash_attention_backward(q, q, q, q, q, lse, None, None, 16, 16, dropout, False, rng, unused)
    assert from_pytorch(got[0]) and len(provider["_flash_attention_backward"].calls) == 1


def test_options_from_a_newer_torch(provider, forward_spy):
    """The dispatcher hands over keyword options that differ from their default: an unknown one set
    to a value goes to PyTorch's kernel; None (a default) is ignored. Called without the dispatcher,
    since the installed schema has no such option."""
    q = rand(1, 16, 2, 64)
    original = provider["_flash_attention_forward"]
    for value, ours in ((None, True), (3, False)):
        call = torch_provider._Call("_flash_attention_forward", original, None, fwd_args(q), {"future_option": value})
        result = torch_provider._flash_forward(call, *fwd_args(q), future_option=value)
        assert from_pytorch(result[0]) != ours
    assert len(forward_spy) == 1 and len(original.calls) == 1
    call = torch_provider._Call("_flash_attention_forward", original, None, (*fwd_args(q), 1.0), {})
    assert from_pytorch(torch_provider._flash_forward(call, *fwd_args(q), 1.0)[0]), "an extra positional argument"


def test_a_problem_without_our_kernel_falls_back(provider, monkeypatch):
    def no_kernel(*args, **kwargs):
        raise NotImplementedError("flash-attn4: split-KV with this mask is not implemented")

    monkeypatch.setattr(torch_provider, "_run_forward", no_kernel)
    q = rand(1, 16, 2, 64)
    assert from_pytorch(torch.ops.aten._flash_attention_forward(*fwd_args(q), num_splits=4)[0])


def test_without_a_pytorch_kernel_the_error_names_op_and_reason(cpu_backward):
    handle = torch_provider.install("CPU")  # this build has no CPU flash kernel to capture
    try:
        q = rand(1, 16, 2, 64)
        with pytest.raises(RuntimeError, match=r"aten::_flash_attention_forward .*dropout_p=0\.1"):
            torch.ops.aten._flash_attention_forward(*fwd_args(q, dropout_p=0.1))
    finally:
        handle.remove()
