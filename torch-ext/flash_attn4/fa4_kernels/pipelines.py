"""Pipeline helpers every architecture's kernels use (cutlass.pipeline states and barriers)."""

from __future__ import annotations

import cutlass.pipeline as pipeline


def advanced(state: pipeline.PipelineState, steps: int = 1) -> pipeline.PipelineState:
    """The state ``steps`` stages on (default: the next), as a new value: loop-carried state must be
    rebound, not mutated."""
    nxt = state.clone()
    for _ in range(steps):
        nxt.advance()
    return nxt
