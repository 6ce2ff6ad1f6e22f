"""The backward's tile algorithm emulated on the CPU (tests/bwd_tile_model.py) against autograd through
tests/reference.py's attention_ref, by the GPU backward suite's rule (tests/gpu/test_bwd.py:
max|grad - grad_ref| <= 2 * max|grad_pt - grad_ref| + atol, grad_ref the float32 reference's gradient,
grad_pt the input dtype's). The model's tiles are what dispatch builds (BackwardConfig); its out and
LSE come from the forward's model (tests/tile_model.py). Small problems, float32/float64 numpy: no GPU,
a few seconds."""

from __future__ import annotations

import math
import zlib
from dataclasses import replace

import numpy as np
import pytest
import torch

from flash_attn4 import dispatch
from flash_attn4.fa4_kernels.arch import Arch
from tests import bwd_tile_model as bm
from tests import tile_model as tm
from tests.gpu.test_bwd import dsink_rounding, grad_atol
from tests.cpu.test_tile_emulation import CASES as FORWARD_CASES
from tests.reference import assert_close_fa_rule, attention_ref

TANH_REL_ERROR = 2.0 ** -11  # tanh.approx.f32 (softcap)
MUFU_REL_ERROR = 2.0 ** -22  # MUFU.EX2


def configs(dtype="bfloat16", d=64, dv=None, causal=False, local=False, softcap=0.0, deterministic=False,
            arch=Arch.SM90):
    """(BackwardConfig, ForwardConfig) that dispatch builds for the problem class on ``arch`` (the
    forward, which only supplies out and LSE, is sm90's: its tile model is the checked one)."""
    flags = dict(causal=causal, local=local, has_softcap=bool(softcap), varlen=False, has_seqused_k=False)
    dv = d if dv is None else dv
    bwd = dispatch.backward_config(arch, dtype, d, dv, deterministic=deterministic, **flags)
    fwd = dispatch.forward_config(Arch.SM90, dtype, d, dv, has_sink=False, **flags)
    return bwd, fwd


