"""The path a B200 user's backward takes through the torch layer, on the CPU: a faked sm_100 device,
compiling replaced by torch stand-ins with the kernels' call convention (tests/cpu/test_ops.py) that
record the configurations they are built for, and CPU tensors let through the device check
(tests/cpu/test_selfcheck.py's fake_gpu / fake_bwd).

What is checked: dispatch picks the sm_100a backward configuration (tiles and stages of
sm100/tiles.py); the dQ accumulator the torch layer allocates and reads back is sm100's (the
stand-in main kernel writes sm100/dq_accum.py's order, written out independently in test_ops.py, and
the torch reference of the postprocessing must read it back right); the postprocessing and the
preprocessing configurations are sm_100a's; the first-use self-check runs before the user's launch
and a wrong kernel is refused; head dims without a kernel of their own run zero-padded to the next
kernel's; and the configurations the torch layer asks for
compile for sm_100a. A B300 (sm_103a) takes the same path with the same kernels compiled for it:
the tests on the ``blackwell`` fixture run for both targets. What this does not show: that the kernel
is right on a B200 or B300 (no Blackwell GPU here; tests/gpu/test_bwd.py runs there, and the
self-check guards every user).
"""

from __future__ import annotations

import pytest
import torch

from flash_attn4 import compile_cache, ops, selfcheck
from flash_attn4.fa4_kernels.arch import Arch
from flash_attn4.fa4_kernels.config import BackwardConfig, PostprocessConfig, PreprocessConfig
from flash_attn4.fa4_kernels.sm100 import tiles as sm100_tiles
from tests.cpu.test_selfcheck import (BF16, dk_scaled, fake_bwd, fake_gpu, leaves, rand_qkv,  # noqa: F401
                                      seed)
from tests.reference import attention_ref


@pytest.fixture
def b200(fake_bwd, monkeypatch):
    """fake_bwd on sm_100a (not run by us: the check is required by default); ``configs`` lists
    every configuration a kernel was compiled for, in order."""
    fake_bwd.update(arch=Arch.SM100, configs=[])
    monkeypatch.setattr(selfcheck, "UNVERIFIED_ARCHS", frozenset({Arch.SM100, Arch.SM103}))
    for name in ("_compile_backward", "_compile_backward_preprocess", "_compile_backward_postprocess"):
        inner = getattr(compile_cache, name)

        def recording(cfg, _inner=inner, **kwargs):
            fake_bwd["configs"].append(cfg)
            return _inner(cfg, **kwargs)

        monkeypatch.setattr(compile_cache, name, recording)
    return fake_bwd


@pytest.fixture(params=[Arch.SM100, Arch.SM103], ids=lambda arch: arch.value)
def blackwell(b200, request):
    """b200, or the same on a B300 (sm_103a: the sm100 backward compiled for it)."""
    b200.update(arch=request.param)
    return b200


def grads_of(call, tensors, dout):
    out = call(*tensors)
    out.backward(dout)
    return [t.grad for t in tensors]


def reference_grads(q, k, v, dout, **kwargs):
    leaves_ = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out, _ = attention_ref(*leaves_, **kwargs)
    out.backward(dout.double())
    return [t.grad for t in leaves_]


def check_grads_with_dv(d, dv, sq, sk, **opts):
    """A (2, sq / sk, 4 / 2 heads) problem at head dims d / dv through flash_attn_func's forward and
    backward: the gradients (the user's shapes) match autograd of the reference."""
    q, k, _ = rand_qkv(b=2, sq=sq, sk=sk, hq=4, hk=2, d=d)
    v = torch.randn(2, sk, 2, dv, dtype=BF16)
    dout = torch.randn(2, sq, 4, dv, dtype=BF16)
    got = grads_of(lambda *t: ops_call(*t, **opts), leaves(q, k, v), dout)
    want = reference_grads(q, k, v, dout, **opts)
    for name, g, w in zip("qkv", got, want):
        assert g.shape == w.shape, name
        err = float((g.double() - w).abs().max())
        assert err <= 0.02 * float(w.abs().max()) + 1e-3, (name, err)


