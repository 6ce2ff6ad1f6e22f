"""The forward kernel's tile algorithm emulated on the CPU (tests/tile_model.py) against a float64
reference: real tile shapes, rescale threshold, emulated columns, polynomial and P's 16-bit rounding,
on random and adversarial inputs. Float64 torch/numpy on small problems: no GPU, a few seconds."""

from __future__ import annotations

import math
import zlib
from fractions import Fraction

import numpy as np
import pytest
import torch

from tests import tile_model as tm
from flash_attn4 import dispatch
from flash_attn4.fa4_kernels import exp2 as kexp2
from flash_attn4.fa4_kernels.arch import Arch
from tests.reference import _mask, attention_ref

# ---- the kernels' tile rules, in one table ---------------------------------------------------------
# What dispatch builds for the problem class on each arch (the tile rules in sm90/tiles.py and
# sm100/tiles.py): sm90 with its defaults (threshold 0, no emulation) and with its optional
# switches; sm100 as it ships (CTA tiles of 256 or 128 rows x 128 keys, threshold 8 in log2 units,
# one column pair in eight emulated up to d = 128, one thread per row) and with two pairs in eight.


def _config(arch, dtype, d, **flags):
    return dispatch.forward_config(arch, dtype, d, d, varlen=False, has_seqused_k=False, **flags)


def _sm90(dtype, d, **flags):
    return tm.TileParams.from_forward_config(_config(Arch.SM90, dtype, d, **flags), layout="wgmma")


def _sm90_switches(dtype, d, **flags):
    cfg = _config(Arch.SM90, dtype, d, **flags).replace(rescale_threshold=8.0, exp2_emulated_eighths=2)
    return tm.TileParams.from_forward_config(cfg, layout="wgmma")


def _sm100(eighths=None):
    def make(dtype, d, **flags):
        cfg = _config(Arch.SM100, dtype, d, **flags)
        if eighths is not None:
            cfg = cfg.replace(exp2_emulated_eighths=eighths)
        return tm.TileParams.from_forward_config(cfg, layout="row")
    return make


KERNELS = {
    "sm90": _sm90,
    "sm90-threshold8-eighths2": _sm90_switches,
    "sm100-eighths1": _sm100(),
    "sm100-eighths2": _sm100(2),
}
MUFU_REL_ERROR = 2.0 ** -22  # MUFU.EX2: ~2 ulp
TANH_REL_ERROR = 2.0 ** -11  # tanh.approx.f32 (softcap)


def params_for(kernel, dtype="bfloat16", d=64, causal=False, local=False, softcap=0.0, sink=None):
    return KERNELS[kernel](dtype, d, causal=causal, local=local, has_softcap=bool(softcap),
                           has_sink=sink is not None)


# ---- inputs and references ------------------------------------------------------------------------

def _rand(gen, *shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


def ref64(q, k, v, *, softmax_scale, causal=False, window=(-1, -1), softcap=0.0, sink=None):
    """softmax(s) V in float64, s = scale q.k (softcapped), with reference.py's mask; rows that see
    nothing give 0 and LSE -inf (or the sink logit)."""
    q, k, v = q.double(), k.double(), v.double()
    s = q @ k.T * softmax_scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~_mask(q.shape[0], k.shape[0], causal, window, q.device), -math.inf)
    logits = s if sink is None else torch.cat([s, torch.full((s.shape[0], 1), float(sink), dtype=s.dtype)], 1)
    lse = torch.logsumexp(logits, dim=1)
    p = torch.where(torch.isfinite(lse)[:, None], torch.exp(s - lse.nan_to_num(neginf=0.0)[:, None]), 0.0)
    return p @ v, lse


def ref_low(q, k, v, **kw):
    """The same in the input precision (the FlashAttention suite's out_pt)."""
    window = kw.pop("window", (-1, -1))
    sink = kw.pop("sink", None)
    out, _ = attention_ref(q[None, :, None], k[None, :, None], v[None, :, None], window_size=window,
                           learnable_sink=None if sink is None else torch.tensor([sink]), upcast=False, **kw)
    return out[0, :, 0]


