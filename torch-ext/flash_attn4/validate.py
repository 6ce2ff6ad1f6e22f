"""Argument checks and layout fixes for the attention entry points.

Two kinds of checks, on purpose in different places:

* metadata checks (dtype, device, ndim, shapes, head dims, option values) raise ``ValueError`` naming
  the offending argument. They only read tensor metadata, so they are free, run on every call and are
  traced by ``torch.compile`` without graph breaks (``interface`` calls them).
* layout fixes (:func:`kernel_layout`) and the optional cu_seqlens *value* check run inside the op's
  real implementation, on real tensors: the kernel needs a unit-stride last dim, 16-byte-aligned
  pointers and strides; any other layout is legal but is copied to a fresh contiguous tensor rather
  than rejected. The value check needs a device sync, so it only runs when
  ``FLASH_ATTN4_CHECK_CU_SEQLENS=1`` (see ``settings``): malformed cu_seqlens values are otherwise
  undefined behaviour, exactly as in FlashAttention.
"""

from __future__ import annotations

import math
import numbers

import torch

from .fa4_kernels.arch import supported_devices

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
SUPPORTED_DEVICES = f"supported: CUDA tensors on {supported_devices()} GPUs"
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8
# The smallest head dim (q/k and v) served: sm_90a's forward has no 8-column accumulator layout
# (head_dim_v), sm_100a's MMAs step 16 columns, and head_dim 8, which sm_90a's forward compiles, has
# never been run on a GPU. 8 is valid FlashAttention input, so it is a NotImplementedError, raised
# here rather than when a kernel is picked on the GPU.
MIN_HEAD_DIM = 16
ALIGN_BYTES = 16
SINK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Device types accepted by check_devices. Only CUDA is real; CPU tests monkeypatch this to exercise
# the plumbing (interface -> op -> kernel call convention) with a torch stand-in for the kernel.
DEVICE_TYPES = ("cuda",)

# Tensor types that dispatch as plain tensors: nn.Parameter disables __torch_function__ and adds no
# dispatch key (a float32 learnable sink is often one). What the host fast paths accept (the
# validation memos, ops._route); any other type (DTensor, FakeTensor, ...) takes the general path.
PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def tensor_key(t):
    """What validation reads of a tensor, as a memo key: (shape, dtype, device) of a plain tensor,
    None for None; False (keep no verdict) for anything else."""
    if t is None:
        return None
    if type(t) not in PLAIN_TENSOR_TYPES:
        return False
    return t.shape, t.dtype, t.device


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


def check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def check_dtypes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dtype not in SUPPORTED_DTYPES:
        hint = (" (a float32 model: load it in bfloat16 or float16, e.g. from_pretrained(..., dtype=torch.bfloat16),"
                " or cast the inputs)" if q.dtype == torch.float32 else "")
        raise ValueError(f"q has dtype {q.dtype}; supported: torch.bfloat16, torch.float16{hint}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but q has {q.dtype}; q, k and v must share one dtype")


def check_devices(q: torch.Tensor, **others) -> None:
    """q must be on a supported device; every other tensor given (None skipped) on the same one."""
    if q.device.type not in DEVICE_TYPES:
        raise ValueError(f"q is on device '{q.device}'; flash-attn4 runs on the GPU only ({SUPPORTED_DEVICES})")
    for name, t in others.items():
        if t is None:
            continue
        if t.device != q.device:
            raise ValueError(
                f"{name} is on device '{t.device}' but q is on '{q.device}'; all tensors must be on the same "
                f"CUDA device ({SUPPORTED_DEVICES})"
            )


