"""Forward correctness on a real GPU against tests/reference.py, with FlashAttention's accuracy rule:
max|out - out_ref| <= 2 * max|out_pt - out_ref| + atol (out_ref float32, out_pt in the input dtype).

Outputs are poisoned: the op's test hook (ops._poison_outputs_for_tests) fills out with NaN and lse with
+inf right after allocation, so an element the kernel forgets to write fails the test instead of passing
on whatever torch.empty returned. Inputs are fresh random tensors; the seed is printed for reruns.

Every feature these tests call (dense, causal, local windows, softcap, sinks, GQA/MQA and its packing,
varlen, seqused_k, fp16/bf16, head dims 64-256, equal or not) must pass on every arch the suite runs on:
none of them is in tests/unsupported.py, the explicit list of what the library refuses with
NotImplementedError (tests/cpu/test_unsupported.py keeps that list equal to what the code raises), so a
NotImplementedError here is a failure. test_listed_refusals runs the listed combinations on this GPU:
each must be refused with its listed reason where the list says so for this arch, and run elsewhere.
"""

from __future__ import annotations


import pytest
import torch

from flash_attn4 import compile_cache, flash_attn_func, flash_attn_varlen_func, ops
from tests.gpu.helpers import DEVICE, HEADS, rand, random_lengths, seed_from_urandom
from tests.reference import assert_close_fa_rule, attention_ref, max_abs_diff, random_pages, unpage
from tests.unsupported import forward_refusals, refusal_pattern

pytestmark = pytest.mark.gpu



@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(ops, "_poison_outputs_for_tests", True)


@pytest.fixture
def seed():
    return seed_from_urandom()


def check(out, lse, q, k, v, *, atol=None, lse_atol=2e-3, **ref_kwargs):
    """Compare (out, lse) with the float32 reference under the FA rule; lse must agree where finite and
    be -inf exactly where the reference is. Default atol: twice the error of rounding the exact output
    to the input dtype (FlashAttention's tests use the same kind of allowance)."""
    assert not torch.isnan(out).any(), "NaN in out (an unwritten element, or a NaN from masked rows)"
    assert not torch.isnan(lse).any(), "NaN in lse"
    out_ref, lse_ref = attention_ref(q, k, v, upcast=True, **ref_kwargs)
    out_pt, lse_pt = attention_ref(q, k, v, upcast=False, **ref_kwargs)
    if atol is None:
        # the output is stored in q.dtype: its own rounding is an error no kernel can avoid
        atol = 2 * max_abs_diff(out_ref.to(q.dtype), out_ref) + 1e-6
    assert_close_fa_rule(out, out_ref, out_pt, atol=atol)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref)), "lse -inf pattern differs from reference"
    assert not torch.isposinf(lse).any(), "lse left unwritten (+inf poison)"
    # lse: the kernel's scores are float32 dot products of the same inputs, so it is held to an absolute
    # tolerance (the input-precision lse_pt, from rounded scores, would be a far looser yardstick)
    finite = torch.isfinite(lse_ref)
    err = max_abs_diff(lse[finite], lse_ref[finite])
    assert err <= lse_atol, f"lse: max|lse - ref| = {err:.3e} > {lse_atol:.1e}"
    # rows that see no key: exactly zero output
    masked = torch.isneginf(lse_ref)
    if masked.any():
        rows = masked.transpose(-1, -2) if lse_ref.dim() == 3 else masked.transpose(0, 1)  # -> (.., s, h)
        assert (out[rows] == 0).all(), "fully masked rows must give out = 0"


def route_forward_config(monkeypatch, choose) -> None:
    """``choose`` in place of dispatch.forward_config for the rest of the test (or of the
    monkeypatch context), with a launch-plan cache of its own: ops' plans hold the configuration they
    were built with, so a plan made earlier for the same shapes would run the earlier kernel. Kernels
    compiled for earlier choices stay cached under their own configs."""
    from flash_attn4 import dispatch

    monkeypatch.setattr(dispatch, "forward_config", choose)
    monkeypatch.setattr(ops, "_PLANS", {})


