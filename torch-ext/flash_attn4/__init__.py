"""flash-attn4: FlashAttention-4 forward kernels (CuTe DSL) for Hopper and Blackwell, as a torch layer.

Public API: :func:`flash_attn_func` and :func:`flash_attn_varlen_func` (FlashAttention-compatible).
Environment overrides are documented in ``settings``.
"""

from .interface import flash_attn_func, flash_attn_varlen_func

__version__ = "0.1.0"

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "__version__"]
