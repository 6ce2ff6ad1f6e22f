"""flash-attn4: FlashAttention-4 attention kernels (CuTe DSL) as a torch layer: forward and backward on
Hopper (sm_90), forward on Blackwell (sm_100, sm_103; compiled and self-checked, not run by us).

Public API: :func:`flash_attn_func`, :func:`flash_attn_varlen_func` and :func:`flash_attn_with_kvcache`
(FlashAttention-compatible), and :func:`flash_attn_combine` (merging partial attention over disjoint
key sets).
Environment overrides are documented in ``settings``.

transformers: when transformers is already imported, importing this package registers
``attn_implementation="fa4"`` (see ``transformers_adapter``); otherwise
``from flash_attn4 import transformers_adapter; transformers_adapter.register()`` (the submodule is
not imported here: importing transformers would cost every user of the plain functions seconds).
"""

import sys as _sys

from .interface import flash_attn_combine, flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from .torch_provider import register as _register_torch_provider

__version__ = "0.1.0"

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "flash_attn_combine",
           "__version__"]

if "transformers" in _sys.modules:
    from . import transformers_adapter as _transformers_adapter

    _transformers_adapter.maybe_register()

# torch.nn.attention.activate_flash_attention_impl("flash-attn4") opts in (torch_provider); never activated here.
_register_torch_provider()