def check_against_reference(res, q, k, v, lse_tol=2e-4, **kw):
    """The FA rule on the output, and the LSE within lse_tol (the polynomial's 7.5e-5 plus fp32),
    plus what tanh.approx's error does to a softcapped score (cap * TANH_REL_ERROR)."""
    lse_tol += kw.get("softcap", 0.0) * TANH_REL_ERROR
    out_ref, lse_ref = ref64(q, k, v, **kw)
    out_pt = ref_low(q, k, v, **kw)
    assert torch.isfinite(res.out_f32).all() and not torch.isnan(res.lse).any()
    err = (res.out.double() - out_ref).abs().max().item()
    base = (out_pt.double() - out_ref).abs().max().item()
    assert err <= 2 * base + 1e-5, (err, base)
    lse = res.lse.double()
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
    fin = torch.isfinite(lse_ref)
    if fin.any():
        lse_err = (lse[fin] - lse_ref[fin]).abs().max().item()
        assert lse_err <= lse_tol, lse_err
    return err, base


# ---- the column rule -------------------------------------------------------------------------------

def test_emulated_columns_come_in_pairs_eighths_of_every_16():
    for eighths in range(9):
        cols = [c for c in range(64) if kexp2.emulated(c, eighths)]
        assert len(cols) == 64 * eighths // 8
        assert all(kexp2.emulated(c ^ 1, eighths) for c in cols)  # both members of each pair
        for start in range(0, 64, 16):  # the same count in every 16 columns
            assert sum(kexp2.emulated(c, eighths) for c in range(start, start + 16)) == 2 * eighths
        if eighths < 8:
            assert set(cols) <= {c for c in range(64) if kexp2.emulated(c, eighths + 1)}
    # What the sm90 fragment order means in keys: whole 8-key groups (lanes' pairs side by side).
    keys = np.flatnonzero(tm.emulated_keys(128, 1, "wgmma"))
    assert keys.tolist() == list(range(56, 64)) + list(range(120, 128))
    keys = np.flatnonzero(tm.emulated_keys(128, 1, "row"))
    assert keys.tolist() == [14, 15, 30, 31, 46, 47, 62, 63, 78, 79, 94, 95, 110, 111, 126, 127]


# ---- the float32 emulation helpers and exp2_fma ------------------------------------------------------

def _f32_round(fr: Fraction) -> np.float32:
    """Nearest-even float32 of an exact rational (normal range)."""
    lo = np.float32(float(fr))
    cands = [np.nextafter(lo, np.float32(-np.inf)), lo, np.nextafter(lo, np.float32(np.inf))]
    dists = [abs(Fraction(float(c)) - fr) for c in cands]
    best = min(dists)
    ties = [c for c, dd in zip(cands, dists) if dd == best]
    return ties[0] if len(ties) == 1 else [c for c in ties if not (c.view(np.int32) & 1)][0]


def test_fma_f32_rounds_once_including_ties():
    rng = np.random.default_rng(1)
    a = rng.standard_normal(300).astype(np.float32)
    b = rng.standard_normal(300).astype(np.float32)
    c = (rng.standard_normal(300) * 4).astype(np.float32)
    # Cancellation: c near -a * b, where the result is made of the product's low bits.
    ab = (a.astype(np.float64) * b).astype(np.float32)
    c[:100] = -ab[:100] + np.float32(1.0)
    got = tm.fma_f32(a, b, c)
    for i in range(300):
        want = _f32_round(Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i])))
        assert got[i] == want, (i, a[i], b[i], c[i], got[i], want)
    # Exact tie with a tail: 1 + 2^-24 (halfway) + 2^-60 rounds up, not to even.
    hi = np.array([1.0 + 2.0 ** -24]), np.array([2.0 ** -60])
    assert tm._to_f32_nearest(*hi)[0] == np.nextafter(np.float32(1), np.float32(2))
    assert tm._to_f32_nearest(hi[0], np.array([0.0]))[0] == np.float32(1)


