"""The torch.library custom op that runs the forward kernel, its fake (meta) implementation and its
autograd registration.

``fwd`` is functional (``mutates_args=()``): it allocates ``out`` and ``lse`` and returns both, so
``torch.compile(fullgraph=True)`` traces it as one opaque node (shapes from the fake implementation)
and CUDA-graph capture records the kernel launch. The kernel is launched through TVM-FFI: when a
torch CUDA tensor is an argument, tvm-ffi asks torch (DLPack exchange API: torch itself, or
torch-c-dlpack-ext) for the *current stream* of that tensor's device and hands it to the kernel as
the environment stream. So the kernel runs on ``torch.cuda.current_stream()`` - inside
``torch.cuda.stream(s)`` on ``s``, and during graph capture on the capture stream.

The op expects arguments already checked by ``validate`` (``interface`` does that); it only fixes
layouts the kernel cannot read (copies) and, when asked by FLASH_ATTN4_CHECK_CU_SEQLENS, checks
varlen metadata values.

Schema (all scalars are plain op arguments, never tensors):
    fwd(q, k, v, cu_seqlens_q?, cu_seqlens_k?, seqused_k?, learnable_sink?, softmax_scale: float,
        softcap: float, causal: bool, window_left: int, window_right: int, max_seqlen_q: int)
        -> (out, lse)
``causal``/``window_*`` are canonical (``validate.canonical_mask``): local = not causal and a window
side >= 0. ``learnable_sink`` must already be float32.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from . import compile_cache, dispatch, settings, validate
from ._ops import add_op_namespace_prefix

# Test hook: when True the op fills out with NaN and lse with +inf right after allocating them, so a
# test can tell "the kernel wrote every element" from "torch.empty happened to hold the right bytes".
# The tests set it with monkeypatch; nothing else should.
_poison_outputs_for_tests = False


def _output_shapes(q: torch.Tensor, v: torch.Tensor, varlen: bool) -> tuple[tuple, tuple]:
    if varlen:
        total_q, hq = q.shape[0], q.shape[1]
        return (total_q, hq, v.shape[-1]), (hq, total_q)
    b, sq, hq = q.shape[0], q.shape[1], q.shape[2]
    return (b, sq, hq, v.shape[-1]), (b, hq, sq)


def _is_local(causal: bool, window_left: int, window_right: int) -> bool:
    return not causal and (window_left >= 0 or window_right >= 0)


def _kernel_for(q: torch.Tensor, v: torch.Tensor, *, causal: bool, local: bool, has_softcap: bool,
                varlen: bool, has_seqused_k: bool, has_sink: bool):
    """Device -> arch -> ForwardConfig -> compiled kernel (the one seam CPU tests replace)."""
    arch = dispatch.arch_for_device(q.device)
    cfg = dispatch.forward_config(
        arch, dispatch.dtype_name(q.dtype), q.shape[-1], v.shape[-1], causal=causal, local=local,
        has_softcap=has_softcap, varlen=varlen, has_seqused_k=has_seqused_k, has_sink=has_sink,
    )
    return compile_cache.get_forward_kernel(cfg)


def _fill_empty_keys(out: torch.Tensor, lse: torch.Tensor, learnable_sink: Optional[torch.Tensor],
                     varlen: bool) -> None:
    """No key at all: every row is fully masked (out 0; lse -inf, or the sink logit with a sink)."""
    out.zero_()
    if learnable_sink is None:
        lse.fill_(float("-inf"))
    elif varlen:  # lse (hq, total_q)
        lse.copy_(learnable_sink[:, None].expand_as(lse))
    else:  # lse (b, hq, sq)
        lse.copy_(learnable_sink[None, :, None].expand_as(lse))


@torch.library.custom_op(add_op_namespace_prefix("fwd"), mutates_args=())
def fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor],
    seqused_k: Optional[torch.Tensor],
    learnable_sink: Optional[torch.Tensor],
    softmax_scale: float,
    softcap: float,
    causal: bool,
    window_left: int,
    window_right: int,
    max_seqlen_q: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    varlen = cu_seqlens_q is not None
    out_shape, lse_shape = _output_shapes(q, v, varlen)
    out = torch.empty(out_shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    if _poison_outputs_for_tests:
        out.fill_(float("nan"))
        lse.fill_(float("inf"))
    if out.numel() == 0:
        return out, lse
    if k.shape[0] == 0 or (not varlen and k.shape[1] == 0):
        _fill_empty_keys(out, lse, learnable_sink, varlen)
        return out, lse

    q, k, v = validate.kernel_layout(q), validate.kernel_layout(k), validate.kernel_layout(v)
    if varlen:
        cu_seqlens_q = cu_seqlens_q.contiguous()
        cu_seqlens_k = cu_seqlens_k.contiguous()
        if (settings.check_cu_seqlens()
                and not (q.is_cuda and torch.cuda.is_current_stream_capturing())):
            validate.check_varlen_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q,
                                         seqused_k)
    if seqused_k is not None:
        seqused_k = seqused_k.contiguous()
    if learnable_sink is not None:
        learnable_sink = learnable_sink.contiguous()

    kernel = _kernel_for(
        q, v, causal=causal, local=_is_local(causal, window_left, window_right), has_softcap=softcap > 0.0,
        varlen=varlen, has_seqused_k=seqused_k is not None, has_sink=learnable_sink is not None,
    )
    with _device_guard(q.device):
        kernel(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, learnable_sink,
               float(softmax_scale), float(softcap), int(window_left), int(window_right), int(max_seqlen_q))
    return out, lse


def _device_guard(device: torch.device):
    """Make ``device`` current for the launch when it is not already (multi-GPU processes)."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


