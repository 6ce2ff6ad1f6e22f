"""Hugging Face transformers integration (transformers 5.17 to 5.22).

Two ways to run a transformers model on these kernels:

1. ``attn_implementation="fa4"`` (this module). Importing flash_attn4 (from a checkout, a wheel or
   ``kernels.get_kernel``) registers an attention function and a padding-mask function under "fa4"
   with transformers' ``AttentionInterface`` / ``AttentionMaskInterface``, whatever the import order:
   at once when ``transformers.modeling_utils`` / ``transformers.masking_utils`` are loaded, else
   from an import hook when they load (``install_import_hook``), so importing flash_attn4 never
   imports transformers (seconds) by itself. ``register()`` does it by hand, under any name.

2. The Hub string ``attn_implementation=HUB_ATTN_IMPLEMENTATION`` ("<org>/flash-attn4@v1").
   transformers then calls ``kernels.get_kernel`` and wraps our ``flash_attn_varlen_func`` /
   ``flash_attn_func`` with its own flash-attention wrapper (it inspects their parameter names).
   Keep the "@v1": transformers 5.17 asks for branch v0 of any repo whose id matches ".*flash.*4"
   when no revision is given; 5.18+ asks for v1. Non-``kernels-community`` repos also need
   ``allow_all_kernels=True``. This name contains "flash", so every ``is_flash_attention_requested``
   branch of transformers takes its flash side (README: which name works on which path).

What the "fa4" attention function does with transformers' arguments (both 5.17 and 5.22):

- query (B, Hq, Sq, D), key/value (B, Hk, Sk, D[v]) with Hk unrepeated (GQA/MQA go to the kernel
  as they are). They are re-viewed as (B, S, H, D) without a copy; the op copies only a layout a
  kernel cannot read (see validate.kernel_layout).
- attention_mask: the 2-D (B, kv_len) boolean padding mask built by ``padding_mask`` below (or
  None); 4-D masks are rejected. Then, as transformers' own flash path (``_flash_attention_forward``,
  whose helpers from ``transformers.modeling_flash_attention_utils`` we call):
  - prefill / training with padding: ``_upad_input`` -> ``flash_attn_varlen_func`` -> ``_pad_input``
    (zeros at padded query positions). A non-causal call with fewer queries than keys
    (cross-attention) pads the keys only (transformers' helper would treat the key mask as a query
    mask there).
  - a step on a KV cache (fewer queries than keys: decoding, chunked prefill; dynamic or static
    cache): when each row's valid keys are one contiguous range (left padding, the unused tail of a
    static cache), ``flash_attn_with_kvcache`` reads the cache in place (cache_leftpad /
    cache_seqlens, automatic split-KV), with no copy and no device sync under torch.compile; each
    (batch, KV head) pair is one cache row, since transformers stores (B, Hk, S, D). Other masks,
    and attention sinks with several KV heads, go through the unpadding above.
- no mask: ``flash_attn_func`` (``num_splits=0``, automatic split-KV, when no gradient is needed).
- packed sequences: ``cu_seq_lens_q/k`` (+ ``max_length_q/k``) kwargs (DataCollatorWithFlattening
  with ``return_flash_attn_kwargs=True``), or ``position_ids`` that restart (B == 1, no padding
  mask; transformers' ``_is_packed_sequence`` / ``prepare_fa_kwargs_from_position_ids``) -> varlen.
- Causality: ``kwargs["is_causal"]`` if given, else ``module.is_causal``, sent as it is. Masks are
  aligned bottom-right (CONTRACTS.md), so a single-query step (decode) sees every key either way;
  sent causal, it runs the kernels that FlashAttention-style decode callers (``causal=True``) run
  and that the shipped precompiled set holds (docs/AOT.md), instead of compiling unmasked ones.
- ``scaling`` -> ``softmax_scale``; ``softcap`` -> ``softcap``; ``s_aux`` (attention sinks, one
  logit per query head) -> ``learnable_sink`` in float32.
- ``sliding_window`` follows transformers' flash-attention path: only when the key length exceeds
  it, left window ``sliding_window - 1`` (the query plus ``sliding_window - 1`` earlier keys), right
  window 0 when causal and ``sliding_window - 1`` when not.
- ``dropout > 0`` on a module in training mode raises NotImplementedError (the kernels have no
  dropout); in eval mode dropout is ignored, as in any attention implementation.

The kernels are looked up on the package at call time (``flash_attn4.flash_attn_func`` /
``flash_attn_varlen_func`` / ``flash_attn_with_kvcache``), so tests can substitute a reference.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
import weakref

import torch

DEFAULT_NAME = "fa4"
HUB_REPO_ID = "flash-attn4-org/flash-attn4"
HUB_VERSION = 1
HUB_ATTN_IMPLEMENTATION = f"{HUB_REPO_ID}@v{HUB_VERSION}"

# The transformers modules that define the two registries; registration waits for them to load.
_ATTENTION_MODULE = "transformers.modeling_utils"
_MASK_MODULE = "transformers.masking_utils"


def _backend():
    """The package whose public functions we call (resolved per call, never cached; a dict lookup
    that torch.compile traces, where importlib.import_module would break the graph)."""
    return sys.modules[__package__]


# --------------------------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------------------------


def _check_name(name) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    if "/" in name or ":" in name:
        raise ValueError(
            f"{name!r} looks like a Hub kernel id; transformers would try to download it. "
            f"Use a plain name such as {DEFAULT_NAME!r} (or pass {HUB_ATTN_IMPLEMENTATION!r} as "
            "attn_implementation to go through the Hub instead)."
        )
    if "flash" in name.lower():
        # transformers treats every name containing "flash" as one of its own flash-attention
        # implementations and tries to import or download it at model construction.
        raise ValueError(f"{name!r} contains 'flash', which transformers reserves for its own loaders")


def _register_attention(name: str) -> None:
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(name, attention_forward)


def _register_mask(name: str) -> None:
    from transformers.masking_utils import AttentionMaskInterface

    AttentionMaskInterface.register(name, padding_mask)


def register(name: str = DEFAULT_NAME) -> str:
    """Register ``attention_forward`` and ``padding_mask`` with transformers under ``name``.

    Returns the name, for ``attn_implementation=``. Imports transformers' two registry modules;
    raises ImportError without transformers.
    """
    _check_name(name)
    _register_attention(name)
    _register_mask(name)
    return name


def maybe_register(name: str = DEFAULT_NAME, import_transformers: bool = False) -> str | None:
    """``register(name)`` when transformers is already imported; otherwise do nothing, return None.

    With ``import_transformers=True`` it imports transformers when it is installed. Never raises: a
    transformers that fails to import or lacks the interfaces gives a warning.
    """
    if "transformers" not in sys.modules:
        if not import_transformers:
            return None
        try:
            if importlib.util.find_spec("transformers") is None:
                return None
        except (ImportError, ValueError):
            return None
    try:
        return register(name)
    except Exception as exc:  # an incompatible or broken transformers must not break our import
        warnings.warn(f"flash_attn4: could not register attn_implementation={name!r} with transformers: {exc}")
        return None


def _register_part(module_name: str, name: str) -> None:
    """Register the half of ``name`` that lives in ``module_name`` (just loaded). Never raises: an
    exception here would fail the user's ``import transformers``."""
    try:
        (_register_attention if module_name == _ATTENTION_MODULE else _register_mask)(name)
    except Exception as exc:
        warnings.warn(f"flash_attn4: could not register attn_implementation={name!r} with transformers: {exc}")