def check_head_dims(head_dim: int, head_dim_v: int, qk: str = "q and k", v: str = "v") -> None:
    """ValueError for a head dim that is not a multiple of 8 in [8, 256]; NotImplementedError for one
    below MIN_HEAD_DIM (8: valid in FlashAttention, served by no kernel here), before anything runs.
    ``qk`` and ``v`` name the arguments the dims come from (the caches for flash_attn_with_kvcache)."""
    for name, what, d in (("head_dim", f"last dim of {qk}", head_dim), ("head_dim_v", f"last dim of {v}", head_dim_v)):
        if d % HEAD_DIM_MULTIPLE != 0 or not HEAD_DIM_MULTIPLE <= d <= MAX_HEAD_DIM:
            raise ValueError(
                f"{name} ({what}) must be a multiple of {HEAD_DIM_MULTIPLE} in [{HEAD_DIM_MULTIPLE}, "
                f"{MAX_HEAD_DIM}], got {d}"
            )
    for name, what, d, pad in (("head_dim", qk, head_dim, f"pass softmax_scale={head_dim} ** -0.5"),
                               ("head_dim_v", v, head_dim_v, f"take out[..., :{head_dim_v}]")):
        if d < MIN_HEAD_DIM:
            raise NotImplementedError(
                f"flash-attn4: {name} = {d} is not implemented (the kernels' smallest head dim is "
                f"{MIN_HEAD_DIM}); zero-pad {what} to {MIN_HEAD_DIM} on the last dim and {pad}, which gives "
                f"the same attention"
            )


def _check_heads(hq: int, hk: int) -> None:
    if hk < 1 or hq % hk != 0:
        raise ValueError(
            f"the number of query heads (q.shape[-2] = {hq}) must be a multiple of the number of key/value "
            f"heads (k.shape[-2] = {hk})"
        )


def check_batched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Shapes for flash_attn_func: q (b, sq, hq, d), k (b, sk, hk, d), v (b, sk, hk, dv)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, seqlen, heads, head_dim), got shape {_shape(t)}")
    check_dtypes(q, k, v)
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        raise ValueError(f"batch sizes differ: q {_shape(q)}, k {_shape(k)}, v {_shape(v)}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v must match k in (batch, seqlen_k, heads): k {_shape(k)}, v {_shape(v)}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k must have the head_dim of q: q {_shape(q)}, k {_shape(k)}")
    _check_heads(q.shape[2], k.shape[2])
    check_head_dims(q.shape[-1], v.shape[-1])


