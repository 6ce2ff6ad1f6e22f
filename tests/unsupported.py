"""What the public functions refuse with NotImplementedError, per compile target: the one explicit list
the GPU tests consult, so that a feature regressing into "unsupported" fails instead of passing.

Written out by hand from the rules (validate.MIN_HEAD_DIM, each arch's ``check_forward`` in
fa4_kernels/<arch>/tiles.py, ``FORWARD_SPLIT_KV``, the registry's forward-only families in
fa4_kernels/arch.py), not computed from them: tests/cpu/test_unsupported.py runs the public
functions on CPU tensors over a grid of head dims and options for every arch and fails when this
list and the code disagree in either direction, so the list cannot drift.

Refused today (anything else must run):

- every arch: head_dim or head_dim_v below 16 (valid FlashAttention input, served by no kernel);
- sm_100a and sm_103a backward (the same kernels and rules: fa4_kernels/sm100/tiles.py check_backward,
  whose messages name the arch): head dims outside 64, 96 and 128 (each of
  head_dim and head_dim_v) after the backward's padding to a multiple of 16 (at least 32), except the pair
  (192, 128) of the serial kernel (local windows, softcap, varlen and seqused_k run; its BWD_UNIMPLEMENTED flags,
  none today, would be listed here);
- every arch: the backward of a forward with ``seqused_q`` or a paged KV cache (inference-only inputs).
"""

from __future__ import annotations

import re
from typing import Optional

from flash_attn4.fa4_kernels.arch import Arch

BLACKWELL = (Arch.SM100, Arch.SM103)
SMALLEST_HEAD_DIM = 16

# Each reason is a regex of the message the library raises (matched with re.search).
HEAD_DIM_TOO_SMALL = r"head_dim(_v)? = \d+ is not implemented"
SM100_BWD_HEAD_DIMS = (64, 96, 128)
SM100_BWD_SERIAL_HEAD_DIMS = ((192, 128),)  # the serial kernel's (head_dim, head_dim_v)
SM100_BWD_PAIR256_HEAD_DIMS = ((256, 256),)  # CTA pairs only (sm100/bwd_pair256.py): batched or varlen


def sm100_bwd_head_dim(arch: Arch) -> str:
    """The sm100 backward's head-dim refusal on ``arch`` (sm_100a or sm_103a: the message names it)."""
    return rf"{arch.value} backward: head dims \d+/\d+ are not implemented"


# raised by the forward itself when its inputs require grad (validate.check_no_grad, interface.py)
NO_INFERENCE_ONLY_BACKWARD = r"no backward (with (page_table|seqused_q)|through a paged KV cache)"


def forward_refusals(arch: Arch, *, head_dim: int, head_dim_v: int, seqused_q: bool = False, paged: bool = False,
                     num_splits: int = 1) -> list[str]:
    """The reasons (regexes) the forward of a problem is refused on ``arch``; empty when it must run.
    Several reasons may apply at once; the library raises for one of them."""
    reasons = []
    if min(head_dim, head_dim_v) < SMALLEST_HEAD_DIM:
        reasons.append(HEAD_DIM_TOO_SMALL)
    del arch, seqused_q, paged, num_splits  # every arch runs these (sm100 since its decode kernels)
    return reasons


def backward_kernel_head_dim(x: int) -> int:
    """The head dim the backward runs a user's head dim at: padded to a multiple of 16, at least 32."""
    return max(32, -(-x // 16) * 16)


def backward_refusals(arch: Arch, *, head_dim: int = 128, head_dim_v: int = 128, window: bool = False,
                      softcap: bool = False, varlen: bool = False, seqused_k: bool = False,
                      deterministic: bool = False, seqused_q: bool = False, paged: bool = False) -> list[str]:
    """The reasons a backward pass is refused on ``arch`` (after a forward that ran). ``varlen``:
    cu_seqlens given; ``window``: a local window (not the causal mask)."""
    reasons = []
    if arch in BLACKWELL:
        d, dv = backward_kernel_head_dim(head_dim), backward_kernel_head_dim(head_dim_v)
        serial = (d, dv) in SM100_BWD_SERIAL_HEAD_DIMS
        pair256 = (d, dv) in SM100_BWD_PAIR256_HEAD_DIMS
        if not serial and not pair256 and (d not in SM100_BWD_HEAD_DIMS or dv not in SM100_BWD_HEAD_DIMS):
            reasons.append(sm100_bwd_head_dim(arch))
    del window, softcap, varlen, seqused_k, deterministic  # every arch with a backward runs these
    return reasons + ([NO_INFERENCE_ONLY_BACKWARD] if seqused_q or paged else [])


def listed_backward_refusal(arch: Arch, message: str) -> Optional[str]:
    """The listed feature refusal of ``arch``'s backward (a head dim or an option it lacks) that a
    NotImplementedError's message matches, or None (then the refusal is not listed: a failure).
    For the GPU tests of the backward (tests/conftest.py), which run every feature and skip the
    ones the list says this arch refuses."""
    if arch not in BLACKWELL:
        return None
    pattern = sm100_bwd_head_dim(arch)
    return pattern if re.search(pattern, message) else None


def refusal_pattern(reasons: list[str]) -> Optional[str]:
    """One regex that any of ``reasons`` matches, or None when there is none."""
    return "|".join(f"(?:{r})" for r in reasons) or None
