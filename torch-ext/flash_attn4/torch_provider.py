"""flash-attn4 as a PyTorch flash-attention provider (``torch.nn.attention``'s provider registry).

Importing flash_attn4 registers the provider under :data:`PROVIDER_NAME`; it is never activated
by the import (providers must coexist). Opt in with::

    import flash_attn4, torch
    torch.nn.attention.activate_flash_attention_impl("flash-attn4")
    ...  # F.scaled_dot_product_attention (flash backend), varlen_attn, context_parallel run on our kernels
    torch.nn.attention.restore_flash_attention_impl()  # PyTorch's own kernels again

Activation installs CUDA kernels for ATen's flash-attention ops: ``_flash_attention_forward``,
``_flash_attention_backward``, ``_scaled_dot_product_flash_attention`` and its ``_backward``, and
(where the op exists, torch >= 2.13) ``_flash_attention_forward_no_dropout_inplace``. ATen's own
autograd formulas stay in charge, so forward and backward both arrive here. Each call is served by
our forward / backward (ops.py) when we can; otherwise it goes to PyTorch's kernel for that op,
captured when the provider was activated, with a one-time debug log of the reason
(``FLASH_ATTN4_LOG_LEVEL=DEBUG``). Falls back: dropout_p > 0, return_debug_mask, alibi_slopes,
block_table (paged KV), an option a newer torch passes that we do not know, inputs our validation
rejects (dtype, head dim, shapes), a GPU without our kernel for the pass (e.g. the backward on
Blackwell), a LSE that is not float32. ``num_splits`` > 1 on an arch without split-KV runs unsplit;
None lets our heuristic choose (ATen's "automatic"), 1 turns split-KV off.

What ATen gets back: the output, the LSE (float32, (b, h, s) batched, (h, total_q) packed, the
layout our kernels produce), an rng state ((2,) uint64) and offset (uint64 scalar) left unset since
no dropout ran (as PyTorch's kernel leaves them), an empty debug mask. The SDPA op's output has the
strides of ``empty_like(query)``, as PyTorch's meta function promises (a copy only when the query is
not a transposed view of (b, s, h, d) memory). The backward accepts an LSE it did not produce
(context parallelism merges the chunks' LSEs before calling it);
``torch.use_deterministic_algorithms(True)`` runs our deterministic backward.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from . import compile_cache, dispatch, ops, settings, validate
from .fa4_kernels.tiles import has_split_kv

PROVIDER_NAME = "flash-attn4"

# Keyword options of ATen's flash forward that we translate; any other one a newer torch passes
# with a value other than None sends the call to PyTorch's kernel.
_FORWARD_OPTIONS = frozenset({"scale", "window_size_left", "window_size_right", "seqused_k", "alibi_slopes",
                              "block_table", "num_splits"})
_BACKWARD_OPTIONS = frozenset({"scale", "window_size_left", "window_size_right"})


def register() -> bool:
    """Register the provider with torch's registry (does not activate it). False, with a debug log,
    on a torch without the registry (before 2.11)."""
    attention = torch.nn.attention
    if not hasattr(attention, "register_flash_attention_impl"):
        settings.get_logger().debug("torch %s has no torch.nn.attention.register_flash_attention_impl; the "
                                    "%r attention provider is not registered", torch.__version__, PROVIDER_NAME)
        return False
    attention.register_flash_attention_impl(PROVIDER_NAME, register_fn=functools.partial(install, "CUDA"))
    return True


class ProviderHandle:
    """What activation returns to torch's registry: ``remove()`` drops our kernels, which puts
    PyTorch's back (torch.nn.attention.restore_flash_attention_impl calls it)."""

    def __init__(self, library: torch.library.Library):
        self._library = library

    @property
    def active(self) -> bool:
        return self._library is not None

    def remove(self) -> None:
        if self._library is None:
            return
        destroy = getattr(self._library, "_destroy", None)
        if destroy is not None:
            destroy()  # unregisters now, not whenever the Library is garbage-collected
        self._library = None