class _HookedLoader(importlib.abc.Loader):
    """A module's own loader, followed by a callback once the module has executed."""

    def __init__(self, loader, callback):
        self._loader, self._callback = loader, callback

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._callback(module.__name__)

    def __getattr__(self, attr):  # get_source, get_filename, is_package, ... for tools that ask
        return getattr(self._loader, attr)


class _RegistrationFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when transformers' registry modules are about to load, it wraps the
    loader that the other finders return so that "fa4" is registered right after they execute.
    There is no plugin hook in transformers for attention implementations, hence this."""

    # Marks the finders of every copy of this module (a checkout and a Hub build loaded side by side):
    # they skip each other, so the copy imported last (first on sys.meta_path) registers.
    flash_attn4_registration = True

    def __init__(self, names):
        self.names = names

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in (_ATTENTION_MODULE, _MASK_MODULE):
            return None
        for finder in sys.meta_path:
            if getattr(finder, "flash_attn4_registration", False) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        names = tuple(self.names)
        spec.loader = _HookedLoader(spec.loader, lambda mod: [_register_part(mod, n) for n in names])
        return spec


_FINDER: _RegistrationFinder | None = None


def install_import_hook(name: str = DEFAULT_NAME) -> None:
    """Register ``name`` with transformers now for the registry modules already loaded, and when
    each of the others loads (a ``sys.meta_path`` finder; it imports nothing). Called by the
    package's ``__init__``; idempotent. Never raises for transformers' sake (warnings instead)."""
    global _FINDER
    _check_name(name)
    for module_name in (_ATTENTION_MODULE, _MASK_MODULE):
        if module_name in sys.modules:
            _register_part(module_name, name)
    if _FINDER is None:
        _FINDER = _RegistrationFinder([])
    if name not in _FINDER.names:
        _FINDER.names.append(name)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def remove_import_hook() -> None:
    """Undo ``install_import_hook``'s finder (registrations already made stay)."""
    if _FINDER is not None and _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)