def test_round_down_add_gives_floor_like_the_magic_constant_promises():
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.uniform(-127, 8, 100_000), -(2.0 ** -rng.uniform(1, 140, 2000)),
                        2.0 ** -rng.uniform(1, 140, 2000), np.arange(-127, 9)]).astype(np.float32)
    x = np.concatenate([x, np.nextafter(np.arange(-127, 9, dtype=np.float32), np.float32(-np.inf))])
    rounded = tm.add_f32_round_down(x, np.float32(kexp2.ROUND_DOWN_MAGIC))
    np.testing.assert_array_equal(rounded.astype(np.float64) - kexp2.ROUND_DOWN_MAGIC, np.floor(x.astype(np.float64)))
    # The round-to-nearest add would not: tiny negative x must floor to -1.
    assert (np.float32(-1e-20) + np.float32(kexp2.ROUND_DOWN_MAGIC)) == np.float32(kexp2.ROUND_DOWN_MAGIC)


def test_exp2_fma_relative_error_on_a_dense_grid():
    grid = np.linspace(-125.0, 0.0, 1_250_001).astype(np.float32)  # 1e-4 apart
    ints = np.arange(-124, 1, dtype=np.float32)
    x = np.concatenate([grid, np.nextafter(ints, np.float32(-np.inf)), np.nextafter(ints, np.float32(np.inf)),
                        -(2.0 ** -np.arange(1, 120)).astype(np.float32)])
    got = tm.exp2_fma(x).astype(np.float64)
    want = np.exp2(x.astype(np.float64))
    rel = np.abs(got - want) / want
    worst = rel.max()
    print(f"exp2_fma max relative error on [-125, 0]: {worst:.4e} at x = {x[rel.argmax()]!r}")
    assert worst < 7.6e-5  # exp2.py's docstring: 7.5e-5
    assert worst > 1e-5  # a polynomial, not the exact function
    # [-126, -125): subnormal results, relative error up to 1.5e-4, absolute < 2^-138.
    low = np.linspace(-126.0, -125.0, 100_001, dtype=np.float32)
    got = tm.exp2_fma(low).astype(np.float64)
    want = np.exp2(low.astype(np.float64))
    assert np.all(np.abs(got - want) / want < 1.6e-4) and np.all(np.abs(got - want) < 2.0 ** -138)


def test_exp2_fma_is_finite_far_below_the_max():
    """Scores far below the row max (x <= -126) clamp to a tiny positive value, never NaN (the clamp
    at -127 gave 0xFFFFFB18, a NaN, because COEFFS[0] < 1)."""
    rng = np.random.default_rng(4)
    x = np.concatenate([np.linspace(-200.0, -120.0, 80_001), -(10.0 ** rng.uniform(2, 38, 10_000)),
                        [-126.0, -126.00001, -127.0, -127.5, -128.0]]).astype(np.float32)
    got = tm.exp2_fma(x)
    assert np.all(np.isfinite(got)) and np.all(got >= 0)
    assert np.all(got[x <= -126] == tm.exp2_fma(np.float32([-126.0]))[0])
    assert np.all(got[x <= -120] <= 2.0 ** -120)


def test_exp2_fma_matches_the_plain_float32_recipe():
    """A second, independent reading of the recipe, bit for bit: floor() for the round-down magic
    add, ldexp for the exponent-field add (normal results only: x >= -100 here), each Horner step as
    the exact float64 product plus the coefficient, rounded to float32 once (this seeded sample hits
    no double-rounding tie)."""
    rng = np.random.default_rng(3)
    x = rng.uniform(-100, 8, 200_000).astype(np.float32)
    fl = np.floor(x)
    frac = (x - fl).astype(np.float32)
    poly = np.float64(np.float32(kexp2.COEFFS[3]))
    for c in kexp2.COEFFS[2::-1]:  # fma: exact product in float64, then one rounding (no ties here)
        poly = (poly * frac.astype(np.float64) + np.float32(c)).astype(np.float32).astype(np.float64)
    want = np.ldexp(poly, fl.astype(np.int64)).astype(np.float32)
    np.testing.assert_array_equal(tm.exp2_fma(x), want)


