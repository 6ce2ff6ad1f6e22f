"""Named-barrier ids of each kernel (its ``Barrier`` IntEnum): a CTA has 16 hardware barriers, 0 is
__syncthreads, and the per-warpgroup ranges (FIRST + w) must not run into each other's ids for any
warpgroup count the kernel is built with."""

from __future__ import annotations

import pytest

from flash_attn4.fa4_kernels.sm90 import bwd as sm90_bwd
from flash_attn4.fa4_kernels.sm90 import fwd as sm90_fwd
from flash_attn4.fa4_kernels.sm100 import bwd as sm100_bwd
from flash_attn4.fa4_kernels.sm100 import fwd as sm100_fwd

HARDWARE_BARRIERS = 16


def used_ids(barrier, per_warpgroup: int) -> list[int]:
    """Every id the kernel can name: FIRST + w for w < per_warpgroup, the others as they are."""
    ids = []
    for member in barrier:
        count = per_warpgroup if member.name.endswith("_FIRST") else 1
        ids += [int(member) + w for w in range(count)]
    return ids


@pytest.mark.parametrize("barrier,per_warpgroup", [
    (sm90_fwd.Barrier, sm90_fwd.MAX_CONSUMER_WARPGROUPS),
    (sm90_bwd.Barrier, sm90_bwd.NUM_CONSUMER_WARPGROUPS),
    (sm100_fwd.Barrier, 1),
    (sm100_bwd.Barrier, 1),
], ids=["sm90_fwd", "sm90_bwd", "sm100_fwd", "sm100_bwd"])
def test_barrier_ids_are_distinct_and_within_the_hardware(barrier, per_warpgroup):
    ids = used_ids(barrier, per_warpgroup)
    assert len(ids) == len(set(ids)), f"{barrier.__module__}: ids overlap: {sorted(ids)}"
    assert min(ids) >= 1, "id 0 is __syncthreads"
    assert max(ids) < HARDWARE_BARRIERS


def test_sm90_forward_has_an_id_range_for_its_largest_consumer_count():
    """192-row tiles run three consumer warpgroups: the register table bounds the count the
    per-warpgroup ranges are sized for."""
    assert sm90_fwd.MAX_CONSUMER_WARPGROUPS == 3
    assert 192 // sm90_fwd.WGMMA_M == sm90_fwd.MAX_CONSUMER_WARPGROUPS
