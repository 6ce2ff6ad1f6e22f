"""The first-use self-check (flash_attn4/selfcheck.py) on the CPU, with injected fake kernels.

The real kernels need a GPU; here the compile step yields a torch stand-in with the compiled kernel's
call convention (ForwardConfig's docstring) computing attention with tests/reference.py, and CPU
tensors are let through the device check, as in test_ops.py. A correct stand-in must pass the check;
stand-ins that are wrong in the ways kernels go wrong (one row off, one varlen sequence reading the
wrong keys, NaN or a finite LSE in rows that see no key, rows left unwritten, a feature ignored) must
make the first call raise, naming the configuration. What this does not show: that a real kernel
launched on a GPU is checked correctly (tests/gpu/test_selfcheck_gpu.py does that on the H200).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from flash_attn4 import compile_cache, device_info, dispatch, flash_attn_func, flash_attn_varlen_func, ops
from flash_attn4 import selfcheck, settings, validate
from flash_attn4.fa4_kernels.arch import Arch
from flash_attn4.fa4_kernels.config import ForwardConfig, SplitKVConfig
from tests.reference import attention_ref, attention_used_into, combine_ref, unpage

BF16 = torch.bfloat16


@pytest.fixture
def seed(monkeypatch):
    """Fresh inputs for the check's problem every run (the seed is printed for a rerun)."""
    s = int.from_bytes(os.urandom(4), "little")
    print(f"selfcheck seed={s}")
    monkeypatch.setattr(selfcheck, "SEED", s)
    torch.manual_seed(s)
    return s


def reference_into(cfg, q, k, v, out, lse, cu_q, cu_k, used, sink, scale, softcap, left, right, key_shift=None,
                   used_q=None):
    """The kernel's job done by tests/reference.py (key_shift: (sequence, shift) reads that varlen
    sequence's keys ``shift`` tokens off, a cu_seqlens_k offset bug; used_q: seqused_q, whose rows
    past it stay as they are)."""
    window = (left, right) if cfg.local else (-1, -1)
    kwargs = dict(softmax_scale=scale, causal=cfg.causal, window_size=window,
                  softcap=softcap if cfg.has_softcap else 0.0, learnable_sink=sink)
    if used_q is not None:
        attention_used_into(out, lse, q, k, v, seqused_q=used_q, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                            seqused_k=used, **kwargs)
        return
    o, l = attention_ref(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=used, **kwargs)
    if key_shift is not None:
        b, shift = key_shift
        q0, q1, k0 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]) + shift
        k1 = k0 + (int(used[b]) if used is not None else int(cu_k[b + 1] - cu_k[b]))
        ob, lb = attention_ref(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], **kwargs)
        o[q0:q1], l[:, q0:q1] = ob[0], lb[0]
    out.copy_(o)
    lse.copy_(l)


class FakeKernel:
    """compile_forward(cfg)'s stand-in; ``mutate(cfg, out, lse, args)`` makes it wrong. A split-KV
    stand-in computes the whole attention in split 0 and leaves the other splits empty (LSE -inf,
    partial O unwritten), a valid split of the keys that the merge must see through."""

    def __init__(self, cfg, calls, mutate=None):
        self.cfg, self.calls, self.mutate = cfg, calls, mutate

    def __call__(self, q, k, v, out, lse, cu_q, cu_k, used_q, used, page_table, sink, scale, softcap, left, right,
                 max_seqlen_q):
        cfg = self.cfg
        assert (used_q is not None) == cfg.has_seqused_q and (page_table is not None) == (cfg.page_size > 0)
        self.calls.append(tuple(q.shape))
        if page_table is not None:  # the pages' keys as the packed (or padded) batch they hold
            assert cu_k is None and k.shape[1] == cfg.page_size
            k, v, cu_k = unpage(k, v, page_table, used, batched=not cfg.varlen)
        if cfg.split_kv:
            assert out.dtype == torch.float32 and out.shape[0] == lse.shape[0] == selfcheck.SPLITS
            lse[1:] = float("-inf")
            out, lse = out[0], lse[0]
        # the call convention ops promises (ForwardConfig's docstring)
        assert isinstance(scale, float) and isinstance(softcap, float)
        assert all(type(x) is int for x in (left, right, max_seqlen_q))
        assert (cu_q is not None) == (cu_k is not None) == cfg.varlen
        assert (used is not None) == cfg.has_seqused_k and (sink is not None) == cfg.has_sink
        assert sink is None or sink.dtype == torch.float32
        assert out.is_contiguous() and lse.dtype == torch.float32 and q.dtype == torch.bfloat16
        assert q.shape[-2] // k.shape[-2] == cfg.query_heads_per_group or cfg.pack_gqa == 1
        args = (q, k, v, out, lse, cu_q, cu_k, used, sink, scale, softcap, left, right)
        if self.mutate is None:
            reference_into(cfg, *args, used_q=used_q)
        else:
            self.mutate(cfg, *args)


@pytest.fixture
def fake_gpu(monkeypatch, seed):
    """CPU tensors pass validation; the device is ``state["arch"]`` (sm_100a unless a test sets it);
    compiling yields a FakeKernel with ``state["mutate"]``. Returns the state, whose "calls" lists
    the q shape of every kernel call."""
    state = {"arch": Arch.SM100, "mutate": None, "calls": []}
    monkeypatch.setattr(validate, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(dispatch, "arch_for_device", lambda device, kernel="forward": state["arch"])
    monkeypatch.setattr(compile_cache, "_compile_forward",
                        lambda cfg, **_: FakeKernel(cfg, state["calls"], state["mutate"]))
    monkeypatch.setattr(compile_cache, "_compile_split_kv",
                        lambda cfg, **_: pipeline(cfg, FakeKernel(cfg.forward, state["calls"], state["mutate"])))
    monkeypatch.setenv("FLASH_ATTN4_DISABLE_DISK_CACHE", "1")
    monkeypatch.delenv(settings.SELF_CHECK, raising=False)
    compile_cache.clear()
    selfcheck.clear()
    yield state
    compile_cache.clear()
    selfcheck.clear()


def config(arch=Arch.SM100, d=128, dv=None, ratio=1, **flags):
    base = dict(causal=False, local=False, has_softcap=False, varlen=False, has_seqused_k=False, has_sink=False)
    base.update(flags)
    dv = d if dv is None else dv
    return dispatch.forward_config(arch, "bfloat16", d, dv, qhead_per_kvhead=ratio, **base)


def rand_qkv(b=2, sq=37, sk=51, hq=4, hk=2, d=128):
    return (torch.randn(b, sq, hq, d, dtype=BF16), torch.randn(b, sk, hk, d, dtype=BF16),
            torch.randn(b, sk, hk, d, dtype=BF16))


def problem_shape(cfg):
    return tuple(selfcheck.build_forward_problem(cfg).q.shape)


# ---- a correct kernel ----


def test_correct_kernel_is_checked_once_then_cached(fake_gpu):
    q, k, v = rand_qkv()
    cfg = config(causal=True, ratio=2)
    outs = [flash_attn_func(q, k, v, causal=True, return_lse=True) for _ in range(2)]
    # one check launch, before the first user launch, then the two user launches
    assert fake_gpu["calls"] == [problem_shape(cfg), tuple(q.shape), tuple(q.shape)]
    assert selfcheck.verdict(cfg, "cpu") == "passed"
    report = selfcheck.report(cfg, "cpu")
    assert report.ok and report.out_err <= report.out_allowed and report.lse_err <= report.lse_allowed
    ref, ref_lse = attention_ref(q, k, v, causal=True)
    for out, lse in outs:
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(lse, ref_lse)


def test_each_configuration_is_checked_on_its_first_use(fake_gpu):
    q, k, v = rand_qkv()
    flash_attn_func(q, k, v)
    flash_attn_func(q, k, v, causal=True)
    flash_attn_func(q, k, v)
    flash_attn_func(q, k, v, causal=True)
    plain, causal = config(ratio=2), config(ratio=2, causal=True)
    user = tuple(q.shape)
    assert fake_gpu["calls"] == [problem_shape(plain), user, problem_shape(causal), user, user, user]
    assert selfcheck.verdict(plain, "cpu") == selfcheck.verdict(causal, "cpu") == "passed"


def test_varlen_with_every_feature_passes(fake_gpu):
    hq, hk, d = 8, 2, 64
    cu_q = torch.tensor([0, 5, 5, 40], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 30, 61], dtype=torch.int32)
    q, k, v = torch.randn(40, hq, d, dtype=BF16), torch.randn(61, hk, d, dtype=BF16), torch.randn(61, hk, d, dtype=BF16)
    used = torch.tensor([9, 0, 17], dtype=torch.int32)
    sink = torch.randn(hq)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, seqused_k=used, window_size=(7, 3), softcap=5.0,
                                 learnable_sink=sink)
    cfg = config(d=d, ratio=4, local=True, varlen=True, has_seqused_k=True, has_softcap=True, has_sink=True)
    assert cfg.pack_gqa == 4
    assert fake_gpu["calls"] == [problem_shape(cfg), tuple(q.shape)]
    assert selfcheck.verdict(cfg, "cpu") == "passed"
    ref, _ = attention_ref(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=used, window_size=(7, 3),
                           softcap=5.0, learnable_sink=sink)
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("d,dv,ratio,flags", [
    (64, 64, 1, dict()), (128, 128, 4, dict(causal=True)), (192, 128, 8, dict(local=True)),
    (256, 256, 16, dict(has_softcap=True, has_sink=True)), (128, 128, 1, dict(varlen=True)),
    (64, 64, 2, dict(varlen=True, has_seqused_k=True, causal=True)),
    (256, 256, 4, dict(varlen=True, local=True, has_seqused_k=True, has_sink=True, has_softcap=True)),
    (96, 96, 6, dict(has_seqused_k=True, local=True)),
    (128, 128, 1, dict(has_seqused_q=True, causal=True)),
    (128, 128, 4, dict(varlen=True, has_seqused_q=True, has_seqused_k=True, local=True)),
    (128, 128, 4, dict(split_kv=True)), (64, 64, 1, dict(split_kv=True, varlen=True, has_seqused_k=True, causal=True)),
    (256, 256, 2, dict(split_kv=True, has_seqused_q=True, has_softcap=True)),
    (128, 128, 4, dict(varlen=True, has_seqused_k=True, page_size=16, causal=True)),
    (64, 64, 1, dict(varlen=True, has_seqused_k=True, page_size=256, split_kv=True, has_seqused_q=True)),
    (128, 128, 4, dict(has_seqused_k=True, page_size=64, causal=True)),
    (64, 64, 2, dict(has_seqused_k=True, page_size=16, split_kv=True))])
