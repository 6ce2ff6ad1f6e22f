"""flash-attn4 CuTe-DSL kernels.

No torch, no driver queries: everything here compiles on a machine without a GPU once the target
is named (``Arch``). ``sm90/`` and ``sm100/`` hold the architecture-specific kernels; the modules at
this level hold what both share (configuration, sequence bookkeeping, block ranges, masks, online
softmax, tile scheduling, fragment layouts).
"""

from .arch import Arch
from .config import ForwardConfig

__all__ = ["Arch", "ForwardConfig"]