def override_forward_config(monkeypatch, **overrides):
    """Dispatch's ForwardConfig with ``overrides`` for the rest of the test (route_forward_config)."""
    from flash_attn4 import dispatch

    arch = dispatch.arch_for_device(torch.device(DEVICE))
    hopper_only = sorted(k for k, v in overrides.items() if k in HOPPER_SWITCHES and v != HOPPER_SWITCHES[k])
    if hopper_only and arch.value != "sm_90a":
        pytest.skip(f"{', '.join(hopper_only)}: schedule switches of the sm90 kernel; this GPU runs {arch.value}")
    chosen = dispatch.forward_config
    route_forward_config(monkeypatch, lambda *a, **k: chosen(*a, **k).replace(**overrides))


# ForwardConfig fields only the sm90 forward reads (sm90/tiles.py), with the value that means "off".
HOPPER_SWITCHES = dict(tma_store_o=False, rescale_o_before_pv=False, pingpong=True, whole_k_gemms=False)


# ---- batched: the main grid ----

SEQLENS = [(1, 1), (3, 3), (113, 203), (203, 113), (128, 128), (1000, 1000)]


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", SEQLENS)
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_batched_bf16(seed, d, sq, sk, causal, heads):
    hq, hk = HEADS[heads]
    b = 2
    q, k, v = rand(b, sq, hq, d), rand(b, sk, hk, d), rand(b, sk, hk, d)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert out.shape == (b, sq, hq, d) and out.dtype == torch.bfloat16
    assert lse.shape == (b, hq, sq) and lse.dtype == torch.float32
    check(out, lse, q, k, v, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [72, 88, 120, 200, 248])
def test_head_dims_multiple_of_8_not_16(seed, d, causal):
    """Head dims whose O columns do not fill 16-column stmatrix tiles (dispatch keeps those off the
    TMA store of O: d = 72 took an illegal address there)."""
    hq, hk = HEADS["gqa"]
    q, k, v = rand(2, 300, hq, d), rand(2, 257, hk, d), rand(2, 257, hk, d)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    check(out, lse, q, k, v, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(113, 203), (1000, 1000), (1, 257)])
@pytest.mark.parametrize("d,dv", [(64, 64), (96, 96), (128, 128), (192, 128), (192, 192), (256, 256)])
@pytest.mark.parametrize("tma_store_o", [False, True])
def test_tma_store_o_switch(seed, monkeypatch, d, dv, sq, sk, causal, tma_store_o):
    """Both epilogues of every head dim (dispatch stores O by TMA for batched inputs with dv a
    multiple of 16; registers to global memory otherwise): partial tiles clip at the sequence end and
    nothing is left unwritten (outputs start as NaN). At 192/192 and 256/256 the TMA path stages O
    in Q's buffer, all consumer warpgroups past their GEMMs first."""
    override_forward_config(monkeypatch, tma_store_o=tma_store_o)
    hq, hk = HEADS["gqa"]
    q, k, v = rand(2, sq, hq, d), rand(2, sk, hk, d), rand(2, sk, hk, dv)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    check(out, lse, q, k, v, causal=causal)


@pytest.mark.parametrize("tma_store_o", [False, True])
def test_tma_store_o_switch_with_softcap_sink_window(seed, monkeypatch, tma_store_o):
    override_forward_config(monkeypatch, tma_store_o=tma_store_o)
    hq, hk, d = 8, 2, 64
    q, k, v = rand(2, 300, hq, d), rand(2, 257, hk, d), rand(2, 257, hk, d)
    sink = torch.randn(hq, device=DEVICE, dtype=torch.float32)
    out, lse = flash_attn_func(q, k, v, window_size=(100, 7), softcap=20.0, learnable_sink=sink, return_lse=True)
    # approximate tanh moves scores by up to softcap * 5e-4 (test_softcap)
    check(out, lse, q, k, v, window_size=(100, 7), softcap=20.0, learnable_sink=sink, lse_atol=20.0 * 1e-3)


SCHEDULE_SWITCHES = [dict(rescale_o_before_pv=True), dict(rescale_threshold=8.0), dict(exp2_emulated_eighths=3),
                     dict(pingpong=False), dict(rescale_o_before_pv=True, rescale_threshold=8.0)]


