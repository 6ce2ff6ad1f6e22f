"""The sm100 backward at d = dv = 256 (sm100/bwd_pair256.py, a CTA pair with 64 keys per CTA): its
tensor-memory and shared-memory plan (tiles.backward_pair256_*), and, compiled for sm_100a on the
CPU, what the SASS and PTX say about it. Expected numbers come from the plan (tile sizes, the MMA's
K, the folded accumulators), never from a compile."""

from __future__ import annotations

import pytest

from flash_attn4.fa4_kernels.sm100 import tiles as sm100_tiles

TMEM_LIMIT = 512


def test_pair256_tmem_plan_disjoint_and_within_512_columns():
    """Every accumulator of a CTA (64 rows x N folded into 128 lanes x N / 2) has its own columns:
    no two overlap, all lie in 512, and each is as wide as its fold needs (so no MMA waits for
    another accumulator's read-out)."""
    plan = sm100_tiles.backward_pair256_tmem_columns(256, 256)
    assert set(plan) == {"dk", "dv", "s", "dp", "dq"}
    spans = sorted((start, start + width) for start, width in plan.values())
    assert spans[0][0] >= 0 and spans[-1][1] <= TMEM_LIMIT
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans
    tile_m = sm100_tiles.BWD_TILE_M
    n = dict(dk=256, dv=256, s=tile_m, dp=tile_m, dq=256)  # N of each MMA
    for name, (_, width) in plan.items():
        assert 2 * width == n[name], name
    # The folded S^T / dP^T hold a CTA's keys: 64 rows in 128 lanes.
    assert 2 * sm100_tiles.BWD_PAIR256_KEYS == 128


def test_pair256_shared_memory_within_the_limit():
    """The per-CTA plan fits what a block may opt into (the DSL's capacity and tiles.SMEM_BYTES), and
    is the sum of the buffers the module docstring lists (K, V, K^T half, Q, dO: 32 KiB; P^T, dS^T,
    dS, dQ staging: 16 KiB; LSE / D and barriers: 1 KiB each), fp16 the same as bf16."""
    import cutlass.memory

    kib = 1024
    got = sm100_tiles.backward_pair256_shared_memory_bytes(256, 256, 2)
    capacity = cutlass.memory.get_smem_capacity_in_bytes("sm_100")
    assert got <= min(capacity, sm100_tiles.SMEM_BYTES)
    assert got == 5 * 32 * kib + 4 * 16 * kib + 2 * kib
    # Without the second TMA phase (Q^T, dO^T in buffers of their own) it would not fit.
    assert got + 2 * 32 * kib > sm100_tiles.SMEM_BYTES
    assert sm100_tiles.backward_pair256(256, 256) and sm100_tiles.backward_pair256(250, 256)
    assert not sm100_tiles.backward_pair256(192, 192) and not sm100_tiles.backward_pair256(256, 128)
