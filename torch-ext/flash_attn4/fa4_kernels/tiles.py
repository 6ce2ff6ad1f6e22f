"""Tile shapes and schedule choices per problem class: a pure function of head dims, mask kind and
layout, never of sizes. dispatch builds its configurations from here and CI compiles the same ones
(fa4_kernels.compile.kernel_set).

The rules are the architecture's own (``<arch package>/tiles.py``, with the measurements behind
them); this module looks them up through the registry (``arch.KERNELS``). An arch without rules
raises NotImplementedError naming it and what exists.
"""

from __future__ import annotations

from .arch import Arch, describe_implemented, kernels_for


def _rule(arch: Arch, name: str, kernel: str):
    # Rules are plain Python and exist for kernels not yet ready for users too (compile tools);
    # dispatch refuses those through arch.IMPLEMENTED.
    rule = getattr(kernels_for(arch, kernel, compiled=True).rules(), name, None)
    if rule is None:
        raise NotImplementedError(f"flash-attn4: {arch} has no {name} rule (implemented: {describe_implemented()})")
    return rule


def forward_tiles(arch: Arch, head_dim: int, head_dim_v: int, causal: bool, local: bool, page_size: int = 0) -> dict:
    """ForwardConfig overrides (tile_m, tile_n, num_stages) for a problem class (``page_size``: of a
    paged KV cache, 0 for contiguous keys)."""
    return _rule(arch, "forward_tiles", "forward")(head_dim, head_dim_v, causal, local, page_size=page_size)


def forward_schedule(arch: Arch, head_dim: int, head_dim_v: int, varlen: bool, qhead_per_kvhead: int = 1,
                     split_kv: bool = False, pack_group: int = 0) -> dict:
    """ForwardConfig overrides for the epilogue, the O rescale, the GEMM calls and GQA packing of a
    problem class (whatever of those the arch's forward has); ``split_kv``: of its split-KV variant,
    NotImplementedError for an arch without one (``FORWARD_SPLIT_KV`` in its rules). ``pack_group``
    > 0: the ratio packed in padded groups of that many rows (ForwardConfig.pack_gqa_heads),
    NotImplementedError for an arch without them (``FORWARD_PADDED_PACK``)."""
    rule = _rule(arch, "forward_schedule", "forward")
    if not split_kv:
        fields = rule(head_dim, head_dim_v, varlen, qhead_per_kvhead)
    elif not has_split_kv(arch):
        raise NotImplementedError(f"flash-attn4: the {arch} forward has no split-KV kernel yet (num_splits > 1)")
    else:
        fields = rule(head_dim, head_dim_v, varlen, qhead_per_kvhead, split_kv=True)
    if pack_group:
        if not has_padded_pack(arch):
            raise NotImplementedError(f"flash-attn4: the {arch} forward does not pack padded GQA groups "
                                      f"(pack_group={pack_group})")
        fields.update(pack_gqa=pack_group, pack_gqa_heads=qhead_per_kvhead)
    return fields


def forward_grid(arch: Arch, head_dim: int, head_dim_v: int, causal: bool, local: bool, varlen: bool,
                 split_kv: bool = False, **flags) -> dict:
    """ForwardConfig overrides for the launch grid of a problem class (persistent CTAs or one CTA per
    tile; ``varlen``: cu_seqlens_q or seqused_q), from the arch's optional ``forward_grid`` rule;
    none (one CTA per tile, the config's default) for an arch without it. ``flags``: the problem's
    has_seqused_k, has_sink and paged (a paged KV cache), which some grids refuse."""
    rule = getattr(kernels_for(arch, "forward").rules(), "forward_grid", None)
    return {} if rule is None else rule(head_dim, head_dim_v, causal, local, varlen, split_kv, **flags)


def has_padded_pack(arch: Arch) -> bool:
    """Whether the arch's forward packs a head ratio in padded groups in the kernel
    (ForwardConfig.pack_gqa_heads; its rules say ``FORWARD_PADDED_PACK``)."""
    return bool(getattr(kernels_for(arch, "forward").rules(), "FORWARD_PADDED_PACK", False))


def has_split_kv(arch: Arch) -> bool:
    """Whether the arch's forward has the split-KV variant (its rules say ``FORWARD_SPLIT_KV``)."""
    return bool(getattr(kernels_for(arch, "forward").rules(), "FORWARD_SPLIT_KV", False))


def backward_tiles(arch: Arch, head_dim: int, head_dim_v: int, causal: bool, local: bool, has_softcap: bool) -> dict:
    """BackwardConfig overrides (tiles, stages and the arch's backward layout switches) for a
    problem class."""
    return _rule(arch, "backward_tiles", "backward")(head_dim, head_dim_v, causal, local, has_softcap)


def backward_head_dims(arch: Arch, head_dim: int, head_dim_v: int) -> tuple[int, int]:
    """The (head_dim, head_dim_v) the arch's backward kernel runs a problem's head dims at: the torch
    layer zero-pads Q, K, V, O and dO to them (ops.backward), which leaves the attention and its
    gradients unchanged, and drops the padded gradient columns."""
    return _rule(arch, "backward_head_dims", "backward")(head_dim, head_dim_v)


def backward_grid(arch: Arch, head_dim: int, head_dim_v: int, causal: bool, local: bool, varlen: bool,
                  deterministic: bool) -> dict:
    """BackwardConfig overrides for the launch grid of a problem class (CTA pairs where the arch's
    optional ``backward_grid`` rule runs them; they take precedence over backward_tiles' fields);
    none (one CTA per KV tile) for an arch without the rule."""
    rule = getattr(kernels_for(arch, "backward", compiled=True).rules(), "backward_grid", None)
    return {} if rule is None else rule(head_dim, head_dim_v, causal, local, varlen, deterministic)


def backward_schedule(arch: Arch, head_dim: int, head_dim_v: int, varlen: bool) -> dict:
    """BackwardConfig overrides that depend on the layout of a problem class (batched or varlen),
    from the arch's optional ``backward_schedule`` rule; none for an arch without it."""
    rule = getattr(kernels_for(arch, "backward", compiled=True).rules(), "backward_schedule", None)
    return {} if rule is None else rule(head_dim, head_dim_v, varlen)