# ---- the model against the reference ---------------------------------------------------------------

CASES = {
    "plain": dict(sq=200, sk=333),
    "causal-sq<sk": dict(sq=150, sk=400, causal=True),
    "causal-sq>sk": dict(sq=300, sk=180, causal=True),
    "local": dict(sq=260, sk=390, window=(100, 20)),
    "softcap": dict(sq=130, sk=300, softcap=15.0),
    "sink": dict(sq=140, sk=260, sink=1.5),
    "d128-causal": dict(sq=170, sk=260, causal=True, d=128),
    "d256-local": dict(sq=150, sk=300, window=(60, 90), d=256),  # sm90: 128 x 80 tiles
}


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("case", list(CASES))
def test_model_matches_reference(kernel, case):
    c = dict(CASES[case])
    sq, sk, d = c.pop("sq"), c.pop("sk"), c.pop("d", 64)
    gen = torch.Generator().manual_seed(zlib.crc32(f"{kernel}/{case}".encode()))
    q, k, v = _rand(gen, sq, d), _rand(gen, sk, d), _rand(gen, sk, d)
    p = params_for(kernel, d=d, causal=c.get("causal", False), local="window" in c,
                   softcap=c.get("softcap", 0.0), sink=c.get("sink"))
    kw = dict(softmax_scale=d ** -0.5, **c)
    res = tm.forward(q, k, v, p, mufu_rel_error=MUFU_REL_ERROR, tanh_rel_error=TANH_REL_ERROR, seed=sq, **kw)
    check_against_reference(res, q, k, v, **kw)
    # Every key a row sees lies in a visited block; full blocks ran the polynomial where configured.
    if p.exp2_emulated_eighths and any(not masked for _, _, masked in res.stats.blocks):
        assert res.stats.emulated > 0
    if not p.exp2_emulated_eighths:
        assert res.stats.emulated == 0


def test_fp16_p():
    gen = torch.Generator().manual_seed(5)
    q, k, v = (_rand(gen, 190, 64, dtype=torch.float16) for _ in range(3))
    for kernel in ("sm90", "sm100-eighths2"):
        p = params_for(kernel, dtype="float16")
        assert p.p_dtype is torch.float16
        res = tm.forward(q, k, v, p, softmax_scale=0.125, mufu_rel_error=MUFU_REL_ERROR)
        check_against_reference(res, q, k, v, softmax_scale=0.125)


# ---- adversarial inputs ----------------------------------------------------------------------------

