"""The public attention functions (FlashAttention-compatible signatures, see docs/CONTRACTS.md).

Layout (batch, seqlen, heads, head_dim); varlen packs the sequences: (total_tokens, heads, head_dim)
with int32 ``cu_seqlens`` offsets. Masks are aligned bottom-right when seqlen_q != seqlen_k: query row i
sees keys j with ``i + sk - sq - left <= j <= i + sk - sq + right`` (-1 = unbounded; causal: right = 0).
Rows that see no key give out = 0 and lse = -inf.
"""

from __future__ import annotations

import torch

from . import ops, validate


def _reject_unsupported(dropout_p, alibi_slopes, return_attn_probs, seqused_q=None) -> None:
    if dropout_p is None:
        dropout_p = 0.0
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise ValueError(f"dropout_p must be a float, got {dropout_p!r}")
    if dropout_p != 0.0:
        raise NotImplementedError(f"flash-attn4: dropout_p={dropout_p} is not supported (only dropout_p=0.0)")
    if alibi_slopes is not None:
        raise NotImplementedError("flash-attn4: alibi_slopes is not supported")
    if return_attn_probs:
        raise NotImplementedError(
            "flash-attn4: return_attn_probs=True is not supported (use return_lse=True for the log-sum-exp)"
        )
    if seqused_q is not None:
        raise NotImplementedError("flash-attn4: seqused_q is not supported (use cu_seqlens_q)")