def _rand(gen, *shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


def forward_outputs(q, k, v, fwd_cfg, sink=None, **kw):
    """out (sq, g, dv) and lse (g, sq) of the forward's tile model, per query head."""
    params = tm.TileParams.from_forward_config(fwd_cfg)
    outs, lses = [], []
    for h in range(q.shape[1]):
        res = tm.forward(q[:, h], k, v, params, sink=None if sink is None else float(sink[h]), **kw)
        outs.append(res.out)
        lses.append(res.lse)
    return torch.stack(outs, 1), torch.stack(lses)


def reference_grads(q, k, v, dout, sink=None, upcast=True, **kw):
    """Gradients of attention_ref (one batch entry, one KV head) for q, k, v (and the sink)."""
    cast = (lambda t: t.float()) if upcast else (lambda t: t)  # noqa: E731
    leaves = [cast(t).detach().clone().requires_grad_() for t in (q[None], k[None, :, None], v[None, :, None])]
    sink_leaf = None if sink is None else sink.float().detach().clone().requires_grad_()
    out, _ = attention_ref(*leaves, learnable_sink=sink_leaf, upcast=upcast, **kw)
    out.backward(cast(dout[None]))
    grads = {"dq": leaves[0].grad[0], "dk": leaves[1].grad[0, :, 0], "dv": leaves[2].grad[0, :, 0]}
    if sink is not None:
        grads["dsink"] = sink_leaf.grad
    return grads


def run_case(gen, sq, sk, g=1, d=64, dv=None, dtype=torch.bfloat16, causal=False, window=(-1, -1), softcap=0.0,
             sink=None, deterministic=False, seed=0, q_scale=1.0, k=None, arch=Arch.SM90):
    """Random inputs (k may be given), the forward model's out and LSE, the backward model with the
    tiles of ``arch``'s backward, and the rule against the references; returns (result, inputs,
    reference grads)."""
    dv = d if dv is None else dv
    name = {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    bwd_cfg, fwd_cfg = configs(name, d, dv, causal=causal, local=window != (-1, -1), softcap=softcap,
                               deterministic=deterministic, arch=arch)
    q = _rand(gen, sq, g, d, dtype=dtype, scale=q_scale)
    k = _rand(gen, sk, d, dtype=dtype, scale=q_scale) if k is None else k
    v, dout = _rand(gen, sk, dv, dtype=dtype), _rand(gen, sq, g, dv, dtype=dtype)
    sink_t = None if sink is None else torch.full((g,), float(sink)) + torch.randn(g, generator=gen)
    kw = dict(softmax_scale=d ** -0.5, causal=causal, window=window, softcap=softcap)
    out, lse = forward_outputs(q, k, v, fwd_cfg, sink=sink_t, **kw)
    res = bm.backward(q, k, v, out, dout, lse, bm.BwdTileParams.from_backward_config(bwd_cfg), sink=sink_t,
                      deterministic=deterministic, seed=seed, tanh_rel_error=TANH_REL_ERROR,
                      mufu_rel_error=MUFU_REL_ERROR, **kw)
    check_rule(res, q, k, v, dout, sink_t, **kw)
    return res, (q, k, v, dout, sink_t), reference_grads(q, k, v, dout, sink_t, **_ref_kw(kw))


def _ref_kw(kw):
    return dict(softmax_scale=kw["softmax_scale"], causal=kw.get("causal", False),
                window_size=kw.get("window", (-1, -1)), softcap=kw.get("softcap", 0.0))


def check_rule(res, q, k, v, dout, sink, **kw):
    """The GPU backward suite's rule on every gradient of the model."""
    ref = reference_grads(q, k, v, dout, sink, upcast=True, **_ref_kw(kw))
    pt = reference_grads(q, k, v, dout, sink, upcast=False, **_ref_kw(kw))
    got = {"dq": res.dq, "dk": res.dk, "dv": res.dv, "dsink": res.dsink}
    for name, want in ref.items():
        assert torch.isfinite(got[name]).all(), name
        atol = grad_atol(want, got[name].dtype)
        if name == "dsink":
            atol += dsink_rounding(q[None], k[None, :, None], v[None, :, None], dout[None], sink, **_ref_kw(kw))
        assert_close_fa_rule(got[name], want, pt[name], atol=atol, name=name)


# ---- the tiles are dispatch's ----------------------------------------------------------------------

@pytest.mark.parametrize("d,flags,tiles", [
    (64, dict(), (128, 128)), (64, dict(causal=True), (128, 128)), (128, dict(), (80, 128)),
    (128, dict(causal=True), (80, 128)), (128, dict(local=True), (64, 128)), (128, dict(softcap=1.0), (64, 128)),
    (96, dict(), (64, 128)), (256, dict(), (64, 64)), (192, dict(local=True), (64, 64))])
def test_tile_params_are_what_dispatch_builds(d, flags, tiles):
    """The model's tiles come from the BackwardConfig dispatch builds (sm90/tiles.py's backward rules:
    128 queries up to d = 64, 80 at d = 128 without local or softcap, else 64; 64 keys when the head
    dim is split above 128)."""
    cfg, _ = configs(d=d, **flags)
    params = bm.BwdTileParams.from_backward_config(cfg)
    assert (params.tile_m, params.tile_n) == (cfg.tile_m, cfg.tile_n) == tiles
    assert params.dtype is torch.bfloat16


# ---- the model against the reference ---------------------------------------------------------------

# The forward emulation's problems, then GQA, deterministic mode and the backward's own tiles.
CASES = {name: FORWARD_CASES[name] for name in ("plain", "causal-sq<sk", "causal-sq>sk", "local", "softcap", "sink")}
CASES |= {
    "gqa3-causal": dict(sq=130, sk=200, g=3, causal=True),
    "gqa2-sink-deterministic": dict(sq=260, sk=300, g=2, sink=0.5, deterministic=True),
    "d128-causal": dict(sq=170, sk=260, causal=True, d=128),  # 80-query blocks
    "d128-local": dict(sq=150, sk=200, window=(30, 0), d=128),  # 64-query blocks
    "d256-local": dict(sq=150, sk=300, window=(60, 90), d=256),  # split head dim: 64 x 64 tiles
    "d192-128": dict(sq=100, sk=150, d=192, dv=128, causal=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_model_matches_reference(case):
    c = dict(CASES[case])
    gen = torch.Generator().manual_seed(zlib.crc32(case.encode()))
    res, _, _ = run_case(gen, seed=c["sq"], **c)
    assert res.stats.masked_steps > 0  # the sequence's end at least
    if case in ("plain", "sink", "d128-causal", "gqa2-sink-deterministic"):
        assert res.stats.full_steps > 0  # and blocks without the element-wise mask


def test_fp16():
    gen = torch.Generator().manual_seed(5)
    res, _, _ = run_case(gen, 190, 250, dtype=torch.float16, causal=True)
    assert res.dq.dtype == res.dk.dtype == res.dv.dtype == torch.float16


def test_gqa_sums_dk_dv_over_the_group():
    """With g query heads on one KV head, dK and dV are the sums of the per-head gradients: the model
    on the group equals the sum of the model on each head alone, to float32 accumulation and one
    rounding each."""
    gen = torch.Generator().manual_seed(6)
    res, (q, k, v, dout, _), ref = run_case(gen, 120, 200, g=3)
    bwd_cfg, fwd_cfg = configs()
    params = bm.BwdTileParams.from_backward_config(bwd_cfg)
    kw = dict(softmax_scale=0.125)
    alone = []
    for h in range(3):
        out, lse = forward_outputs(q[:, h:h + 1], k, v, fwd_cfg, **kw)
        alone.append(bm.backward(q[:, h:h + 1], k, v, out, dout[:, h:h + 1], lse, params, **kw))
    for name in ("dk", "dv"):
        summed = sum(getattr(r, name).double() for r in alone)
        got = getattr(res, name).double()
        assert (got - summed).abs().max() <= 3 * 2.0 ** -8 * summed.abs().max(), name  # bf16 roundings only
        assert (got - summed).abs().max() < (getattr(alone[0], name).double()).abs().max()  # not one head's
    for h in range(3):
        assert torch.equal(res.dq[:, h], alone[h].dq[:, 0])  # dQ per head is the head's own


# ---- the dQ reduction order --------------------------------------------------------------------------

def test_deterministic_order_is_bitwise_reproducible_and_arrival_order_is_not():
    """Eight KV blocks add into every query block's dQ. Deterministic mode (KV-block order) gives the
    same float32 accumulator bit for bit whatever order the parts arrive in; the atomic mode's
    arrival order changes the last bits only (float32 reassociation), within the rule either way."""
    gen = torch.Generator().manual_seed(7)
    sq, sk = 130, 1000
    q, k, v, dout = _rand(gen, sq, 1, 64), _rand(gen, sk, 64), _rand(gen, sk, 64), _rand(gen, sq, 1, 64)
    bwd_cfg, fwd_cfg = configs(deterministic=True)
    params = bm.BwdTileParams.from_backward_config(bwd_cfg)
    kw = dict(softmax_scale=0.125)
    out, lse = forward_outputs(q, k, v, fwd_cfg, **kw)
    det = [bm.backward(q, k, v, out, dout, lse, params, deterministic=True, seed=s, **kw) for s in (1, 2)]
    atomic = [bm.backward(q, k, v, out, dout, lse, params, deterministic=False, seed=s, **kw) for s in (1, 2, 3)]
    assert np.array_equal(det[0].dq_accum.view(np.int32), det[1].dq_accum.view(np.int32))
    assert torch.equal(det[0].dq, det[1].dq)
    bits = [a.dq_accum.view(np.int32) for a in atomic]
    assert not (np.array_equal(bits[0], bits[1]) and np.array_equal(bits[0], bits[2]))  # the order shows
    # ... but only as rounding: 8 float32 adds of parts at most |dq| large each
    bound = 8 * 2.0 ** -24 * np.abs(det[0].dq_accum).max() * 8
    for a in atomic:
        assert np.abs(a.dq_accum.astype(np.float64) - det[0].dq_accum).max() <= bound
        assert torch.equal(a.dk, det[0].dk) and torch.equal(a.dv, det[0].dv)  # no atomics there
    check_rule(atomic[0], q, k, v, dout, None, **kw)
    check_rule(det[0], q, k, v, dout, None, **kw)


# ---- adversarial inputs ----------------------------------------------------------------------------

@pytest.mark.parametrize("sink", [None, 0.75])
def test_rows_without_keys_get_zero_gradients(sink):
    """Causal with 300 queries and 100 keys: rows 0..199 see no key (LSE -inf, +inf in log2 units:
    P = exp2(-inf) = 0; with a sink the LSE is the sink logit and the mask zeroes P). Their dQ is
    exactly 0 and nothing is NaN; the query blocks made only of them are never visited."""
    gen = torch.Generator().manual_seed(9)
    res, (q, k, v, dout, sink_t), _ = run_case(gen, 300, 100, causal=True, sink=sink)
    assert (res.dq[:200] == 0).all() and res.dq[200:].abs().max() > 0
    assert np.isfinite(res.dpsum).all()
    visited = {m for _, m, _, _ in res.stats.blocks}
    assert visited == {1, 2}  # 128-query blocks: rows 128..383; block 0 (rows 0..127) sees nothing
    if sink is None:
        _, lse = forward_outputs(q, k, v, configs(causal=True)[1], softmax_scale=0.125, causal=True)
        assert (lse[:, :200] == -math.inf).all() and (bm.lse_log2(lse.numpy())[:, :200] == np.inf).all()


@pytest.mark.parametrize("d", [64, 128])
def test_large_softcap_with_big_scores(d):
    gen = torch.Generator().manual_seed(10)
    res, (q, k, _, _, _), _ = run_case(gen, 160, 300, d=d, softcap=50.0, q_scale=12.0)
    s = (q[:, 0].double() @ k.double().T * d ** -0.5 / 50).tanh() * 50
    assert (s.abs() > 49).float().mean() > 0.1  # saturated: tanh' = 1 - t^2 near 0 there


def test_long_rows_of_equal_scores():
    """Every key equal: P is 1/sk along each row, dS = P (dP - D) a small difference of two sums."""
    gen = torch.Generator().manual_seed(11)
    k = _rand(gen, 1, 64).expand(1000, 64).contiguous()
    res, _, _ = run_case(gen, 70, 1000, k=k)
    assert res.stats.p_max <= 2.0 ** -9.9  # exp2(log2 of 1/1000), not a stale 1


def test_single_visible_key():
    """A window of (0, 0) with sq == sk: every query sees exactly its own key, P = 1, O = V, so
    dP - D = dO.(v_j - O) = 0 up to float32 rounding: dQ and dK nearly vanish and dV = dO exactly."""
    gen = torch.Generator().manual_seed(12)
    res, (_, _, _, dout, _), ref = run_case(gen, 150, 150, window=(0, 0))
    assert torch.equal(res.dv, dout[:, 0])
    assert res.dq.abs().max() < 1e-4 * dout.abs().max() and res.dk.abs().max() < 1e-4 * dout.abs().max()


# ---- the model's own schedule checks can fail -------------------------------------------------------

def test_a_query_block_range_that_misses_rows_is_caught(monkeypatch):
    real = bm.query_block_range
    monkeypatch.setattr(bm, "query_block_range", lambda n, *a: range(real(n, *a).start, real(n, *a).stop - 1))
    with pytest.raises(AssertionError, match="no visited block covers"):
        run_case(torch.Generator().manual_seed(13), 200, 250, causal=True)


def test_a_full_block_that_hides_a_masked_key_is_caught(monkeypatch):
    monkeypatch.setattr(bm, "block_is_full", lambda *a: True)
    with pytest.raises(AssertionError, match="called full but has masked keys"):
        run_case(torch.Generator().manual_seed(14), 200, 250, causal=True)


def test_rounding_p_and_ds_matters():
    """What the rounding points cost: the model's dV differs from one with P kept in float32 by
    about P's bf16 rounding (so the model does round P before dV += P^T dO)."""
    gen = torch.Generator().manual_seed(15)
    res, (q, k, v, dout, _), ref = run_case(gen, 128, 256)
    bwd_cfg, fwd_cfg = configs()
    out, lse = forward_outputs(q, k, v, fwd_cfg, softmax_scale=0.125)
    exact_p = bm.BwdTileParams(tile_m=bwd_cfg.tile_m, tile_n=bwd_cfg.tile_n, dtype=torch.float32)
    unrounded = bm.backward(q, k, v, out, dout, lse, exact_p, softmax_scale=0.125)
    err16 = (res.dv.double() - ref["dv"].double()).abs().max()
    err32 = (unrounded.dv.double() - ref["dv"].double()).abs().max()
    assert err32 < err16 / 4, (float(err32), float(err16))


# ---- the sm100 backward's deterministic dQ order -------------------------------------------------


def sm100_config(d=128, causal=True, local=False):
    return dispatch.backward_config(Arch.SM100, "bfloat16", d, d, causal=causal, local=local, has_softcap=False,
                                    varlen=False, has_seqused_k=False, deterministic=True)


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (200, 0)),
                                           (False, (70, 5)), (False, (0, 300)), (False, (-1, 40))])
def test_sm100_semaphore_turns_count_exactly_the_earlier_kv_blocks(causal, window):
    """sm100/bwd.py deterministic_turn: the CTA of KV block n adds its dQ of query block m once the
    semaphore reads n - n_first(m), n_first from mask.n_block_range (the forward's block range,
    tile_model.block_schedule), and then counts itself. That is the KV-block order only if the KV
    blocks that visit m (bwd_tile_model.query_block_range, the CTA's walk) are exactly
    [n_first, n_max): every earlier one has added before block n's turn comes, and none waits for
    a count that never comes (a deadlock). Over ragged lengths, sq < sk and sq > sk, causal and local
    windows (where a query block's first KV block is not 0: its count starts at its own n_first)."""
    cfg = sm100_config(causal=causal, local=window != (-1, -1))
    tm_, tn = cfg.tile_m, cfg.tile_n
    for sq, sk in [(1, 1), (128, 128), (300, 333), (333, 300), (129, 1000), (1000, 129), (640, 640), (5, 700)]:
        visits = {}
        for n in range(-(-sk // tn)):
            for m in bm.query_block_range(n, sq, sk, tm_, tn, causal, window):
                visits.setdefault(m, []).append(n)
        for m in range(-(-sq // tm_)):
            blocks = [n for n, _ in tm.block_schedule(m, sq, sk, tm_, tn, causal, window)]
            if not blocks:
                assert m not in visits, (sq, sk, m)
                continue
            first, last = min(blocks), max(blocks)
            assert visits.get(m) == list(range(first, last + 1)), (sq, sk, m, visits.get(m), first, last)
            # the count each visiting CTA waits for is the number of visitors before it
            assert [n - first for n in visits[m]] == list(range(len(visits[m]))), (sq, sk, m)


def test_sm100_deterministic_order_is_bitwise_reproducible():
    """The sm100 tiles (128 x 128) in the model's deterministic mode (KV-block order): the float32
    dQ accumulator is the same bit for bit whatever order the parts arrive in, and within the rule."""
    gen = torch.Generator().manual_seed(11)
    sq, sk = 300, 700
    q, k, v, dout = _rand(gen, sq, 1, 128), _rand(gen, sk, 128), _rand(gen, sk, 128), _rand(gen, sq, 1, 128)
    _, fwd_cfg = configs(d=128, causal=True)
    params = bm.BwdTileParams.from_backward_config(sm100_config())
    assert (params.tile_m, params.tile_n) == (128, 128)
    kw = dict(softmax_scale=0.0883883, causal=True)
    out, lse = forward_outputs(q, k, v, fwd_cfg, **kw)
    det = [bm.backward(q, k, v, out, dout, lse, params, deterministic=True, seed=s, **kw) for s in (1, 2)]
    assert np.array_equal(det[0].dq_accum.view(np.int32), det[1].dq_accum.view(np.int32))
    check_rule(det[0], q, k, v, dout, None, **kw)


# ---- the sm100 backward's tiles with local windows, softcap and varlen ------------------------------

SM100_CASES = {
    "local": dict(sq=300, sk=333, window=(70, 5)),
    "causal-window": dict(sq=333, sk=300, window=(100, 0)),  # causal + window: local with right 0
    "right-window-only": dict(sq=200, sk=450, window=(-1, 40)),
    "softcap": dict(sq=200, sk=260, softcap=5.0),
    "causal-softcap-d128": dict(sq=260, sk=300, causal=True, softcap=2.0, d=128),
    "local-softcap-gqa-d128": dict(sq=150, sk=390, g=2, window=(200, 30), softcap=3.0, d=128),
    "local-sink-deterministic": dict(sq=260, sk=300, window=(150, 10), sink=0.5, deterministic=True),
    "d96-causal": dict(sq=300, sk=333, causal=True, d=96),
    "d96-local-softcap-gqa": dict(sq=200, sk=290, g=3, window=(90, 20), softcap=6.0, d=96),
    "d128-dv64-causal": dict(sq=260, sk=300, causal=True, d=128, dv=64),
    "d64-dv128-local": dict(sq=200, sk=333, window=(80, 10), d=64, dv=128),
    # the serial kernel (sm100/bwd_serial.py): dS from the 16-bit P
    "d192-dv128-causal": dict(sq=260, sk=300, causal=True, d=192, dv=128),
    "d192-dv128-local-gqa-deterministic": dict(sq=200, sk=333, g=2, window=(90, 20), d=192, dv=128,
                                               deterministic=True),
    # and its softcap: t recovered from the 16-bit P (bwd_serial.softcap_tanh)
    "d192-dv128-causal-softcap": dict(sq=260, sk=300, causal=True, softcap=2.0, d=192, dv=128),
    "d192-dv128-local-softcap-gqa": dict(sq=200, sk=333, g=2, window=(90, 20), softcap=5.0, d=192, dv=128),
}


@pytest.mark.parametrize("case", list(SM100_CASES))
def test_sm100_tiles_match_reference(case):
    """The model with the sm100 backward's tiles (128 x 128, sm100/tiles.py) under local windows and
    softcap: every visible pair covered by a visited block, no full block hiding a masked key, and
    the gradients within the GPU suite's rule against autograd."""
    c = dict(SM100_CASES[case])
    cfg, _ = configs(d=c.get("d", 64), dv=c.get("dv"), causal=c.get("causal", False), local="window" in c,
                     softcap=c.get("softcap", 0.0), arch=Arch.SM100)
    assert (cfg.arch, cfg.tile_m, cfg.tile_n) == (Arch.SM100, 128, 128)
    gen = torch.Generator().manual_seed(zlib.crc32(case.encode()))
    res, _, _ = run_case(gen, seed=c["sq"], arch=Arch.SM100, **c)
    assert res.stats.masked_steps > 0


# (seqlen_q, seqlen_k) per varlen sequence, seqused_k applied: the kernel runs each sequence as its own
# problem at its offsets (SeqlenInfo), so the model runs them one by one. Ragged ends, one query, keys
# shorter than a block, and a sequence without keys (its rows see nothing: zero dQ).
SM100_VARLEN = ((300, 333), (1, 129), (77, 40), (129, 0), (256, 256))


@pytest.mark.parametrize("flags", [dict(), dict(causal=True), dict(window=(60, 8)), dict(softcap=4.0, causal=True)])
def test_sm100_varlen_sequences_match_reference(flags):
    """Each sequence of a varlen batch through the model with the sm100 tiles: within the rule where
    it has keys; where it has none, no block is visited and dQ is exactly 0."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr(flags).encode()))
    for sq, sk in SM100_VARLEN:
        if sk == 0:
            cfg, _ = configs(causal=flags.get("causal", False), local="window" in flags,
                             softcap=flags.get("softcap", 0.0), arch=Arch.SM100)
            q, dout = _rand(gen, sq, 1, 64), _rand(gen, sq, 1, 64)
            k = v = _rand(gen, 0, 64)
            res = bm.backward(q, k, v, torch.zeros(sq, 1, 64, dtype=q.dtype), dout, torch.full((1, sq), -math.inf),
                              bm.BwdTileParams.from_backward_config(cfg), softmax_scale=0.125,
                              causal=flags.get("causal", False), window=flags.get("window", (-1, -1)),
                              softcap=flags.get("softcap", 0.0))
            assert (res.dq == 0).all() and res.dk.numel() == 0 and not res.stats.blocks
            continue
        run_case(gen, sq, sk, seed=sq + sk, arch=Arch.SM100, **flags)


# ---- the sm100 backward's CTA pairs (sm100/bwd_pair.py) -----------------------------------------------


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (200, 0)),
                                           (False, (70, 5)), (False, (0, 300)), (False, (-1, 40)), (False, (5, 5))])
def test_sm100_pair_walk_covers_every_visible_key_of_both_blocks(causal, window):
    """A CTA pair walks one list of query blocks for both of its KV blocks (its MMAs are the pair's):
    bwd_tile_model.pair_query_block_range, the model of pair_tile_work. Every (query, key) the mask
    lets see each other, with the key in either block, must have its query block in the walk (a
    missing block would lose its dK, dV and dQ terms); blocks in the walk that one CTA's keys are
    hidden from run that CTA's masked step (P^T = dS^T = 0), checked by the tile emulation's masks. The
    walk also covers each block's own range (the 1-CTA kernel's), so the pair does at least that work."""
    cfg = sm100_config(causal=causal, local=window != (-1, -1))
    tm_, tn = cfg.tile_m, cfg.tile_n
    local = window != (-1, -1)
    for sq, sk in [(1, 1), (128, 128), (300, 333), (333, 300), (129, 1000), (1000, 129), (640, 640), (5, 700),
                   (700, 5), (257, 385)]:
        offset = sk - sq
        for pair in range(-(-sk // (2 * tn))):
            walk = bm.pair_query_block_range(pair, sq, sk, tm_, tn, causal, window)
            for n in (2 * pair, 2 * pair + 1):
                if n * tn >= sk:
                    continue
                own = bm.query_block_range(n, sq, sk, tm_, tn, causal, window)
                assert set(own) <= set(walk), (sq, sk, pair, n, own, walk)
                for j in range(n * tn, min((n + 1) * tn, sk)):
                    for i in range(sq):
                        hi = i + offset if causal else (i + offset + window[1] if local and window[1] >= 0 else sk)
                        lo = i + offset - window[0] if local and window[0] >= 0 else 0
                        if lo <= j <= hi:
                            assert i // tm_ in walk, (sq, sk, pair, i, j, walk)


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (200, 0)),
                                           (False, (70, 5)), (False, (0, 300)), (False, (-1, 40))])
def test_sm100_pair_semaphore_turns_count_exactly_the_earlier_pairs(causal, window):
    """bwd_pair.py pair_turn: the pair of KV blocks 2p, 2p + 1 adds its dQ rows of query block m once
    slot ``rank`` of the block's semaphore reads p - n_first(m) // 2 (n_first from mask.n_block_range,
    tile_model.block_schedule), then counts itself. That is pair order without a deadlock only if the
    pairs whose walk (pair_query_block_range) holds m are exactly n_first // 2 .. the pair of m's last
    KV block."""
    cfg = sm100_config(causal=causal, local=window != (-1, -1))
    tm_, tn = cfg.tile_m, cfg.tile_n
    for sq, sk in [(1, 1), (128, 128), (300, 333), (333, 300), (129, 1000), (1000, 129), (640, 640), (5, 700),
                   (257, 385)]:
        visits = {}
        for pair in range(-(-sk // (2 * tn))):
            for m in bm.pair_query_block_range(pair, sq, sk, tm_, tn, causal, window):
                visits.setdefault(m, []).append(pair)
        for m in range(-(-sq // tm_)):
            blocks = [n for n, _ in tm.block_schedule(m, sq, sk, tm_, tn, causal, window)]
            if not blocks:
                assert m not in visits, (sq, sk, m)  # pair_turn would count from a block range that is empty
                continue
            first, last = min(blocks) // 2, max(blocks) // 2
            assert visits.get(m, [])[:1] == [first] and visits[m] == list(range(first, first + len(visits[m]))), \
                (sq, sk, m, visits.get(m), first)
            assert visits[m][-1] >= last, (sq, sk, m, visits[m], last)


@pytest.mark.parametrize("causal,window,deterministic", [(False, (-1, -1), False), (True, (-1, -1), True),
                                                         (False, (150, 20), True), (False, (60, 0), False)])
def test_sm100_pair_model_matches_reference(causal, window, deterministic):
    """The model in pair mode (BwdTileParams.cluster_m = 2, whatever dispatch's switch): the pair
    walk, one dQ part per pair over both blocks' keys, added in pair order when deterministic (bit
    for bit the same whatever the arrival order); every gradient within the GPU suite's rule, and dK /
    dV the 1-CTA model's bit for bit (each CTA's own keys, the same steps in the same order plus
    masked ones that add zeros)."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr((causal, window)).encode()))
    sq, sk, d = 300, 650, 128
    q, k, v, dout = _rand(gen, sq, 2, d), _rand(gen, sk, d), _rand(gen, sk, d), _rand(gen, sq, 2, d)
    _, fwd_cfg = configs(d=d, causal=causal, local=window != (-1, -1))
    kw = dict(softmax_scale=d ** -0.5, causal=causal, window=window)
    out, lse = forward_outputs(q, k, v, fwd_cfg, **kw)
    single, pair = (bm.BwdTileParams(128, 128, torch.bfloat16, cluster_m=c) for c in (1, 2))
    runs = [bm.backward(q, k, v, out, dout, lse, pair, deterministic=deterministic, seed=s, **kw) for s in (1, 2)]
    check_rule(runs[0], q, k, v, dout, None, **kw)
    if deterministic:
        assert np.array_equal(runs[0].dq_accum.view(np.int32), runs[1].dq_accum.view(np.int32))
    one = bm.backward(q, k, v, out, dout, lse, single, deterministic=deterministic, seed=1, **kw)
    assert torch.equal(one.dk, runs[0].dk) and torch.equal(one.dv, runs[0].dv)
    assert len(runs[0].stats.blocks) >= len(one.stats.blocks)


def test_sm100_serial_model_takes_ds_from_the_rounded_p():
    """The serial kernel's configurations (192 / 128) set ds_from_rounded_p and no other does; with it
    the model's dK and dQ differ from the float32-P model's (the flag is not vacuous) while both stay
    within the rule (test_sm100_tiles_match_reference)."""
    serial, _ = configs(d=192, dv=128, causal=True, arch=Arch.SM100)
    assert bm.BwdTileParams.from_backward_config(serial).ds_from_rounded_p
    for d, dv, arch in ((128, 128, Arch.SM100), (64, 128, Arch.SM100), (192, 128, Arch.SM90)):
        assert not bm.BwdTileParams.from_backward_config(configs(d=d, dv=dv, arch=arch)[0]).ds_from_rounded_p
    gen = torch.Generator().manual_seed(1925)
    sq, sk, d, dv = 200, 260, 192, 128
    q, k = _rand(gen, sq, 1, d), _rand(gen, sk, d)
    v, dout = _rand(gen, sk, dv), _rand(gen, sq, 1, dv)
    kw = dict(softmax_scale=d ** -0.5, causal=True)
    out, lse = forward_outputs(q, k, v, configs(d=d, dv=dv, causal=True)[1], **kw)
    params = bm.BwdTileParams.from_backward_config(serial)
    got = [bm.backward(q, k, v, out, dout, lse, pr, **kw) for pr in (params, replace(params, ds_from_rounded_p=False))]
    assert not torch.equal(got[0].dk, got[1].dk) and not torch.equal(got[0].dq, got[1].dq)
    assert torch.equal(got[0].dv, got[1].dv)  # dV uses the rounded P either way


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cap", [1.0, 2.0, 30.0])
def test_serial_softcap_tanh_from_the_rounded_p_is_within_its_bound(dtype, cap):
    """bwd_serial.softcap_tanh (as modelled): t recovered from P rounded to 16 bits and the LSE is
    off by exactly ln(P16 / P) / cap (plus the float32 steps behind P and t), so P16 (1 - t^2) is
    within 2 P16 of that of P16 (1 - tanh^2); t is exactly -1 (factor 0) where P is 0, including a
    row whose LSE is +inf. Scores spread over the saturated range (|t| near 1), rows of different
    LSE, P down to the 16-bit subnormals."""
    gen = np.random.default_rng(int(cap * 10) + (dtype is torch.float16))
    rows, cols = 64, 256
    scale_log2 = tm.f32(tm.F32(cap) * tm.F64(tm.F32(tm.LOG2_E)))
    t = tm.f32(np.tanh(gen.normal(0.0, 2.0, (rows, cols))))
    x = t.astype(np.float64) * float(scale_log2)
    L2 = tm.f32(np.log2(np.exp2(x).sum(1, keepdims=True)) + gen.uniform(0.0, 3.0, (rows, 1)))
    arg = tm.fma_f32(t, scale_log2, -L2)
    prob = tm.exp2_mufu(arg)
    prob[:, :8] = 0.0  # masked
    L2[-1] = np.inf  # a row without keys: P = 0 throughout
    prob[-1] = 0.0
    p16 = tm.f32(tm._round_to(prob, dtype))
    got = bm.softcap_tanh(p16, L2, scale_log2)
    assert np.isfinite(got).all() and (got >= -1.0).all()
    assert (got[p16 == 0] == -1.0).all()
    live = p16 > 0
    # float32: the fma and exp2 behind P (relative to its argument), the add and multiply behind t
    slack = (np.abs(arg[live]) + 1.0) * 2.0 ** -21 / float(scale_log2) + 2.0 ** -22
    bound_t = np.abs(np.log(p16[live].astype(np.float64) / prob[live])) / cap + slack
    err_t = np.abs(got[live].astype(np.float64) - t[live])
    assert (err_t <= bound_t).all(), (err_t - bound_t).max()
    factor = lambda tt: p16[live].astype(np.float64) * (1.0 - tt.astype(np.float64) ** 2)  # noqa: E731
    # |(1 - a^2) - (1 - b^2)| = |a - b| |a + b|, |a + b| <= 2 + bound_t (t may overshoot 1 by it)
    assert (np.abs(factor(got[live]) - factor(t[live])) <= (2.0 + bound_t) * p16[live] * bound_t).all()
    assert err_t.max() > 0  # the rounding shows: the bound is not checked against nothing


@pytest.mark.parametrize("cap,q_scale", [(1.0, 3.0), (2.0, 3.0), (5.0, 3.0), (50.0, 1.0)])
def test_serial_softcap_error_against_the_float32_reference(cap, q_scale):
    """The serial kernel's softcap dS (t from the 16-bit P) against the float32 reference: within the
    GPU suite's rule (check_rule), also where saturating scores (q_scale 3) at caps 1 and 2 put most
    entries where 1 - t^2 is small and t's error, 1 / (P cap) of P's rounding, is large against it
    (the measured errors: docs/perf.md). Not bit-identical to the same tiles with t from S^T (the
    1-CTA kernel's algorithm): the recovered t is what the model runs."""
    gen = torch.Generator().manual_seed(int(cap * 100))
    sq, sk, d, dv = 200, 260, 192, 128
    q, k = _rand(gen, sq, 1, d, scale=q_scale), _rand(gen, sk, d, scale=q_scale)
    v, dout = _rand(gen, sk, dv), _rand(gen, sq, 1, dv)
    kw = dict(softmax_scale=d ** -0.5, causal=True, softcap=cap)
    cfg, fwd_cfg = configs(d=d, dv=dv, causal=True, softcap=cap, arch=Arch.SM100)
    out, lse = forward_outputs(q, k, v, fwd_cfg, **kw)
    serial = bm.BwdTileParams.from_backward_config(cfg)
    assert serial.ds_from_rounded_p
    got = bm.backward(q, k, v, out, dout, lse, serial, **kw)
    exact_t = bm.backward(q, k, v, out, dout, lse, replace(serial, ds_from_rounded_p=False), **kw)
    check_rule(got, q, k, v, dout, None, **kw)
    for name in ("dk", "dq"):
        assert not torch.equal(getattr(got, name), getattr(exact_t, name)), name


# (seqlen_q, seqlen_k) per sequence of a packed varlen batch run on CTA pairs (d = 128): an odd number
# of KV blocks, the last pair's odd block wholly past the keys (333 keys, 40); a last pair whose odd
# block holds keys (300); whole pairs, no row past the keys (256); a sequence without keys.
SM100_VARLEN_PAIRS = ((300, 333), (77, 40), (200, 300), (100, 256), (64, 0))


@pytest.mark.parametrize("flags", [dict(), dict(causal=True), dict(window=(60, 8)),
                                   dict(softcap=4.0, causal=True, deterministic=True)])
def test_sm100_varlen_pairs_zero_the_rows_past_the_keys(flags):
    """Varlen on CTA pairs (sm100/bwd_pair.py): each sequence runs as its own problem at its offsets,
    its pairs' tiles reading whole 256-row K/V tiles, whose rows past the keys are the next sequence's
    keys and, with seqused_k, an unused cache's rows (here NaN and Inf). With the kernel's zeroing
    (pair_zero_kv_tail) every gradient is within the GPU suite's rule against autograd and bit for bit
    what zeros past the keys (TMA's fill past a tensor's end) give, dK / dV the 1-CTA model's; without
    it, the NaN reaches dQ wherever a pair's tile holds rows past the keys that a query block's walk
    multiplies (not vacuous)."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr(flags).encode()))
    d, causal, window = 128, flags.get("causal", False), flags.get("window", (-1, -1))
    softcap = flags.get("softcap", 0.0)
    bwd_cfg, fwd_cfg = configs(d=d, causal=causal, local=window != (-1, -1), softcap=softcap, arch=Arch.SM100)
    pair = replace(bm.BwdTileParams.from_backward_config(bwd_cfg), cluster_m=2)
    single = replace(pair, cluster_m=1)
    kw = dict(softmax_scale=d ** -0.5, causal=causal, window=window, softcap=softcap)
    seqs = [(sq, _rand(gen, sq, 2, d), _rand(gen, sk, d), _rand(gen, sk, d), _rand(gen, sq, 2, d))
            for sq, sk in SM100_VARLEN_PAIRS]
    packed_k, packed_v = torch.cat([s[2] for s in seqs]), torch.cat([s[3] for s in seqs])
    garbage = torch.tensor([math.nan, math.inf, -math.inf]).to(torch.bfloat16)
    poisoned = 0
    for b, (sq, q, k, v, dout) in enumerate(seqs):
        sk = k.shape[0]
        start = sum(s[2].shape[0] for s in seqs[:b + 1])
        # What follows the keys in the packed tensors: the next sequences' keys, then cache rows holding NaN/Inf.
        tail = [torch.cat([x[start:start + 60], garbage.repeat(200)[:, None].expand(-1, d)])
                for x in (packed_k, packed_v)]
        if sk == 0:
            continue  # no pair runs (test_sm100_varlen_sequences_match_reference: dQ exactly 0)
        out, lse = forward_outputs(q, k, v, fwd_cfg, **kw)
        common = dict(deterministic=flags.get("deterministic", False), seed=b, **kw)
        zeroed = bm.backward(q, k, v, out, dout, lse, pair, kv_tail=tail, **common)
        check_rule(zeroed, q, k, v, dout, None, **kw)
        clean = bm.backward(q, k, v, out, dout, lse, pair, **common)
        for name in ("dq", "dk", "dv"):
            assert torch.equal(getattr(zeroed, name), getattr(clean, name)), (sq, sk, name)
        one = bm.backward(q, k, v, out, dout, lse, single, kv_tail=tail, **common)
        assert torch.equal(one.dk, zeroed.dk) and torch.equal(one.dv, zeroed.dv), (sq, sk)
        raw = bm.backward(q, k, v, out, dout, lse, pair, kv_tail=tail, zero_kv_tail=False, **common)
        if sk % (2 * pair.tile_n) and any(s for s in zeroed.stats.blocks if s[2] == sk // pair.tile_n):
            assert not torch.isfinite(raw.dq).all(), (sq, sk)
            poisoned += 1
    assert poisoned == 3