def _slow_growth_then_jump(gen, sk_blocks=12, sq=128, d=32, jump_rows=slice(0, 64, 2)):
    """Scores (softmax_scale 1) that grow ~2 (nat, 2.9 in log2) per KV block in the kernel's visiting
    order (last block first), then, in the first block (visited last), jump by 712 (log2: 1027 ~ 2^10)
    at one key for the rows in jump_rows."""
    sk = 128 * sk_blocks
    q = torch.randn(sq, d, generator=gen, dtype=torch.float64) * 0.25
    k = torch.randn(sk, d, generator=gen, dtype=torch.float64) * 0.25
    q[:, :2] = 0.0
    q[:, 0] = 1.0
    q[jump_rows, 1] = 1.0
    k[:, :2] = 0.0
    k[:, 0] = 2.0 * (sk_blocks - 1 - torch.arange(sk) // 128)
    k[37, 1] = 712.0
    v = torch.randn(sk, d, generator=gen, dtype=torch.float64)
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


@pytest.mark.parametrize("eighths", [1, 2])
def test_slow_growth_then_jump_skips_rescales_and_stays_exact(eighths):
    gen = torch.Generator().manual_seed(7)
    q, k, v = _slow_growth_then_jump(gen)
    kw = dict(softmax_scale=1.0)
    base = tm.TileParams(tile_m=128, tile_n=128, exp2_emulated_eighths=eighths, layout="row")
    always = tm.forward(q, k, v, base, **kw)
    lazy = tm.forward(q, k, v, base.__class__(**{**base.__dict__, "rescale_threshold": 8.0}), keep_probs=True, **kw)
    for res in (always, lazy):
        check_against_reference(res, q, k, v, **kw)
    # Threshold 0 moves the max at nearly every one of the 11 later blocks; threshold 8 about every third.
    assert always.stats.max_updates >= 128 * 9, always.stats.max_updates
    assert lazy.stats.max_updates <= always.stats.max_updates // 2, (lazy.stats.max_updates, always.stats.max_updates)
    assert lazy.stats.stale_steps > 128 * 4
    # The stale max lets P grow past 1 but never past 2^8.
    assert 2.0 < lazy.stats.p_max <= 2.0 ** 8, lazy.stats.p_max
    # Threshold 0: P <= 1, up to exp2 of the fma's unrounded m * s (half an ulp of ~1060 here).
    assert always.stats.p_max <= 2.0 ** (2.0 ** -14)
    # The jump (1027 in log2 units) rescales: key 37 takes all the weight in those rows.
    out_ref, _ = ref64(q, k, v, **kw)
    jump = torch.zeros(128, dtype=torch.bool)
    jump[0:64:2] = True
    assert torch.allclose(out_ref[jump], v[37].double().expand(int(jump.sum()), -1), atol=1e-6)
    # In the model: P of that key is 1 (up to the fma's unrounded m * s), every other key of those
    # rows in its block underflows (MUFU flushes to 0, the polynomial stops at 2^-126), nothing overflows.
    assert (lazy.probs[jump, 37].double() - 1).abs().max() < 2.0 ** -13
    others = lazy.probs[jump, :128].clone()  # block 0, visited last (after the jump)
    others[:, 37] = 0
    assert others.max() <= 2.0 ** -126


def test_stale_max_row_factor_is_exactly_one():
    """The row factor exp2(m_old * s - m_new * s) compiles to FFMA(m_old, s, -round(m_new * s)): when
    the max stays put that is the rounding error of m * s, not 0, so the factor would be 1 + O(2^-24)
    and the kernels' vote that skips O's multiplies when no row moved would rarely skip.
    softmax.update_max therefore sets a kept maximum's factor to exactly 1 ("kernel");
    exp2((m_old - m_new) * s) ("diff") would too; the bare FFMA ("ffma") does not."""
    gen = torch.Generator().manual_seed(8)
    q, k, v = _slow_growth_then_jump(gen, sk_blocks=6)
    kw = dict(softmax_scale=1.0)
    for rule in ("ffma", "diff", "kernel"):
        p = tm.TileParams(tile_m=128, tile_n=128, rescale_threshold=8.0, layout="row", factor_rule=rule)
        res = tm.forward(q, k, v, p, **kw)
        check_against_reference(res, q, k, v, **kw)
        steps = 128 * 5
        stale = steps - res.stats.max_updates
        print(f"{rule}: {res.stats.factor_not_one_stale} of {stale} steps without a max update have factor != 1")
        if rule in ("diff", "kernel"):
            assert res.stats.factor_not_one_stale == 0
        else:
            assert res.stats.factor_not_one_stale > stale // 4


@pytest.mark.parametrize("kernel", ["sm90", "sm100-eighths2"])
def test_fully_masked_rows_give_zero_and_minus_inf(kernel):
    gen = torch.Generator().manual_seed(9)
    sq, sk = 300, 100  # causal, bottom-right: rows 0..199 see no key
    q, k, v = _rand(gen, sq, 64), _rand(gen, sk, 64), _rand(gen, sk, 64)
    p = params_for(kernel, causal=True)
    res = tm.forward(q, k, v, p, softmax_scale=0.125, causal=True)
    assert not torch.isnan(res.out_f32).any() and not torch.isnan(res.lse).any()
    assert (res.out_f32[:200] == 0).all() and (res.lse[:200] == -math.inf).all()
    assert torch.isfinite(res.lse[200:]).all()
    check_against_reference(res, q, k, v, softmax_scale=0.125, causal=True)
    # The tile straddling the boundary walked its block with rows of -inf only (no NaN from them).
    assert any(m == 1 for m, _, _ in res.stats.blocks)
    # With a sink the empty rows give 0 and LSE = the sink logit.
    res = tm.forward(q, k, v, p, softmax_scale=0.125, causal=True, sink=0.75)
    assert (res.out_f32[:200] == 0).all()
    assert torch.allclose(res.lse[:200].double(), torch.full((200,), 0.75, dtype=torch.float64), atol=1e-6)
    check_against_reference(res, q, k, v, softmax_scale=0.125, causal=True, sink=0.75)


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_large_softcap_with_big_scores(kernel):
    gen = torch.Generator().manual_seed(10)
    q, k, v = _rand(gen, 160, 64, scale=12.0), _rand(gen, 300, 64, scale=12.0), _rand(gen, 300, 64)
    p = params_for(kernel, softcap=50.0)
    kw = dict(softmax_scale=0.125, softcap=50.0)
    res = tm.forward(q, k, v, p, mufu_rel_error=MUFU_REL_ERROR, tanh_rel_error=TANH_REL_ERROR, **kw)
    # The scores reach the cap's saturation: many within 1 of +-50.
    s = (q.double() @ k.double().T * 0.125 / 50).tanh() * 50
    assert (s.abs() > 49).float().mean() > 0.1
    check_against_reference(res, q, k, v, **kw)


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_long_rows_of_equal_scores(kernel):
    gen = torch.Generator().manual_seed(11)
    sq, sk, d = 70, 1000, 64
    q = _rand(gen, sq, d)
    k = _rand(gen, 1, d).expand(sk, d).contiguous()  # every key the same: a row's scores are equal
    v = _rand(gen, sk, d)
    p = params_for(kernel)
    res = tm.forward(q, k, v, p, mufu_rel_error=MUFU_REL_ERROR, keep_probs=True, softmax_scale=0.125)
    check_against_reference(res, q, k, v, softmax_scale=0.125)
    # Whether a column ran on MUFU or the polynomial, P rounds to the same 16-bit value (1).
    p16 = res.probs.to(p.p_dtype)
    assert (p16 == 1).all()
    assert torch.allclose(res.out_f32.double(), v.double().mean(0).expand(sq, -1), atol=2e-5)


def test_emulated_p_within_one_bf16_ulp_of_the_exact_one():
    """All of a full block's exponentials on the polynomial against all on (exact, rounded) MUFU, with
    the same running maxima: after rounding to bf16 >= 99.9% of P agree to 1 ulp."""
    gen = torch.Generator().manual_seed(12)
    q, k, v = _rand(gen, 256, 64, scale=1.5), _rand(gen, 1024, 64, scale=1.5), _rand(gen, 1024, 64)
    kw = dict(softmax_scale=0.125, keep_probs=True)
    base = dict(tile_m=128, tile_n=128, rescale_threshold=8.0, layout="row")
    exact = tm.forward(q, k, v, tm.TileParams(**base, exp2_emulated_eighths=0), **kw)
    emu = tm.forward(q, k, v, tm.TileParams(**base, exp2_emulated_eighths=8), **kw)
    full = torch.zeros(256, 1024, dtype=torch.bool)
    for m, n, masked in emu.stats.blocks:
        if not masked:
            full[m * 128:(m + 1) * 128, n * 128:(n + 1) * 128] = True
    assert full.float().mean() > 0.8
    a = exact.probs[full].bfloat16().view(torch.int16).to(torch.int32)
    b = emu.probs[full].bfloat16().view(torch.int16).to(torch.int32)
    ulps = (a - b).abs()  # P >= 0: the bit patterns are ordered like the values
    within1 = (ulps <= 1).float().mean().item()
    same = (ulps == 0).float().mean().item()
    print(f"bf16 P: {same:.5f} identical, {within1:.6f} within 1 ulp, max {int(ulps.max())} ulp")
    assert within1 >= 0.999
    assert same < 1.0  # the polynomial did run
    check_against_reference(emu, q, k, v, softmax_scale=0.125)
