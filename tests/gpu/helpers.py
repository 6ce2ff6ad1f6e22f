"""What the GPU test modules share: the device, head layouts, fresh random inputs."""

from __future__ import annotations

import os

import torch

DEVICE = "cuda"
HEADS = {"mha": (4, 4), "gqa": (6, 2), "mqa": (4, 1)}


def seed_from_urandom() -> int:
    """Seed torch from the OS (fresh inputs every run) and print the seed, so that a failure can be
    replayed."""
    s = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(s)
    print(f"seed={s}")
    return s


def rand(*shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, device=DEVICE, dtype=torch.float32) * scale).to(dtype)


def random_lengths(batch, max_len):
    """Random lengths in [1, max_len], then one empty sequence and one whose queries have no keys
    (fully masked rows)."""
    lens_q = torch.randint(1, max_len + 1, (batch,)).tolist()
    lens_k = torch.randint(1, max_len + 1, (batch,)).tolist()
    zero = int(torch.randint(0, batch, ()))
    lens_q[zero] = lens_k[zero] = 0
    lens_k[(zero + 1) % batch] = 0
    return lens_q, lens_k
