"""Blackwell Ultra (sm_103a, B300/GB300) rules: the sm100 kernels and tiles, with the softmax's
exponentials all on MUFU.

sm_103 doubles the MUFU.EX2 rate of sm_100, so the exponentials of a tile no longer keep pace with
its MMAs only thanks to the FMA pipe: the polynomial would cost FMA-pipe issue slots for nothing
(FA4 turns its emulation off there too). And single CTAs only: the CTA-pair kernel (tiles.TWO_CTA)
has not been compiled and checked for sm_103a. Everything else is sm_100's (tiles.py). Not run by us.
"""

from __future__ import annotations

from .tiles import (FORWARD_KERNEL_SET, FORWARD_SPLIT_KV, L2_BUDGET_BYTES, check_forward,  # noqa: F401
                    forward_tiles)
from .tiles import forward_grid as _sm100_grid
from .tiles import forward_schedule as _sm100_schedule


def forward_grid(head_dim: int, head_dim_v: int, causal: bool, local: bool, varlen: bool, split_kv: bool,
                 has_seqused_k: bool = False) -> dict:
    grid = _sm100_grid(head_dim, head_dim_v, causal, local, varlen, split_kv, has_seqused_k)
    grid.pop("cluster_m", None)
    return grid


def forward_schedule(head_dim: int, head_dim_v: int, varlen: bool, qhead_per_kvhead: int = 1,
                     split_kv: bool = False) -> dict:
    return {**_sm100_schedule(head_dim, head_dim_v, varlen, qhead_per_kvhead, split_kv), "exp2_emulated_eighths": 0}