@pytest.mark.parametrize("switch", SCHEDULE_SWITCHES, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_schedule_switches(seed, monkeypatch, switch, d, causal):
    """ForwardConfig's schedule switches that the bench A/Bs (off by default where they did not pay)
    must give the same results: O rescaled before P V, conditional rescaling, FMA-pipe exp2,
    no ping-pong. 1000 x 1000 spans many KV blocks, so that rescales happen and the
    conditional one also skips some."""
    override_forward_config(monkeypatch, **switch)
    hq, hk = HEADS["gqa"]
    q, k, v = rand(2, 1000, hq, d), rand(2, 1000, hk, d), rand(2, 1000, hk, d)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    check(out, lse, q, k, v, causal=causal)


@pytest.mark.parametrize("whole_k", [False, True])
@pytest.mark.parametrize("mask", ["none", "causal", "local"])
@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_gemm_calls_whole_k_or_per_slice(seed, monkeypatch, whole_k, mask, d):
    """GEMMs issued as one call over their k slices (what dispatch picks above d = 128, to compile
    faster) or one call per slice, at every head dim: many KV blocks (rescales), lengths that are
    no multiple of the tiles, sq > sk (fully masked causal rows), a window with full blocks on both
    sides of each query tile."""
    override_forward_config(monkeypatch, whole_k_gemms=whole_k)
    window = (300, 40) if mask == "local" else (-1, -1)
    hq, hk = HEADS["gqa"]
    for sq, sk in [(1000, 777), (203, 113)]:
        q, k, v = rand(2, sq, hq, d), rand(2, sk, hk, d), rand(2, sk, hk, d)
        out, lse = flash_attn_func(q, k, v, causal=mask == "causal", window_size=window, return_lse=True)
        check(out, lse, q, k, v, causal=mask == "causal", window_size=window)


@pytest.mark.parametrize("causal", [False, True])
def test_gemm_calls_whole_k_varlen(seed, monkeypatch, causal):
    override_forward_config(monkeypatch, whole_k_gemms=True)
    check_varlen_mqa(causal, max_len=700, d=256)


@pytest.mark.parametrize("b,hq,hk", [(1, 4, 2), (2, 5, 1)])
def test_partial_group_first_order(seed, b, hq, hk):
    """The longest-first order's partial L2 group of heads goes first: at d = 256 and 8k keys a
    (head, batch) pair reads 8 MiB of K and V, so the order groups 3 pairs per L2 budget, and 4 or
    10 pairs leave a partial group of 1. Every tile must be computed once."""
    q, k, v = rand(b, 8192, hq, 256), rand(b, 8192, hk, 256), rand(b, 8192, hk, 256)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    check(out, lse, q, k, v, causal=True)


@pytest.mark.parametrize("order", ["launch_order", "grouped", "min_blocks"])
@pytest.mark.parametrize("mask", ["causal", "local"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_tile_order_switches(seed, monkeypatch, order, mask, d):
    """ForwardConfig.longest_first and longest_first_min_blocks (A/B switches of the tile order):
    off, the launch order; a minimum of exactly the head's query tiles still groups heads
    longest-first, one more keeps the launch order through the same kernel. Every tile must be
    computed once and by the same arithmetic as in the default order: the results are bitwise the
    default kernel's."""
    from flash_attn4 import dispatch

    window = (300, 40) if mask == "local" else (-1, -1)
    hq, hk = HEADS["gqa"]
    sq = 1000
    q, k, v = rand(3, sq, hq, d), rand(3, sq, hk, d), rand(3, sq, hk, d)
    kwargs = dict(causal=mask == "causal", window_size=window)
    # (one split: split-KV tiles keep the launch order whatever the switches say)
    base_out, base_lse = flash_attn_func(q, k, v, return_lse=True, num_splits=1, **kwargs)
    def picked():
        return dispatch.forward_config(dispatch.arch_for_device(q.device), "bfloat16", d, d, causal=mask == "causal",
                                       local=mask == "local", has_softcap=False, varlen=False, has_seqused_k=False,
                                       has_sink=False, qhead_per_kvhead=hq // hk)

    default = picked()
    assert default.longest_first
    m_blocks = -(-sq * default.pack_gqa // default.tile_m)
    # (any minimum above the head's tiles keeps the launch order: one above the default's too, so
    # that the override differs from it)
    above = max(m_blocks, default.longest_first_min_blocks) + 1
    fields = {"launch_order": dict(longest_first=False), "grouped": dict(longest_first_min_blocks=m_blocks),
              "min_blocks": dict(longest_first_min_blocks=above)}[order]
    override_forward_config(monkeypatch, **fields)
    assert picked() == default.replace(**fields) != default
    out, lse = flash_attn_func(q, k, v, return_lse=True, num_splits=1, **kwargs)
    check(out, lse, q, k, v, **kwargs)
    assert torch.equal(out, base_out) and torch.equal(lse, base_lse), "the tile order changed the results"


@pytest.mark.parametrize("hq,hk", [(4, 2), (16, 4), (16, 2)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(1, 257), (7, 1000), (64, 64), (300, 257), (1000, 1000)])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_pack_gqa(seed, monkeypatch, d, sq, sk, causal, hq, hk):
    """GQA packing (the g = hq // hk query heads of a KV head share a tile, row = token * g + head):
    partial tiles, the causal diagonal in tokens not rows, and each row's O and LSE back at its own
    head."""
    override_forward_config(monkeypatch, pack_gqa=hq // hk)
    q, k, v = rand(2, sq, hq, d), rand(2, sk, hk, d), rand(2, sk, hk, d)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    check(out, lse, q, k, v, causal=causal)


@pytest.mark.parametrize("persistent_ctas", [0, 5])
@pytest.mark.parametrize("tma_store_o", [False, True])
def test_pack_gqa_with_softcap_sink_window(seed, monkeypatch, tma_store_o, persistent_ctas):
    """Per-row sinks (each row's own query head), the window in tokens, both epilogues, and the
    persistent grid walking packed tiles."""
    hq, hk, d = 8, 2, 128
    override_forward_config(monkeypatch, pack_gqa=hq // hk, tma_store_o=tma_store_o,
                            persistent_ctas=persistent_ctas)
    q, k, v = rand(2, 300, hq, d), rand(2, 257, hk, d), rand(2, 257, hk, d)
    sink = torch.randn(hq, device=DEVICE, dtype=torch.float32) * 3
    out, lse = flash_attn_func(q, k, v, window_size=(100, 7), softcap=20.0, learnable_sink=sink, return_lse=True)
    check(out, lse, q, k, v, window_size=(100, 7), softcap=20.0, learnable_sink=sink, lse_atol=20.0 * 1e-3)


@pytest.mark.parametrize("d", [64, 128])
def test_pack_gqa_matches_unpacked_decode(seed, monkeypatch, d):
    """Decoding (one query token, many keys): packed and unpacked kernels agree to float32
    summation-order noise."""
    hq, hk = 32, 8
    q, k, v = rand(4, 1, hq, d), rand(4, 4000, hk, d), rand(4, 4000, hk, d)
    results = []
    for g in (1, hq // hk):
        with monkeypatch.context() as m:
            override_forward_config(m, pack_gqa=g)
            results.append(flash_attn_func(q, k, v, return_lse=True))
    (ref, ref_lse), (out, lse) = results
    check(out, lse, q, k, v)
    ulp = ref.abs().max().item() * 2 ** -7  # a bf16 ulp of the largest output, or twice it
    assert max_abs_diff(out, ref) <= ulp, "packed and unpacked outputs differ by more than a bf16 ulp"
    assert max_abs_diff(lse, ref_lse) <= 1e-4


@pytest.fixture
def persistent(monkeypatch):
    """ForwardConfig.persistent_ctas for the duration of a test: 5 CTAs, so that every CTA walks
    many tiles and the pipelines' states carry over between them (sm90: a switch, off by default,
    slower at long causal; sm100: on by default for unmasked batched problems with 148 CTAs, here
    for every mask and layout). sm90 above d = 192: O goes out from registers, since the TMA
    epilogue would stage it in Q's buffer, which a persistent CTA needs for its next tile (the
    kernel refuses the pair); sm100 has no TMA epilogue (tma_store_o is off there)."""
    from flash_attn4 import dispatch

    def chosen(*args, **kwargs):
        cfg = dispatch_forward_config(*args, **kwargs)
        tma_store_o = cfg.tma_store_o and max(cfg.head_dim, cfg.head_dim_v) <= 192
        return cfg.replace(persistent_ctas=5, tma_store_o=tma_store_o)

    dispatch_forward_config = dispatch.forward_config
    route_forward_config(monkeypatch, chosen)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(113, 203), (1000, 1000), (1, 257), (203, 113)])
@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (256, 256), (192, 128)])
def test_persistent_grid(seed, persistent, d, dv, sq, sk, causal):
    hq, hk = HEADS["gqa"]
    q, k, v = rand(2, sq, hq, d), rand(2, sk, hk, d), rand(2, sk, hk, dv)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    check(out, lse, q, k, v, causal=causal)


@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (256, 256), (192, 128)])
def test_default_grid_with_more_tiles_than_ctas(seed, d, dv):
    """The arch's own grid rule on a problem with more output tiles than a persistent grid has CTAs
    (sm100: 148 persistent CTAs for unmasked batched problems, here each walking two to four tiles
    in the scheduler's order; sm90: one CTA per tile)."""
    hq, hk = 16, 4
    q, k, v = rand(3, 1500, hq, d), rand(3, 1400, hk, d), rand(3, 1400, hk, dv)
    out, lse = flash_attn_func(q, k, v, return_lse=True)
    check(out, lse, q, k, v)


def test_persistent_grid_with_softcap_sink_window(seed, persistent):
    hq, hk, d = 8, 2, 128
    q, k, v = rand(2, 300, hq, d), rand(2, 257, hk, d), rand(2, 257, hk, d)
    sink = torch.randn(hq, device=DEVICE, dtype=torch.float32)
    out, lse = flash_attn_func(q, k, v, window_size=(100, 7), softcap=20.0, learnable_sink=sink, return_lse=True)
    check(out, lse, q, k, v, window_size=(100, 7), softcap=20.0, learnable_sink=sink, lse_atol=20.0 * 1e-3)


@pytest.mark.parametrize("causal", [False, True])
def test_persistent_grid_varlen(seed, persistent, causal):
    """Tiles past a short sequence's end are skipped by the producer and the consumers alike."""
    check_varlen_mqa(causal, max_len=300, d=128)


def check_varlen_mqa(causal: bool, max_len: int, d: int):
    """Six packed MQA sequences of random lengths up to ``max_len``, against the reference."""
    hq, hk = HEADS["mqa"]
    lens_q, lens_k = random_lengths(6, max_len)
    q, k, v, cu_q, cu_k = make_varlen(lens_q, lens_k, hq, hk, d)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
                                      causal=causal, return_lse=True)
    check(out, lse, q, k, v, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(113, 203), (1000, 1000), (1, 257)])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_batched_fp16(seed, d, sq, sk, causal):
    hq, hk = HEADS["gqa"]
    q, k, v = (rand(2, sq, hq, d, dtype=torch.float16), rand(2, sk, hk, d, dtype=torch.float16),
               rand(2, sk, hk, d, dtype=torch.float16))
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert out.dtype == torch.float16
    check(out, lse, q, k, v, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_long_sequence(seed, causal):
    hq, hk, d = 4, 2, 128
    s = 4224
    q, k, v = rand(1, s, hq, d), rand(1, s, hk, d), rand(1, s, hk, d)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    check(out, lse, q, k, v, causal=causal)


def test_fully_masked_rows_causal_sq_gt_sk(seed):
    """Causal with sq > sk: the first sq - sk query rows see no key -> out 0, lse -inf, no NaN."""
    b, sq, sk, hq, hk, d = 2, 300, 77, 4, 2, 128
    q, k, v = rand(b, sq, hq, d), rand(b, sk, hk, d), rand(b, sk, hk, d)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    n_masked = sq - sk
    assert (out[:, :n_masked] == 0).all()
    assert torch.isneginf(lse[:, :, :n_masked]).all()
    assert torch.isfinite(lse[:, :, n_masked:]).all()
    check(out, lse, q, k, v, causal=True)


def test_softmax_scale_and_return_types(seed):
    q, k, v = rand(1, 65, 2, 64), rand(1, 80, 2, 64), rand(1, 80, 2, 64)
    scale = float(torch.empty(()).uniform_(0.05, 0.5))
    out = flash_attn_func(q, k, v, softmax_scale=scale)
    assert isinstance(out, torch.Tensor)
    out, lse = flash_attn_func(q, k, v, softmax_scale=scale, return_lse=True)
    check(out, lse, q, k, v, softmax_scale=scale)


def test_deterministic_forward_is_bitwise_repeatable(seed):
    q, k, v = rand(2, 333, 6, 128), rand(2, 444, 2, 128), rand(2, 444, 2, 128)
    a = flash_attn_func(q, k, v, causal=True, deterministic=True)
    b = flash_attn_func(q, k, v, causal=True, deterministic=True)
    assert torch.equal(a, b)


def test_strided_inputs(seed):
    """q/k/v as slices of a fused projection (non-contiguous, 16-byte aligned strides) and a transposed
    (b, h, s, d) buffer give the same result as contiguous copies."""
    b, s, h, d = 2, 157, 4, 128
    fused = rand(b, s, 3, h, d)
    q, k, v = fused.unbind(2)
    assert not q.is_contiguous()
    kt = rand(b, h, s, d).transpose(1, 2)
    out = flash_attn_func(q, kt, v, causal=True)
    ref = flash_attn_func(q.contiguous(), kt.contiguous(), v.contiguous(), causal=True)
    assert torch.equal(out, ref)


def test_head_dim_v_differs(seed):
    q, k, v = rand(2, 129, 4, 192), rand(2, 211, 2, 192), rand(2, 211, 2, 128)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert out.shape == (2, 129, 4, 128)
    check(out, lse, q, k, v, causal=True)


# ---- masks and score options ----


@pytest.mark.parametrize("window", [(32, 0), (17, 5), (-1, 9), (0, 0), (64, -1)])
@pytest.mark.parametrize("sq,sk", [(113, 203), (256, 256), (203, 113)])
def test_local_window(seed, window, sq, sk):
    q, k, v = rand(2, sq, 4, 128), rand(2, sk, 2, 128), rand(2, sk, 2, 128)
    out, lse = flash_attn_func(q, k, v, window_size=window, return_lse=True)
    check(out, lse, q, k, v, window_size=window)


@pytest.mark.parametrize("causal", [False, True])
def test_softcap(seed, causal):
    q, k, v = rand(2, 173, 4, 128, scale=4.0), rand(2, 190, 2, 128), rand(2, 190, 2, 128)
    out, lse = flash_attn_func(q, k, v, causal=causal, softcap=15.0, return_lse=True)
    # tanh is typically evaluated approximately in hardware (rel. error ~5e-4): scores move by up to
    # softcap * 5e-4, so lse gets a matching allowance
    check(out, lse, q, k, v, causal=causal, softcap=15.0, lse_atol=15.0 * 1e-3)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sink_dtype", [torch.float32, torch.bfloat16])
def test_learnable_sink(seed, causal, sink_dtype):
    q, k, v = rand(2, 150, 8, 64), rand(2, 150, 2, 64), rand(2, 150, 2, 64)
    sink = (torch.randn(8, device=DEVICE) * 2).to(sink_dtype)
    out, lse = flash_attn_func(q, k, v, causal=causal, learnable_sink=sink, return_lse=True)
    check(out, lse, q, k, v, causal=causal, learnable_sink=sink.float())


# ---- varlen ----


def make_varlen(lens_q, lens_k, hq, hk, d, dtype=torch.bfloat16):
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    q = rand(int(cu_q[-1]), hq, d, dtype=dtype)
    k = rand(int(cu_k[-1]), hk, d, dtype=dtype)
    v = rand(int(cu_k[-1]), hk, d, dtype=dtype)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("heads", ["mha", "gqa"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_varlen(seed, d, causal, heads):
    hq, hk = HEADS[heads]
    lens_q, lens_k = random_lengths(6, 300)
    q, k, v, cu_q, cu_k = make_varlen(lens_q, lens_k, hq, hk, d)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
                                      causal=causal, return_lse=True)
    assert out.shape == (q.shape[0], hq, d) and lse.shape == (hq, q.shape[0])
    check(out, lse, q, k, v, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def test_varlen_fp16_default_max_seqlen(seed):
    lens_q, lens_k = random_lengths(4, 500)
    q, k, v, cu_q, cu_k = make_varlen(lens_q, lens_k, 4, 1, 128, dtype=torch.float16)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, causal=True, return_lse=True)  # max_seqlen computed
    check(out, lse, q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def test_varlen_matches_batched(seed):
    """Equal-length varlen must equal the batched kernel on the same data (up to bf16 rounding)."""
    b, s, hq, hk, d = 3, 190, 4, 2, 128
    q, k, v = rand(b, s, hq, d), rand(b, s, hk, d), rand(b, s, hk, d)
    cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=DEVICE)
    out_b = flash_attn_func(q, k, v, causal=True)
    out_v = flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, max_seqlen_q=s,
                                   causal=True)
    assert max_abs_diff(out_v.view(b, s, hq, d), out_b) <= 1e-2


def test_varlen_seqused_k(seed):
    lens_q, lens_k = [70, 0, 200, 33], [90, 12, 150, 40]
    q, k, v, cu_q, cu_k = make_varlen(lens_q, lens_k, 4, 2, 128)
    used = torch.tensor([int(torch.randint(0, n + 1, ())) for n in lens_k], dtype=torch.int32, device=DEVICE)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_seqlen_q=200, seqused_k=used, causal=True,
                                      return_lse=True)
    check(out, lse, q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=used)