def _common_options(head_dim, softmax_scale, causal, window_size, softcap, learnable_sink):
    softmax_scale = validate.check_softmax_scale(softmax_scale, head_dim)
    softcap = validate.check_softcap(softcap)
    left, right = validate.check_window_size(window_size)
    causal, _local, left, right = validate.canonical_mask(causal, left, right)
    if learnable_sink is not None and learnable_sink.dtype != torch.float32:
        learnable_sink = learnable_sink.float()  # the kernel reads float32 sinks
    return softmax_scale, softcap, causal, left, right, learnable_sink


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    learnable_sink: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_lse: bool = False,
    return_attn_probs: bool = False,
    num_splits: int = 1,
):
    """Attention over (batch, seqlen, heads, head_dim) tensors.

    q (b, sq, hq, d), k (b, sk, hk, d), v (b, sk, hk, dv); bf16 or fp16 on one CUDA device; hq a multiple
    of hk (GQA/MQA); d, dv multiples of 8 up to 256. ``softmax_scale`` defaults to 1/sqrt(d); ``softcap``
    > 0 applies ``softcap * tanh(s / softcap)`` to the scaled scores; ``learnable_sink`` (hq,) adds one
    logit per head to the softmax denominator (gpt-oss). ``deterministic=True`` makes the backward
    bitwise repeatable (dQ is reduced across KV tiles in a fixed order; a little slower); the forward
    always is. Differentiable w.r.t. q, k, v and learnable_sink (head dims that are not multiples of 16
    run the backward zero-padded to one). Returns ``out`` (b, sq, hq, dv), or ``(out, lse)`` with
    ``return_lse=True``
    (lse float32 (b, hq, sq)). ``dropout_p`` > 0, ``alibi_slopes`` and ``return_attn_probs`` raise
    NotImplementedError.

    ``num_splits`` (split-KV, forward only): 1 (default) runs one CTA per output tile; N > 1 shares
    each tile's keys among N CTAs, whose float32 partial outputs a combine kernel merges (for few
    (batch x head) pairs and long keys: decoding); 0 chooses the count from the problem and the SM
    count (``dispatch.num_splits_heuristic``). The result is the same attention (a learnable sink
    joins the denominator once, in the combine); gradients run the usual backward from it.
    """
    _reject_unsupported(dropout_p, alibi_slopes, return_attn_probs)
    validate.check_batched(q, k, v)
    validate.check_learnable_sink(learnable_sink, q.shape[2])
    num_splits = validate.check_num_splits(num_splits, q.shape[2])
    softmax_scale, softcap, causal, left, right, learnable_sink = _common_options(
        q.shape[-1], softmax_scale, causal, window_size, softcap, learnable_sink
    )
    validate.check_devices(q, k=k, v=v, learnable_sink=learnable_sink)
    out, lse = ops.fwd(q, k, v, None, None, None, learnable_sink, softmax_scale, softcap, causal, left, right,
                       q.shape[1], k.shape[1], bool(deterministic), num_splits)
    return (out, lse) if return_lse else out


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | torch.Tensor | None = None,
    max_seqlen_k: int | torch.Tensor | None = None,
    seqused_q: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    learnable_sink: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_lse: bool = False,
    return_attn_probs: bool = False,
    num_splits: int = 1,
):
    """Attention over packed variable-length sequences.

    q (total_q, hq, d), k (total_k, hk, d), v (total_k, hk, dv); cu_seqlens_q/k int32 (b + 1,) offsets of
    each sequence (start at 0, non-decreasing, end at total; checked only with
    FLASH_ATTN4_CHECK_CU_SEQLENS=1 because it costs a sync). ``seqused_k`` int32 (b,) uses only the first
    seqused_k[i] keys of sequence i (masks align to that length). ``max_seqlen_q`` may be an int or a
    one-element tensor; a tensor is read with ``int()`` here, outside the op (a CUDA tensor costs a
    device sync; pass an int under torch.compile). When None it is computed from cu_seqlens_q (a sync),
    or, while compiling or capturing a CUDA graph, bounded by total_q. ``max_seqlen_k`` likewise, but
    only the backward needs it (it sizes the grid), so when None the backward computes it. Returns
    ``out`` (total_q, hq, dv), or ``(out, lse)`` with lse float32 (hq, total_q). Other options as in
    :func:`flash_attn_func` (``num_splits`` included: each sequence's keys are split); ``seqused_q``
    raises NotImplementedError. The backward has the head-dim limits of :func:`flash_attn_func`'s.
    """
    _reject_unsupported(dropout_p, alibi_slopes, return_attn_probs, seqused_q)
    validate.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)
    batch = cu_seqlens_q.shape[0] - 1
    validate.check_seqused_k(seqused_k, batch)
    validate.check_learnable_sink(learnable_sink, q.shape[1])
    num_splits = validate.check_num_splits(num_splits, q.shape[1])
    softmax_scale, softcap, causal, left, right, learnable_sink = _common_options(
        q.shape[-1], softmax_scale, causal, window_size, softcap, learnable_sink
    )
    max_q = validate.as_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_k = validate.as_max_seqlen("max_seqlen_k", max_seqlen_k)
    validate.check_devices(q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                           seqused_k=seqused_k, learnable_sink=learnable_sink)
    if max_q is None:
        max_q = validate.longest_sequence(cu_seqlens_q, q.shape[0])
    if max_k is None:
        max_k = -1  # only the backward needs it: it finds it then (ops.bwd)
    out, lse = ops.fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, learnable_sink, softmax_scale, softcap,
                       causal, left, right, max_q, max_k, bool(deterministic), num_splits)
    return (out, lse) if return_lse else out


def flash_attn_combine(out_partial: torch.Tensor, lse_partial: torch.Tensor, out_dtype: torch.dtype | None = None):
    """Merge attention computed over disjoint sets of keys (split-KV, context parallelism).

    out_partial (num_splits, b, sq, h, dv) float32: each split's output, normalised over its own keys
    (0 where the split saw none); lse_partial (num_splits, b, h, sq) float32: each split's log-sum-exp
    (-inf where it saw no key). Returns ``(out, lse)``: out (b, sq, h, dv) in ``out_dtype`` (default
    float32; bfloat16 and float16 too), out = sum_s exp(lse_s - lse) * out_s, and lse (b, h, sq) float32
    = log sum_s exp(lse_s) (-inf, with out = 0, where every split is empty). A varlen batch passes its
    packed tokens as b = 1. Forward only: not differentiable (inputs that require grad raise).
    """
    out_dtype = torch.float32 if out_dtype is None else out_dtype
    validate.check_combine(out_partial, lse_partial, out_dtype)
    if torch.is_grad_enabled() and (out_partial.requires_grad or lse_partial.requires_grad):
        raise NotImplementedError("flash-attn4: flash_attn_combine has no backward; call it under torch.no_grad() "
                                  "or on detached tensors")
    return ops.combine(out_partial, lse_partial, out_dtype)