def install(dispatch_key: str = "CUDA") -> ProviderHandle:
    """Install our kernels for ATen's flash-attention ops under ``dispatch_key`` (the registry's
    register_fn; tests use "CPU"). PyTorch's kernels are captured first: torch's registry restores the
    previous provider before calling this, so what is captured is PyTorch's own (a capture taken
    after our registration would return ours)."""
    library = torch.library.Library("aten", "IMPL", dispatch_key)
    handle = ProviderHandle(library)
    try:
        for name, impl in _IMPLS.items():
            if not hasattr(torch.ops.aten, name):  # _flash_attention_forward_no_dropout_inplace: torch >= 2.13
                continue
            original = _capture(name, dispatch_key)
            library.impl(name, _kernel(name, impl, original), dispatch_key, with_keyset=True)
    except BaseException:
        handle.remove()
        raise
    return handle


def _capture(name: str, dispatch_key: str):
    """PyTorch's current kernel for aten::name, or None where there is none (a CPU-only build has no
    CUDA flash kernels) or torch cannot hand it out."""
    get_kernel = getattr(torch.library, "get_kernel", None)
    if get_kernel is None:
        return None
    try:
        return get_kernel(f"aten::{name}", dispatch_key)
    except RuntimeError:
        return None


class _Unsupported(Exception):
    """This call goes to PyTorch's kernel; the message says why."""


class _Call:
    """One dispatched call: what PyTorch's kernel needs to run it instead of us."""

    __slots__ = ("op", "original", "keyset", "args", "kwargs")

    def __init__(self, op, original, keyset, args, kwargs):
        self.op, self.original, self.keyset, self.args, self.kwargs = op, original, keyset, args, kwargs

    def fallback(self, reason: str):
        _log_once(f"flash-attn4 attention provider: aten::{self.op} runs PyTorch's kernel: {reason}")
        if self.original is None:
            raise RuntimeError(f"flash-attn4 attention provider: aten::{self.op} cannot run this call on our kernels "
                               f"({reason}) and PyTorch has no kernel of its own to fall back to here")
        return self.original.call_boxed(self.keyset, *self.args, **self.kwargs)


_LOGGED: set = set()


def _log_once(message: str) -> None:
    """A debug log line, once per distinct message (fallback reasons repeat on every call)."""
    if message in _LOGGED:
        return
    if len(_LOGGED) < 1024:
        _LOGGED.add(message)
    settings.get_logger().debug(message)


def _kernel(name: str, impl, original):
    def run(keyset, *args, **kwargs):
        return impl(_Call(name, original, keyset, args, kwargs), *args, **kwargs)

    run.__name__ = f"flash_attn4_{name}"
    return ops._outside_dynamo(run)


# ---- argument translation ----


def _check_options(options: dict, known: frozenset) -> None:
    unknown = sorted(k for k, val in options.items() if k not in known and val is not None)
    if unknown:
        raise _Unsupported(f"option(s) {', '.join(unknown)} (from a newer torch) are not handled by flash-attn4")


def _check_positional(extra: tuple) -> None:
    if extra:
        raise _Unsupported(f"{len(extra)} positional argument(s) more than this schema has (a newer torch)")


def _arch(device: torch.device, kernel: str):
    try:
        return dispatch.arch_for_device(device, kernel=kernel)
    except (RuntimeError, NotImplementedError) as exc:
        raise _Unsupported(str(exc)) from None


def _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k=None) -> None:
    """Our validation of ATen's tensors (shapes, dtypes, head dims, devices); its errors mean "not for us"."""
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise _Unsupported("cum_seq_q and cum_seq_k must both be given (packed) or both be None (batched)")
    try:
        if cu_seqlens_q is None:
            validate.check_batched(q, k, v)
            batch = q.shape[0]
        else:
            validate.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)
            batch = cu_seqlens_q.shape[0] - 1
        validate.check_seqused_k(seqused_k, batch)
        validate.check_devices(q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k)
    except (ValueError, NotImplementedError) as exc:
        raise _Unsupported(str(exc)) from None


def _mask_and_scale(q, is_causal, scale, window_size_left, window_size_right):
    """(softmax_scale, causal, left, right) in our kernels' terms; ATen's -1 or None = unbounded."""
    try:
        softmax_scale = validate.check_softmax_scale(scale, q.shape[-1])
        left, right = validate.check_window_size((window_size_left, window_size_right))
        causal, _local, left, right = validate.canonical_mask(bool(is_causal), left, right)
    except (ValueError, NotImplementedError) as exc:
        raise _Unsupported(str(exc)) from None
    return softmax_scale, causal, left, right


