import torch

ops = torch.ops._flash_attn4_dev


def add_op_namespace_prefix(op_name: str) -> str:
    """Prefix an op name with the namespace of this build (dev tree; the Hub build regenerates it)."""
    return f"_flash_attn4_dev::{op_name}"