def test_correct_kernel_passes_every_configuration(seed, d, dv, ratio, flags):
    """check_forward directly: the correct stand-in passes for every feature combination, so the
    check's reference and tolerances agree with tests/reference.py."""
    cfg = config(d=d, dv=dv, ratio=ratio, **flags)
    calls = []
    report = selfcheck.check_forward(cfg, FakeKernel(cfg, calls), ops._launch_forward, torch.device("cpu"))
    assert report.ok, report.failures
    assert calls == [problem_shape(cfg)]
    assert 0 < report.out_err <= report.out_allowed and report.lse_err <= report.lse_allowed


# ---- wrong kernels ----


def off_in_one_row(amount):
    def mutate(cfg, q, k, v, out, lse, *rest):
        reference_into(cfg, q, k, v, out, lse, *rest)
        rows = torch.isfinite(lse).transpose(-1, -2)  # (.., s, h) for batched (b, h, s), varlen (h, t)
        last = rows.nonzero()[-1].tolist()  # the last (row, head) that sees a key
        out[tuple(last)][0] += amount

    return mutate


def second_sequence_reads_keys_one_early(cfg, q, k, v, out, lse, cu_q, cu_k, *rest):
    reference_into(cfg, q, k, v, out, lse, cu_q, cu_k, *rest, key_shift=(3, -1))


def nan_where_no_key(cfg, q, k, v, out, lse, *rest):
    reference_into(cfg, q, k, v, out, lse, *rest)
    out[torch.isneginf(lse).transpose(-1, -2)] = float("nan")  # the check's problem has such rows


def finite_lse_where_no_key(cfg, q, k, v, out, lse, *rest):
    reference_into(cfg, q, k, v, out, lse, *rest)
    lse[torch.isneginf(lse)] = 0.0


def lse_without_sink(cfg, q, k, v, out, lse, cu_q, cu_k, used, sink, *rest):
    reference_into(cfg, q, k, v, out, lse, cu_q, cu_k, used, sink, *rest)
    no_sink = torch.empty_like(lse)
    reference_into(cfg, q, k, v, out.clone(), no_sink, cu_q, cu_k, used, None, *rest)
    lse.copy_(no_sink)


def last_tile_unwritten(cfg, q, k, v, out, lse, *rest):
    """Rows from 256 on of each batch element left as they were (a missing partial tile)."""
    full_o, full_l = torch.empty_like(out), torch.empty_like(lse)
    reference_into(cfg, q, k, v, full_o, full_l, *rest)
    out[:, :256].copy_(full_o[:, :256])
    lse[..., :256].copy_(full_l[..., :256])


def softcap_ignored(cfg, q, k, v, out, lse, cu_q, cu_k, used, sink, scale, softcap, left, right):
    reference_into(cfg, q, k, v, out, lse, cu_q, cu_k, used, sink, scale, 0.0, left, right)


def window_right_ignored(cfg, q, k, v, out, lse, cu_q, cu_k, used, sink, scale, softcap, left, right):
    reference_into(cfg, q, k, v, out, lse, cu_q, cu_k, used, sink, scale, softcap, left, -1)


def seqused_ignored(cfg, q, k, v, out, lse, cu_q, cu_k, used, *rest):
    reference_into(cfg, q, k, v, out, lse, cu_q, cu_k, None, *rest)


def kv_head_modulo(cfg, q, k, v, out, lse, *rest):
    """Query head h reads KV head h % hk instead of h // (hq // hk)."""
    hq, hk = q.shape[-2], k.shape[-2]
    order = torch.arange(hq) % hk
    perm = torch.argsort(order, stable=True)  # query heads grouped by the KV head they wrongly read
    inverse = torch.argsort(perm)
    o, l = torch.empty_like(out), torch.empty_like(lse)
    reference_into(cfg, q[..., perm, :], k, v, o, l, *rest)
    out.copy_(o[..., inverse, :])
    lse.copy_(l[..., inverse, :] if l.dim() == 3 else l[inverse])


