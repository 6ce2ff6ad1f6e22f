"""Pipeline helpers every architecture's kernels use (cutlass.pipeline states and barriers)."""

from __future__ import annotations

import cutlass.pipeline as pipeline


def advanced(state: pipeline.PipelineState) -> pipeline.PipelineState:
    """The next pipeline state, as a new value: loop-carried state must be rebound, not mutated."""
    nxt = state.clone()
    nxt.advance()
    return nxt