@pytest.mark.parametrize("d,causal,hq,hk", [(64, True, 4, 2), (128, False, 4, 1), (120, True, 2, 2), (56, False, 6, 2),
                                            (96, True, 4, 2), (88, False, 2, 1)])
@pytest.mark.parametrize("postprocess_kernel", [True, False])
def test_b200_backward_runs_the_sm100_configs_after_its_self_check(blackwell, monkeypatch, d, causal, hq, hk,
                                                                   postprocess_kernel):
    """A user's forward and backward: the self-check launch, then the user's; the configurations
    are the device's target's (sm_100a or sm_103a) with sm100's tiles; the gradients (the stand-in's
    float32 math, through sm100's dQ
    accumulator order and the torch layer's reading of it) match autograd of the reference."""
    monkeypatch.setattr(ops, "POSTPROCESS_KERNEL", postprocess_kernel)
    q, k, v = rand_qkv(b=2, sq=150, sk=140, hq=hq, hk=hk, d=d)
    dout = torch.randn(2, 150, hq, d, dtype=BF16)
    got = grads_of(lambda *t: ops_call(*t, causal=causal), leaves(q, k, v), dout)
    want = reference_grads(q, k, v, dout, causal=causal)
    for name, g, w in zip("qkv", got, want):
        err = float((g.double() - w).abs().max())
        assert err <= 0.02 * float(w.abs().max()) + 1e-3, (name, err)

    kernel_d = {64: 64, 128: 128, 120: 128, 56: 64, 96: 96, 88: 96}[d]  # the 1-CTA kernel's classes
    mains = [c for c in blackwell["configs"] if isinstance(c, BackwardConfig)]
    assert len(mains) == 1
    cfg = mains[0]
    assert (cfg.arch, cfg.head_dim, cfg.head_dim_v, cfg.causal) == (blackwell["arch"], kernel_d, kernel_d, causal)
    assert (cfg.tile_m, cfg.tile_n, cfg.num_stages) == (sm100_tiles.BWD_TILE_M, sm100_tiles.TILE_N,
                                                        sm100_tiles.backward_stages(kernel_d))
    assert not (cfg.varlen or cfg.local or cfg.has_softcap or cfg.deterministic or cfg.has_seqused_k)
    pre = [c for c in blackwell["configs"] if isinstance(c, PreprocessConfig)]
    post = [c for c in blackwell["configs"] if isinstance(c, PostprocessConfig)]
    assert [c.arch for c in pre] == [blackwell["arch"]] and pre[0].head_dim_v == kernel_d
    assert post == ([cfg.postprocess()] if postprocess_kernel else [])
    # the check's launch first, then the user's
    assert blackwell["bwd_calls"][1:] == [(2, 150, hq, kernel_d)] and len(blackwell["bwd_calls"]) == 2
    assert selfcheck.verdict(cfg, "cpu") == "passed"


@pytest.mark.parametrize("d,dv,causal", [(128, 64, True), (64, 128, False), (96, 128, True), (120, 56, False),
                                         (192, 128, True), (184, 120, False)])
def test_b200_backward_with_head_dim_v_unlike_head_dim(b200, d, dv, causal):
    """d != dv (each zero-padded to 64, 96 or 128, or as the pair 192 / 128 of the serial kernel)
    reaches the sm_100a backward with both head dims on its configuration (the
    preprocessing at dv, the postprocessing at d) and the gradients match autograd of the reference."""
    check_grads_with_dv(d, dv, 150, 140, causal=causal)
    pad = lambda x: {56: 64, 64: 64, 96: 96, 120: 128, 128: 128, 184: 192, 192: 192}[x]  # noqa: E731
    cfg = [c for c in b200["configs"] if isinstance(c, BackwardConfig)][0]
    assert (cfg.arch, cfg.head_dim, cfg.head_dim_v) == (Arch.SM100, pad(d), pad(dv))
    assert cfg.num_stages == sm100_tiles.backward_stages(pad(d), pad(dv))
    assert [c.head_dim_v for c in b200["configs"] if isinstance(c, PreprocessConfig)] == [pad(dv)]
    assert [c.head_dim for c in b200["configs"] if isinstance(c, PostprocessConfig)] == [pad(d)]
    assert selfcheck.verdict(cfg, "cpu") == "passed"