# --------------------------------------------------------------------------------------------
# Mask function
# --------------------------------------------------------------------------------------------


def padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset=0,
    kv_offset=0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    device=None,
    **kwargs,
) -> torch.Tensor | None:
    """The 2-D (batch, kv_length) boolean mask of the keys in use, or None when all are.

    The rule of transformers' ``flash_attention_mask`` (only the padding matters: causal and
    sliding-window structure travel as kernel arguments), plus what its flash path gets from the
    generation loop by name ("flash" in the implementation name, which "fa4" cannot have): a static
    cache, whose keys run past the tokens seen so far, gets a mask whose unused tail is False. The
    mask always spans kv_length keys (a static shape: a compiled decode step does not recompile as
    the sequence grows) and is built without a device sync, except for the eager all-true check
    that turns an unpadded mask into None, as transformers does.
    """
    _reject_chunked_attention(kv_length, kv_offset, kwargs)
    if attention_mask is not None:
        mask = attention_mask[:, -kv_length:].bool()
        if mask.shape[-1] < kv_length:  # static cache: the keys after the seen tokens are unused
            return torch.nn.functional.pad(mask, (0, kv_length - mask.shape[-1]), value=False)
        if not torch.compiler.is_compiling() and bool(mask.all()):
            return None
        return mask
    if not (isinstance(kv_offset, int) and kv_offset == 0):
        return None  # sliding-window cache layers hold only keys in use
    if isinstance(q_offset, int) and q_offset + q_length >= kv_length:
        return None  # dynamic cache (or none): every key is in use
    seen = q_offset + q_length  # StaticLayer gives q_offset as a tensor: no sync here
    if device is None:
        device = seen.device if isinstance(seen, torch.Tensor) else None
    keys = torch.arange(kv_length, device=device)
    return (keys < seen).view(1, kv_length).expand(batch_size, kv_length)


def _reject_chunked_attention(kv_length, kv_offset, kwargs) -> None:
    """Chunked attention (Llama 4's local layers: a query sees only keys of its own chunk) has no
    kernel argument; past one chunk it would silently become full causal attention. transformers'
    flash path raises there too (masking_utils.create_chunked_causal_mask). Its mask call is the one
    whose ``local_size`` is the config's attention_chunk_size (sliding windows pass theirs)."""
    config = kwargs.get("config")
    chunk = getattr(config, "attention_chunk_size", None)
    local = kwargs.get("local_size")
    if chunk is None or local is None or local != chunk or getattr(config, "sliding_window", None) == chunk:
        return
    if kv_length + kv_offset > chunk:
        raise ValueError(
            f"attn_implementation 'fa4' cannot run chunked attention (attention_chunk_size={chunk}) over "
            f"{kv_length + kv_offset} keys: the kernels have no chunk mask. Use attn_implementation='sdpa' "
            "or 'flex_attention' for this model, or inputs of at most one chunk."
        )


# --------------------------------------------------------------------------------------------
# Attention function
# --------------------------------------------------------------------------------------------


def _as_int(x) -> int:
    return int(x.item()) if isinstance(x, torch.Tensor) else int(x)


def _bshd(x: torch.Tensor) -> torch.Tensor:
    """(B, H, S, D) -> (B, S, H, D) as a view. Never copies here: the op's layout check
    (validate.kernel_layout) copies only what a kernel cannot read."""
    return x.transpose(1, 2)


