"""The public attention functions (FlashAttention-compatible signatures, see docs/CONTRACTS.md).

Layout (batch, seqlen, heads, head_dim); varlen packs the sequences: (total_tokens, heads, head_dim)
with int32 ``cu_seqlens`` offsets. Masks are aligned bottom-right when seqlen_q != seqlen_k: query row i
sees keys j with ``i + sk - sq - left <= j <= i + sk - sq + right`` (-1 or None = unbounded; causal: right = 0).
Rows that see no key give out = 0 and lse = -inf.
"""

from __future__ import annotations

import torch

from . import ops, validate


def _reject_unsupported(dropout_p, alibi_slopes, return_attn_probs) -> None:
    if dropout_p is None:
        dropout_p = 0.0
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise ValueError(f"dropout_p must be a float, got {dropout_p!r}")
    if dropout_p != 0.0:
        raise NotImplementedError(f"flash-attn4: dropout_p={dropout_p} is not supported (only dropout_p=0.0)")
    if alibi_slopes is not None:
        raise NotImplementedError("flash-attn4: alibi_slopes is not supported")
    # check_flag, not truthiness: a tensor would raise torch's own "ambiguous" RuntimeError.
    if return_attn_probs is not None and validate.check_flag("return_attn_probs", return_attn_probs):
        raise NotImplementedError(
            "flash-attn4: return_attn_probs=True is not supported (use return_lse=True for the log-sum-exp)"
        )


# ---- validated-call memo ----

# A call whose arguments have plain types (exact torch.Tensor, bool, int, float, None, a tuple of two
# ints) is validated once per key of everything the checks read: each tensor's shape, dtype and
# device, each option's value, and the accepted device types. A repeated call (a decode step, each
# layer) then reuses the canonical options; any other call, and every call whose key changed, runs
# the checks, so every error stays where it was. Exact types matter: True == 1 == 1.0 in a key, but
# the checks treat them differently.
VALIDATION_MEMO = True
MAX_MEMO = 1024
_MEMO: dict = {}
_Tensor = torch.Tensor
_tensor_key = validate.tensor_key


def _plain(softmax_scale, causal, window_size, softcap) -> bool:
    return ((softmax_scale is None or type(softmax_scale) is float) and type(causal) is bool
            and type(softcap) is float and type(window_size) is tuple and len(window_size) == 2
            and type(window_size[0]) is int and type(window_size[1]) is int)


def _remember(key, options):
    if len(_MEMO) >= MAX_MEMO:
        _MEMO.clear()
    _MEMO[key] = options
    return options


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
    of hk (GQA/MQA); d, dv multiples of 8 from 16 to 256. ``softmax_scale`` defaults to 1/sqrt(d); ``softcap``
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
    key = None
    if (VALIDATION_MEMO and type(q) is _Tensor and not torch.compiler.is_compiling() and type(k) is _Tensor and type(v) is _Tensor
            and alibi_slopes is None and type(dropout_p) is float and type(deterministic) is bool
            and type(return_lse) is bool and type(return_attn_probs) is bool and type(num_splits) is int
            and _plain(softmax_scale, causal, window_size, softcap)):
        key = ("func", q.shape, q.dtype, q.device, k.shape, k.dtype, k.device, v.shape, v.dtype, v.device,
               _tensor_key(learnable_sink), softmax_scale, causal, window_size, softcap, dropout_p, deterministic,
               return_lse, return_attn_probs, num_splits, validate.DEVICE_TYPES)
    options = _MEMO.get(key) if key is not None else None
    if options is None:
        options = _check_func(q, k, v, softmax_scale, causal, window_size, softcap, learnable_sink, dropout_p,
                              alibi_slopes, deterministic, return_lse, return_attn_probs, num_splits)
        if key is not None and key[10] is not False:
            _remember(key, options)
    softmax_scale, softcap, causal, left, right, deterministic, return_lse, num_splits = options
    if learnable_sink is not None and learnable_sink.dtype != torch.float32:
        learnable_sink = learnable_sink.float()  # the kernel reads float32 sinks
    out, lse = ops.forward(q, k, v, None, None, None, learnable_sink, softmax_scale, softcap, causal, left, right,
                           q.shape[1], k.shape[1], deterministic, num_splits, need_lse=return_lse)
    return (out, lse) if return_lse else out