def check_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q, cu_seqlens_k) -> None:
    """Shapes for flash_attn_varlen_func: q (total_q, hq, d), k (total_k, hk, d), v (total_k, hk, dv),
    cu_seqlens_q/k int32 (b + 1,)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D (total_tokens, heads, head_dim) for varlen, got shape {_shape(t)}")
    check_dtypes(q, k, v)
    if v.shape[:2] != k.shape[:2]:
        raise ValueError(f"v must match k in (total_k, heads): k {_shape(k)}, v {_shape(v)}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k must have the head_dim of q: q {_shape(q)}, k {_shape(k)}")
    _check_heads(q.shape[1], k.shape[1])
    check_head_dims(q.shape[-1], v.shape[-1])
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu is None:
            raise ValueError(f"{name} is required for flash_attn_varlen_func")
        check_tensor(name, cu)
        if cu.dtype != torch.int32:
            raise ValueError(f"{name} must have dtype torch.int32, got {cu.dtype}")
        if cu.dim() != 1 or cu.shape[0] < 1:
            raise ValueError(f"{name} must be 1-D of length batch + 1, got shape {_shape(cu)}")
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must both have length batch + 1, got {cu_seqlens_q.shape[0]} "
            f"and {cu_seqlens_k.shape[0]}"
        )


def check_seqused_k(seqused_k, batch: int) -> None:
    if seqused_k is not None:
        _check_index_vector("seqused_k", seqused_k, batch)


def check_no_grad(what: str, *tensors) -> None:
    """NotImplementedError when autograd would need a backward that ``what`` has none of."""
    # Only tensors can require grad: a wrong type (a list for learnable_sink) is its own check's error.
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
        raise NotImplementedError(f"flash-attn4: no backward with {what} (forward only, for inference); call it "
                                  f"under torch.no_grad() / torch.inference_mode() or on detached tensors")


def check_seqused_q(seqused_q, batch: int, *inputs) -> None:
    """seqused_q int32 (batch,), forward only (the backward has no per-sequence query lengths)."""
    if seqused_q is not None:
        _check_index_vector("seqused_q", seqused_q, batch)
        check_no_grad("seqused_q", *inputs)


def check_learnable_sink(learnable_sink, num_heads_q: int) -> None:
    if learnable_sink is None:
        return
    check_tensor("learnable_sink", learnable_sink)
    if learnable_sink.dtype not in SINK_DTYPES:
        raise ValueError(
            f"learnable_sink must be float32, bfloat16 or float16, got {learnable_sink.dtype}"
        )
    if learnable_sink.dim() != 1 or learnable_sink.shape[0] != num_heads_q:
        raise ValueError(
            f"learnable_sink must have shape (num_heads_q,) = ({num_heads_q},), got {_shape(learnable_sink)}"
        )


def _is_int(x) -> bool:
    # type(x) is int first: the abstract-class check costs about 0.4 us, twice per call for window_size
    return type(x) is int or (isinstance(x, (numbers.Integral, torch.SymInt)) and not isinstance(x, bool))


def check_window_size(window_size) -> tuple[int, int]:
    """(left, right) as ints, -1 meaning unbounded; None (or a None entry) also means unbounded."""
    if window_size is None:
        return -1, -1
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}") from None
    out = []
    for side, w in (("left", left), ("right", right)):
        if w is None:
            w = -1
        if not _is_int(w):
            raise ValueError(f"window_size {side} must be an int, or -1 or None for unbounded, got {w!r}")
        if w < -1:
            raise ValueError(f"window_size {side} must be >= -1 (-1 or None: unbounded), got {w}")
        out.append(int(w) if isinstance(w, numbers.Integral) else w)
    return out[0], out[1]


def check_softcap(softcap) -> float:
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise ValueError(f"softcap must be a float (0 = off), got {softcap!r}")
    softcap = float(softcap)
    if not 0.0 <= softcap < math.inf:  # also false for NaN; comparisons (not math.isfinite) trace in dynamo
        raise ValueError(f"softcap must be a finite number >= 0 (0 = off), got {softcap}")
    return softcap


def check_softmax_scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return head_dim ** -0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise ValueError(f"softmax_scale must be a float or None, got {softmax_scale!r}")
    softmax_scale = float(softmax_scale)
    if not -math.inf < softmax_scale < math.inf:
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    return softmax_scale


def check_flag(name: str, value) -> bool:
    """A boolean option as a Python bool: True/False, NumPy's bool_, a one-element bool tensor, or
    the integers 0 and 1; anything else (a string such as "no", None, 2, 0.5) is a TypeError naming
    the argument, since Python's truthiness would silently read "no" as True."""
    if isinstance(value, bool):
        return value
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
        return bool(value)
    if isinstance(value, torch.Tensor) and value.dtype == torch.bool and value.numel() == 1:
        return bool(value.item())
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value in (0, 1):
        return bool(value)
    raise TypeError(f"{name} must be a bool (True or False), got {value!r} of type {type(value).__name__}")


def canonical_mask(causal: bool, window_left: int, window_right: int) -> tuple[bool, bool, int, int]:
    """(causal, local, left, right) in the kernel's terms.

    causal forces right = 0. No bound on either side: no mask. Unbounded left with right = 0: causal.
    Anything else: local (a -1 side stays unbounded).
    """
    causal = check_flag("causal", causal)
    if causal:
        window_right = 0
    if window_left < 0 and window_right < 0:
        return False, False, -1, -1
    if window_left < 0 and window_right == 0:
        return True, False, -1, 0
    return False, True, window_left, window_right