@pytest.mark.parametrize("hq,hk", [(8, 2), (16, 2)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_varlen_pack_gqa(seed, monkeypatch, d, causal, hq, hk):
    """GQA packing with packed sequences: each sequence's rows start at g times its first token;
    empty sequences, sequences without keys, and decoding-length ones (1-3 queries) among them."""
    override_forward_config(monkeypatch, pack_gqa=hq // hk)
    lens_q, lens_k = random_lengths(8, 300)
    lens_q[-3:] = [1, 3, 2]
    q, k, v, cu_q, cu_k = make_varlen(lens_q, lens_k, hq, hk, d)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
                                      causal=causal, return_lse=True)
    check(out, lse, q, k, v, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def test_varlen_pack_gqa_seqused_k_sink_window(seed, monkeypatch):
    override_forward_config(monkeypatch, pack_gqa=4)
    lens_q, lens_k = [70, 0, 200, 1, 33], [90, 12, 150, 300, 40]
    q, k, v, cu_q, cu_k = make_varlen(lens_q, lens_k, 8, 2, 128)
    used = torch.tensor([int(torch.randint(0, n + 1, ())) for n in lens_k], dtype=torch.int32, device=DEVICE)
    sink = torch.randn(8, device=DEVICE, dtype=torch.float32) * 3
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_seqlen_q=200, seqused_k=used, window_size=(50, 3),
                                      learnable_sink=sink, return_lse=True)
    check(out, lse, q, k, v, window_size=(50, 3), learnable_sink=sink, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
          seqused_k=used)


def test_varlen_check_cu_seqlens_setting(seed, monkeypatch):
    lens_q, lens_k = [10, 20], [15, 25]
    q, k, v, cu_q, cu_k = make_varlen(lens_q, lens_k, 2, 2, 64)
    bad = torch.tensor([0, 31, 30], dtype=torch.int32, device=DEVICE)  # decreasing, right total
    monkeypatch.setenv("FLASH_ATTN4_CHECK_CU_SEQLENS", "1")
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        flash_attn_varlen_func(q, k, v, bad, cu_k, max_seqlen_q=31)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_seqlen_q=20)
    assert torch.isfinite(out).all()


# ---- compile count ----


def test_new_lengths_do_not_recompile(seed):
    d = 128
    flash_attn_func(rand(1, 8, 4, d), rand(1, 8, 2, d), rand(1, 8, 2, d), causal=True)  # warm
    flash_attn_varlen_func(*make_varlen([5, 7], [6, 8], 4, 2, d), max_seqlen_q=7, causal=True)  # warm
    before = compile_cache.stats()
    for b, sq, sk in [(1, 1, 1), (3, 77, 500), (2, 1025, 1024), (5, 64, 3)]:
        flash_attn_func(rand(b, sq, 4, d), rand(b, sk, 2, d), rand(b, sk, 2, d), causal=True)
    for batch in (1, 3, 9):
        lens_q, lens_k = random_lengths(max(batch, 2), 400)
        q, k, v, cu_q, cu_k = make_varlen(lens_q, lens_k, 4, 2, d)
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_seqlen_q=max(lens_q), causal=True)
    after = compile_cache.stats()
    assert after["compiled"] == before["compiled"], (before, after)
    assert after["disk_hits"] == before["disk_hits"], (before, after)