@pytest.mark.parametrize("d,dv,causal,window", [(192, 128, True, (-1, -1)), (184, 120, False, (40, 8))])
def test_b200_softcap_at_192_128_runs_the_serial_kernel(b200, d, dv, causal, window):
    """Softcap at head dims 192 / 128 (users' 177..192 / 113..128) reaches the serial kernel (its
    dS^T factor from the 16-bit P^T, bwd_serial.softcap_tanh), after its first-use self-check, and
    the gradients match autograd of the reference."""
    from flash_attn4.fa4_kernels.sm100 import bwd_pair, bwd_serial

    check_grads_with_dv(d, dv, 150, 140, causal=causal, window_size=window, softcap=4.0)
    cfg = [c for c in b200["configs"] if isinstance(c, BackwardConfig)][0]
    assert (cfg.arch, cfg.head_dim, cfg.head_dim_v, cfg.has_softcap, cfg.cluster_m) == (Arch.SM100, 192, 128, True, 1)
    assert type(bwd_pair.backward_kernel(cfg)) is bwd_serial.FlashAttentionBackwardSm100Serial
    assert selfcheck.verdict(cfg, "cpu") == "passed"


def ops_call(q, k, v, **kwargs):
    from flash_attn4 import flash_attn_func

    return flash_attn_func(q, k, v, **kwargs)