def longest_sequence(cu_seqlens: torch.Tensor, total: int) -> int:
    """Longest sequence of a cu_seqlens vector. Exact needs a device sync; while compiling or capturing
    a CUDA graph (where a sync is not allowed) the total is used: a valid upper bound that only
    launches idle tiles."""
    if torch.compiler.is_compiling() or (cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing()):
        return total
    if cu_seqlens.shape[0] < 2:
        return 0
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item())


def as_max_seqlen(name: str, value) -> int | None:
    """An int from an int or a one-element tensor (a CUDA tensor costs a device sync), or None."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_floating_point() or value.is_complex():
            raise ValueError(f"{name} must be an int or a one-element integer tensor, got {value!r}")
        value = int(value.item())
    elif not _is_int(value):
        raise ValueError(f"{name} must be an int or a one-element integer tensor, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


MAX_NUM_SPLITS = 256  # dispatch.MAX_SPLITS: the most an explicit num_splits may ask for
MAX_GRID_Y = 65535  # the split count is folded into the grid's head mode (CUDA's limit on grid.y)


def check_num_splits(num_splits, num_heads_q: int) -> int:
    """num_splits as an int: 1 = no split-KV, 0 = automatic, N > 1 = N CTAs per output tile's KV range
    (the split index joins the heads in the grid's y extent, at most 65535)."""
    if not _is_int(num_splits):
        raise ValueError(f"num_splits must be an int (1: off, 0: automatic), got {num_splits!r}")
    if not 0 <= num_splits <= MAX_NUM_SPLITS:
        raise ValueError(f"num_splits must be in [0, {MAX_NUM_SPLITS}] (1: off, 0: automatic), got {num_splits}")
    if num_heads_q * num_splits > MAX_GRID_Y:
        raise ValueError(f"num_splits={num_splits} x {num_heads_q} query heads exceeds the grid's {MAX_GRID_Y} "
                         f"(head, split) pairs")
    return int(num_splits)


COMBINE_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_combine(out_partial, lse_partial, out_dtype) -> None:
    """flash_attn_combine's arguments: out_partial (num_splits, b, sq, h, dv) and lse_partial
    (num_splits, b, h, sq), float32, on one device; dv a multiple of 8 up to 256; out_dtype one of
    COMBINE_OUT_DTYPES."""
    check_tensor("out_partial", out_partial)
    check_tensor("lse_partial", lse_partial)
    for name, t, ndim in (("out_partial", out_partial, 5), ("lse_partial", lse_partial, 4)):
        if t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {t.dtype}")
        if t.dim() != ndim:
            layout = "(num_splits, b, sq, h, dv)" if ndim == 5 else "(num_splits, b, h, sq)"
            raise ValueError(f"{name} must be {layout}, got shape {_shape(t)}")
    splits, b, sq, h, dv = out_partial.shape
    if tuple(lse_partial.shape) != (splits, b, h, sq):
        raise ValueError(f"lse_partial must have shape (num_splits, b, h, sq) = {(splits, b, h, sq)} for "
                         f"out_partial of shape {_shape(out_partial)}, got {_shape(lse_partial)}")
    if splits < 1:
        raise ValueError("out_partial has no split (num_splits = 0)")
    if dv % HEAD_DIM_MULTIPLE or not 0 < dv <= MAX_HEAD_DIM:
        raise ValueError(f"out_partial's head dim must be a multiple of {HEAD_DIM_MULTIPLE} in "
                         f"[{HEAD_DIM_MULTIPLE}, {MAX_HEAD_DIM}], got {dv}")
    if not isinstance(out_dtype, torch.dtype):  # `in` on a tensor or string compares elementwise or not at all
        raise TypeError(f"out_dtype must be a torch.dtype (one of {COMBINE_OUT_DTYPES}) or None, got {out_dtype!r} "
                        f"of type {type(out_dtype).__name__}")
    if out_dtype not in COMBINE_OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {COMBINE_OUT_DTYPES}, got {out_dtype!r}")
    if out_partial.device.type not in DEVICE_TYPES:
        raise ValueError(f"out_partial is on device '{out_partial.device}'; flash-attn4 runs on the GPU only "
                         f"({SUPPORTED_DEVICES})")
    if lse_partial.device != out_partial.device:
        raise ValueError(f"lse_partial is on {lse_partial.device} but out_partial on {out_partial.device}")


# ---- real-tensor checks, run inside the op implementation ----


def needs_copy(t: torch.Tensor) -> bool:
    """True when the kernel cannot read ``t`` in place: last dim not unit-stride, a stride that is not a
    multiple of 16 bytes, or a data pointer that is not 16-byte aligned (never for an empty tensor).
    Runs for every tensor of every call: one stride() and a plain loop (any() over a generator took
    2.5x as long)."""
    strides = t.stride()
    elems = ALIGN_BYTES // t.element_size()
    bad = strides[-1] != 1 or t.data_ptr() % ALIGN_BYTES != 0
    for s in strides[:-1]:
        bad = bad or s % elems != 0
    return bad and t.numel() != 0


def kernel_layout(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when the kernel can read it, else a fresh row-major copy (legal layouts never raise)."""
    if not needs_copy(t):
        return t
    fresh = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    fresh.copy_(t)
    return fresh


def check_varlen_values(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int, total_k: int,
                        max_seqlen_q: int, seqused_k: torch.Tensor | None = None) -> None:
    """Value checks of cu_seqlens / seqused_k / max_seqlen_q with one device sync (opt-in, see settings)."""
    conds = []
    names = []
    for name, cu, total in (("cu_seqlens_q", cu_seqlens_q, total_q), ("cu_seqlens_k", cu_seqlens_k, total_k)):
        lens = cu[1:] - cu[:-1]
        conds += [cu[0] == 0, (lens >= 0).all(), cu[-1] == total]
        names += [f"{name}[0] must be 0", f"{name} must be non-decreasing", f"{name}[-1] must equal {total}"]
    lens_q = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    if lens_q.numel():
        conds.append(lens_q.max() <= max_seqlen_q)
        names.append(f"max_seqlen_q = {max_seqlen_q} is smaller than the longest query sequence")
    if seqused_k is not None:
        lens_k = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
        conds += [(seqused_k >= 0).all(), (seqused_k <= lens_k).all()]
        names += ["seqused_k must be >= 0", "seqused_k[i] must be <= cu_seqlens_k[i+1] - cu_seqlens_k[i]"]
    ok = torch.stack([c.reshape(()) for c in conds]).cpu().tolist()  # the one sync
    bad = [n for n, good in zip(names, ok) if not good]
    if bad:
        raise ValueError("malformed varlen metadata: " + "; ".join(bad))


# ---- paged KV caches ----


def check_page_table(page_table, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: int) -> int:
    """A paged cache's shapes: k_cache (num_pages, page_size, hk, d), v_cache (num_pages, page_size, hk,
    dv), page_table int32 (batch, max_pages); page_size a multiple of 16 (a K/V tile's TMA boxes are
    whole 16-row MMA steps, fa4_kernels/paged_kv.py). Returns the page size. Metadata only (no sync):
    the table's values are check_page_table_values'."""
    check_tensor("page_table", page_table)
    if page_table.dtype != torch.int32:
        raise ValueError(f"page_table must have dtype torch.int32, got {page_table.dtype}")
    if page_table.dim() != 2 or page_table.shape[0] != batch:
        raise ValueError(f"page_table must have shape (batch, max_pages) = ({batch}, max_pages), got "
                         f"{_shape(page_table)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4:
            raise ValueError(f"a paged {name} must be 4-D (num_pages, page_size, kv_heads, head_dim), got shape "
                             f"{_shape(t)}")
    if v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(f"v_cache must match k_cache in (num_pages, page_size, kv_heads): k_cache "
                         f"{_shape(k_cache)}, v_cache {_shape(v_cache)}")
    page_size = k_cache.shape[1]
    if page_size <= 0 or page_size % 16:
        raise ValueError(f"page_size (k_cache.shape[1]) must be a positive multiple of 16, got {page_size}")
    return page_size


def check_varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table) -> None:
    """flash_attn_varlen_func over a paged cache: q (total_q, hq, d) with cu_seqlens_q, k and v paged
    (check_page_table) with the key lengths in seqused_k and no cu_seqlens_k."""
    check_tensor("q", q)
    if q.dim() != 3:
        raise ValueError(f"q must be 3-D (total_tokens, heads, head_dim) for varlen, got shape {_shape(q)}")
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t)
    check_dtypes(q, k, v)
    if cu_seqlens_q is None:
        raise ValueError("cu_seqlens_q is required for flash_attn_varlen_func")
    check_tensor("cu_seqlens_q", cu_seqlens_q)
    if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] < 1:
        raise ValueError(f"cu_seqlens_q must be int32 1-D of length batch + 1, got {cu_seqlens_q.dtype} "
                         f"{_shape(cu_seqlens_q)}")
    if cu_seqlens_k is not None:
        raise ValueError("with a page_table, cu_seqlens_k must be None: the key lengths are seqused_k and the "
                         "table says where the keys are")
    if seqused_k is None:
        raise ValueError("a page_table needs seqused_k, the number of keys of each sequence")
    check_page_table(page_table, k, v, cu_seqlens_q.shape[0] - 1)
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k must have the head_dim of q: q {_shape(q)}, k {_shape(k)}")
    _check_heads(q.shape[1], k.shape[2])
    check_head_dims(q.shape[-1], v.shape[-1])


def check_page_table_values(page_table: torch.Tensor, seqlens_k: torch.Tensor, num_pages: int,
                            page_size: int) -> None:
    """With one device sync (opt-in, like check_varlen_values: FLASH_ATTN4_CHECK_CU_SEQLENS=1): every
    sequence's keys fit in its row of the table (seqlens_k <= max_pages * page_size) and the pages they
    use are in [0, num_pages). Entries past a sequence's pages are never read and may hold anything.
    Unchecked, a page out of range reads zeros in the kernel (TMA bounds), and an append to it raises a
    CUDA error."""
    capacity = page_table.shape[1] * page_size
    used = (seqlens_k.long()[:, None] + page_size - 1) // page_size > torch.arange(page_table.shape[1],
                                                                                 device=page_table.device)
    in_range = (page_table >= 0) & (page_table < num_pages)
    ok = torch.stack([(seqlens_k >= 0).all(), (seqlens_k <= capacity).all(),
                      (in_range | ~used).all()]).cpu().tolist()  # the one sync
    names = ["key lengths must be >= 0",
             f"a sequence's keys must fit in its page_table row (max_pages x page_size = {capacity})",
             f"the pages a sequence uses must be in [0, num_pages = {num_pages})"]
    bad = [n for n, good in zip(names, ok) if not good]
    if bad:
        raise ValueError("malformed page table: " + "; ".join(bad))


# ---- flash_attn_with_kvcache ----

MAX_PACKED_ROWS = 2 ** 31 - 1  # the kernel's packed-row offsets are int32


def _check_index_vector(name: str, t, batch: int) -> None:
    check_tensor(name, t)
    if t.dtype != torch.int32:
        raise ValueError(f"{name} must have dtype torch.int32, got {t.dtype}")
    if t.dim() != 1 or t.shape[0] != batch:
        raise ValueError(f"{name} must have shape (batch,) = ({batch},), got {_shape(t)}")


def check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, rotary_cos=None,
                  rotary_sin=None, page_table=None) -> None:
    """Shapes, dtypes and (for an int cache_seqlens) the fill level for flash_attn_with_kvcache:
    q (b, sq, hq, d), k_cache (b_cache, s_cache, hk, d), v_cache (b_cache, s_cache, hk, dv), new k
    (b, s_new, hk, d) and v (b, s_new, hk, dv) (both or neither), cache_seqlens None, an int or int32
    (b,), cache_batch_idx and cache_leftpad int32 (b,), rotary_cos/sin (seqlen_ro, rotary_dim / 2)
    floating, both or neither, only with k, rotary_dim <= d. With ``page_table`` the caches are paged
    (check_page_table): each sequence holds up to max_pages * page_size tokens, and cache_batch_idx
    and cache_leftpad are not supported. Metadata only (no sync)."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, seqlen, heads, head_dim), got shape {_shape(t)}")
    if q.dtype not in SUPPORTED_DTYPES:
        hint = (" (a float32 model: load it in bfloat16 or float16, e.g. from_pretrained(..., dtype=torch.bfloat16),"
                " or cast the inputs)" if q.dtype == torch.float32 else "")
        raise ValueError(f"q has dtype {q.dtype}; supported: torch.bfloat16, torch.float16{hint}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but q has {q.dtype}; they must share one dtype")
    if v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(f"v_cache must match k_cache in (batch, seqlen, heads): k_cache {_shape(k_cache)}, "
                         f"v_cache {_shape(v_cache)}")
    if k_cache.shape[-1] != q.shape[-1]:
        raise ValueError(f"k_cache must have the head_dim of q: q {_shape(q)}, k_cache {_shape(k_cache)}")
    _check_heads(q.shape[2], k_cache.shape[2])
    check_head_dims(q.shape[-1], v_cache.shape[-1], qk="q and k_cache", v="v_cache")
    batch, b_cache, s_cache = q.shape[0], k_cache.shape[0], k_cache.shape[1]
    if page_table is not None:
        s_cache = check_page_table(page_table, k_cache, v_cache, batch) * page_table.shape[1]  # per sequence
        for name, t in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
            if t is not None:
                raise NotImplementedError(f"flash-attn4: {name} with a paged KV cache is not supported (the page "
                                          f"table already says where each sequence's keys are)")
    elif b_cache * s_cache > MAX_PACKED_ROWS:
        raise ValueError(f"k_cache has {b_cache} x {s_cache} rows; at most {MAX_PACKED_ROWS} are supported")
    if page_table is None and cache_batch_idx is None and b_cache != batch:
        raise ValueError(f"k_cache has batch {b_cache} but q has {batch}; pass cache_batch_idx to select "
                         f"cache rows")
    if (k is None) != (v is None):
        raise ValueError("k and v (the new tokens) must be given together")
    s_new = 0
    if k is not None:
        for name, t, dim in (("k", k, k_cache.shape[-1]), ("v", v, v_cache.shape[-1])):
            check_tensor(name, t)
            if t.dim() != 4:
                raise ValueError(f"{name} must be 4-D (batch, seqlen_new, heads, head_dim), got shape {_shape(t)}")
            if t.dtype != q.dtype:
                raise ValueError(f"{name} has dtype {t.dtype} but q has {q.dtype}")
            if t.shape[0] != batch or t.shape[2] != k_cache.shape[2] or t.shape[3] != dim:
                raise ValueError(f"{name} must have shape (batch, seqlen_new, kv_heads, head_dim) = "
                                 f"({batch}, seqlen_new, {k_cache.shape[2]}, {dim}), got {_shape(t)}")
        if v.shape[1] != k.shape[1]:
            raise ValueError(f"k and v must have the same number of new tokens: k {_shape(k)}, v {_shape(v)}")
        s_new = k.shape[1]
        if cache_seqlens is None:
            raise ValueError("cache_seqlens is required when k and v are given (where to append them)")
    if cache_seqlens is not None and not isinstance(cache_seqlens, torch.Tensor):
        if not _is_int(cache_seqlens):
            raise ValueError(f"cache_seqlens must be an int or an int32 tensor (batch,), got {cache_seqlens!r}")
        if cache_seqlens < 0 or cache_seqlens + s_new > s_cache:
            where = "s_cache" if page_table is None else "max_pages x page_size"
            raise ValueError(f"cache_seqlens ({cache_seqlens}) + new tokens ({s_new}) must be in [0, "
                             f"{where} = {s_cache}]")
    elif cache_seqlens is not None:
        _check_index_vector("cache_seqlens", cache_seqlens, batch)
    if cache_batch_idx is not None:
        _check_index_vector("cache_batch_idx", cache_batch_idx, batch)
    if cache_leftpad is not None:
        _check_index_vector("cache_leftpad", cache_leftpad, batch)
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None:
        if k is None:
            raise ValueError("rotary_cos/rotary_sin need the new tokens k and v (they rotate q and k)")
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            check_tensor(name, t)
            if t.dim() != 2 or not t.is_floating_point():
                raise ValueError(f"{name} must be a 2-D floating tensor (seqlen_ro, rotary_dim / 2), got "
                                 f"{t.dtype} {_shape(t)}")
        if rotary_sin.shape != rotary_cos.shape:
            raise ValueError(f"rotary_sin must have the shape of rotary_cos {_shape(rotary_cos)}, got "
                             f"{_shape(rotary_sin)}")
        if not 0 < 2 * rotary_cos.shape[1] <= q.shape[-1]:
            raise ValueError(f"rotary_dim = 2 * rotary_cos.shape[1] = {2 * rotary_cos.shape[1]} must be in "
                             f"[2, head_dim = {q.shape[-1]}]")


