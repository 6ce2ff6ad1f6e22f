"""Reliability on a GPU (issue 24, item 7): NaN inputs and sizes past 2^31 elements behave like the
reference.

* NaN propagates to exactly the outputs that depend on it (as plain attention with a select-based
  mask does; tests/reference.py itself turns a row whose lse is NaN into 0, so it is the yardstick for
  the other rows only): NaN in one element of q: exactly that query row (of that head) is NaN, every
  other output matches the reference; NaN in one key: the rows that see that key (causal: the rows at or after it, of the
  query heads reading that KV head) are NaN, the rows that do not see it match the reference. (NaN in
  v is not tested: the reference's 0 * NaN spreads it to rows that mask that key out, so the
  reference itself does not say what a kernel should do there.)
* One sequence of 2^20 + 4096 tokens with 16 heads of 128 (2^31 + 2^23 elements per tensor), causal
  and with a sliding window, batched and as a 2-sequence varlen batch: rows sampled across the whole
  length (the last ones lie past element 2^31) against the reference over the keys they see.
"""

from __future__ import annotations

import pytest
import torch

from flash_attn4 import flash_attn_func, flash_attn_varlen_func
from tests.gpu.helpers import DEVICE, rand, seed_from_urandom
from tests.reference import assert_close_fa_rule, attention_ref, max_abs_diff

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def seed():
    return seed_from_urandom()


def compare_where_finite(out, q, k, v, nan_rows, **ref_kwargs):
    """NaN exactly at nan_rows (bool (b, sq, hq)); elsewhere the FA rule against the reference."""
    out_ref, _ = attention_ref(q, k, v, upcast=True, **ref_kwargs)
    out_pt, _ = attention_ref(q, k, v, upcast=False, **ref_kwargs)
    got_nan = torch.isnan(out).any(-1)
    assert torch.equal(got_nan, nan_rows), (f"NaN rows differ: {int((got_nan & ~nan_rows).sum())} unexpected, "
                                            f"{int((nan_rows & ~got_nan).sum())} missing")
    keep = ~nan_rows
    atol = 2 * max_abs_diff(out_ref[keep].to(q.dtype), out_ref[keep]) + 1e-6
    assert_close_fa_rule(out[keep], out_ref[keep], out_pt[keep], atol=atol)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_nan_in_one_query(d, causal):
    q, k, v = rand(2, 300, 4, d), rand(2, 280, 2, d), rand(2, 280, 2, d)
    b, i, h = 1, int(torch.randint(0, 300, ())), int(torch.randint(0, 4, ()))
    q[b, i, h, int(torch.randint(0, d, ()))] = float("nan")
    out = flash_attn_func(q, k, v, causal=causal)
    nan_rows = torch.zeros(2, 300, 4, dtype=torch.bool, device=DEVICE)
    sees_a_key = not causal or i + 280 - 300 >= 0  # a row that sees no key gives 0, not NaN
    nan_rows[b, i, h] = sees_a_key
    compare_where_finite(out, q, k, v, nan_rows, causal=causal)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (40, 0)])
def test_nan_in_one_key(d, window):
    sq = sk = 333
    q, k, v = rand(1, sq, 4, d), rand(1, sk, 2, d), rand(1, sk, 2, d)
    j, hk = 150, 1
    k[0, j, hk, 3] = float("nan")
    out = flash_attn_func(q, k, v, window_size=window)
    rows = torch.arange(sq, device=DEVICE)
    left, right = window
    sees = torch.ones(sq, dtype=torch.bool, device=DEVICE)
    if right >= 0:
        sees &= j <= rows + right
    if left >= 0:
        sees &= j >= rows - left
    nan_rows = torch.zeros(1, sq, 4, dtype=torch.bool, device=DEVICE)
    nan_rows[0, :, 2:] = sees[:, None]  # query heads 2, 3 read KV head 1
    compare_where_finite(out, q, k, v, nan_rows, window_size=window)


# ---- past 2^31 elements ----

LONG = 2 ** 20 + 4096
HEADS, DIM = 16, 128


def sampled_rows(n: int) -> list[int]:
    """First, last and random rows, some of them past element 2^31 (row 2^31 / (HEADS * DIM) = 2^20)."""
    rows = {0, 1, n - 1, n - 2, 2 ** 20, 2 ** 20 + 1} | set(torch.randint(0, n, (6,)).tolist())
    return sorted(r for r in rows if r < n)


def check_rows(out, q, k, v, rows, window_left):
    """Each sampled query row against the reference over the keys it sees (causal or windowed)."""
    for r in rows:
        first = 0 if window_left < 0 else max(0, r - window_left)
        ref_q, ref_k, ref_v = q[r:r + 1], k[first:r + 1], v[first:r + 1]
        kwargs = dict(causal=True)
        out_ref, _ = attention_ref(ref_q[None], ref_k[None], ref_v[None], upcast=True, **kwargs)
        out_pt, _ = attention_ref(ref_q[None], ref_k[None], ref_v[None], upcast=False, **kwargs)
        atol = 2 * max_abs_diff(out_ref.to(q.dtype), out_ref) + 1e-6
        assert_close_fa_rule(out[r:r + 1][None], out_ref, out_pt, atol=atol, name=f"row {r}")


@pytest.mark.slow
@pytest.mark.parametrize("window_left", [255, -1])
def test_one_sequence_past_2_31_elements(window_left):
    q, k, v = (rand(1, LONG, HEADS, DIM) for _ in range(3))
    assert q.numel() > 2 ** 31
    window = (window_left, 0)
    with torch.no_grad():
        out = flash_attn_func(q, k, v, window_size=window)
    assert not torch.isnan(out).any()
    check_rows(out[0], q[0], k[0], v[0], sampled_rows(LONG), window_left)


@pytest.mark.slow
def test_varlen_past_2_31_elements():
    total = LONG
    split = int(torch.randint(1000, total - 1000, ()))
    cu = torch.tensor([0, split, total], dtype=torch.int32, device=DEVICE)
    q, k, v = (rand(total, HEADS, DIM) for _ in range(3))
    with torch.no_grad():
        out = flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen_q=max(split, total - split),
                                     max_seqlen_k=max(split, total - split),
                                     window_size=(255, 0))
    rows = sampled_rows(total)
    second = [r - split for r in rows if r >= split]
    check_rows(out[:split], q[:split], k[:split], v[:split], [r for r in rows if r < split], 255)
    check_rows(out[split:], q[split:], k[split:], v[split:], second, 255)
