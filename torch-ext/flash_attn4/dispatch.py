"""Which kernel runs a problem: device capability -> compile target, problem -> ForwardConfig.

Everything here is a pure function of plain values (capability, dtype, head dims, mask flags), so it
can be tested without a GPU. Batch size and sequence lengths are deliberately not parameters of
anything that builds a config: they are runtime values of the kernel and never part of the compile key.
"""

from __future__ import annotations

import functools

import torch

from . import device_info
from .fa4_kernels.arch import IMPLEMENTED, Arch, supported_devices
from .fa4_kernels.config import BackwardConfig, ForwardConfig, PreprocessConfig
from .fa4_kernels.tiles import backward_tiles, forward_schedule, forward_tiles


_TORCH_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def arch_for_capability(capability: tuple[int, int], device_name: str = "this GPU",
                        kernel: str = "forward") -> Arch:
    """The compile target for a device, or a clear error.

    RuntimeError for GPUs we ship no kernels for; NotImplementedError for a supported family whose
    ``kernel`` is not implemented yet (per ``fa4_kernels.arch.IMPLEMENTED``).
    """
    major, minor = capability
    arch = Arch.for_capability(major, minor)
    if arch is None:
        raise RuntimeError(
            f"flash-attn4 has no kernels for {device_name} (compute capability {major}.{minor}); "
            f"supported: {supported_devices(IMPLEMENTED)}"
        )
    if kernel not in IMPLEMENTED.get(arch, ()):
        what = (f"{arch.family} kernels are not implemented yet" if not IMPLEMENTED.get(arch)
                else f"{arch.family} {kernel} kernels are not implemented yet")
        raise NotImplementedError(
            f"flash-attn4: {what} ({kernel} pass requested on {device_name}, compute capability "
            f"{major}.{minor}); supported: {supported_devices(IMPLEMENTED)}"
        )
    return arch


def arch_for_device(device: torch.device, kernel: str = "forward") -> Arch:
    info = device_info.get_device_info(device)
    return arch_for_capability(info.capability, f"{info.name} (cuda:{info.index})", kernel)


def choose_tiles(arch: Arch, head_dim: int, head_dim_v: int, causal: bool, local: bool) -> dict:
    """Tile sizes and pipeline depth for a problem class (never for a problem size): the kernels'
    own table (fa4_kernels.tiles), so the torch layer asks for what CI compiles."""
    return forward_tiles(arch, head_dim, head_dim_v, causal, local)


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _TORCH_DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype}; supported: torch.bfloat16, torch.float16") from None


@functools.lru_cache(maxsize=1024)
def forward_config(arch: Arch, dtype: str, head_dim: int, head_dim_v: int, *, causal: bool, local: bool,
                   has_softcap: bool, varlen: bool, has_seqused_k: bool, has_sink: bool,
                   qhead_per_kvhead: int = 1, split_kv: bool = False) -> ForwardConfig:
    """The ForwardConfig for a problem class (a model's head ratio included: it decides GQA
    packing; ``split_kv``: the kernel that writes float32 partials for num_splits > 1). Cached: the
    same arguments give the same object."""
    return ForwardConfig(
        arch=arch, dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v, causal=causal, local=local,
        has_softcap=has_softcap, varlen=varlen, has_seqused_k=has_seqused_k, has_sink=has_sink, split_kv=split_kv,
        **forward_schedule(arch, head_dim, head_dim_v, varlen, qhead_per_kvhead, split_kv=split_kv),
        **choose_tiles(arch, head_dim, head_dim_v, causal, local),
    )


@functools.lru_cache(maxsize=256)
def backward_config(arch: Arch, dtype: str, head_dim: int, head_dim_v: int, *, causal: bool, local: bool,
                    has_softcap: bool, varlen: bool, has_seqused_k: bool, deterministic: bool) -> BackwardConfig:
    """The BackwardConfig for a problem class (tiles: fa4_kernels/tiles.py)."""
    return BackwardConfig(arch=arch, dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v, causal=causal,
                          local=local, has_softcap=has_softcap, varlen=varlen, has_seqused_k=has_seqused_k,
                          deterministic=deterministic,
                          **backward_tiles(arch, head_dim, head_dim_v, causal, local, has_softcap))


@functools.lru_cache(maxsize=64)
def preprocess_config(arch: Arch, dtype: str, head_dim_v: int) -> PreprocessConfig:
    """The backward's preprocessing kernel for a dtype and head dim."""
    return PreprocessConfig(arch=arch, dtype=dtype, head_dim_v=head_dim_v)