def _split_count(num_splits, arch, num_heads_q: int) -> int:
    """ATen's num_splits as ours: None -> 0 (automatic), N > 1 -> 1 where the arch has no split-KV."""
    if num_splits is None:
        return 0
    try:
        num_splits = validate.check_num_splits(num_splits, num_heads_q)
    except ValueError as exc:
        raise _Unsupported(str(exc)) from None
    if num_splits > 1 and not has_split_kv(arch):
        _log_once(f"flash-attn4 attention provider: num_splits={num_splits} ignored, {arch.value} has no split-KV")
        return 1
    return num_splits


def _forward_args(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, dropout_p, is_causal, return_debug_mask,
                  options: dict) -> dict:
    """ATen's flash forward arguments as ours (_run_forward's keywords), or _Unsupported."""
    softmax_scale, causal, left, right, num_splits = _memoized(
        "forward", (q, k, v, cu_seqlens_q, cu_seqlens_k), (dropout_p, is_causal, return_debug_mask), options,
        lambda: _checked_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, is_causal, return_debug_mask,
                                 options))
    varlen = cu_seqlens_q is not None
    return dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=options.get("seqused_k"),
                softmax_scale=softmax_scale, causal=causal, window_left=left, window_right=right,
                max_seqlen_q=int(max_q) if varlen else q.shape[1], max_seqlen_k=int(max_k) if varlen else k.shape[1],
                num_splits=num_splits)


def _checked_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, is_causal, return_debug_mask,
                     options: dict) -> tuple:
    """_forward_args' checks (_Unsupported for what is not ours to run) and what they derive:
    (softmax_scale, causal, window_left, window_right, num_splits)."""
    _check_options(options, _FORWARD_OPTIONS)
    if dropout_p:
        raise _Unsupported(f"dropout_p={dropout_p}: flash-attn4 has no dropout")
    if return_debug_mask:
        raise _Unsupported("return_debug_mask=True: flash-attn4 returns no attention probabilities")
    for name in ("alibi_slopes", "block_table"):
        if options.get(name) is not None:
            raise _Unsupported(f"{name} is not supported through the provider")
    _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, options.get("seqused_k"))
    arch = _arch(q.device, "forward")
    softmax_scale, causal, left, right = _mask_and_scale(q, is_causal, options.get("scale"),
                                                         options.get("window_size_left"),
                                                         options.get("window_size_right"))
    return softmax_scale, causal, left, right, _split_count(options.get("num_splits"), arch, q.shape[-2])


