"""Hopper (sm_90a) kernels: TMA loads, WGMMA, warp-specialised producer/consumer warpgroups."""

from .fwd import FlashAttentionForwardSm90

__all__ = ["FlashAttentionForwardSm90"]
