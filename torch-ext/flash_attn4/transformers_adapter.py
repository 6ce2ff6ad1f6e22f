"""Hugging Face transformers integration.

Two ways to run a transformers model on these kernels:

1. ``attn_implementation="fa4"`` (this module). ``register()`` adds an attention function and a
   padding-mask function to transformers' ``AttentionInterface`` / ``AttentionMaskInterface``;
   ``maybe_register()`` does the same only when transformers is already imported (the package's
   ``__init__`` calls it, so that importing flash_attn4 alone never imports transformers).

       import transformers
       import flash_attn4                     # registers "fa4" (or call transformers_adapter.register())
       model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="fa4")

2. The Hub string ``attn_implementation=HUB_ATTN_IMPLEMENTATION`` ("<org>/flash-attn4@v1").
   transformers then calls ``kernels.get_kernel`` and wraps our ``flash_attn_varlen_func`` /
   ``flash_attn_func`` with its own flash-attention wrapper (it inspects their parameter names).
   Keep the "@v1": transformers 5.17 asks for branch v0 of any repo whose id matches ".*flash.*4"
   when no revision is given; 5.18+ asks for v1. Non-``kernels-community`` repos also need
   ``allow_all_kernels=True``.

What the attention function does with transformers' arguments (both 5.17 and 5.22):

- query (B, Hq, Sq, D), key/value (B, Hk, Sk, D[v]) with Hk unrepeated (GQA/MQA go to the kernel
  as they are). They are re-viewed as (B, S, H, D) without a copy; the op copies only a layout a
  kernel cannot read (see validate.kernel_layout).
- attention_mask: the 2-D (B, kv_len) boolean padding mask built by ``padding_mask`` below (or
  None). Padded batches are unpadded to the varlen layout (cu_seqlens), run through
  ``flash_attn_varlen_func``, and re-padded with zeros at padded query positions. A mask shorter
  than the keys (static cache) slices the keys to the mask length. 4-D masks are rejected.
- Packed batches: ``cu_seq_lens_q/k`` (+ ``max_length_q/k``, ints or 0-d tensors) kwargs, or
  ``position_ids`` that restart (B == 1, no padding mask, Sq == Sk) -> varlen.
- Causality: ``kwargs["is_causal"]`` if given, else ``module.is_causal``. Masks are aligned
  bottom-right (CONTRACTS.md), so a single-query step (decode) is the same as non-causal and is
  sent as such.
- ``scaling`` -> ``softmax_scale``; ``softcap`` -> ``softcap``; ``s_aux`` (attention sinks, one
  logit per query head) -> ``learnable_sink`` in float32.
- ``sliding_window`` follows transformers' flash-attention path exactly: only when the key length
  exceeds it, left window ``sliding_window - 1`` (the query plus ``sliding_window - 1`` earlier
  keys), right window 0 when causal and ``sliding_window - 1`` when not. (transformers' own SDPA
  mask for *bidirectional* sliding windows admits distance <= sliding_window, one more than its
  flash path; we follow the flash path.)
- ``dropout > 0`` on a module in training mode raises NotImplementedError (the kernels have no
  dropout); in eval mode dropout is ignored, as in any attention implementation.

The kernels are looked up on the package at call time (``flash_attn4.flash_attn_func`` /
``flash_attn_varlen_func``), so tests can substitute a reference implementation.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings

import torch

DEFAULT_NAME = "fa4"
HUB_REPO_ID = "flash-attn4-org/flash-attn4"
HUB_VERSION = 1
HUB_ATTN_IMPLEMENTATION = f"{HUB_REPO_ID}@v{HUB_VERSION}"


def _backend():
    """The package whose public functions we call (resolved per call, never cached)."""
    return importlib.import_module(__package__)


# --------------------------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------------------------


def register(name: str = DEFAULT_NAME) -> str:
    """Register ``attention_forward`` and ``padding_mask`` with transformers under ``name``.

    Returns the name, for ``attn_implementation=``. Raises ImportError without transformers.
    """
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
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, padding_mask)
    return name


def maybe_register(name: str = DEFAULT_NAME, import_transformers: bool = False) -> str | None:
    """``register(name)`` when transformers is already imported; otherwise do nothing, return None.

    Meant for the package's ``__init__``: importing flash_attn4 never pulls in transformers (seconds
    of import time) by itself. A program that imports flash_attn4 first calls ``register()`` later,
    or passes ``import_transformers=True`` to import it here when it is installed. Never raises: a
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
    """The 2-D (batch, kv_len) boolean padding mask, or None when nothing is padded.

    The same rule as transformers' ``flash_attention_mask`` (only the padding mask matters: causal
    and sliding-window structure travel as kernel arguments), plus one case transformers' flash
    path gets from its generation loop by name ("flash" in the implementation name, which ours
    cannot have): a static cache with no padding, where the keys are longer than the tokens seen
    so far. There we return an all-true mask of the seen length, which tells ``attention_forward``
    to ignore the unused tail of the cache.
    """
    if attention_mask is not None:
        attention_mask = attention_mask[:, -kv_length:]
        if attention_mask.shape[-1] == kv_length and bool(attention_mask.all()):
            return None
        return attention_mask.bool()
    if isinstance(kv_offset, int) and kv_offset == 0 and not torch.compiler.is_compiling():
        seen = int(q_offset) + int(q_length)
        if seen < kv_length:
            return torch.ones(batch_size, seen, dtype=torch.bool, device=device)
    return None


# --------------------------------------------------------------------------------------------
# Attention function
# --------------------------------------------------------------------------------------------