def _backward_args(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_q, max_k, dropout_p, is_causal,
                   options: dict) -> dict:
    """ATen's flash backward arguments as ours (_run_backward's keywords), or _Unsupported."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    softmax_scale, causal, left, right = _memoized(
        "backward", (grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k), (dropout_p, is_causal, deterministic),
        options, lambda: _checked_backward(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dropout_p,
                                           is_causal, deterministic, options))
    varlen = cu_seqlens_q is not None
    return dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, softmax_scale=softmax_scale, causal=causal,
                window_left=left, window_right=right,
                max_seqlen_q=int(max_q) if varlen else q.shape[1], max_seqlen_k=int(max_k) if varlen else k.shape[1],
                deterministic=deterministic)


def _checked_backward(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dropout_p, is_causal,
                      deterministic: bool, options: dict) -> tuple:
    """_backward_args' checks (_Unsupported for what is not ours to run) and what they derive:
    (softmax_scale, causal, window_left, window_right)."""
    _check_options(options, _BACKWARD_OPTIONS)
    if dropout_p:
        raise _Unsupported(f"dropout_p={dropout_p}: flash-attn4 has no dropout")
    _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)
    varlen = cu_seqlens_q is not None
    lse_shape = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
    if lse.dtype != torch.float32 or tuple(lse.shape) != lse_shape:
        raise _Unsupported(f"logsumexp must be float32 of shape {lse_shape}, got {lse.dtype} {tuple(lse.shape)}")
    out_shape = (*q.shape[:-1], v.shape[-1])
    for name, t in (("out", out), ("grad_out", grad_out)):
        if tuple(t.shape) != out_shape or t.dtype != q.dtype or t.device != q.device:
            raise _Unsupported(f"{name} must be {q.dtype} of shape {out_shape} on {q.device}, got {t.dtype} "
                               f"{tuple(t.shape)} on {t.device}")
    arch = _arch(q.device, "backward")
    softmax_scale, causal, left, right = _mask_and_scale(q, is_causal, options.get("scale"),
                                                         options.get("window_size_left"),
                                                         options.get("window_size_right"))
    try:  # what the arch's backward does not implement is PyTorch's (sm90, sm100: every head dim runs, padded)
        dispatch.backward_config(arch, dispatch.dtype_name(q.dtype),
                                 *dispatch.backward_head_dims(arch, q.shape[-1], v.shape[-1]), causal=causal,
                                 local=ops._is_local(causal, left, right), has_softcap=False, varlen=varlen,
                                 has_seqused_k=False, deterministic=deterministic)
    except NotImplementedError as exc:
        raise _Unsupported(str(exc)) from None
    return softmax_scale, causal, left, right


# ---- the checks' memo ----
#
# A model calls these ops with the same shapes and options at every layer and step, and checking
# them (shapes, dtypes, devices, options, the arch and its backward) cost as much host time as the
# rest of a small call. What the checks derived for a call they accepted is kept under a key of
# everything they read: each tensor's shape, dtype and device (no values, no strides), the scalar
# arguments and options (typed by ATen's schemas, so True, 1 and 1.0 never meet in a key), and what
# the process adds (the device types validation takes, deterministic mode: part of the backward's
# scalars). A refused call is never kept, so it falls back, with its reason, every time. Forgotten
# with the compiled kernels (compile_cache.clear).
MEMO = True
MAX_MEMO = 1024
_MEMO: dict = {}
compile_cache._clear_hooks.append(_MEMO.clear)


def _memoized(kind: str, tensors: tuple, scalars: tuple, options: dict, check: Callable[[], tuple]) -> tuple:
    """``check()``'s result for this call: kept from an earlier call with the same key, or computed
    (its _Unsupported propagates, and nothing is kept)."""
    key = _memo_key(kind, tensors, scalars, options)
    if key is not None:
        try:
            checked = _MEMO.get(key)
        except TypeError:  # an option no dict key can hold: not kept
            key = checked = None
        if checked is not None:
            return checked
    checked = check()
    if key is not None:
        if len(_MEMO) >= MAX_MEMO:
            _MEMO.clear()
        _MEMO[key] = checked
    return checked


def _memo_key(kind: str, tensors: tuple, scalars: tuple, options: dict) -> Optional[tuple]:
    """The memo key of a call, or None (not kept): the memo off, or a tensor that is not a plain one
    (validate.tensor_key)."""
    if not MEMO:
        return None
    parts = [kind, validate.DEVICE_TYPES, scalars]
    for t in tensors:
        part = validate.tensor_key(t)
        if part is False:
            return None
        parts.append(part)
    for name, value in options.items():
        if isinstance(value, torch.Tensor):
            value = validate.tensor_key(value)
            if value is False:
                return None
        parts.append((name, value))
    return tuple(parts)


# ---- the seams to our kernels (CPU tests replace these) ----


def _run_forward(q, k, v, *, cu_seqlens_q, cu_seqlens_k, seqused_k, softmax_scale, causal, window_left, window_right,
                 max_seqlen_q, max_seqlen_k, num_splits):
    """(out, lse) from our forward. We are below ATen's autograd here, so the op's implementation
    runs directly (no autograd node of ours, no dispatcher round trip)."""
    return ops._forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, None, softmax_scale, 0.0, causal, window_left,
                        window_right, max_seqlen_q, max_seqlen_k, num_splits)


def _run_backward(grad_out, q, k, v, out, lse, *, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_left,
                  window_right, max_seqlen_q, max_seqlen_k, deterministic):
    """(dq, dk, dv) from our backward (any head dim the forward takes)."""
    return ops.backward(grad_out, q, k, v, out, lse.contiguous(), cu_seqlens_q, cu_seqlens_k, None, softmax_scale, 0.0,
                        causal, window_left, window_right, max_seqlen_q, max_seqlen_k, deterministic)


def _no_dropout_outputs(q: torch.Tensor):
    """rng state, offset and debug mask of a call without dropout, shaped and typed as ATen's. The
    first two are left unset, as PyTorch's own flash kernel leaves them without dropout: nothing
    reads them, and zeroing them cost two fill kernels per forward on the GPU."""
    rng_state = torch.empty((2,), dtype=torch.uint64, device=q.device)
    offset = torch.empty((), dtype=torch.uint64, device=q.device)
    return rng_state, offset, torch.empty(0, dtype=q.dtype, device=q.device)


def _laid_out_like(t: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy with the strides of ``torch.empty_like(ref)`` (what the meta functions of the
    SDPA ops promise, and what compiled graphs may assert)."""
    if t.shape != ref.shape or t.stride() == torch.empty_like(ref, device="meta").stride():
        return t
    fresh = torch.empty_like(ref)
    fresh.copy_(t)
    return fresh