def _check_func(q, k, v, softmax_scale, causal, window_size, softcap, learnable_sink, dropout_p, alibi_slopes,
                deterministic, return_lse, return_attn_probs, num_splits) -> tuple:
    """flash_attn_func's checks; its canonical options."""
    _reject_unsupported(dropout_p, alibi_slopes, return_attn_probs)
    deterministic = validate.check_flag("deterministic", deterministic)
    return_lse = validate.check_flag("return_lse", return_lse)
    validate.check_batched(q, k, v)
    validate.check_learnable_sink(learnable_sink, q.shape[2])
    num_splits = validate.check_num_splits(num_splits, q.shape[2])
    softmax_scale, softcap, causal, left, right, learnable_sink = _common_options(
        q.shape[-1], softmax_scale, causal, window_size, softcap, learnable_sink
    )
    validate.check_devices(q, k=k, v=v, learnable_sink=learnable_sink)
    return softmax_scale, softcap, causal, left, right, deterministic, return_lse, num_splits


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int | torch.Tensor | None = None,
    max_seqlen_k: int | torch.Tensor | None = None,
    seqused_q: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
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
    :func:`flash_attn_func` (``num_splits`` included: each sequence's keys are split). The backward has
    the head-dim limits of :func:`flash_attn_func`'s.

    Padded batches (forward only): ``seqused_q`` int32 (b,) uses only the first seqused_q[i] queries of
    sequence i (of its cu_seqlens_q slot; masks align to that length); the output and LSE rows past
    them are undefined (left as allocated, or with num_splits != 1 merged from unwritten partials).
    With cu_seqlens_q and cu_seqlens_k both None, q, k, v are batched (b, s, h, d) tensors padded per
    sequence, lengths given by seqused_q and/or seqused_k:
    a decode or prefill batch runs without repacking. The outputs then have flash_attn_func's shapes.

    Paged keys (``page_table`` int32 (b, max_pages), forward only): k (num_pages, page_size, hk, d) and
    v (num_pages, page_size, hk, dv), page_size a multiple of 16; sequence i's keys are its first
    seqused_k[i] tokens (required), key t in page page_table[i, t // page_size], row t % page_size;
    cu_seqlens_k must be None. Pages may be in any order and shared; table entries past a sequence's
    pages are never read. Values are checked with FLASH_ATTN4_CHECK_CU_SEQLENS=1 (a sync).
    """
    key = None
    if (VALIDATION_MEMO and type(q) is _Tensor and not torch.compiler.is_compiling() and alibi_slopes is None
            and type(dropout_p) is float and type(deterministic) is bool and type(return_lse) is bool
            and type(return_attn_probs) is bool and type(num_splits) is int
            and (max_seqlen_q is None or type(max_seqlen_q) is int)
            and (max_seqlen_k is None or type(max_seqlen_k) is int)
            and _plain(softmax_scale, causal, window_size, softcap)):
        # Some checks refuse inputs that require grad (forward-only options): which ones do is keyed too.
        grads = (tuple(getattr(t, "requires_grad", False) for t in (q, k, v, learnable_sink))
                 if torch.is_grad_enabled() else None)
        key = ("varlen", q.shape, q.dtype, q.device, _tensor_key(k), _tensor_key(v), _tensor_key(cu_seqlens_q),
               _tensor_key(cu_seqlens_k), _tensor_key(seqused_q), _tensor_key(seqused_k), _tensor_key(page_table),
               _tensor_key(learnable_sink), grads, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size,
               softcap, dropout_p, deterministic, return_lse, return_attn_probs, num_splits, validate.DEVICE_TYPES)
    options = _MEMO.get(key) if key is not None else None
    if options is None:
        options = _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                                seqused_k, page_table, softmax_scale, causal, window_size, softcap, learnable_sink,
                                dropout_p, alibi_slopes, deterministic, return_lse, return_attn_probs, num_splits)
        if key is not None and not any(part is False for part in key[4:12]):  # every tensor a plain one
            _remember(key, options)
    softmax_scale, softcap, causal, left, right, deterministic, return_lse, num_splits, max_q, max_k = options
    if learnable_sink is not None and learnable_sink.dtype != torch.float32:
        learnable_sink = learnable_sink.float()  # the kernel reads float32 sinks
    if cu_seqlens_q is None and cu_seqlens_k is None and page_table is None:  # padded batch (_check_padded_batch)
        out, lse = ops.forward(q, k, v, None, None, seqused_k, learnable_sink, softmax_scale, softcap, causal, left,
                               right, q.shape[1], k.shape[1], deterministic, num_splits, None, seqused_q,
                               need_lse=return_lse)
        return (out, lse) if return_lse else out
    if max_q is None:
        max_q = validate.longest_sequence(cu_seqlens_q, q.shape[0])
    if max_k is None:
        max_k = -1  # only the backward needs it: it finds it then (ops.bwd)
    out, lse = ops.forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, learnable_sink, softmax_scale, softcap,
                           causal, left, right, max_q, max_k, deterministic, num_splits, page_table, seqused_q,
                           need_lse=return_lse)
    return (out, lse) if return_lse else out


def _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, page_table,
                  softmax_scale, causal, window_size, softcap, learnable_sink, dropout_p, alibi_slopes, deterministic,
                  return_lse, return_attn_probs, num_splits) -> tuple:
    """flash_attn_varlen_func's checks; its canonical options and max_seqlen_q/k (ints or None)."""
    _reject_unsupported(dropout_p, alibi_slopes, return_attn_probs)
    deterministic = validate.check_flag("deterministic", deterministic)
    return_lse = validate.check_flag("return_lse", return_lse)
    if cu_seqlens_q is None and cu_seqlens_k is None and page_table is None:
        return _check_padded_batch(q, k, v, seqused_q, seqused_k, softmax_scale, causal, window_size, softcap,
                                   learnable_sink, deterministic, return_lse, num_splits)
    if page_table is not None:
        validate.check_varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            raise NotImplementedError("flash-attn4: no backward through a paged KV cache (page_table); call it "
                                      "under torch.no_grad() / torch.inference_mode() or on detached tensors")
    else:
        validate.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)
    batch = cu_seqlens_q.shape[0] - 1
    validate.check_seqused_k(seqused_k, batch)
    validate.check_seqused_q(seqused_q, batch, q, k, v, learnable_sink)
    validate.check_learnable_sink(learnable_sink, q.shape[1])
    num_splits = validate.check_num_splits(num_splits, q.shape[1])
    softmax_scale, softcap, causal, left, right, learnable_sink = _common_options(
        q.shape[-1], softmax_scale, causal, window_size, softcap, learnable_sink
    )
    max_q = validate.as_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_k = validate.as_max_seqlen("max_seqlen_k", max_seqlen_k)
    validate.check_devices(q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                           seqused_k=seqused_k, seqused_q=seqused_q, page_table=page_table,
                           learnable_sink=learnable_sink)
    return softmax_scale, softcap, causal, left, right, deterministic, return_lse, num_splits, max_q, max_k


def _check_padded_batch(q, k, v, seqused_q, seqused_k, softmax_scale, causal, window_size, softcap, learnable_sink,
                        deterministic, return_lse, num_splits) -> tuple:
    """flash_attn_varlen_func's checks without cu_seqlens: batched tensors with per-sequence used lengths."""
    validate.check_batched(q, k, v)
    batch = q.shape[0]
    validate.check_seqused_k(seqused_k, batch)
    validate.check_seqused_q(seqused_q, batch, q, k, v, learnable_sink)
    if seqused_k is not None and seqused_q is None:  # the batched backward reads no key lengths
        validate.check_no_grad("seqused_k without cu_seqlens_k", q, k, v, learnable_sink)
    validate.check_learnable_sink(learnable_sink, q.shape[2])
    num_splits = validate.check_num_splits(num_splits, q.shape[2])
    softmax_scale, softcap, causal, left, right, learnable_sink = _common_options(
        q.shape[-1], softmax_scale, causal, window_size, softcap, learnable_sink
    )
    validate.check_devices(q, k=k, v=v, seqused_q=seqused_q, seqused_k=seqused_k, learnable_sink=learnable_sink)
    return softmax_scale, softcap, causal, left, right, deterministic, return_lse, num_splits, None, None


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


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    learnable_sink: torch.Tensor | None = None,
    rotary_interleaved: bool = True,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
):
    """Attention of new queries against a KV cache, appending new keys/values to it first (decoding,
    speculative decoding, chunked prefill). Inference only (inputs that require grad raise).

    q (b, sq, hq, d); k_cache (b_cache, s_cache, hk, d), v_cache (b_cache, s_cache, hk, dv); k, v
    (b, s_new, hk, d / dv) optional new tokens, written **in place** into the caches at positions
    cache_seqlens[i] .. cache_seqlens[i] + s_new - 1 of cache row cache_batch_idx[i] (default i) before
    attending. ``cache_seqlens``: an int or int32 (b,) tensor, the tokens already in each cache row
    (None: the whole cache, only without k/v). Batch entry i attends to the keys at positions
    [cache_leftpad[i] (default 0), cache_seqlens[i] + s_new) of its cache row; masks align bottom-right
    to them (causal: query row j sees the first j + seqlen_k - sq + 1 of them). ``cache_batch_idx``
    int32 (b,): the cache row of each batch entry (duplicates: one writer wins). ``num_splits``: 0
    (default) chooses split-KV from the problem (sized by s_cache, so the choice does not change as
    the cache fills), 1 off, N as in :func:`flash_attn_func`. Other options as in
    :func:`flash_attn_func`. Returns ``out`` (b, sq, hq, dv), or ``(out, lse)`` (lse float32 (b, hq, sq))
    with ``return_softmax_lse=True``.

    No device sync: CUDA-graph capturable with cache_seqlens (a tensor) changing between replays.
    Values are the caller's contract, as in FlashAttention: cache_seqlens + s_new <= s_cache,
    cache_batch_idx < b_cache, cache_leftpad <= cache_seqlens (checked for an int cache_seqlens, and
    for tensors with FLASH_ATTN4_CHECK_CU_SEQLENS=1, at the cost of a sync). Cache positions outside
    a row's key range may hold anything finite. With cache_batch_idx or cache_leftpad, caches whose batch
    stride is not s_cache times their row stride are copied for reading on every call (slow; the append
    still goes to the caller's tensor); without them the kernel reads any batch stride in place.
    ``rotary_cos``/``rotary_sin`` (seqlen_ro, rotary_dim / 2), with k and v only: rotary embedding of the
    first rotary_dim dims (pairs (2i, 2i + 1) with ``rotary_interleaved``, else (i, i + rotary_dim / 2)),
    in float32 by torch ops before the append: the new keys at positions cache_seqlens + t (the cache
    stores them rotated), q at cache_seqlens + i when causal or windowed, else all at cache_seqlens
    (FlashAttention's rule; positions must be < seqlen_ro).

    Paged KV cache: ``page_table`` (or its FlashAttention-2 name ``block_table``) int32 (b, max_pages),
    k_cache (num_pages, page_size, hk, d), v_cache (num_pages, page_size, hk, dv), page_size a multiple
    of 16 (16 to 256 and beyond): sequence i's token t is row t % page_size of page page_table[i, t //
    page_size], pages in any order and shareable; new tokens go to their pages in place.
    ``cache_batch_idx`` and ``cache_leftpad`` raise NotImplementedError with a page table. That the
    used table entries are in [0, num_pages) and cover the lengths is checked with
    FLASH_ATTN4_CHECK_CU_SEQLENS=1 (a sync); entries past a sequence's pages are never read.
    """
    if block_table is not None:
        if page_table is not None:
            raise ValueError("pass page_table or block_table (the same argument under two names), not both")
        page_table = block_table
    key = None
    if (VALIDATION_MEMO and type(q) is _Tensor and not torch.compiler.is_compiling()
            and type(return_softmax_lse) is bool and type(rotary_interleaved) is bool and type(num_splits) is int
            and _plain(softmax_scale, causal, window_size, softcap)):
        seqlens_key = cache_seqlens if type(cache_seqlens) is int else _tensor_key(cache_seqlens)
        key = ("kvcache", q.shape, q.dtype, q.device, _tensor_key(k_cache), _tensor_key(v_cache), _tensor_key(k),
               _tensor_key(v), seqlens_key, _tensor_key(cache_batch_idx), _tensor_key(cache_leftpad),
               _tensor_key(page_table), _tensor_key(learnable_sink), _tensor_key(rotary_cos), _tensor_key(rotary_sin),
               softmax_scale, causal, window_size, softcap, rotary_interleaved, num_splits, return_softmax_lse,
               validate.DEVICE_TYPES)
    options = _MEMO.get(key) if key is not None else None
    if options is None:
        options = _check_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                                 cache_leftpad, page_table, softmax_scale, causal, window_size, softcap,
                                 learnable_sink, rotary_interleaved, num_splits, return_softmax_lse)
        if key is not None and not any(part is False for part in key[4:15]):  # every tensor a plain one
            _remember(key, options)
    softmax_scale, softcap, causal, left, right, num_splits, return_softmax_lse, rotary_interleaved = options
    if learnable_sink is not None and learnable_sink.dtype != torch.float32:
        learnable_sink = learnable_sink.float()  # the kernel reads float32 sinks
    seqlens_tensor = cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (q, k_cache, v_cache, k, v, learnable_sink)):
        raise NotImplementedError("flash-attn4: flash_attn_with_kvcache has no backward; call it under "
                                  "torch.no_grad() / torch.inference_mode() or on detached tensors")
    if cache_seqlens is not None and seqlens_tensor is None:
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)
    out, lse = ops.forward_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                                   cache_leftpad, page_table, learnable_sink, softmax_scale, softcap, causal, left,
                                   right, num_splits, return_softmax_lse, rotary_interleaved)
    return (out, lse) if return_softmax_lse else out


def _check_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                   page_table, softmax_scale, causal, window_size, softcap, learnable_sink, rotary_interleaved,
                   num_splits, return_softmax_lse) -> tuple:
    """flash_attn_with_kvcache's checks; its canonical options."""
    # Flags first: on a tensor of the wrong device a bad flag should still be reported as itself.
    return_softmax_lse = validate.check_flag("return_softmax_lse", return_softmax_lse)
    rotary_interleaved = validate.check_flag("rotary_interleaved", rotary_interleaved)
    validate.check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, rotary_cos,
                           rotary_sin, page_table)
    validate.check_learnable_sink(learnable_sink, q.shape[2])
    num_splits = validate.check_num_splits(num_splits, q.shape[2])
    softmax_scale, softcap, causal, left, right, learnable_sink = _common_options(
        q.shape[-1], softmax_scale, causal, window_size, softcap, learnable_sink
    )
    seqlens_tensor = cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None
    validate.check_devices(q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_seqlens=seqlens_tensor,
                           cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, page_table=page_table,
                           learnable_sink=learnable_sink, rotary_cos=rotary_cos, rotary_sin=rotary_sin)
    return softmax_scale, softcap, causal, left, right, num_splits, return_softmax_lse, rotary_interleaved