def _first_tensor(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _flash_utils():
    """transformers' flash-attention helpers (present with these names in 5.17 to 5.22)."""
    from transformers import modeling_flash_attention_utils as mfau

    return mfau


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: (B, H, S, D) inputs -> ((B, Sq, Hq, Dv) output, None)."""
    if dropout and getattr(module, "training", False):
        raise NotImplementedError(
            f"flash_attn4 has no attention dropout (got dropout={dropout} in training mode); "
            "set the model's attention_dropout to 0.0 or use another attn_implementation for training"
        )
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            "expected query/key/value of shape (batch, heads, seqlen, head_dim), got "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if query.numel() == 0:
        raise ValueError(f"query has a zero-sized dimension: {tuple(query.shape)}")
    is_causal = kwargs.pop("is_causal", None)
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    is_causal = bool(is_causal)

    if query.dtype == torch.float32 and torch.is_autocast_enabled(query.device.type):
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)

    mask = attention_mask
    if mask is not None:
        if mask.dim() != 2:
            raise ValueError(
                f"attn_implementation 'fa4' takes the 2-D (batch, kv_len) padding mask; got a {mask.dim()}-D "
                "mask (a custom mask?). Use attn_implementation='sdpa' or 'eager' for arbitrary masks."
            )
        if mask.dtype != torch.bool:
            mask = mask.bool()
        if mask.shape[-1] > key.shape[2]:
            mask = mask[:, -key.shape[2]:]

    sq = query.shape[2]
    sk = key.shape[2] if mask is None else min(key.shape[2], mask.shape[-1])
    window = (-1, -1)
    if sliding_window is not None and sk > sliding_window:
        left = int(sliding_window) - 1
        window = (left, 0) if is_causal else (left, left)
    softcap = float(softcap) if softcap else 0.0
    sink = s_aux.float() if s_aux is not None else None
    fa = _backend()

    if mask is not None:
        options = _options(scaling, is_causal, window, softcap, sink)
        if sq < mask.shape[-1] and (is_causal or sq == 1):  # a step on a KV cache
            out = _cache_forward(fa, query, key, value, mask, options)
            if out is not None:
                return out, None
        return _padded_forward(fa, query, key, value, mask, is_causal, options), None

    # No mask: every decode step on a dynamic cache lands here, once per layer, so this path calls
    # the function directly (no options dict, no helpers): each Python step between the model's
    # other ops costs a multiple of its back-to-back time (scripts/host_time.py --in-model).
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # (B, S, H, D) views
    if kwargs:
        packed = _packed_kwargs(kwargs, q.shape[0], sq, k.shape[1])
        if packed is not None:
            return _packed_attention(fa, q, k, v, *packed, _options(scaling, is_causal, window, softcap, sink)), None
    # automatic split-KV (decoding's few (batch, head) pairs fill the GPU) where no gradient is needed
    out = fa.flash_attn_func(q, k, v, softmax_scale=scaling, causal=is_causal, window_size=window, softcap=softcap,
                             learnable_sink=sink, num_splits=1 if _needs_grad(q, k, v) else 0)
    return _first_tensor(out), None


def _options(softmax_scale, causal: bool, window_size: tuple, softcap: float, learnable_sink) -> dict:
    """The keyword arguments every flash_attn4 call of the masked and packed paths passes."""
    return dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                learnable_sink=learnable_sink)


# ---- packed sequences (padding-free training) ----


def _packed_kwargs(kwargs: dict, batch: int, sq: int, sk: int):
    """(cu_q, cu_k, max_q, max_k) when the batch holds packed sequences, else None: transformers'
    flash kwargs when given (DataCollatorWithFlattening(return_flash_attn_kwargs=True)), else
    restarting ``position_ids``, detected and converted as transformers' flash path does."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        if cu_q is None or cu_k is None:
            raise ValueError("pass both cu_seq_lens_q and cu_seq_lens_k (packed sequences), or neither")
        cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
        max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
        max_q = _as_int(max_q) if max_q is not None else _as_int((cu_q[1:] - cu_q[:-1]).max())
        max_k = _as_int(max_k) if max_k is not None else _as_int((cu_k[1:] - cu_k[:-1]).max())
        return cu_q, cu_k, max_q, max_k
    position_ids = kwargs.get("position_ids")
    # transformers 5.17's _is_packed_sequence lacks the shape checks of 5.22's: make them here
    if not isinstance(position_ids, torch.Tensor) or batch != 1 or sq != sk or sq < 2:
        return None
    if position_ids.shape[-1] != sq:
        return None
    memo = _PACKED_MEMO[0]
    # (inference tensors have no version counter: checked every time, as under torch.compile)
    memoize = not torch.compiler.is_compiling() and not position_ids.is_inference()
    if memoize and memo is not None and memo[0]() is position_ids and memo[1] == position_ids._version:
        return memo[2]
    mfau = _flash_utils()
    packed = None
    if bool(mfau._is_packed_sequence(position_ids, batch)):
        (cu_q, cu_k), (max_q, max_k) = mfau.prepare_fa_kwargs_from_position_ids(position_ids)
        packed = cu_q, cu_k, _as_int(max_q), _as_int(max_k)
    if memoize:
        _PACKED_MEMO[0] = (weakref.ref(position_ids), position_ids._version, packed)
    return packed


# The verdict on the last position_ids seen: every layer of a forward passes the same tensor, and
# checking it (_is_packed_sequence, then the lengths) waits for the GPU. Kept while that tensor lives
# unchanged (its version counter), so a training forward waits once instead of once per layer. Not
# under torch.compile, which traces the check into the graph.
_PACKED_MEMO: list = [None]  # (weakref to position_ids, its _version, _packed_kwargs' result)


def _packed_attention(fa, q, k, v, cu_q, cu_k, max_q: int, max_k: int, options: dict) -> torch.Tensor:
    """Packed sequences in a (batch, seq, heads, dim) batch (batch is 1 in practice): attend through
    the varlen entry point and give the output back in the batch's shape."""
    batch, sq = q.shape[0], q.shape[1]
    out = _first_tensor(fa.flash_attn_varlen_func(
        q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]),
        cu_q, cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k, **options))
    return out.reshape(batch, sq, *out.shape[-2:])


