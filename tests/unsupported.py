"""What the public functions refuse with NotImplementedError, per compile target: the one explicit list
the GPU tests consult, so that a feature regressing into "unsupported" fails instead of passing.

Written out by hand from the rules (validate.MIN_HEAD_DIM, each arch's ``check_forward`` in
fa4_kernels/<arch>/tiles.py, ``FORWARD_SPLIT_KV``, the registry's forward-only families in
fa4_kernels/arch.py), not computed from them: tests/cpu/test_unsupported.py runs the public
functions on CPU tensors over a grid of head dims and options for every arch and fails when this
list and the code disagree in either direction, so the list cannot drift.

Refused today (anything else must run):

- every arch: head_dim or head_dim_v below 16 (valid FlashAttention input, served by no kernel);
- every arch: the backward of a forward with ``seqused_q`` or a paged KV cache (inference-only inputs).
"""

from __future__ import annotations

from typing import Optional

from flash_attn4.fa4_kernels.arch import Arch

BLACKWELL = (Arch.SM100, Arch.SM103)
SMALLEST_HEAD_DIM = 16

# Each reason is a regex of the message the library raises (matched with re.search).
HEAD_DIM_TOO_SMALL = r"head_dim(_v)? = \d+ is not implemented"


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


def backward_refusals(arch: Arch, *, head_dim: int = 128, head_dim_v: int = 128, window: bool = False,
                      softcap: bool = False, varlen: bool = False, seqused_k: bool = False,
                      deterministic: bool = False, seqused_q: bool = False, paged: bool = False) -> list[str]:
    """The reasons a backward pass is refused on ``arch`` (after a forward that ran). ``varlen``:
    cu_seqlens given; ``window``: a local window (not the causal mask)."""
    # Every arch with a backward runs every head dim (sm100: zero-padded to its kernels' classes,
    # tiles.backward_head_dims) and these options.
    del arch, head_dim, head_dim_v, window, softcap, varlen, seqused_k, deterministic
    return [NO_INFERENCE_ONLY_BACKWARD] if seqused_q or paged else []


def refusal_pattern(reasons: list[str]) -> Optional[str]:
    """One regex that any of ``reasons`` matches, or None when there is none."""
    return "|".join(f"(?:{r})" for r in reasons) or None