def _as_int(x) -> int:
    return int(x.item()) if isinstance(x, torch.Tensor) else int(x)


def _bshd(x: torch.Tensor) -> torch.Tensor:
    """(B, H, S, D) -> (B, S, H, D) as a view. Never copies here: the op's layout check
    (validate.kernel_layout) copies only what a kernel cannot read."""
    return x.transpose(1, 2)


def _cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))


def _packed_attention(fa, q, k, v, cu_q, cu_k, max_q: int, max_k: int, options: dict) -> torch.Tensor:
    """Packed sequences in a (batch, seq, heads, dim) batch (batch is 1 in practice): attend through
    the varlen entry point and give the output back in the batch's shape."""
    batch, sq = q.shape[0], q.shape[1]
    out = _first_tensor(fa.flash_attn_varlen_func(
        q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]),
        cu_q, cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k, **options))
    return out.reshape(batch, sq, *out.shape[-2:])


def _first_tensor(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _packed_cu_seqlens(position_ids, batch: int, sq: int, sk: int):
    """cu_seqlens (int32) and max length when ``position_ids`` describe several packed sequences."""
    if position_ids is None or batch != 1 or sq != sk or sq < 2:
        return None
    if not isinstance(position_ids, torch.Tensor) or position_ids.numel() != sq:
        return None
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos[1:] != pos[:-1] + 1).flatten() + 1
    if starts.numel() == 0:
        return None
    bounds = torch.cat(
        [starts.new_zeros(1), starts, starts.new_full((1,), sq)]
    ).to(torch.int32)
    return bounds, _as_int((bounds[1:] - bounds[:-1]).max())


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

    batch, hq, sq, _ = query.shape
    q, k, v = _bshd(query), _bshd(key), _bshd(value)
    device_type = q.device.type
    if q.dtype == torch.float32 and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)

    mask = attention_mask
    if mask is not None:
        if mask.dim() != 2:
            raise ValueError(
                f"attn_implementation 'fa4' takes the 2-D (batch, kv_len) padding mask; got a {mask.dim()}-D "
                "mask (a custom mask?). Use attn_implementation='sdpa' or 'eager' for arbitrary masks."
            )
        mask = mask.bool()
        if mask.shape[-1] < k.shape[1]:  # static cache: ignore the unused tail
            k, v = k[:, : mask.shape[-1]], v[:, : mask.shape[-1]]
        elif mask.shape[-1] > k.shape[1]:
            mask = mask[:, -k.shape[1]:]
        if bool(mask.all()):
            mask = None
    sk = k.shape[1]

    causal = bool(is_causal) and sq > 1  # one query row sees every key under bottom-right alignment
    window = (-1, -1)
    if sliding_window is not None and sk > sliding_window:
        left = int(sliding_window) - 1
        window = (left, 0) if is_causal else (left, left)
    options = dict(
        softmax_scale=scaling,
        causal=causal,
        window_size=window,
        softcap=float(softcap) if softcap else 0.0,
        learnable_sink=s_aux.float() if s_aux is not None else None,
    )
    fa = _backend()

    if mask is not None:
        return _padded_forward(fa, q, k, v, mask, bool(is_causal), options), None

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        if cu_q is None or cu_k is None:
            raise ValueError("pass both cu_seq_lens_q and cu_seq_lens_k (packed sequences), or neither")
        cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
        max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
        max_q = _as_int(max_q) if max_q is not None else _as_int((cu_q[1:] - cu_q[:-1]).max())
        max_k = _as_int(max_k) if max_k is not None else _as_int((cu_k[1:] - cu_k[:-1]).max())
        return _packed_attention(fa, q, k, v, cu_q, cu_k, max_q, max_k, options), None

    packed = _packed_cu_seqlens(kwargs.get("position_ids"), batch, sq, sk)
    if packed is not None:
        cu, max_len = packed
        return _packed_attention(fa, q, k, v, cu, cu, max_len, max_len, options), None

    return _first_tensor(fa.flash_attn_func(q, k, v, **options)), None


def _padded_forward(fa, q, k, v, mask, is_causal: bool, options: dict) -> torch.Tensor:
    """Unpad (B, S, H, D) q/k/v with a (B, Sk) padding mask, run varlen, re-pad with zeros."""
    batch, sq, hq, _ = q.shape
    sk = k.shape[1]
    if sq == sk:
        q_mask = mask
    elif is_causal:
        # Queries are the last sq positions (generation with a cache; left padding).
        q_mask = mask[:, -sq:]
    else:
        q_mask = None  # e.g. cross-attention: the mask pads the keys only
    k_lens = mask.sum(dim=-1, dtype=torch.int32)
    cu_k = _cu_seqlens(k_lens)
    k_un, v_un = k[mask], v[mask]
    if q_mask is None:
        q_un = q.reshape(batch * sq, *q.shape[2:])
        cu_q = torch.arange(0, (batch + 1) * sq, sq, dtype=torch.int32, device=q.device)
        max_q = sq
    else:
        q_lens = q_mask.sum(dim=-1, dtype=torch.int32)
        cu_q = _cu_seqlens(q_lens)
        q_un = q[q_mask]
        max_q = _as_int(q_lens.max())
    out = fa.flash_attn_varlen_func(
        q_un,
        k_un,
        v_un,
        cu_q,
        cu_k,
        max_seqlen_q=max_q,
        max_seqlen_k=_as_int(k_lens.max()),
        **options,
    )
    out = _first_tensor(out)
    if q_mask is None:
        return out.reshape(batch, sq, *out.shape[-2:])
    full = out.new_zeros(batch, sq, *out.shape[-2:])
    full[q_mask] = out
    return full