# ---- padded batches: unpad, varlen, re-pad ----


def _padded_forward(fa, query, key, value, mask, is_causal: bool, options: dict) -> torch.Tensor:
    """(B, H, S, D) q/k/v with a (B, Sk) padding mask -> (B, Sq, Hq, Dv), padded query rows zero."""
    q, k, v = _bshd(query), _bshd(key), _bshd(value)
    batch, sq = q.shape[0], q.shape[1]
    if not is_causal and 1 < sq != mask.shape[-1]:
        return _keys_only_padded(fa, q, k, v, mask, options)
    mfau = _flash_utils()
    q_un, k_un, v_un, indices_q, (cu_q, cu_k), (max_q, max_k) = mfau._upad_input(
        q, k, v, mask, sq, mfau._unpad_input)
    out = _first_tensor(fa.flash_attn_varlen_func(
        q_un, k_un, v_un, cu_q, cu_k, max_seqlen_q=_as_int(max_q), max_seqlen_k=_as_int(max_k), **options))
    return mfau._pad_input(out, indices_q, batch, sq)


def _keys_only_padded(fa, q, k, v, mask, options: dict) -> torch.Tensor:
    """Non-causal attention of unpadded queries to padded keys (cross-attention): transformers'
    ``_upad_input`` would read the last Sq columns of the key mask as a query mask here."""
    batch, sq = q.shape[0], q.shape[1]
    k = k[:, : mask.shape[-1]]
    v = v[:, : mask.shape[-1]]
    k_lens = mask.sum(dim=-1, dtype=torch.int32)
    cu_k = torch.nn.functional.pad(torch.cumsum(k_lens, dim=0, dtype=torch.int32), (1, 0))
    cu_q = torch.arange(0, (batch + 1) * sq, sq, dtype=torch.int32, device=q.device)
    out = _first_tensor(fa.flash_attn_varlen_func(
        q.reshape(batch * sq, *q.shape[2:]), k[mask], v[mask], cu_q, cu_k,
        max_seqlen_q=sq, max_seqlen_k=_as_int(k_lens.max()), **options))
    return out.reshape(batch, sq, *out.shape[-2:])


# ---- steps on a KV cache: flash_attn_with_kvcache over transformers' (B, Hk, S, D) cache ----

_RANGE_CACHE: list = []  # [(weakref to a mask, its key ranges)]: one mask serves every layer of a step