def check_kvcache_values(cache_seqlens, cache_batch_idx, cache_leftpad, s_new: int, b_cache: int,
                         s_cache: int, seqlen_q: int = 0, seqlen_ro=None) -> None:
    """The values of flash_attn_with_kvcache's int32 metadata, with one device sync (opt-in, like
    check_varlen_values: FLASH_ATTN4_CHECK_CU_SEQLENS=1): 0 <= cache_seqlens, cache_seqlens + s_new <=
    s_cache, 0 <= cache_batch_idx < b_cache, 0 <= cache_leftpad <= cache_seqlens (s_cache without
    cache_seqlens); with rotary (seqlen_ro rows of cos/sin), cache_seqlens + max(seqlen_q, s_new) <= seqlen_ro.
    Unchecked, values out of range are undefined behaviour (as in FlashAttention)."""
    conds, names = [], []
    if cache_seqlens is not None:
        conds += [(cache_seqlens >= 0).all(), (cache_seqlens + s_new <= s_cache).all()]
        names += ["cache_seqlens must be >= 0", f"cache_seqlens + {s_new} new tokens must be <= s_cache = {s_cache}"]
    if cache_batch_idx is not None:
        conds += [((cache_batch_idx >= 0) & (cache_batch_idx < b_cache)).all()]
        names += [f"cache_batch_idx must be in [0, {b_cache})"]
    if cache_leftpad is not None:
        end = s_cache if cache_seqlens is None else cache_seqlens
        conds += [((cache_leftpad >= 0) & (cache_leftpad <= end)).all()]
        names += ["cache_leftpad must be in [0, cache_seqlens]"]
    if seqlen_ro is not None:
        conds += [(cache_seqlens + max(seqlen_q, s_new) <= seqlen_ro).all()]
        names += [f"cache_seqlens + {max(seqlen_q, s_new)} rotary positions must be <= rotary_cos.shape[0] = "
                  f"{seqlen_ro}"]
    if not conds:
        return
    ok = torch.stack([c.reshape(()) for c in conds]).cpu().tolist()  # the one sync
    bad = [n for n, good in zip(names, ok) if not good]
    if bad:
        raise ValueError("malformed KV-cache metadata: " + "; ".join(bad))
