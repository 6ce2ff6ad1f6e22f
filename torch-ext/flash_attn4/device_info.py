"""Facts about a CUDA device that dispatch needs, asked of torch once per device and cached.

The kernels never query the driver themselves (they must compile without a GPU); anything they need
to know about the device (SM count, ...) comes from here as a plain value.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    capability: tuple[int, int]
    sm_count: int

    @property
    def capability_str(self) -> str:
        return f"{self.capability[0]}.{self.capability[1]}"


def device_index(device: torch.device | int | str) -> int:
    """The CUDA device index of a device spec (``cuda`` without index means the current device)."""
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"expected a CUDA device, got {device}")
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _query(index: int) -> DeviceInfo:
    props = torch.cuda.get_device_properties(index)
    return DeviceInfo(
        index=index,
        name=props.name,
        capability=(props.major, props.minor),
        sm_count=props.multi_processor_count,
    )


def get_device_info(device: torch.device | int | str) -> DeviceInfo:
    """Cached per device index; the first call for a device asks torch (and so the driver)."""
    return _query(device_index(device))


def clear_cache() -> None:
    _query.cache_clear()
