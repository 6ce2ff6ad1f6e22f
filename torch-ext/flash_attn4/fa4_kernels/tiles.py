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
    rule = getattr(kernels_for(arch, kernel).rules(), name, None)
    if rule is None:
        raise NotImplementedError(f"flash-attn4: {arch} has no {name} rule (implemented: {describe_implemented()})")
    return rule


def forward_tiles(arch: Arch, head_dim: int, head_dim_v: int, causal: bool, local: bool) -> dict:
    """ForwardConfig overrides (tile_m, tile_n, num_stages) for a problem class."""
    return _rule(arch, "forward_tiles", "forward")(head_dim, head_dim_v, causal, local)


def forward_schedule(arch: Arch, head_dim: int, head_dim_v: int, varlen: bool, qhead_per_kvhead: int = 1) -> dict:
    """ForwardConfig overrides for the epilogue, the O rescale, the GEMM calls and GQA packing of a
    problem class (whatever of those the arch's forward has)."""
    return _rule(arch, "forward_schedule", "forward")(head_dim, head_dim_v, varlen, qhead_per_kvhead)


def backward_tiles(arch: Arch, head_dim: int, head_dim_v: int, causal: bool, local: bool, has_softcap: bool) -> dict:
    """BackwardConfig overrides (tiles, stages and the arch's backward layout switches) for a
    problem class."""
    return _rule(arch, "backward_tiles", "backward")(head_dim, head_dim_v, causal, local, has_softcap)