def test_dq_accum_is_allocated_in_sm100s_layout():
    """ops._dq_accum / _dq_accum_index through the registry's hook: sm100's blocked order, not sm90's."""
    from tests.cpu.test_ops import dq_accum_positions

    cfg = BackwardConfig(arch=Arch.SM100, dtype="bfloat16", head_dim=64, head_dim_v=64, tile_m=128, tile_n=128,
                         num_stages=2)
    q = torch.empty(2, 200, 3, 64)
    accum = ops._dq_accum(q, cfg, None)
    assert accum.shape == (2, 3, 2 * 128 * 64 // 128, 128) and not accum.any()
    assert torch.equal(ops._dq_accum_index(cfg, q, None), dq_accum_positions(cfg, q, None))
    sm90 = BackwardConfig(arch=Arch.SM90, dtype="bfloat16", head_dim=64, head_dim_v=64, tile_m=128, tile_n=128)
    assert not torch.equal(ops._dq_accum_index(sm90, q, None), ops._dq_accum_index(cfg, q, None))


def test_wrong_sm100_backward_is_refused_by_its_self_check(blackwell):
    blackwell["bwd_mutate"] = dk_scaled
    q, k, v = tensors = leaves(*rand_qkv(hq=4, hk=2, d=64))
    out = ops_call(q, k, v, causal=True)
    with pytest.raises(selfcheck.SelfCheckError, match=rf"BackwardConfig\(arch={blackwell['arch'].value}") as info:
        out.backward(torch.randn_like(out))
    assert "have not been run by the flash-attn4 developers" in str(info.value)
    assert all(t.grad is None for t in tensors) and len(blackwell["bwd_calls"]) == 1  # the check's launch only


def test_wrong_serial_backward_raises_without_a_fallback(b200):
    """The serial kernel (192 / 128) has no other kernel to fall back to (dispatch.self_check_fallback
    is None for it): a failed first-use check raises its SelfCheckError, and no gradient is returned."""
    from flash_attn4 import dispatch

    b200["bwd_mutate"] = dk_scaled
    q, k, v = rand_qkv(hq=4, hk=2, d=192)
    q, k, v = tensors = leaves(q, k, torch.randn(*v.shape[:-1], 128, dtype=BF16))
    out = ops_call(q, k, v, causal=True)
    with pytest.raises(selfcheck.SelfCheckError, match=r"BackwardConfig\(arch=sm_100a") as info:
        out.backward(torch.randn_like(out))
    cfg = [c for c in b200["configs"] if isinstance(c, BackwardConfig)][0]
    assert (cfg.head_dim, cfg.head_dim_v, cfg.cluster_m) == (192, 128, 1)
    assert dispatch.self_check_fallback(cfg) is None and "head_dim=192" in str(info.value)
    assert all(t.grad is None for t in tensors) and len(b200["bwd_calls"]) == 1  # the check's launch only


# Head dims with no kernel of their own: (user's head_dim, head_dim_v) -> the kernel's, zero-padded.
PADDED = {
    "32": ((32, 32), (64, 64)),
    "80": ((80, 80), (96, 96)),
    "72 / 112": ((72, 112), (96, 128)),
    "160": ((160, 160), (256, 256)),
    "192 / 192": ((192, 192), (256, 256)),
    "128 / 192": ((128, 192), (256, 256)),
    "224": ((224, 224), (256, 256)),
    "256 / 128": ((256, 128), (256, 256)),
}


@pytest.mark.parametrize("name", list(PADDED))
def test_head_dims_without_a_kernel_run_zero_padded_to_the_next_class(blackwell, name):
    """Every head dim the forward takes has a backward on sm_100a and sm_103a: dims without a kernel
    of their own reach the smallest kernel class holding both (the d = dv = 256 CTA pair above 128
    unless dv <= 128 and d <= 192), Q, K, V, O and dO zero-padded; the gradients, cut back to the
    user's dims, match autograd of the reference (the padded columns change nothing)."""
    (d, dv), (kernel_d, kernel_dv) = PADDED[name]
    check_grads_with_dv(d, dv, 37, 51, causal=True)
    cfg = [c for c in blackwell["configs"] if isinstance(c, BackwardConfig)][0]
    assert (cfg.arch, cfg.head_dim, cfg.head_dim_v) == (blackwell["arch"], kernel_d, kernel_dv)
    assert cfg.cluster_m == (2 if kernel_d == 256 else 1)
    assert [c.head_dim_v for c in blackwell["configs"] if isinstance(c, PreprocessConfig)] == [kernel_dv]
    assert blackwell["bwd_calls"][-1] == (2, 37, 4, kernel_d)
    assert selfcheck.verdict(cfg, "cpu") == "passed"


FEATURES = {
    "window": dict(window_size=(16, 3)),
    "causal window": dict(causal=True, window_size=(40, 0)),
    "softcap": dict(softcap=5.0),
    "causal softcap GQA 4": dict(causal=True, softcap=3.0, hq=4, hk=1),
    "varlen": dict(varlen=True),
    "varlen causal": dict(varlen=True, causal=True),
    "varlen seqused_k window softcap deterministic": dict(varlen=True, seqused_k=True, window_size=(20, 5),
                                                          softcap=4.0, deterministic=True),
}


def feature_call(opts, d=64):
    """A user's forward through the public function the options need, its leaves and dout, and the
    keyword arguments of the same problem for tests/reference.py's attention_ref."""
    from flash_attn4 import flash_attn_varlen_func

    opts = dict(opts)
    hq, hk = opts.pop("hq", 4), opts.pop("hk", 2)
    varlen, seqused = opts.pop("varlen", False), opts.pop("seqused_k", False)
    ref = {k: v for k, v in opts.items() if k in ("causal", "window_size", "softcap")}
    if varlen:
        # ragged: a sequence longer than a tile, one without queries, one with a single query
        cu_q = torch.tensor([0, 150, 150, 151, 230], dtype=torch.int32)
        cu_k = torch.tensor([0, 170, 210, 350, 390], dtype=torch.int32)
        q, k, v = leaves(torch.randn(230, hq, d, dtype=BF16), torch.randn(390, hk, d, dtype=BF16),
                         torch.randn(390, hk, d, dtype=BF16))
        extra = dict(seqused_k=torch.tensor([130, 0, 140, 9], dtype=torch.int32)) if seqused else {}
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_seqlen_q=150, max_seqlen_k=170, **extra, **opts)
        ref.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **extra)
    else:
        q, k, v = leaves(*rand_qkv(b=2, sq=150, sk=190, hq=hq, hk=hk, d=d))
        out = ops_call(q, k, v, **opts)
    return out, (q, k, v), torch.randn_like(out), ref