def _key_ranges(mask: torch.Tensor):
    """(leftpad, end, contiguous) of a (B, L) bool mask, on the device without a sync: row b's first
    valid key, one past its last, and whether every row's valid keys are exactly [leftpad, end)."""
    length = mask.shape[-1]
    as_int = mask.to(torch.int32)
    leftpad = torch.argmax(as_int, dim=-1).to(torch.int32)
    end = (length - torch.argmax(as_int.flip(-1), dim=-1)).to(torch.int32)
    contiguous = (as_int.sum(dim=-1) == end - leftpad).all()
    return leftpad, end, contiguous


def _eager_key_ranges(mask: torch.Tensor, heads: int):
    """_key_ranges with the contiguity, and whether any row is left-padded, read on the host (one
    sync) and the ranges repeated for each of ``heads`` KV heads (one cache row per (batch, KV head)),
    remembered for the mask object: the layers of one forward share it, and pay neither the sync nor
    the repeats again. leftpad is None when no row is left-padded (a static cache's unused tail
    only): the KV-cache call then takes its common case (the batched kernel, no varlen metadata)."""
    version = _mask_version(mask)
    if _RANGE_CACHE:
        ref, cached_version, cached_heads, ranges = _RANGE_CACHE[0]
        if ref() is mask and cached_version == version and cached_heads == heads:
            return ranges
    leftpad, end, contiguous = _key_ranges(mask)
    contiguous, padded = torch.stack((contiguous, (leftpad != 0).any())).tolist()
    ranges = (leftpad.repeat_interleave(heads) if padded else None, end.repeat_interleave(heads), contiguous)
    _RANGE_CACHE[:] = [(weakref.ref(mask), version, heads, ranges)]
    return ranges


def _mask_version(mask: torch.Tensor):
    """The mask's version counter, which in-place changes bump; None for an inference tensor (made
    under torch.inference_mode, as pipelines and servers generate), which has none: such a mask
    is recognised by identity alone (transformers builds a new mask for each step and never
    changes one in place)."""
    return None if mask.is_inference() else mask._version


def _cache_forward(fa, query, key, value, mask, options: dict):
    """Attention of the last Sq positions over a cache whose valid keys per row are given by mask
    (B, L), L <= cache length. Each (batch, KV head) pair becomes one row of a one-head KV cache:
    (B, Hk, S, D) storage is (B * Hk, S, 1, D) rows without a copy. Returns None (caller unpads)
    when the mask has holes, the storage does not allow the view, or per-head sinks would have to
    differ between the pairs' query-head groups."""
    batch, hq, sq, d = query.shape
    hk, s_cache = key.shape[1], key.shape[2]
    if options["learnable_sink"] is not None and hk > 1:
        return None
    if _needs_grad(query, key, value) or not hasattr(fa, "flash_attn_with_kvcache"):
        return None
    try:
        k_rows = key.view(batch * hk, s_cache, 1, d)
        v_rows = value.view(batch * hk, s_cache, 1, value.shape[-1])
    except RuntimeError:
        return None
    if torch.compiler.is_compiling():
        leftpad, end, contiguous = _key_ranges(mask)
        # no host sync while tracing: a mask with holes stops the program instead of attending wrongly
        torch._assert_async(contiguous, "flash_attn4: under torch.compile a KV-cache step needs each row's "
                                        "valid keys to be one contiguous range (left padding)")
    else:
        leftpad, end, contiguous = _eager_key_ranges(mask, hk)
        if not contiguous:
            return None
    group = hq // hk
    # (B, Hq, Sq, D) -> (B * Hk, Sq, group, D): the query heads of one KV head share its cache row. One
    # query (decoding) is one reshape each way: (b, head, d) is the same order on both sides.
    if sq == 1:
        q_rows = query.reshape(batch * hk, 1, group, d)
    else:
        q_rows = query.reshape(batch, hk, group, sq, d).transpose(2, 3).reshape(batch * hk, sq, group, d)
    if torch.compiler.is_compiling():  # eager: _eager_key_ranges repeated them once for every layer
        leftpad, end = leftpad.repeat_interleave(hk), end.repeat_interleave(hk)
    out = _first_tensor(fa.flash_attn_with_kvcache(
        q_rows, k_rows, v_rows, cache_seqlens=end, cache_leftpad=leftpad, **options))
    dv = out.shape[-1]
    if sq == 1:
        return out.reshape(batch, 1, hq, dv)
    return out.view(batch, hk, sq, group, dv).transpose(1, 2).reshape(batch, sq, hq, dv)