@fwd.register_fake
def _fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, learnable_sink, softmax_scale, softcap,
              causal, window_left, window_right, max_seqlen_q):
    out_shape, lse_shape = _output_shapes(q, v, cu_seqlens_q is not None)
    return q.new_empty(out_shape), q.new_empty(lse_shape, dtype=torch.float32)


# ---- backward ----
#
# The sm90 backward kernel is a draft that has not been validated on a GPU: unless the developer switch
# FLASH_ATTN4_UNVERIFIED_BACKWARD=1 is set, a backward pass raises BACKWARD_NOT_IMPLEMENTED. Forward
# calls with requires_grad inputs always work (inference, or training other parts of a model).

BACKWARD_NOT_IMPLEMENTED = (
    "flash-attn4: backward is not implemented yet (forward only). Run the forward under "
    "torch.no_grad()/torch.inference_mode(), or use another attention implementation for training."
)
LOG2_E = 1.4426950408889634


@torch.library.custom_op(add_op_namespace_prefix("bwd"), mutates_args=())
def bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of the batched forward (kernel call convention: BackwardConfig's docstring). The
    small elementwise steps around the kernel (LSE in log2 units, rowsum(dout * out), fp32
    accumulators and their conversion) run in torch."""
    q, k, v, dout = (validate.kernel_layout(t) for t in (q, k, v, dout))
    cfg = dispatch.backward_config(dispatch.arch_for_device(q.device), dispatch.dtype_name(q.dtype), q.shape[-1],
                                   v.shape[-1], causal=causal, local=_is_local(causal, window_left, window_right))
    kernel = compile_cache.get_backward_kernel(cfg)
    lse_log2 = torch.where(torch.isinf(lse), float("inf"), lse * LOG2_E).contiguous()  # no key: P = 0
    dpsum = (dout.float() * out.float()).sum(-1).transpose(1, 2).contiguous()  # (b, hq, sq)
    dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk_acc = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv_acc = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    with _device_guard(q.device):
        kernel(q, k, v, dout, lse_log2, dpsum, dq_acc, dk_acc, dv_acc, float(softmax_scale), int(window_left),
               int(window_right))
    return (dq_acc * softmax_scale).to(q.dtype), dk_acc.to(k.dtype), dv_acc.to(v.dtype)


@bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _backward_limits(q, v, cu_seqlens_q, seqused_k, learnable_sink, softcap) -> str | None:
    """What the backward draft does not do, or None."""
    if cu_seqlens_q is not None or seqused_k is not None:
        return "varlen inputs"
    if learnable_sink is not None:
        return "learnable_sink"
    if softcap > 0.0:
        return "softcap"
    d, dv = q.shape[-1], v.shape[-1]
    if d != dv or d > 128 or d % 16 != 0:
        return f"head dims {d}/{dv} (needs head_dim == head_dim_v, a multiple of 16 up to 128)"
    return None


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, _, seqused_k, learnable_sink, softmax_scale, softcap, causal, left, right, _ = inputs
    out, lse = output
    ctx.set_materialize_grads(False)  # an unused lse gradient arrives as None
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.limits = _backward_limits(q, v, cu_seqlens_q, seqused_k, learnable_sink, softcap)
    ctx.options = (softmax_scale, causal, left, right)


def _backward(ctx, grad_out, grad_lse):
    if not settings.unverified_backward():
        raise NotImplementedError(BACKWARD_NOT_IMPLEMENTED)
    if ctx.limits is not None:
        raise NotImplementedError(f"flash-attn4 backward (draft): {ctx.limits} not supported")
    if grad_lse is not None:
        raise NotImplementedError("flash-attn4 backward: gradients through the returned lse are not supported")
    q, k, v, out, lse = ctx.saved_tensors
    if grad_out is None:
        return (None,) * 13
    dq, dk, dv = bwd(grad_out, q, k, v, out, lse, *ctx.options)
    return (dq, dk, dv) + (None,) * 10


fwd.register_autograd(_backward, setup_context=_setup_context)
