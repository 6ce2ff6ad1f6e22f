"""flash-attn4: FlashAttention-4 attention kernels (CuTe DSL) as a torch layer: forward and backward on
Hopper (sm_90) and Blackwell (sm_100, sm_103; compiled and self-checked, not run by us).

Public API: :func:`flash_attn_func`, :func:`flash_attn_varlen_func` and :func:`flash_attn_with_kvcache`
(FlashAttention-compatible), and :func:`flash_attn_combine` (merging partial attention over disjoint
key sets).
Environment overrides are documented in ``settings``.

transformers: importing this package registers ``attn_implementation="fa4"`` with transformers in any
import order, without importing transformers itself: at once if its registries are loaded, else when
they load (an import hook, ``transformers_adapter.install_import_hook``). By hand (or under another
name): ``from flash_attn4 import transformers_adapter; transformers_adapter.register()``.
"""

from .interface import flash_attn_combine, flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from .torch_provider import register as _register_torch_provider

__version__ = "0.1.0"

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "flash_attn_combine",
           "__version__"]

from . import transformers_adapter as _transformers_adapter  # imports torch only

_transformers_adapter.install_import_hook()

# torch.nn.attention.activate_flash_attention_impl("flash-attn4") opts in (torch_provider); never activated here.
_register_torch_provider()