# ---- what tests/unsupported.py lists as refused ----


def _listed_problem(case: str):
    """(problem for forward_refusals, call, reference kwargs) of a combination the list names: the
    call runs it on random inputs; where it runs, its result is compared with the reference."""
    hq, hk = HEADS["gqa"]
    if case in ("head_dim_8", "head_dim_v_8", "num_splits_3"):
        d, dv = {"head_dim_8": (8, 8), "head_dim_v_8": (64, 8), "num_splits_3": (128, 128)}[case]
        q, k, v = rand(2, 70, hq, d), rand(2, 900, hk, d), rand(2, 900, hk, dv)
        splits = 3 if case == "num_splits_3" else 1
        return (dict(head_dim=d, head_dim_v=dv, num_splits=splits),
                lambda: flash_attn_func(q, k, v, causal=True, num_splits=splits, return_lse=True),
                dict(q=q, k=k, v=v, causal=True))
    lens_q, lens_k = [37, 1, 90], [200, 33, 129]
    q, k, v, cu_q, cu_k = make_varlen(lens_q, lens_k, hq, hk, 128)
    used_k = torch.tensor(lens_k, dtype=torch.int32, device=DEVICE)
    if case == "seqused_q":  # every query used: the result is plain varlen attention
        used_q = torch.tensor(lens_q, dtype=torch.int32, device=DEVICE)
        return (dict(head_dim=128, head_dim_v=128, seqused_q=True),
                lambda: flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_seqlen_q=90, seqused_q=used_q, causal=True,
                                               return_lse=True),
                dict(q=q, k=k, v=v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k))
    assert case == "paged", case
    table, num_pages = random_pages(lens_k, 64)
    table = table.to(DEVICE)
    k_pages, v_pages = rand(num_pages, 64, hk, 128), rand(num_pages, 64, hk, 128)
    k_ref, v_ref, cu_ref = unpage(k_pages, v_pages, table, lens_k)
    return (dict(head_dim=128, head_dim_v=128, paged=True),
            lambda: flash_attn_varlen_func(q, k_pages, v_pages, cu_q, None, max_seqlen_q=90, seqused_k=used_k,
                                           page_table=table, causal=True, return_lse=True),
            dict(q=q, k=k_ref, v=v_ref, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_ref))


@pytest.mark.parametrize("case", ["head_dim_8", "head_dim_v_8", "seqused_q", "paged", "num_splits_3"])
def test_listed_refusals(seed, case):
    """Each kind of combination tests/unsupported.py lists: refused with its listed reason on the
    archs the list names, computed correctly on the others."""
    from flash_attn4 import dispatch

    arch = dispatch.arch_for_device(torch.device(DEVICE))
    problem, call, ref = _listed_problem(case)
    pattern = refusal_pattern(forward_refusals(arch, **problem))
    if pattern is not None:
        with pytest.raises(NotImplementedError, match=pattern):
            call()
        return
    out, lse = call()
    check(out, lse, ref.pop("q"), ref.pop("k"), ref.pop("v"), **ref)