# ---- the ATen kernels ----


def _flash_forward(call, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                   return_debug_mask, *extra, **options):
    try:
        _check_positional(extra)
        args = _forward_args(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                             return_debug_mask, options)
    except _Unsupported as exc:
        return call.fallback(str(exc))
    try:
        out, lse = _run_forward(query, key, value, **args)
    except NotImplementedError as exc:  # no kernel of ours for this problem (e.g. an explicit num_splits)
        return call.fallback(str(exc))
    return (out, lse, *_no_dropout_outputs(query))


def _flash_forward_into(call, out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                        return_debug_mask, *extra, **options):
    try:
        _check_positional(extra)
        args = _forward_args(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                             return_debug_mask, options)
        want = (*query.shape[:-1], value.shape[-1])
        if tuple(out.shape) != want or out.dtype != query.dtype:
            raise _Unsupported(f"out must be {query.dtype} of shape {want}, got {out.dtype} {tuple(out.shape)}")
    except _Unsupported as exc:
        return call.fallback(str(exc))
    try:
        result, lse = _run_forward(query, key, value, **args)
    except NotImplementedError as exc:
        return call.fallback(str(exc))
    out.copy_(result)  # our forward allocates its output
    return lse


def _flash_backward(call, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                    dropout_p, is_causal, rng_state, unused, *extra, **options):
    try:
        _check_positional(extra)
        args = _backward_args(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                              dropout_p, is_causal, options)
    except _Unsupported as exc:
        return call.fallback(str(exc))
    return _run_backward(grad_out, query, key, value, out, logsumexp, **args)


def _bshd(*tensors):
    """(b, h, s, d) views as (b, s, h, d) views (no copy)."""
    return tuple(t.transpose(1, 2) for t in tensors)


def _sdpa_forward(call, query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *extra,
                  **options):
    try:
        _check_positional(extra)
        if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
            raise _Unsupported("the SDPA op takes 4-D (batch, heads, seqlen, head_dim) tensors")
        q, k, v = _bshd(query, key, value)
        args = _forward_args(q, k, v, None, None, q.shape[1], k.shape[1], dropout_p, is_causal, return_debug_mask,
                             options)
    except _Unsupported as exc:
        return call.fallback(str(exc))
    try:
        out, lse = _run_forward(q, k, v, **args)
    except NotImplementedError as exc:
        return call.fallback(str(exc))
    out = _laid_out_like(out.transpose(1, 2), query)
    return (out, lse, None, None, query.shape[2], key.shape[2], *_no_dropout_outputs(query))


def _sdpa_backward(call, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                   is_causal, philox_seed, philox_offset, *extra, **options):
    try:
        _check_positional(extra)
        if any(t.dim() != 4 for t in (grad_out, query, key, value, out)):
            raise _Unsupported("the SDPA op takes 4-D (batch, heads, seqlen, head_dim) tensors")
        go, q, k, v, o = _bshd(grad_out, query, key, value, out)
        args = _backward_args(go, q, k, v, o, logsumexp, None, None, q.shape[1], k.shape[1], dropout_p, is_causal,
                              options)
    except _Unsupported as exc:
        return call.fallback(str(exc))
    dq, dk, dv = _run_backward(go, q, k, v, o, logsumexp, **args)
    return tuple(_laid_out_like(g.transpose(1, 2), ref) for g, ref in ((dq, query), (dk, key), (dv, value)))


_IMPLS = {
    "_flash_attention_forward": _flash_forward,
    "_flash_attention_forward_no_dropout_inplace": _flash_forward_into,
    "_flash_attention_backward": _flash_backward,
    "_scaled_dot_product_flash_attention": _sdpa_forward,
    "_scaled_dot_product_flash_attention_backward": _sdpa_backward,
}
