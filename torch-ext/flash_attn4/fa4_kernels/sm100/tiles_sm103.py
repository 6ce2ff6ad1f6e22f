"""Blackwell Ultra (sm_103a, B300/GB300) rules: the sm100 kernels and tiles, with the forward
softmax's exponentials all on MUFU; the backward is sm_100a's unchanged.

Forward. sm_103 doubles the MUFU.EX2 rate of sm_100, so the exponentials of a tile no longer keep
pace with its MMAs only thanks to the FMA pipe: the polynomial would cost FMA-pipe issue slots for
nothing (FA4 turns its emulation off there too). CTA pairs (tiles.TWO_CTA) run where they do on
sm_100a: the pair kernel compiles for sm_103a with the same static facts (no local memory under
ptxas 12.9 and 13.4, every MMA, commit and TMA load in its 2-CTA form, the MMA counts the tiles
imply; all exponentials on MUFU, since the pair kernel's softmax takes exp2_emulated_eighths from
this schedule like the single-CTA one: tests/cpu/test_sm100_static.py).

Backward. Its rules are sm_100a's, re-exported as they are: the one thing the forward changes for
sm_103 (the exp2 emulation) has no counterpart there, since every exponential of the backward
(P^T = exp2(S^T * scale - LSE)) is already on MUFU, so the faster MUFU only shortens it. What its
tiles, stages and pairs rest on is the same on both targets: 227 KiB of shared memory a CTA
(cutlass' get_smem_capacity_in_bytes gives sm_103 the same 232448 bytes as sm_100), 512 TMEM
columns (get_max_tmem_alloc_cols), the register file, tcgen05 with cta_group::2 (the sm_100f
family). The kernels are compiled for sm_103a (sm_100a code does not run there) and have the same
static facts (tests/cpu/test_sm100_bwd_static.py: no local memory under both ptxas, the MMA counts,
the pair's 2-CTA forms, all 512 TMEM columns allocated and released). Everything else is sm_100's
(tiles.py). Not run by us: each configuration is checked against PyTorch on first use.
"""

from __future__ import annotations

from .tiles import (BACKWARD_CLUSTER_M, FORWARD_CLUSTER_M, FORWARD_KERNEL_SET,  # noqa: F401
                    FORWARD_PADDED_PACK, FORWARD_SPLIT_KV, L2_BUDGET_BYTES, backward_grid, backward_head_dims,
                    backward_tiles, check_backward, check_forward, check_postprocess, forward_grid, forward_tiles)
from .tiles import forward_schedule as _sm100_schedule


def forward_schedule(head_dim: int, head_dim_v: int, varlen: bool, qhead_per_kvhead: int = 1,
                     split_kv: bool = False) -> dict:
    return {**_sm100_schedule(head_dim, head_dim_v, varlen, qhead_per_kvhead, split_kv), "exp2_emulated_eighths": 0}


# Problem classes CI compiles for sm_103a's backward: one of each kernel (the kernels and their
# rules are sm_100a's, whose set covers the flags; this one shows they build for sm_103a, at a
# fraction of the compile time): the d = 128 pair (batched, causal), the 1-CTA kernel (varlen: the
# kernel a varlen pair falls back to), the serial 192 / 128 kernel, the d = 256 pair (varlen, its
# K/V tail zeroing included; tests/cpu/test_sm100_bwd_pair256.py compiles it batched for sm_103a).
BACKWARD_KERNEL_SET = (dict(causal=True), dict(causal=True, varlen=True, has_seqused_k=True, cluster_m=1),
                       dict(d=192, dv=128), dict(d=256, dv=256, causal=True, varlen=True, has_seqused_k=True))