@pytest.mark.parametrize("name", list(FEATURES))
def test_b200_backward_with_windows_softcap_and_varlen_runs_sm100_configs(b200, name):
    """Local windows, softcap, varlen and seqused_k reach the sm_100a backward (flags set on its
    configuration, varlen postprocessing), after its first-use self-check, and the gradients (the
    stand-in's math through sm100's dQ accumulator order, packed by sequence for varlen) match
    autograd of the reference. Keys past seqused_k get zero gradients."""
    opts = FEATURES[name]
    out, tensors, dout, ref = feature_call(opts)
    out.backward(dout)
    want = reference_grads(*tensors, dout, **ref)
    for label, t, w in zip("qkv", tensors, want):
        assert torch.isfinite(t.grad).all(), label
        err = float((t.grad.double() - w).abs().max())
        assert err <= 0.02 * float(w.abs().max()) + 1e-3, (name, label, err)
    if opts.get("seqused_k"):
        assert (tensors[1].grad[170:210] == 0).all() and (tensors[2].grad[350 + 9:] == 0).all()
    cfg = [c for c in b200["configs"] if isinstance(c, BackwardConfig)][0]
    assert cfg.arch is Arch.SM100
    assert (cfg.varlen, cfg.has_seqused_k) == (opts.get("varlen", False), opts.get("seqused_k", False))
    assert cfg.local == ("window_size" in opts and not (opts.get("causal") and opts["window_size"][0] < 0))
    assert cfg.has_softcap == ("softcap" in opts) and cfg.deterministic == opts.get("deterministic", False)
    post = [c for c in b200["configs"] if isinstance(c, PostprocessConfig)]
    assert post == [cfg.postprocess()] and post[0].varlen == cfg.varlen
    checks = 2 if cfg.deterministic else 1
    assert len(b200["bwd_calls"]) == checks + 1 and b200["bwd_calls"][-1] == tuple(tensors[0].shape)
    assert selfcheck.verdict(cfg, "cpu") == "passed"


def test_b200_and_b300_backward_configs_compile_for_their_target(blackwell):
    """The configurations a B200 (B300) user's backward asks for (recorded from the torch layer, not
    written here) compile for sm_100a (sm_103a): main kernel, pre- and postprocessing."""
    from flash_attn4.fa4_kernels import compile as compile_mod

    q, k, v = leaves(*rand_qkv(hq=4, hk=2, d=64))
    out = ops_call(q, k, v, causal=True)
    out.backward(torch.randn_like(out))
    configs = list(dict.fromkeys(blackwell["configs"]))
    kinds = {type(c) for c in configs}
    assert kinds == {BackwardConfig, PreprocessConfig, PostprocessConfig}
    assert all(c.arch is blackwell["arch"] for c in configs)
    compilers = {BackwardConfig: compile_mod.compile_backward,
                 PreprocessConfig: compile_mod.compile_backward_preprocess,
                 PostprocessConfig: compile_mod.compile_backward_postprocess}
    for cfg in configs:
        assert compilers[type(cfg)](cfg, jit_engine=False) is not None, cfg


def test_deterministic_b200_backward_is_checked_twice_then_runs(b200):
    """deterministic=True reaches the sm_100a kernel (with its dQ semaphore); its self-check runs
    the backward twice and compares the runs bit for bit before the user's launch."""
    q, k, v = leaves(*rand_qkv(hq=4, hk=2, d=128))
    out = ops_call(q, k, v, causal=True, deterministic=True)
    out.backward(torch.randn_like(out))
    cfg = [c for c in b200["configs"] if isinstance(c, BackwardConfig)][0]
    assert cfg.arch is Arch.SM100 and cfg.deterministic
    assert len(b200["bwd_calls"]) == 3 and b200["bwd_calls"][2] == tuple(q.shape)
    assert selfcheck.verdict(cfg, "cpu") == "passed" and q.grad is not None


def test_run_dependent_sm100_dq_fails_the_deterministic_check(b200):
    from tests.cpu.test_selfcheck import run_dependent_dq

    b200["bwd_mutate"] = run_dependent_dq
    q, k, v = leaves(*rand_qkv(hq=4, hk=2, d=64))
    out = ops_call(q, k, v, deterministic=True)
    with pytest.raises(selfcheck.SelfCheckError, match="deterministic mode gave a different result"):
        out.backward(torch.randn_like(out))
    assert q.grad is None