WRONG = {
    "one row off by 0.2": (off_in_one_row(0.2), dict(causal=True)),
    "varlen: the last sequence reads its keys one token early":
        (second_sequence_reads_keys_one_early, dict(varlen=True, causal=True)),
    "NaN in rows that see no key": (nan_where_no_key, dict(causal=True)),
    "NaN in rows past seqused_k = 0": (nan_where_no_key, dict(varlen=True, has_seqused_k=True)),
    "finite lse in rows that see no key": (finite_lse_where_no_key, dict(local=True, varlen=True)),
    "sink left out of lse": (lse_without_sink, dict(has_sink=True)),
    "last partial tile unwritten": (last_tile_unwritten, dict()),
    "softcap ignored": (softcap_ignored, dict(has_softcap=True)),
    "window_right ignored": (window_right_ignored, dict(local=True)),
    "seqused_k ignored": (seqused_ignored, dict(varlen=True, has_seqused_k=True)),
    "GQA: wrong KV head": (kv_head_modulo, dict(pack_ratio=4)),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_wrong_kernel_raises_naming_the_configuration(fake_gpu, name):
    mutate, flags = WRONG[name]
    flags = dict(flags)
    ratio = flags.pop("pack_ratio", 2)
    fake_gpu["mutate"] = mutate
    cfg = config(ratio=ratio, **flags)
    varlen = cfg.varlen
    hq, hk, d = 2 * ratio, 2, 128
    if varlen:
        cu = torch.tensor([0, 20, 45], dtype=torch.int32)
        q, k, v = (torch.randn(45, h, d, dtype=BF16) for h in (hq, hk, hk))
        used = torch.tensor([20, 25], dtype=torch.int32) if cfg.has_seqused_k else None
        call = lambda: flash_attn_varlen_func(q, k, v, cu, cu, seqused_k=used, causal=cfg.causal,  # noqa: E731
                                              window_size=(9, 4) if cfg.local else (-1, -1))
    else:
        q, k, v = rand_qkv(hq=hq, hk=hk, d=d)
        sink = torch.randn(hq) if cfg.has_sink else None
        window = (9, 4) if cfg.local else (-1, -1)
        call = lambda: flash_attn_func(q, k, v, causal=cfg.causal, window_size=window,  # noqa: E731
                                       softcap=2.0 if cfg.has_softcap else 0.0, learnable_sink=sink)
    # A CTA pair (the rules' pick where they run pairs) falls back to single CTAs, wrong here too:
    # the error names the configuration that failed last.
    fallback = dispatch.self_check_fallback(cfg)
    named = cfg if fallback is None else fallback
    with pytest.raises(selfcheck.SelfCheckError) as info:
        call()
    message = str(info.value)
    assert "self-check FAILED" in message and "not used" in message
    assert f"ForwardConfig({', '.join(named.key()[1:])})" in message  # every field of the configuration
    assert "arch=sm_100a" in message and f"pack_gqa={ratio}" in message
    assert "on cpu" in message  # the device (a GPU's name and capability on a GPU)
    assert selfcheck.ISSUE_TRACKER in message and "FLASH_ATTN4_SELF_CHECK=0" in message
    assert "error: " in message and "measured: out max|out - ref|" in message
    assert f"seed {selfcheck.SEED}" in message
    # the check ran (the pair's, then its fallback's); the caller's launch never happened
    assert fake_gpu["calls"] == [problem_shape(c) for c in dict.fromkeys((cfg, named))]
    assert selfcheck.verdict(cfg, "cpu") == selfcheck.verdict(named, "cpu") == "failed"


@pytest.fixture
def pairs_on(monkeypatch):
    """The sm100 rules with CTA pairs switched on (sm100/tiles.TWO_CTA), whatever the default."""
    from flash_attn4.fa4_kernels.sm100 import tiles as sm100_tiles
    monkeypatch.setattr(sm100_tiles, "TWO_CTA", True)
    dispatch.forward_config.cache_clear()
    yield
    dispatch.forward_config.cache_clear()


def odd_cta_unwritten(cfg, q, k, v, out, lse, *rest):
    """A CTA-pair kernel (cluster_m = 2) whose odd CTA writes nothing: rows 256-511 of every pair
    tile keep what the outputs held (the check's NaN); single-CTA kernels are right."""
    reference_into(cfg, q, k, v, out, lse, *rest)
    if cfg.cluster_m == 2:
        out[:, 256:512] = float("nan")
        lse[..., 256:512] = float("inf")


def test_pair_failing_its_check_falls_back_to_single_ctas(fake_gpu, pairs_on, caplog):
    """A pair configuration that fails its first-use check is replaced, on that device, by the same
    problem class on single CTAs (dispatch.self_check_fallback), which is checked in turn: the
    caller gets the single-CTA kernel's (right) result and one warning line, later calls go
    straight to the single-CTA kernel, and the pair's failure is on record."""
    fake_gpu["mutate"] = odd_cta_unwritten
    pair = config(ratio=2)
    single = pair.replace(cluster_m=1)
    assert pair.cluster_m == 2 and dispatch.self_check_fallback(pair) == single
    q, k, v = rand_qkv()
    with caplog.at_level("WARNING", logger=settings.LOGGER_NAME):
        outs = [flash_attn_func(q, k, v, return_lse=True) for _ in range(2)]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert "cluster_m=2" in warnings[0] and "cluster_m=1" in warnings[0] and selfcheck.ISSUE_TRACKER in warnings[0]
    # the pair's check, the single-CTA kernel's check, then the two calls (single CTAs)
    assert fake_gpu["calls"] == [problem_shape(pair), problem_shape(single), tuple(q.shape), tuple(q.shape)]
    assert selfcheck.verdict(pair, "cpu") == "failed" and selfcheck.verdict(single, "cpu") == "passed"
    ref, ref_lse = attention_ref(q, k, v)
    for out, lse in outs:
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(lse, ref_lse)
    compile_cache.clear()  # the launch plans keep their kernel: forget them, and
    selfcheck.clear()  # the fallback: the pair is checked (and replaced) again
    flash_attn_func(q, k, v)
    assert selfcheck.verdict(pair, "cpu") == "failed"


def test_pair_fallback_that_fails_too_raises(fake_gpu, pairs_on):
    """No fallback hides a wrong kernel: with the single-CTA kernel wrong as well, the call raises
    the single-CTA configuration's SelfCheckError."""
    fake_gpu["mutate"] = last_tile_unwritten
    q, k, v = rand_qkv(sq=300)
    with pytest.raises(selfcheck.SelfCheckError) as info:
        flash_attn_func(q, k, v)
    assert "cluster_m=1" in str(info.value)
    assert selfcheck.verdict(config(ratio=2), "cpu") == "failed"


def dummy_rows_stored(cfg, q, k, v, out, lse, *rest):
    """A kernel packing padded GQA groups that stores its dummy rows: each KV head's first real
    query head but the first KV head's gets the previous group's dummy row (garbage, here 0)."""
    reference_into(cfg, q, k, v, out, lse, *rest)
    if cfg.pack_gqa_heads:
        ratio = cfg.pack_gqa_heads
        out[..., ratio::ratio, :] = 0.0
        lse[..., ratio::ratio, :] = 0.0


def test_padded_groups_failing_their_check_fall_back_to_the_heads_unpacked(fake_gpu, caplog):
    """Decode with a head ratio packed in padded groups (7 in 8 rows) whose kernel writes its dummy
    rows fails its check and is replaced by the same heads unpacked on single CTAs, checked in turn:
    the caller gets the right result and one warning line."""
    fake_gpu["mutate"] = dummy_rows_stored
    q, k, v = rand_qkv(b=2, sq=1, sk=51, hq=14, hk=2)
    padded = dispatch.forward_config(Arch.SM100, "bfloat16", 128, 128, causal=True, local=False, has_softcap=False,
                                     varlen=False, has_seqused_k=False, has_sink=False, qhead_per_kvhead=7,
                                     pack_group=8)
    unpacked = config(ratio=7, causal=True)
    assert (padded.pack_gqa, padded.pack_gqa_heads) == (8, 7) and unpacked.pack_gqa == 1
    assert dispatch.self_check_fallback(padded) == unpacked.replace(cluster_m=1)
    with caplog.at_level("WARNING", logger=settings.LOGGER_NAME):
        out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "pack_gqa_heads=7" in warnings[0], warnings
    assert selfcheck.verdict(padded, "cpu") == "failed" and selfcheck.verdict(unpacked, "cpu") == "passed"
    ref, ref_lse = attention_ref(q, k, v, causal=True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)


def test_failing_configuration_without_fallback_still_raises():
    """Only pairs and padded GQA groups have a fallback: every other configuration's failure raises
    (the policy above)."""
    assert dispatch.self_check_fallback(config().replace(cluster_m=1)) is None
    assert dispatch.self_check_fallback(config(causal=True)) is None
    assert config(causal=True).cluster_m == 1


def seqused_q_ignored(cfg, q, k, v, out, lse, *rest):
    """Every stored query row attends (the causal diagonal then sits seqused_q rows off)."""
    reference_into(cfg, q, k, v, out, lse, *rest)


def split_kernel(cfg, how):
    """A split-KV stand-in that is wrong: "duplicate" (split 1 repeats split 0's keys) or
    "unwritten" (split 1 claims keys but writes nothing)."""
    def run(q, k, v, out, lse, cu_q, cu_k, used_q, used, page_table, sink, scale, softcap, left, right, max_seqlen_q):
        reference_into(cfg, q, k, v, out[0], lse[0], cu_q, cu_k, used, sink, scale, softcap, left, right,
                       used_q=used_q)
        lse[2:] = float("-inf")
        if how == "duplicate":
            out[1].copy_(out[0])
            lse[1].copy_(lse[0])
    return run


def pipeline(cfg: SplitKVConfig, split, drop_sink: bool = False):
    """A split-KV pipeline (fa4_kernels/split_kv.py's call convention) of the stand-in ``split``
    kernel and the reference combine; ``drop_sink``: a wrong combine that leaves the sink out."""
    from tests.cpu.test_splitkv_cpu import combine_stand_in, pipeline_stand_in

    def no_sink(out_p, lse_p, out, lse, sink):
        o, l = combine_ref(out_p, lse_p)
        out.copy_(o.to(out.dtype))
        lse.copy_(l)
    return pipeline_stand_in(cfg, split, no_sink if drop_sink else combine_stand_in(cfg.combine, []))


def split_kv_config(has_sink: bool, arch=Arch.SM100, d=128, **flags) -> SplitKVConfig:
    """dispatch's split-KV pipeline for ``config``'s problem class (its split kernel and combine)."""
    base = dict(causal=False, local=False, has_softcap=False, varlen=False, has_seqused_k=False)
    return dispatch.split_kv_config(arch, "bfloat16", d, d, has_sink=has_sink, **dict(base, **flags))


@pytest.mark.parametrize("varlen", [True, False])
def test_split_kv_pipeline_is_checked_on_its_combined_output(seed, varlen):
    """The pipeline splits the check's keys SPLITS ways into a workspace and its own combine writes
    out and lse, with the sink the combine adds: a correct one passes, one whose combine drops the
    sink fails on both out and lse."""
    cfg = split_kv_config(True, causal=True, varlen=varlen, has_seqused_k=varlen)
    calls = []
    report = selfcheck.check_forward(cfg, pipeline(cfg, FakeKernel(cfg.forward, calls)), ops._launch_forward,
                                     torch.device("cpu"))
    assert report.ok, report.failures
    assert calls and f"{selfcheck.SPLITS} KV splits" in report.problem and "learnable sink" in report.problem
    report = selfcheck.check_forward(cfg, pipeline(cfg, FakeKernel(cfg.forward, []), drop_sink=True),
                                     ops._launch_forward, torch.device("cpu"))
    assert not report.ok and report.out_err > report.out_allowed and report.lse_err > report.lse_allowed


def test_split_kv_pipeline_that_leaves_a_split_unwritten_fails(seed):
    """Split 1 claims keys (its LSE finite) but its partial output stays as the workspace was: NaN."""
    cfg = split_kv_config(False, causal=True, varlen=True, has_seqused_k=True)

    def split(q, k, v, out, lse, *rest):
        split_kernel(cfg.forward, "unwritten")(q, k, v, out, lse, *rest)
        lse[1] = lse[0]
    report = selfcheck.check_forward(cfg, pipeline(cfg, split), ops._launch_forward, torch.device("cpu"))
    assert not report.ok and any("NaN or infinite" in f for f in report.failures), report.failures


def test_split_kv_call_checks_its_pipeline_first(fake_gpu, monkeypatch):
    """A split-KV call is one launch of the pipeline, with its workspace, after the pipeline's own
    check (also one launch); the pipeline's verdict is kept under its SplitKVConfig."""
    launched = []
    real = ops._launch

    def spy(kernel, q, k, v, out, lse, *args):
        launched.append((tuple(q.shape), tuple(args[-1].shape)))
        return real(kernel, q, k, v, out, lse, *args)

    monkeypatch.setattr(ops, "_launch", spy)
    q, k, v = rand_qkv(sq=1, sk=700, hq=4, hk=1)
    out = flash_attn_func(q, k, v, num_splits=3)
    ref, _ = attention_ref(q, k, v)
    assert (out.float() - ref.float()).abs().max() < 2e-2
    forward = dispatch.forward_config(Arch.SM100, "bfloat16", 128, 128, causal=False, local=False, has_softcap=False,
                                      varlen=False, has_seqused_k=False, has_sink=False, qhead_per_kvhead=4,
                                      split_kv=True)
    cfg = dispatch.split_kv_config(Arch.SM100, "bfloat16", 128, 128, causal=False, local=False, has_softcap=False,
                                   varlen=False, has_seqused_k=False, has_sink=False, qhead_per_kvhead=4)
    assert cfg.forward == forward and selfcheck.verdict(cfg, "cpu") == "passed"
    check_rows = math.prod(selfcheck.build_forward_problem(cfg).output_shapes()[0][:-1])
    assert launched[0] == (problem_shape(cfg), cfg.workspace_shape(selfcheck.SPLITS, check_rows))
    # the call's workspace: 3 splits, rows with room past the partials (ops puts the dropped LSE there)
    assert len(launched) == 2 and launched[1][0] == tuple(q.shape) and launched[1][1][0] == 3
    assert launched[1][1][1] >= cfg.workspace_shape(3, 2 * 1 * 4)[1]


@pytest.mark.parametrize("flags", [dict(has_seqused_q=True, causal=True),
                                   dict(varlen=True, has_seqused_q=True, has_seqused_k=True, causal=True)])
def test_seqused_q_ignored_fails(seed, flags):
    cfg = config(**flags)
    report = selfcheck.check_forward(cfg, FakeKernel(cfg, [], seqused_q_ignored), ops._launch_forward,
                                     torch.device("cpu"))
    assert not report.ok and report.out_err > report.out_allowed
    assert "seqused_q" in report.problem


@pytest.mark.parametrize("how,failure", [("duplicate", "lse: max|lse - ref|"), ("unwritten", "NaN or +inf")])
def test_wrong_split_kv_partials_fail(seed, how, failure):
    cfg = config(split_kv=True, causal=True, varlen=True, has_seqused_k=True)
    report = selfcheck.check_forward(cfg, split_kernel(cfg, how), ops._launch_forward, torch.device("cpu"))
    assert not report.ok and any(failure in f for f in report.failures), report.failures
    assert f"{selfcheck.SPLITS} KV splits" in report.problem


def pages_misread(cfg, q, k, v, out, lse, cu_q, cu_k, used, *rest):
    """Reads the pool as if the pages were in table order 0, 1, 2, ... (the page table ignored)."""
    keys = [k.flatten(0, 1)[:int(n)] for n in used]
    vals = [v.flatten(0, 1)[:int(n)] for n in used]
    cu = torch.tensor([0] + [int(n) for n in used], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    reference_into(cfg, q, torch.cat(keys), torch.cat(vals), out, lse, cu_q, cu, used, *rest)


def test_paged_kernel_that_ignores_the_page_table_fails(seed):
    cfg = config(varlen=True, has_seqused_k=True, page_size=64)

    def run(q, k, v, out, lse, cu_q, cu_k, used_q, used, page_table, *rest):
        pages_misread(cfg, q, k, v, out, lse, cu_q, cu_k, used, *rest[:-1])
    report = selfcheck.check_forward(cfg, run, ops._launch_forward, torch.device("cpu"))
    assert not report.ok and report.out_err > report.out_allowed
    assert "paged:" in report.problem and "shuffled" in report.problem


@pytest.mark.parametrize("varlen", [True, False])
def test_paged_problem_holds_the_reference_keys(seed, varlen):
    """The check's pages, read through its table, are exactly the keys the reference uses (packed
    varlen sequences, or batch entries)."""
    p = selfcheck.build_forward_problem(config(varlen=varlen, has_seqused_k=True, page_size=16))
    k, v, cu = unpage(p.k_pages, p.v_pages, p.page_table, p.seqused_k)
    assert p.seqused_k.tolist() == [used for _, _, used in p.lengths] and max(p.seqused_k) > 16
    for b, (_, _, used) in enumerate(p.lengths):
        start = int(p.cu_seqlens_k[b]) if varlen else 0
        stored_k, stored_v = (p.k[start:], p.v[start:]) if varlen else (p.k[b], p.v[b])
        assert torch.equal(k[int(cu[b]):int(cu[b + 1])], stored_k[:used])
        assert torch.equal(v[int(cu[b]):int(cu[b + 1])], stored_v[:used])
    assert len(set(p.page_table[0, :-(-p.lengths[0][1] // 16)].tolist())) == -(-p.lengths[0][1] // 16)


def test_merge_partials_matches_the_whole_attention(seed):
    """Three splits of one sequence's keys (one of them empty for the early causal rows), merged,
    give the attention over all keys; an empty split's partial O is never read."""
    from tests.reference import partial_attention_ref
    sq, sk, hq, hk, d = 9, 20, 4, 2, 32
    q, k, v = torch.randn(sq, hq, d), torch.randn(sk, hk, d), torch.randn(sk, hk, d)
    shares = [torch.arange(sk) < 7, (torch.arange(sk) >= 7) & (torch.arange(sk) < 14), torch.arange(sk) >= 14]
    parts = [partial_attention_ref(q, k, v, keys, causal=True) for keys in shares]
    out_p = torch.stack([o for o, _ in parts])[:, None]  # (splits, 1, sq, hq, d)
    lse_p = torch.stack([l for _, l in parts])[:, None]  # (splits, 1, hq, sq)
    out_p[torch.isneginf(lse_p).transpose(-1, -2)[..., None].expand_as(out_p)] = float("nan")
    out, lse = selfcheck.merge_partials(out_p, lse_p)
    ref, ref_lse = attention_ref(q[None].float(), k[None].float(), v[None].float(), causal=True)
    torch.testing.assert_close(out.float(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.float(), ref_lse, atol=1e-5, rtol=1e-5)


def test_seqused_q_configuration_is_checked_on_first_use(fake_gpu):
    cu = torch.tensor([0, 20, 45], dtype=torch.int32)
    q, k, v = (torch.randn(45, h, 64, dtype=BF16) for h in (4, 2, 2))
    used_q = torch.tensor([20, 3], dtype=torch.int32)
    out = flash_attn_varlen_func(q, k, v, cu, cu, seqused_q=used_q, causal=True)
    cfg = config(d=64, ratio=2, varlen=True, has_seqused_q=True, causal=True)
    assert fake_gpu["calls"] == [problem_shape(cfg), tuple(q.shape)]
    assert selfcheck.verdict(cfg, "cpu") == "passed"
    ref, _ = attention_ref(q[None, 20:23], k[None, 20:45], v[None, 20:45], causal=True)
    torch.testing.assert_close(out[20:23], ref[0])


def test_small_perturbation_within_the_rule_passes(fake_gpu):
    """The other side of 'one row off': an error well inside the FA rule is not a failure."""
    fake_gpu["mutate"] = off_in_one_row(0.002)
    q, k, v = rand_qkv()
    flash_attn_func(q, k, v, causal=True)
    assert selfcheck.verdict(config(causal=True, ratio=2), "cpu") == "passed"


def test_error_names_what_was_wrong_and_where(fake_gpu):
    fake_gpu["mutate"] = second_sequence_reads_keys_one_early
    cu = torch.tensor([0, 20, 45], dtype=torch.int32)
    q, k, v = torch.randn(45, 4, 64, dtype=BF16), torch.randn(45, 2, 64, dtype=BF16), torch.randn(45, 2, 64, dtype=BF16)
    with pytest.raises(selfcheck.SelfCheckError, match=r"exceeds 2 \* max\|out_bfloat16 - ref\|") as info:
        flash_attn_varlen_func(q, k, v, cu, cu)
    assert "at sequence 3 query row" in str(info.value)  # only that sequence is wrong


def test_failure_is_kept_and_raised_again_until_switched_off(fake_gpu, monkeypatch, caplog):
    fake_gpu["mutate"] = nan_where_no_key
    q, k, v = rand_qkv()
    for _ in range(2):
        with pytest.raises(selfcheck.SelfCheckError):
            flash_attn_func(q, k, v, causal=True)
    assert len(fake_gpu["calls"]) == 1  # the second call raised without running the check again
    monkeypatch.setenv(settings.SELF_CHECK, "0")
    with caplog.at_level("WARNING", logger=settings.LOGGER_NAME):
        out = flash_attn_func(q, k, v, causal=True)  # at the user's own risk
    assert "failed its self-check" in caplog.text
    assert out.shape == q.shape and fake_gpu["calls"][1:] == [tuple(q.shape)]
    assert selfcheck.verdict(config(causal=True, ratio=2), "cpu") == "off"


def test_a_new_kernel_object_is_checked_again(fake_gpu):
    """The verdict holds for the kernel object it was made for (a cleared compile cache compiles a new one)."""
    q, k, v = rand_qkv()
    flash_attn_func(q, k, v)
    compile_cache.clear()
    flash_attn_func(q, k, v)
    check, user = problem_shape(config(ratio=2)), tuple(q.shape)
    assert fake_gpu["calls"] == [check, user, check, user]


# ---- when the check runs ----


def test_off_skips_the_check(fake_gpu, monkeypatch):
    monkeypatch.setenv(settings.SELF_CHECK, "off")
    fake_gpu["mutate"] = off_in_one_row(1.0)  # would fail
    q, k, v = rand_qkv()
    flash_attn_func(q, k, v)
    flash_attn_func(q, k, v)
    assert fake_gpu["calls"] == [tuple(q.shape)] * 2
    assert selfcheck.verdict(config(ratio=2), "cpu") == "off"


def test_default_checks_unverified_archs_only(fake_gpu):
    assert Arch.SM100 in selfcheck.UNVERIFIED_ARCHS and Arch.SM90 not in selfcheck.UNVERIFIED_ARCHS
    fake_gpu["arch"] = Arch.SM90
    fake_gpu["mutate"] = off_in_one_row(1.0)  # not checked: it is used as it is
    q, k, v = rand_qkv()
    flash_attn_func(q, k, v)
    assert fake_gpu["calls"] == [tuple(q.shape)]
    assert selfcheck.verdict(config(Arch.SM90, ratio=2), "cpu") == "not required"


@pytest.mark.parametrize("value", ["1", "on", "true", "YES"])
def test_forced_on_checks_sm90(fake_gpu, monkeypatch, value):
    monkeypatch.setenv(settings.SELF_CHECK, value)
    fake_gpu["arch"] = Arch.SM90
    q, k, v = rand_qkv()
    flash_attn_func(q, k, v, causal=True)
    cfg = config(Arch.SM90, causal=True, ratio=2)
    assert fake_gpu["calls"] == [problem_shape(cfg), tuple(q.shape)]
    assert selfcheck.verdict(cfg, "cpu") == "passed"
    fake_gpu["mutate"] = off_in_one_row(1.0)
    with pytest.raises(selfcheck.SelfCheckError, match="arch=sm_90a"):
        flash_attn_func(q, k, v)  # a new configuration (no mask): checked and wrong


@pytest.mark.parametrize("value,expected", [("", None), ("auto", None), (" 1 ", True), ("0", False),
                                            ("off", False), ("No", False)])
def test_setting_values(monkeypatch, value, expected):
    monkeypatch.setenv(settings.SELF_CHECK, value)
    assert settings.self_check() is expected
    assert settings.SELF_CHECK in settings.ALL and settings.SELF_CHECK in settings.__doc__


def test_bad_setting_value_raises(fake_gpu, monkeypatch):
    monkeypatch.setenv(settings.SELF_CHECK, "sometimes")
    with pytest.raises(ValueError, match="FLASH_ATTN4_SELF_CHECK='sometimes'"):
        flash_attn_func(*rand_qkv())


def test_settled_configurations_cost_a_dict_lookup(fake_gpu, monkeypatch):
    """After the first verdict neither the environment nor the check is consulted again."""
    q, k, v = rand_qkv()
    flash_attn_func(q, k, v)

    def forbidden(*_):
        raise AssertionError("consulted after the verdict")

    monkeypatch.setattr(settings, "self_check", forbidden)
    monkeypatch.setattr(selfcheck, "check_forward", forbidden)
    monkeypatch.setitem(selfcheck._CHECKS, ForwardConfig, forbidden)
    flash_attn_func(q, k, v)
    assert len(fake_gpu["calls"]) == 3


def test_check_launches_through_ops_launch_path(fake_gpu, monkeypatch):
    """The check and the caller's call launch through the same call convention (ops._launch), the
    check first."""
    launched = []
    real = ops._launch

    def spy(kernel, q, *args):
        launched.append(tuple(q.shape))
        return real(kernel, q, *args)

    monkeypatch.setattr(ops, "_launch", spy)
    q, k, v = rand_qkv()
    flash_attn_func(q, k, v, causal=True)
    assert launched == fake_gpu["calls"] == [problem_shape(config(causal=True, ratio=2)), tuple(q.shape)]


def test_check_leaves_the_callers_rng_alone(fake_gpu):
    q, k, v = rand_qkv()
    state = torch.get_rng_state()
    flash_attn_func(q, k, v)
    assert len(fake_gpu["calls"]) == 2 and torch.equal(torch.get_rng_state(), state)


def test_first_use_during_cuda_graph_capture_raises(monkeypatch, seed):
    """A kernel cannot be run and waited for inside a capture: the error asks for a warm-up call."""
    selfcheck.clear()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(device_info, "get_device_info",
                        lambda device: device_info.DeviceInfo(0, "NVIDIA B200", (10, 0), 148))
    cfg, calls = config(), []
    with pytest.raises(RuntimeError, match="during CUDA graph capture.*once outside the capture") as info:
        selfcheck.ensure_checked(cfg, torch.device("cuda", 0), FakeKernel(cfg, calls), ops._launch_forward)
    assert "NVIDIA B200" in str(info.value) and "FLASH_ATTN4_SELF_CHECK=0" in str(info.value)
    assert calls == [] and selfcheck.verdict(cfg, 0) is None  # decided at the next (eager) call
    selfcheck.clear()


# ---- the problem covers the configuration ----


@pytest.mark.parametrize("ratio", [1, 2, 4, 8, 16, 32])
def test_problem_head_ratio(ratio):
    cfg = config(ratio=ratio)
    p = selfcheck.build_forward_problem(cfg)
    hq, hk = p.q.shape[-2], p.k.shape[-2]
    assert hq % hk == 0 and hk == p.v.shape[-2]
    if cfg.pack_gqa > 1:
        assert cfg.pack_gqa == ratio and hq // hk == ratio  # the ratio the kernel packs
    else:
        assert hq // hk == selfcheck.UNPACKED_HEAD_RATIO > 1  # GQA indexing without packing


@pytest.mark.parametrize("d,dv", [(64, 64), (96, 96), (192, 128), (256, 256), (72, 72)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_problem_dtype_and_head_dims(d, dv, dtype):
    cfg = config(d=d, dv=dv).replace(dtype=dtype)
    p = selfcheck.build_forward_problem(cfg)
    assert p.q.dtype == p.k.dtype == p.v.dtype == getattr(torch, dtype)
    assert p.q.shape[-1] == p.k.shape[-1] == d and p.v.shape[-1] == dv
    assert p.softmax_scale != d ** -0.5  # a scale the kernel must take from its argument


def test_problem_batched_has_partial_tiles():
    for flags in (dict(), dict(causal=True), dict(local=True)):
        cfg = config(**flags)
        p = selfcheck.build_forward_problem(cfg)
        b, sq, _, _ = p.q.shape
        sk = p.k.shape[1]
        assert b >= 2 and p.cu_seqlens_q is None and p.max_seqlen_q == sq
        assert sq % cfg.tile_m and sk % cfg.tile_n and sq % 128 and sk % 128 and min(sq, sk) > 256
        ref = selfcheck.reference_forward(p)
        assert ref.empty.any() == (cfg.causal or cfg.local)  # more queries than keys: first rows see none


@pytest.mark.parametrize("d,dv,ratio,flags,pair", [(128, 128, 1, dict(), False), (64, 64, 1, dict(), False),
                                                   (128, 128, 4, dict(), False),
                                                   (256, 256, 16, dict(has_softcap=True), False),
                                                   (256, 128, 1, dict(has_seqused_k=True), False),
                                                   (128, 128, 1, dict(), True), (128, 128, 4, dict(), True)])
def test_problem_of_a_persistent_kernel_has_more_tiles_than_its_ctas(d, dv, ratio, flags, pair):
    """A persistent kernel launches min(tiles, persistent_ctas) CTAs (TileScheduler.grid; CTA pairs:
    min(pair tiles, persistent_ctas / 2) pairs): the check's problem must have more tiles than
    that, or no CTA would run a second tile, where the carried pipeline phases matter. The count is
    the scheduler's: query blocks (of tile_m x cluster_m rows) x heads x batch."""
    cfg = config(d=d, dv=dv, ratio=ratio, **flags).replace(cluster_m=2 if pair else 1)
    assert cfg.persistent_ctas > 0, "the sm100 rules make this problem class persistent"
    workers = cfg.persistent_ctas // cfg.cluster_m
    p = selfcheck.build_forward_problem(cfg)
    b, sq, hq, _ = p.q.shape
    hk = p.k.shape[-2]
    rows, heads = (sq * cfg.pack_gqa, hk) if cfg.pack_gqa > 1 else (sq, hq)
    blocks = -(-rows // (cfg.tile_m * (2 if pair else 1)))
    tiles = blocks * heads * b
    assert tiles == selfcheck.output_tiles(cfg, b, sq, hq, hk)
    assert workers < tiles <= workers + heads * blocks  # the smallest batch
    assert len(p.lengths) == b and (p.seqused_k is None) == (not cfg.has_seqused_k)
    if cfg.has_seqused_k:
        assert p.seqused_k.tolist()[:2] == [p.k.shape[1] - 43, 0] and len(p.seqused_k) == b
    if pair:  # a pair whose odd CTA has some rows (rows % 512 > 256) or none (<= 256) in the sequence
        assert rows % (2 * cfg.tile_m) != 0
    # one CTA per tile: the small problem stays small
    single = selfcheck.build_forward_problem(cfg.replace(persistent_ctas=0))
    assert single.q.shape[0] == selfcheck.BATCH



@pytest.mark.parametrize("arch", [Arch.SM100, Arch.SM103])
@pytest.mark.parametrize("d,dv", [(128, 128), (192, 128), (256, 256), (120, 128), (184, 120)])
def test_problem_of_a_pair_ends_in_a_ragged_pair(arch, d, dv):
    """Every head-dim class the rules run on CTA pairs (sm_100a and sm_103a alike, d = 192 / 128
    included) is checked on a problem whose last pair tile is ragged (its rows are not a multiple of
    the pair's 2 x tile_m), and its fallback is the single-CTA kernel of the same class, itself a
    configuration the rules accept."""
    cfg = config(arch, d=d, dv=dv)
    assert cfg.cluster_m == 2, (arch, d, dv)
    p = selfcheck.build_forward_problem(cfg)
    rows = p.q.shape[1]
    assert rows % (2 * cfg.tile_m) != 0 and rows > cfg.tile_m  # the first pair's odd CTA has rows too
    single = dispatch.self_check_fallback(cfg)
    assert single == cfg.replace(cluster_m=1) and single.arch is arch

def test_problem_varlen_is_ragged():
    for flags in (dict(), dict(has_seqused_k=True), dict(causal=True), dict(local=True, has_seqused_k=True)):
        cfg = config(varlen=True, **flags)
        p = selfcheck.build_forward_problem(cfg)
        lens_q = (p.cu_seqlens_q[1:] - p.cu_seqlens_q[:-1]).tolist()
        lens_k = (p.cu_seqlens_k[1:] - p.cu_seqlens_k[:-1]).tolist()
        assert p.cu_seqlens_q.dtype == p.cu_seqlens_k.dtype == torch.int32
        assert p.cu_seqlens_q[0] == p.cu_seqlens_k[0] == 0
        assert p.cu_seqlens_q[-1] == p.q.shape[0] and p.cu_seqlens_k[-1] == p.k.shape[0]
        assert len(lens_q) >= 3 and len(set(lens_q)) == len(lens_q)  # ragged
        assert 0 in lens_q  # a sequence without queries
        assert any(n > 256 and n % 128 for n in lens_k)  # keys ending in a partial block
        assert any(q > k for q, k in zip(lens_q, lens_k))  # more queries than keys
        assert p.max_seqlen_q == max(lens_q)
        ref = selfcheck.reference_forward(p)
        assert ref.empty.any()  # a sequence whose queries see no key, whatever the mask
        if cfg.has_seqused_k:
            used = p.seqused_k.tolist()
            assert p.seqused_k.dtype == torch.int32 and 0 in used
            assert all(u <= n for u, n in zip(used, lens_k)) and any(0 < u < n for u, n in zip(used, lens_k))
        else:
            assert p.seqused_k is None


def test_problem_masks_softcap_sink():
    p = selfcheck.build_forward_problem(config(local=True))
    assert not p.causal and 0 <= p.window_left < 128 and 0 <= p.window_right < 128
    ref = selfcheck.reference_forward(p)
    assert ref.empty.any() and not ref.empty.all()
    p = selfcheck.build_forward_problem(config(causal=True))
    assert p.causal and (p.window_left, p.window_right) == (-1, 0)
    p = selfcheck.build_forward_problem(config())
    assert not p.causal and (p.window_left, p.window_right) == (-1, -1) and p.softcap == 0.0
    assert p.learnable_sink is None and p.seqused_k is None
    p = selfcheck.build_forward_problem(config(has_softcap=True, has_sink=True))
    assert p.softcap > 0 and p.learnable_sink.dtype == torch.float32 and p.learnable_sink.shape == (p.q.shape[-2],)
    p = selfcheck.build_forward_problem(config(has_seqused_k=True))
    assert p.seqused_k.tolist()[1] == 0 and p.seqused_k.tolist()[0] < p.k.shape[1]


def test_problem_inputs_are_random_and_seeded():
    cfg = config()
    a, b = selfcheck.build_forward_problem(cfg, seed=1), selfcheck.build_forward_problem(cfg, seed=2)
    assert not torch.equal(a.q, b.q) and torch.equal(a.q, selfcheck.build_forward_problem(cfg, seed=1).q)
    assert a.q.float().std() > 0.5 and (a.v != 0).all()


@pytest.mark.parametrize("flags", [dict(causal=True, varlen=True, has_seqused_k=True),
                                   dict(local=True, has_softcap=True, has_sink=True), dict(varlen=True, local=True)])
def test_reference_matches_the_suites_reference(seed, flags):
    """selfcheck's own reference (the package cannot import tests/) against tests/reference.py."""
    cfg = config(ratio=4, **flags)
    p = selfcheck.build_forward_problem(cfg)
    ref = selfcheck.reference_forward(p)
    window = (p.window_left, p.window_right) if cfg.local else (-1, -1)
    kwargs = dict(softmax_scale=p.softmax_scale, causal=p.causal, window_size=window, softcap=p.softcap,
                  learnable_sink=p.learnable_sink, cu_seqlens_q=p.cu_seqlens_q, cu_seqlens_k=p.cu_seqlens_k,
                  seqused_k=p.seqused_k)
    out, lse = attention_ref(p.q.float(), p.k.float(), p.v.float(), **kwargs)  # float32 throughout
    assert (ref.out - out.double()).abs().max() < 1e-5
    assert torch.equal(torch.isneginf(ref.lse), torch.isneginf(lse))
    finite = torch.isfinite(lse)
    assert (ref.lse[finite] - lse[finite].double()).abs().max() < 1e-4
    out_pt, _ = attention_ref(p.q, p.k, p.v, upcast=False, **kwargs)
    # the low-precision computation: the same kind of error as the suite's out_pt
    base, base_pt = (ref.out_lowp - ref.out).abs().max(), (out_pt.double() - ref.out).abs().max()
    assert 0.5 * base_pt <= base <= 2 * base_pt


# ---- a kernel that hangs ----


def test_a_kernel_that_never_finishes_fails_the_check_instead_of_hanging_the_caller(fake_gpu, monkeypatch):
    """The launch's completion is polled with a deadline: a kernel stuck on a barrier (the failure a
    wrong mbarrier count would cause on a GPU we never ran) becomes a SelfCheckError naming the hang,
    recorded, so the next call raises without launching it again."""
    probes = []

    def never_done(device):
        probes.append(device)
        return lambda: False

    monkeypatch.setattr(selfcheck, "completion_probe", never_done)
    monkeypatch.setattr(selfcheck, "HANG_TIMEOUT_S", 0.05)
    q, k, v = rand_qkv()
    for _ in range(2):
        with pytest.raises(selfcheck.SelfCheckError, match="did not finish the check's problem within"):
            flash_attn_func(q, k, v)
    assert len(probes) == 1 and len(fake_gpu["calls"]) == 1  # launched once, never for the user


def test_a_pair_that_hangs_raises_without_falling_back(fake_gpu, pairs_on, monkeypatch):
    """A CTA pair stuck on a barrier is not replaced by single CTAs: their launch would queue behind
    the hung kernel; the caller gets the hang's SelfCheckError (hung=True)."""
    monkeypatch.setattr(selfcheck, "completion_probe", lambda device: (lambda: False))
    monkeypatch.setattr(selfcheck, "HANG_TIMEOUT_S", 0.05)
    q, k, v = rand_qkv()
    with pytest.raises(selfcheck.SelfCheckError, match="did not finish") as info:
        flash_attn_func(q, k, v)
    assert info.value.hung and config(ratio=2).cluster_m == 2
    assert len(fake_gpu["calls"]) == 1  # the pair's check only: no single-CTA launch
    assert selfcheck.verdict(config(ratio=2).replace(cluster_m=1), "cpu") is None


def test_await_completion_polls_until_done_or_the_deadline():
    ticks = iter([False, False, True])
    assert selfcheck.await_completion(lambda: next(ticks), timeout_s=5.0, poll_s=0.0)
    start = __import__("time").monotonic()
    assert not selfcheck.await_completion(lambda: False, timeout_s=0.02, poll_s=0.001)
    assert __import__("time").monotonic() - start >= 0.02
    assert selfcheck.await_completion(None)  # the CPU: nothing to wait for


# ---- the backward ----
#
# The backward's check runs the whole backward (ops._launch_backward: the pre- and postprocessing
# stand-ins of test_ops.py and a main-kernel stand-in computing the gradients in float32) on the
# configuration's problem. The check is required on archs we have not run; these tests declare sm90
# not run (UNVERIFIED_ARCHS) unless they test the default (the sm_100a backward's path:
# tests/cpu/test_sm100_bwd_dispatch.py).

from tests.cpu.test_ops import torch_backward_kernel, torch_postprocess_kernel, torch_preprocess_kernel  # noqa: E402


class FakeBackward:
    """compile_backward(cfg)'s stand-in: test_ops.py's torch backward kernel, then ``state["bwd_mutate"]``
    (q, k, v, dq_accum, dk, dv, calls so far) to make it wrong. Records the q shape of every call."""

    def __init__(self, cfg, state):
        self.cfg, self.state, self.inner = cfg, state, torch_backward_kernel(cfg, [])

    def __call__(self, q, k, v, dout, lse_log2, dpsum, dq_acc, dk, dv, *rest):
        self.state["bwd_calls"].append(tuple(q.shape))
        self.inner(q, k, v, dout, lse_log2, dpsum, dq_acc, dk, dv, *rest)
        if self.state["bwd_mutate"] is not None:
            self.state["bwd_mutate"](q, k, v, dq_acc, dk, dv, len(self.state["bwd_calls"]))


@pytest.fixture
def fake_bwd(fake_gpu, monkeypatch):
    """fake_gpu on sm90, declared not run by us, with the backward stand-ins; ``bwd_calls`` lists
    the q shape of every main-kernel call, ``post_mutate`` (dq) spoils the postprocessing's dQ."""
    fake_gpu.update(arch=Arch.SM90, bwd_mutate=None, bwd_calls=[], post_mutate=None)
    monkeypatch.setattr(selfcheck, "UNVERIFIED_ARCHS", selfcheck.UNVERIFIED_ARCHS | {Arch.SM90})
    monkeypatch.setattr(compile_cache, "_compile_backward", lambda cfg, **_: FakeBackward(cfg, fake_gpu))
    monkeypatch.setattr(compile_cache, "_compile_backward_preprocess", lambda cfg, **_: torch_preprocess_kernel(cfg, []))

    def postprocess(cfg, **_):
        inner = torch_postprocess_kernel(cfg, [])

        def run(dq_accum, dq, *rest):
            inner(dq_accum, dq, *rest)
            if fake_gpu["post_mutate"] is not None:
                fake_gpu["post_mutate"](dq)
        return run

    monkeypatch.setattr(compile_cache, "_compile_backward_postprocess", postprocess)
    return fake_gpu


def bwd_config(d=64, dv=None, arch=Arch.SM90, **flags):
    base = dict(causal=False, local=False, has_softcap=False, varlen=False, has_seqused_k=False, deterministic=False)
    base.update(flags)
    return dispatch.backward_config(arch, "bfloat16", d, d if dv is None else dv, **base)


def bwd_problem_shape(cfg):
    return tuple(selfcheck.build_backward_problem(cfg).fwd.q.shape)


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def user_backward(hq=4, hk=2, d=64, sink=False, **kwargs):
    """A user's forward and backward through flash_attn_func; returns the leaves (q, k, v[, sink])."""
    q, k, v = leaves(*rand_qkv(hq=hq, hk=hk, d=d))
    tensors = [q, k, v]
    if sink:
        tensors.append(torch.randn(hq).requires_grad_())
        kwargs["learnable_sink"] = tensors[-1]
    out = flash_attn_func(q, k, v, **kwargs)
    out.backward(torch.randn_like(out))
    return tensors


def test_correct_backward_is_checked_once_then_cached(fake_bwd):
    q, k, v = user_backward(causal=True)
    first = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    out = flash_attn_func(q, k, v, causal=True)
    out.backward(torch.ones_like(out))
    cfg = bwd_config(causal=True)
    # one check launch before the first user launch, none before the second
    assert fake_bwd["bwd_calls"] == [bwd_problem_shape(cfg), tuple(q.shape), tuple(q.shape)]
    assert selfcheck.verdict(cfg, "cpu") == "passed"
    report = selfcheck.report(cfg, "cpu")
    assert report.ok and set(report.grads) == {"dq", "dk", "dv"}
    assert all(0 < err <= allowed for err, allowed in report.grads.values())
    assert all(torch.isfinite(g).all() and g.abs().max() > 0 for g in first)


def test_each_backward_configuration_is_checked_on_its_first_use(fake_bwd):
    user_backward()
    user_backward(causal=True)
    user_backward(causal=True, deterministic=True)
    user_backward()
    plain, causal, det = bwd_config(), bwd_config(causal=True), bwd_config(causal=True, deterministic=True)
    user = tuple(rand_qkv(hq=4, hk=2, d=64)[0].shape)
    # deterministic: the check runs the backward twice (and compares the runs bit for bit)
    assert fake_bwd["bwd_calls"] == [bwd_problem_shape(plain), user, bwd_problem_shape(causal), user,
                                     bwd_problem_shape(det), bwd_problem_shape(det), user, user]
    assert [selfcheck.verdict(c, "cpu") for c in (plain, causal, det)] == ["passed"] * 3


@pytest.mark.parametrize("arch", [Arch.SM90, Arch.SM100], ids=lambda a: a.value)
def test_a_backward_reading_the_keys_past_seqused_k_unzeroed_fails_the_check(fake_bwd, monkeypatch, arch):
    """The check's stored keys past seqused_k are NaN and their values +inf: the tile model with its
    last tile's rows past the keys left as loaded (no zero_kv_tail) fails it, the same model zeroing
    them passes (the sm100 case runs the varlen CTA pair, whose odd block lies past the keys)."""
    cfg = bwd_config(128, 128, varlen=True, has_seqused_k=True, causal=True, arch=arch)
    problem = selfcheck.build_backward_problem(cfg)
    assert problem.fwd.k.isnan().any() and problem.fwd.v.isinf().any()
    reports = {}
    for zero in (True, False):
        monkeypatch.setattr(compile_cache, "_compile_backward",
                            lambda cfg, zero=zero, **_: tile_model_backward_kernel(cfg, zero_kv_tail=zero))
        compile_cache.clear()
        reports[zero] = selfcheck.check_backward(cfg, compile_cache.get_backward_kernel(cfg), ops.BACKWARD_LAUNCH,
                                                 torch.device("cpu"))
    assert reports[True].ok, reports[True].failures
    assert not reports[False].ok and any("NaN or infinite" in f for f in reports[False].failures), \
        reports[False].failures


@pytest.mark.parametrize("d,dv,flags", [
    (64, 64, dict()), (128, 128, dict(causal=True)), (128, 128, dict(local=True, has_softcap=True)),
    (96, 96, dict(varlen=True, has_seqused_k=True, causal=True, deterministic=True)),
    (192, 128, dict(varlen=True, local=True)), (256, 256, dict(causal=True, deterministic=True)),
    (128, 128, dict(varlen=True, has_seqused_k=True, has_softcap=True))])
def test_correct_backward_passes_every_configuration(seed, fake_bwd, d, dv, flags):
    """check_backward directly: the correct stand-in passes for every feature combination."""
    cfg = bwd_config(d, dv, **flags)
    kernel = compile_cache.get_backward_kernel(cfg)
    report = selfcheck.check_backward(cfg, kernel, ops.BACKWARD_LAUNCH, torch.device("cpu"))
    assert report.ok, report.failures
    assert fake_bwd["bwd_calls"] == [bwd_problem_shape(cfg)] * (2 if cfg.deterministic else 1)
    names = {"dq", "dk", "dv"} | ({"dsink"} if selfcheck.backward_has_sink(cfg) else set())
    assert set(report.grads) == names and all(0 < e <= a for e, a in report.grads.values())


@pytest.mark.parametrize("d,flags", [
    (128, dict(varlen=True, has_seqused_k=True, causal=True)), (64, dict(local=True, has_softcap=True)),
    (128, dict(varlen=True, local=True, has_softcap=True, deterministic=True)), (64, dict(varlen=True)),
    (96, dict(causal=True, varlen=True, has_seqused_k=True, has_softcap=True)),
    ((128, 64), dict(causal=True)), ((64, 128), dict(varlen=True, local=True))])
def test_sm100_backward_check_builds_problems_with_varlen_local_and_softcap(seed, fake_bwd, d, flags):
    """The sm_100a backward's first-use check (its kernel now takes varlen, seqused_k, local windows
    and softcap) builds a problem with each option of the configuration: packed sequences (one
    without keys under seqused_k), a window with rows that see no key, a softcap; the correct
    stand-in (sm100's dQ accumulator order) passes it."""
    fake_bwd["arch"] = Arch.SM100
    base = dict(causal=False, local=False, has_softcap=False, varlen=False, has_seqused_k=False, deterministic=False)
    d, dv = d if isinstance(d, tuple) else (d, d)
    cfg = dispatch.backward_config(Arch.SM100, "bfloat16", d, dv, **{**base, **flags})
    p = selfcheck.build_backward_problem(cfg)
    assert (p.fwd.q.shape[-1], p.fwd.v.shape[-1]) == (d, dv)
    assert p.fwd.varlen == cfg.varlen and (p.fwd.seqused_k is not None) == cfg.has_seqused_k
    assert (p.fwd.softcap > 0) == cfg.has_softcap and (p.fwd.window_left >= 0) == cfg.local
    if cfg.has_seqused_k:
        assert 0 in p.fwd.seqused_k.tolist()  # a sequence whose rows see no key
    ref = selfcheck.reference_backward(p)
    if cfg.causal or cfg.local or cfg.has_seqused_k:
        assert ref.empty.any()  # rows without keys: their gradients must come out 0
    kernel = compile_cache.get_backward_kernel(cfg)
    report = selfcheck.check_backward(cfg, kernel, ops.BACKWARD_LAUNCH, torch.device("cpu"))
    assert report.ok, report.failures
    assert fake_bwd["bwd_calls"] == [tuple(p.fwd.q.shape)] * (2 if cfg.deterministic else 1)


# wrong backward kernels: (what the stand-in does wrong, the configuration flags, user-call options)


def dk_scaled(q, k, v, dq_acc, dk, dv, call):
    dk.mul_(1.05)


def dq_block_missing(q, k, v, dq_acc, dk, dv, call):
    """The second query block of the first head gets nothing added (a KV tile's reduce-add lost)."""
    acc = dq_acc if dq_acc.dim() == 3 else dq_acc[0]
    rows = acc.shape[1] // -(-q.shape[-3] // 128)  # d = 64: 128-query blocks
    acc[0, rows:2 * rows] = 0


def dv_of_wrong_head(q, k, v, dq_acc, dk, dv, call):
    dv[..., 0, :] = dv[..., 1, :]


def dk_tail_unwritten(q, k, v, dq_acc, dk, dv, call):
    dk[:, -20:] = float("nan")  # as the op poisoned it: the last keys left unwritten


def run_dependent_dq(q, k, v, dq_acc, dk, dv, call):
    """Deterministic mode, but the second run adds in another order: one element of dQ a few bf16 ulps
    off (well within the tolerance; a difference that rounding to bf16 erases cannot be seen)."""
    if call % 2 == 0:
        flat = dq_acc.view(-1)
        flat[flat.abs().argmax()] *= 1 + 2.0 ** -6


def dk_past_seqused_k(q, k, v, dq_acc, dk, dv, call):
    """Keys past seqused_k get a small gradient (within the tolerance, but they must read 0)."""
    dk.add_(1e-3)


def dq_in_rows_without_keys(dq):
    dq[:, 0] = 1e-3  # row 0 sees no key in the causal problem (more queries than keys)


WRONG_BACKWARD = {
    "dK scaled by 1.05": (dict(bwd_mutate=dk_scaled), dict()),
    "dQ missing a query block": (dict(bwd_mutate=dq_block_missing), dict(causal=True)),
    "dV of the wrong KV head": (dict(bwd_mutate=dv_of_wrong_head), dict()),
    "dK of the last keys unwritten": (dict(bwd_mutate=dk_tail_unwritten), dict(causal=True)),
    "deterministic runs differ": (dict(bwd_mutate=run_dependent_dq), dict(deterministic=True)),
    "dQ not 0 in rows without keys": (dict(post_mutate=dq_in_rows_without_keys), dict(causal=True)),
    "dK not 0 past seqused_k": (dict(bwd_mutate=dk_past_seqused_k), dict(varlen=True, has_seqused_k=True)),
    "dsink 0": (dict(sink_zero=True), dict()),
}


@pytest.mark.parametrize("name", list(WRONG_BACKWARD))
def test_wrong_backward_raises_naming_the_configuration(fake_bwd, monkeypatch, name):
    hooks, flags = WRONG_BACKWARD[name]
    hooks = dict(hooks)
    if hooks.pop("sink_zero", False):
        monkeypatch.setattr(ops, "_sink_grad", lambda grad_out, out, lse, sink, *_: torch.zeros_like(sink))
    fake_bwd.update(hooks)
    cfg = bwd_config(**flags)
    if cfg.causal:
        assert selfcheck.reference_backward(selfcheck.build_backward_problem(cfg)).empty[:, 0].all()
    if cfg.varlen:
        cu = torch.tensor([0, 20, 45], dtype=torch.int32)
        q, k, v = leaves(*(torch.randn(45, h, 64, dtype=BF16) for h in (4, 2, 2)))
        used = torch.tensor([20, 25], dtype=torch.int32) if cfg.has_seqused_k else None
        call = lambda: flash_attn_varlen_func(q, k, v, cu, cu, seqused_k=used, causal=cfg.causal)  # noqa: E731
        tensors = [q, k, v]
    else:
        q, k, v = tensors = leaves(*rand_qkv(hq=4, hk=2, d=64))
        if name == "dsink 0":
            tensors.append(torch.randn(4).requires_grad_())
        call = lambda: flash_attn_func(q, k, v, causal=cfg.causal, deterministic=cfg.deterministic,  # noqa: E731
                                       learnable_sink=tensors[3] if len(tensors) > 3 else None)
    out = call()
    with pytest.raises(selfcheck.SelfCheckError) as info:
        out.backward(torch.randn_like(out))
    message = str(info.value)
    print(message)
    assert "flash-attn4 self-check FAILED" in message and "BackwardConfig(arch=sm_90a" in message
    assert "FLASH_ATTN4_SELF_CHECK=0" in message and selfcheck.ISSUE_TRACKER in message
    assert all(t.grad is None for t in tensors)  # no gradients returned
    assert selfcheck.verdict(cfg, "cpu") == "failed"
    checks = len(fake_bwd["bwd_calls"])
    assert checks == (2 if cfg.deterministic else 1)  # the check's launches, none for the user
    with pytest.raises(selfcheck.SelfCheckError):  # again, without running the check again
        call().backward(torch.ones_like(out))
    assert len(fake_bwd["bwd_calls"]) == checks


def test_backward_error_names_the_gradient_and_where(fake_bwd):
    fake_bwd["bwd_mutate"] = dv_of_wrong_head
    with pytest.raises(selfcheck.SelfCheckError, match=r"dv: max\|dv - ref\| = .* at batch \d key row \d+ head 0 "
                                                       r"exceeds 2 \* max\|dv_bfloat16 - ref\|"):
        user_backward()


def test_backward_small_perturbation_within_the_rule_passes(fake_bwd):
    fake_bwd["bwd_mutate"] = lambda q, k, v, dq_acc, dk, dv, call: dk.mul_(1.002)
    user_backward()
    assert selfcheck.verdict(bwd_config(), "cpu") == "passed"


def test_backward_default_checks_unverified_archs_only(fake_bwd, monkeypatch):
    monkeypatch.setattr(selfcheck, "UNVERIFIED_ARCHS", frozenset({Arch.SM100, Arch.SM103}))
    fake_bwd["bwd_mutate"] = dk_scaled  # not checked: used as it is
    user_backward()
    assert fake_bwd["bwd_calls"] == [tuple(rand_qkv(hq=4, hk=2, d=64)[0].shape)]
    assert selfcheck.verdict(bwd_config(), "cpu") == "not required"


def test_backward_forced_on_checks_sm90_and_off_skips(fake_bwd, monkeypatch):
    monkeypatch.setattr(selfcheck, "UNVERIFIED_ARCHS", frozenset({Arch.SM100, Arch.SM103}))
    monkeypatch.setenv(settings.SELF_CHECK, "1")
    user_backward(causal=True)
    assert selfcheck.verdict(bwd_config(causal=True), "cpu") == "passed"
    fake_bwd["bwd_mutate"] = dk_scaled
    with pytest.raises(selfcheck.SelfCheckError, match="forces it on"):
        user_backward()
    monkeypatch.setenv(settings.SELF_CHECK, "0")
    fake_bwd["bwd_calls"].clear()
    user_backward(window_size=(8, 2))  # a new configuration, not checked
    assert len(fake_bwd["bwd_calls"]) == 1 and selfcheck.verdict(bwd_config(local=True), "cpu") == "off"


def test_backward_check_that_never_finishes_fails(fake_bwd, monkeypatch):
    q, k, v = leaves(*rand_qkv(hq=4, hk=2, d=64))
    out = flash_attn_func(q, k, v)  # the forward's check passes first
    monkeypatch.setattr(selfcheck, "completion_probe", lambda device: (lambda: False))
    monkeypatch.setattr(selfcheck, "HANG_TIMEOUT_S", 0.05)
    with pytest.raises(selfcheck.SelfCheckError, match="backward did not finish the check's problem"):
        out.backward(torch.ones_like(out))
    assert len(fake_bwd["bwd_calls"]) == 1 and q.grad is None


# ---- the backward's problem and reference ----


@pytest.mark.parametrize("flags", [dict(), dict(causal=True), dict(local=True, has_softcap=True),
                                   dict(varlen=True, has_seqused_k=True, deterministic=True)])
def test_backward_problem_covers_the_configuration(flags):
    cfg = bwd_config(**flags)
    p = selfcheck.build_backward_problem(cfg)
    f = p.fwd
    assert f.q.shape[-2] // f.k.shape[-2] == selfcheck.UNPACKED_HEAD_RATIO > 1  # GQA: dK, dV summed over 3 heads
    assert p.dout.shape == f.output_shapes()[0] and p.dout.dtype == f.q.dtype and p.dout.float().std() > 0.5
    assert p.deterministic == cfg.deterministic and (f.learnable_sink is not None) == selfcheck.backward_has_sink(cfg)
    assert (f.learnable_sink is not None) == (not (cfg.causal or cfg.local))
    assert f.softcap > 0 if cfg.has_softcap else f.softcap == 0
    assert p.max_seqlen_k == max(x[1] for x in f.lengths)
    ref = selfcheck.reference_backward(p)
    if cfg.causal or cfg.local or cfg.varlen:
        assert ref.empty.any()  # rows without any key: zero dQ (LSE -inf without a sink)
    if cfg.has_seqused_k:
        assert ref.unseen.any()  # keys past seqused_k: zero dK, dV
    assert not torch.equal(selfcheck.build_backward_problem(cfg, seed=1).dout, selfcheck.build_backward_problem(
        cfg, seed=2).dout)


@pytest.mark.parametrize("flags", [dict(causal=True, varlen=True, has_seqused_k=True),
                                   dict(local=True, has_softcap=True), dict()])
def test_backward_reference_matches_autograd_through_the_suites_reference(seed, flags):
    """selfcheck's backward reference (the package cannot import tests/) against float32 autograd of
    tests/reference.py, and its low-precision gradients about as far off as the suite's grad_pt."""
    cfg = bwd_config(**flags)
    p = selfcheck.build_backward_problem(cfg, seed=seed)
    f = p.fwd
    ref = selfcheck.reference_backward(p)
    window = (f.window_left, f.window_right) if cfg.local else (-1, -1)
    kwargs = dict(softmax_scale=f.softmax_scale, causal=f.causal, window_size=window, softcap=f.softcap,
                  cu_seqlens_q=f.cu_seqlens_q, cu_seqlens_k=f.cu_seqlens_k, seqused_k=f.seqused_k)
    for upcast in (True, False):
        ts = [t.float() if upcast else t for t in (f.q, f.k, f.v)]
        sink = None if f.learnable_sink is None else f.learnable_sink.clone()
        ts = leaves(*ts) + ([sink.requires_grad_()] if sink is not None else [])
        out, _ = attention_ref(*ts[:3], learnable_sink=sink, upcast=upcast, **kwargs)
        out.backward(p.dout.float() if upcast else p.dout)
        for name, t in zip(("dq", "dk", "dv", "dsink"), ts):
            if upcast:
                assert (ref.grads[name] - t.grad.double()).abs().max() < 1e-4 * max(1.0, float(t.grad.abs().max()))
            else:
                base = (ref.lowp[name] - ref.grads[name]).abs().max()
                base_pt = (t.grad.double() - ref.grads[name]).abs().max()
                assert 0.25 * base_pt <= base <= 4 * base_pt, (name, float(base), float(base_pt))


# ---- the kernel's arithmetic passes the backward's check ----

from tests import bwd_tile_model as bm  # noqa: E402
from tests.cpu.test_ops import dq_accum_positions  # noqa: E402


def tile_model_backward_kernel(cfg, zero_kv_tail: bool = True):
    """compile_backward(cfg)'s stand-in that runs the backward's tile model (tests/bwd_tile_model.py:
    the kernel's tiles, rounding points and float32 accumulation, MUFU and tanh.approx errors at their
    hardware bounds) on the rows the preprocessing stand-in left, per sequence and KV head. The last
    tile's rows past the used keys are what follows them in k and v (varlen), which the kernels zero
    (``zero_kv_tail=False``: a kernel that does not)."""
    params = bm.BwdTileParams.from_backward_config(cfg)

    def run(q, k, v, dout, lse_log2, dpsum, dq_acc, dk, dv, cu_q, cu_k, seqused_k, semaphore, scale, softcap, left,
            right, max_seqlen_k):
        hq, hk = q.shape[-2], k.shape[-2]
        g = hq // hk
        opts = dict(softmax_scale=scale, causal=cfg.causal, window=(left, right) if cfg.local else (-1, -1),
                    softcap=softcap if cfg.has_softcap else 0.0, deterministic=cfg.deterministic,
                    tanh_rel_error=2.0 ** -11, mufu_rel_error=2.0 ** -22)
        dq = torch.zeros(q.shape, dtype=torch.float32)
        if cfg.varlen:  # (query rows, key rows, rows of lse_log2 / dpsum) per sequence
            sequences = []
            for b in range(cu_q.shape[0] - 1):
                q0, q1, k0 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b])
                k1 = k0 + int(seqused_k[b]) if seqused_k is not None else int(cu_k[b + 1])
                r0 = (q0 + 3 * b) // 4 * 4  # the packed row layout (test_ops.torch_backward_kernel)
                sequences.append(((slice(q0, q1),), (slice(k0, k1),), (slice(None), slice(r0, r0 + q1 - q0))))
        else:
            sequences = [((b,), (b,), (b, slice(None), slice(0, q.shape[1]))) for b in range(q.shape[0])]
        for qs, ks, rs in sequences:
            qb, kb, vb, dob = q[qs], k[ks], v[ks], dout[qs]
            if kb.shape[0] == 0:
                continue
            tail = None
            if cfg.varlen:  # the packed rows after this sequence's used keys
                after = slice(ks[0].stop, None)
                tail = (k[after], v[after])
            for h in range(hk):
                heads = slice(h * g, (h + 1) * g)
                if qb.shape[0] == 0:
                    dk[ks][:, h], dv[ks][:, h] = 0, 0
                    continue
                kv_tail = None if tail is None else (tail[0][:, h], tail[1][:, h])
                acc, dk_h, dv_h, _ = bm.main(qb[:, heads], kb[:, h], vb[:, h], dob[:, heads],
                                             dpsum[rs][heads].numpy(), lse_log2[rs][heads].numpy(), params,
                                             kv_tail=kv_tail, zero_kv_tail=zero_kv_tail, **opts)
                dq[qs][:, heads] = torch.from_numpy(acc)
                dk[ks][:, h], dv[ks][:, h] = dk_h, dv_h
        dq_acc.view(-1).index_add_(0, dq_accum_positions(cfg, q, cu_q).flatten(), dq.flatten())

    return run


@pytest.mark.parametrize("d,dv,flags", [
    (64, 64, dict()), (128, 128, dict(causal=True)), (128, 128, dict(local=True, has_softcap=True)),
    (128, 128, dict(varlen=True, has_seqused_k=True, causal=True, deterministic=True)), (96, 96, dict(varlen=True)),
    # sm100's serial kernel: dS from the 16-bit P, under softcap t recovered from it (bwd_serial.py)
    (192, 128, dict(causal=True, arch=Arch.SM100)), (192, 128, dict(local=True, has_softcap=True, arch=Arch.SM100)),
    # sm100's varlen CTA pairs (the model's pair walk and per-pair dQ; the check's sequences have odd
    # KV block counts, the last pair's odd block past the keys)
    (128, 128, dict(varlen=True, causal=True, arch=Arch.SM100)),
    (128, 128, dict(varlen=True, has_seqused_k=True, local=True, has_softcap=True, deterministic=True,
                    arch=Arch.SM100))])
def test_the_kernels_arithmetic_passes_the_backward_check(seed, fake_bwd, monkeypatch, d, dv, flags):
    """The check's tolerance admits what the kernel computes: the tile model as the main kernel
    (P and dS rounded to bf16, float32 accumulation, MUFU / tanh.approx errors) passes with room."""
    monkeypatch.setattr(compile_cache, "_compile_backward", lambda cfg, **_: tile_model_backward_kernel(cfg))
    cfg = bwd_config(d, dv, **flags)
    params = bm.BwdTileParams.from_backward_config(cfg)
    assert params.ds_from_rounded_p == (cfg.arch is Arch.SM100 and (d, dv) == (192, 128))
    assert params.cluster_m == cfg.cluster_m
    report = selfcheck.check_backward(cfg, compile_cache.get_backward_kernel(cfg), ops.BACKWARD_LAUNCH,
                                      torch.device("cpu"))
    print(report.summary())
    assert report.ok, report.failures
    assert all(err <= 0.6 * allowed for err, allowed in report.grads.values()), report.summary()
