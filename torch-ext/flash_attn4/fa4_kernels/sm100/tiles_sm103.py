"""Blackwell Ultra (sm_103a, B300/GB300) rules: the sm100 kernels and tiles, with the softmax's
exponentials all on MUFU.

sm_103 doubles the MUFU.EX2 rate of sm_100, so the exponentials of a tile no longer keep pace with
its MMAs only thanks to the FMA pipe: the polynomial would cost FMA-pipe issue slots for nothing
(FA4 turns its emulation off there too). CTA pairs (tiles.TWO_CTA) run where they do on sm_100a:
the pair kernel compiles for sm_103a with the same static facts (no local memory under ptxas 12.9
and 13.4, every MMA, commit and TMA load in its 2-CTA form, the MMA counts the tiles imply; all
exponentials on MUFU, since the pair kernel's softmax takes exp2_emulated_eighths from this
schedule like the single-CTA one: tests/cpu/test_sm100_static.py). Everything else is sm_100's
(tiles.py). Not run by us.
"""

from __future__ import annotations

from .tiles import (FORWARD_CLUSTER_M, FORWARD_KERNEL_SET, FORWARD_SPLIT_KV, L2_BUDGET_BYTES,  # noqa: F401
                    check_forward, forward_grid, forward_tiles)
from .tiles import forward_schedule as _sm100_schedule


def forward_schedule(head_dim: int, head_dim_v: int, varlen: bool, qhead_per_kvhead: int = 1,
                     split_kv: bool = False) -> dict:
    return {**_sm100_schedule(head_dim, head_dim_v, varlen, qhead_per_kvhead, split_kv), "exp2_emulated_eighths": 0}