# ---- CTA pairs (BackwardConfig.cluster_m = 2, sm100/bwd_pair.py) ------------------------------------

@pytest.fixture
def bwd_pairs_on(monkeypatch):
    """The sm100 rules with backward CTA pairs switched on (sm100/tiles.BWD_TWO_CTA), whatever the
    default."""
    from flash_attn4 import dispatch

    monkeypatch.setattr(sm100_tiles, "BWD_TWO_CTA", True)
    dispatch.backward_config.cache_clear()
    yield
    dispatch.backward_config.cache_clear()


def pair_flags(**flags):
    base = dict(causal=False, local=False, has_softcap=False, varlen=False, has_seqused_k=False, deterministic=False)
    return {**base, **flags}


def test_dispatch_runs_pairs_where_the_rule_says(bwd_pairs_on):
    """d = dv = 128 (users' 113..128), batched or varlen (causal, local, softcap, deterministic,
    seqused_k included): a pair of CTAs; every other problem class: the 1-CTA kernel with its own
    stages."""
    from flash_attn4 import dispatch

    for d in (128, 120):
        kernel_d = -(-d // 16) * 16
        cfg = dispatch.backward_config(Arch.SM100, "bfloat16", kernel_d, kernel_d, **pair_flags())
        assert (cfg.cluster_m, cfg.num_stages) == (2, 1)
    for flags in (dict(has_softcap=True), dict(causal=True), dict(local=True, has_softcap=True),
                  dict(causal=True, deterministic=True), dict(varlen=True), dict(varlen=True, deterministic=True),
                  dict(causal=True, varlen=True, has_seqused_k=True), dict(varlen=True, local=True, has_softcap=True)):
        cfg = dispatch.backward_config(Arch.SM100, "float16", 128, 128, **pair_flags(**flags))
        assert (cfg.cluster_m, cfg.num_stages, cfg.varlen) == (2, 1, flags.get("varlen", False)), flags
        single = dispatch.self_check_fallback(cfg)  # the 1-CTA kernel of the same class, its own stages
        assert single == cfg.replace(cluster_m=1, num_stages=sm100_tiles.backward_stages(128)), flags
    for d, dv, flags in ((64, 64, {}), (96, 96, {}), (128, 64, {}), (64, 64, dict(varlen=True)),
                         (96, 96, dict(varlen=True, has_seqused_k=True))):
        cfg = dispatch.backward_config(Arch.SM100, "bfloat16", d, dv, **pair_flags(**flags))
        assert cfg.cluster_m == 1 and cfg.num_stages == sm100_tiles.backward_stages(d, dv), (d, dv, flags)


def test_b200_backward_runs_the_pair_after_its_self_check(b200, bwd_pairs_on):
    """A user's d = 128 backward (GQA 4/2) reaches the pair configuration, checked before the user's
    launch, and its gradients match autograd of the reference."""
    q, k, v = rand_qkv(b=2, sq=150, sk=300, hq=4, hk=2, d=128)
    dout = torch.randn(2, 150, 4, 128, dtype=BF16)
    got = grads_of(lambda *t: ops_call(*t), leaves(q, k, v), dout)
    want = reference_grads(q, k, v, dout)
    for name, g, w in zip("qkv", got, want):
        assert float((g.double() - w).abs().max()) <= 0.02 * float(w.abs().max()) + 1e-3, name
    cfg = [c for c in b200["configs"] if isinstance(c, BackwardConfig)][0]
    assert cfg.cluster_m == 2 and selfcheck.verdict(cfg, "cpu") == "passed"
    assert len(b200["bwd_calls"]) == 2


def odd_cta_dk_unwritten(state):
    """A pair kernel whose odd CTA of the first pair leaves its keys' dK as the op poisoned them."""
    def mutate(q, k, v, dq_acc, dk, dv, call):
        if state["pair_running"]:
            dk[:, 128:256] = float("nan")
    return mutate


def test_pair_failing_its_check_falls_back_to_the_1cta_backward(b200, bwd_pairs_on, monkeypatch, caplog):
    """A backward pair that fails its first-use check is replaced, on that device, by the 1-CTA
    backward of the same problem class (dispatch.self_check_fallback), checked in turn: the user
    gets the 1-CTA kernel's (right) gradients and one warning line; later calls go straight to it."""
    from flash_attn4 import dispatch, settings
    from tests.cpu.test_selfcheck import FakeBackward

    b200["pair_running"] = False
    b200["bwd_mutate"] = odd_cta_dk_unwritten(b200)

    class PairAware(FakeBackward):
        def __call__(self, *args):
            b200["pair_running"] = self.cfg.cluster_m == 2
            return super().__call__(*args)

    monkeypatch.setattr(compile_cache, "_compile_backward", lambda cfg, **_: PairAware(cfg, b200))
    pair = dispatch.backward_config(Arch.SM100, "bfloat16", 128, 128, **pair_flags())
    single = dispatch.self_check_fallback(pair)
    assert pair.cluster_m == 2 and single.cluster_m == 1
    assert single.num_stages == sm100_tiles.backward_stages(128) and single.replace(cluster_m=2, num_stages=1) == pair
    q, k, v = rand_qkv(b=2, sq=150, sk=300, hq=4, hk=2, d=128)
    dout = torch.randn(2, 150, 4, 128, dtype=BF16)
    with caplog.at_level("WARNING", logger=settings.LOGGER_NAME):
        got = grads_of(lambda *t: ops_call(*t), leaves(q, k, v), dout)
        again = grads_of(lambda *t: ops_call(*t), leaves(q, k, v), dout)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "cluster_m=2" in warnings[0] and "cluster_m=1" in warnings[0], warnings
    assert selfcheck.verdict(pair, "cpu") == "failed" and selfcheck.verdict(single, "cpu") == "passed"
    # the pair's check, the 1-CTA kernel's check, then the two users' launches (1-CTA)
    check = selfcheck.build_backward_problem(pair).fwd.q.shape
    assert b200["bwd_calls"] == [tuple(check), tuple(check), tuple(q.shape), tuple(q.shape)]
    want = reference_grads(q, k, v, dout)
    for grads in (got, again):
        for name, g, w in zip("qkv", grads, want):
            assert float((g.double() - w).abs().max()) <= 0.02 * float(w.abs().max()) + 1e-3, name


def test_pair_fallback_that_fails_too_raises(b200, bwd_pairs_on):
    """No fallback hides a wrong kernel: with the 1-CTA backward wrong as well, the backward raises
    the 1-CTA configuration's SelfCheckError and returns no gradients."""
    b200["bwd_mutate"] = dk_scaled
    q, k, v = tensors = leaves(*rand_qkv(hq=4, hk=2, d=128))
    out = ops_call(q, k, v)
    with pytest.raises(selfcheck.SelfCheckError, match=r"cluster_m=1"):
        out.backward(torch.randn_like(out))
    assert all(t.grad is None for t in tensors)


def test_backward_pair_that_hangs_raises_without_falling_back(b200, bwd_pairs_on, monkeypatch):
    """A hang is not answered with the fallback (it would queue behind the hung kernel): it raises."""
    from flash_attn4 import dispatch

    q, k, v = leaves(*rand_qkv(hq=4, hk=2, d=128))
    out = ops_call(q, k, v)
    monkeypatch.setattr(selfcheck, "completion_probe", lambda device: (lambda: False))
    monkeypatch.setattr(selfcheck, "HANG_TIMEOUT_S", 0.05)
    with pytest.raises(selfcheck.SelfCheckError, match="did not finish") as info:
        out.backward(torch.randn_like(out))
    assert len(b200["bwd_calls"]) == 1  # the pair's check only: no 1-CTA launch
    pair = dispatch.backward_config(Arch.SM100, "bfloat16", 128, 128, **pair_flags())
    assert info.value.hung and pair.cluster_m == 2
    assert selfcheck.verdict(dispatch.self_check_fallback(pair), "cpu") is None


def odd_blocks_past_the_keys(cu_k, seqused_k, keys=sm100_tiles.TILE_N):
    """Per sequence of a varlen problem: the packed rows of the odd CTA's block of its last pair
    where the sequence has an odd number of KV blocks of ``keys`` keys (128; the d = 256 pair's 64)
    (that block lies wholly past its keys; its rows of the packed tensors are the next sequences')."""
    rows = []
    for b in range(cu_k.shape[0] - 1):
        sk = int(seqused_k[b]) if seqused_k is not None else int(cu_k[b + 1] - cu_k[b])
        blocks = -(-sk // keys)
        if blocks % 2:
            start = int(cu_k[b]) + blocks * keys
            rows.append(slice(start, start + keys))
    return rows


@pytest.mark.parametrize("name", ["varlen", "varlen causal", "varlen seqused_k window softcap deterministic"])
def test_b200_varlen_backward_runs_the_pair_after_a_varlen_self_check(b200, bwd_pairs_on, name):
    """A user's varlen backward at d = 128 reaches the pair configuration (varlen flags, varlen
    postprocessing), after a first-use check on a varlen problem whose sequences have odd numbers
    of KV blocks (the last pair's odd block past the keys, its packed rows another sequence's), and
    the gradients match autograd of the reference."""
    opts = FEATURES[name]
    out, tensors, dout, ref = feature_call(opts, d=128)
    out.backward(dout)
    want = reference_grads(*tensors, dout, **ref)
    for label, t, w in zip("qkv", tensors, want):
        err = float((t.grad.double() - w).abs().max())
        assert err <= 0.02 * float(w.abs().max()) + 1e-3, (name, label, err)
    cfg = [c for c in b200["configs"] if isinstance(c, BackwardConfig)][0]
    assert (cfg.cluster_m, cfg.varlen, cfg.has_seqused_k) == (2, True, opts.get("seqused_k", False))
    assert selfcheck.verdict(cfg, "cpu") == "passed"
    check = selfcheck.build_backward_problem(cfg).fwd
    assert check.varlen and odd_blocks_past_the_keys(check.cu_seqlens_k, check.seqused_k)
    assert any(-(-used // sm100_tiles.TILE_N) > 2 for _, _, used in check.lengths)  # a second pair


def test_varlen_pair_storing_past_its_keys_fails_the_check_and_falls_back(b200, bwd_pairs_on, monkeypatch, caplog):
    """A varlen pair kernel whose odd CTA stores its block's dK / dV rows although the block lies past
    its sequence's keys (zeros into the next sequences' rows) fails its first-use check; the 1-CTA
    varlen backward replaces it on the device and the user gets right gradients."""
    from flash_attn4 import dispatch, settings
    from tests.cpu.test_selfcheck import FakeBackward

    class OddCtaStoresPastItsKeys(FakeBackward):
        def __call__(self, q, k, v, dout, lse_log2, dpsum, dq_acc, dk, dv, cu_q, cu_k, seqused_k, *rest):
            super().__call__(q, k, v, dout, lse_log2, dpsum, dq_acc, dk, dv, cu_q, cu_k, seqused_k, *rest)
            if self.cfg.cluster_m == 2:
                for rows in odd_blocks_past_the_keys(cu_k, seqused_k):
                    dk[rows], dv[rows] = 0, 0

    monkeypatch.setattr(compile_cache, "_compile_backward", lambda cfg, **_: OddCtaStoresPastItsKeys(cfg, b200))
    out, tensors, dout, ref = feature_call(dict(varlen=True, causal=True), d=128)
    with caplog.at_level("WARNING", logger=settings.LOGGER_NAME):
        out.backward(dout)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "cluster_m=2" in warnings[0] and "cluster_m=1" in warnings[0], warnings
    pair = dispatch.backward_config(Arch.SM100, "bfloat16", 128, 128, **pair_flags(varlen=True, causal=True))
    single = dispatch.self_check_fallback(pair)
    assert (pair.cluster_m, single.cluster_m, single.varlen) == (2, 1, True)
    assert selfcheck.verdict(pair, "cpu") == "failed" and selfcheck.verdict(single, "cpu") == "passed"
    want = reference_grads(*tensors, dout, **ref)
    for label, t, w in zip("qkv", tensors, want):
        assert float((t.grad.double() - w).abs().max()) <= 0.02 * float(w.abs().max()) + 1e-3, label
