"""The sm100 backward at d = dv = 256 (sm100/bwd_pair256.py, a CTA pair with 64 keys per CTA): its
tensor-memory and shared-memory plan (tiles.backward_pair256_*), and, compiled for sm_100a on the
CPU, what the SASS and PTX say about it. Expected numbers come from the plan (tile sizes, the MMA's
K, the folded accumulators), never from a compile."""

from __future__ import annotations

import pytest

from flash_attn4.fa4_kernels.arch import Arch
from flash_attn4.fa4_kernels.config import BackwardConfig
from flash_attn4.fa4_kernels.sm100 import dq_accum as sm100_dq
from flash_attn4.fa4_kernels.sm100 import tiles as sm100_tiles
from scripts import sass_stats_lib as lib
from tests.cpu.test_selfcheck import fake_bwd, fake_gpu, seed  # noqa: F401  (fixtures of b200)
from tests.cpu.test_sm100_bwd_dispatch import b200, blackwell  # noqa: F401  (fixtures: a faked B200 / B300)

TMEM_LIMIT = 512
MMA_K = 16  # reduction depth of one 16-bit tcgen05 MMA
CHUNK = sm100_tiles.BWD_DQ_CHUNK


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


# ---- The compiled kernel ------------------------------------------------------------------------------
# Problem classes compiled here (each under ptxas 13.4 and 12.9): plain, causal, a local window with
# softcap, causal with the deterministic dQ order, fp16; varlen (K/V rows past the keys zeroed by the
# even CTA): plain, causal with seqused_k, and a local window with softcap and the deterministic order.
# sm_103a (B300) runs the same kernel under the same rules (tiles_sm103), compiled for it: once, causal.
CASES = {"d256": dict(), "d256_causal": dict(causal=True), "d256_local_softcap": dict(local=True, has_softcap=True),
         "d256_causal_deterministic": dict(causal=True, deterministic=True), "d256_fp16": dict(dtype="float16"),
         "sm103_d256_causal": dict(causal=True, arch=Arch.SM103),
         "d256_varlen": dict(varlen=True),
         "d256_causal_varlen_seqused_k": dict(causal=True, varlen=True, has_seqused_k=True),
         "d256_varlen_local_softcap_deterministic": dict(varlen=True, local=True, has_softcap=True,
                                                         deterministic=True)}


def pair256_config(dtype="bfloat16", arch=Arch.SM100, **flags) -> BackwardConfig:
    """The d = 256 pair's problem class, built directly (whether or not dispatch routes to it)."""
    return BackwardConfig(arch=arch, dtype=dtype, head_dim=256, head_dim_v=256, tile_m=sm100_tiles.BWD_TILE_M,
                          tile_n=sm100_tiles.TILE_N, cluster_m=2, num_stages=1, **flags)


def kernel_of(cfg):
    from flash_attn4.fa4_kernels.sm100 import bwd, bwd_pair256

    kernel = bwd_pair256.backward_kernel(cfg)
    assert isinstance(kernel, bwd_pair256.FlashAttentionBackwardSm100Pair256)
    return bwd, kernel


def expected_mma256(cfg) -> int:
    """Per query block, each GEMM once, one instruction per k-step: S^T over d, dP^T over dv, dV
    and dK over the block's queries (M = the pair's 128 keys), dQ over the pair's 128 keys (M = the
    block's queries)."""
    pair_keys = 2 * sm100_tiles.BWD_PAIR256_KEYS
    return (cfg.head_dim + cfg.head_dim_v + 2 * cfg.tile_m + pair_keys) // MMA_K


@pytest.fixture(scope="module", params=[(n, f) for n in CASES for f in ("cu13", "cu12")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def compiled(request):
    name, flavour = request.param
    cfg = pair256_config(**CASES[name])
    return flavour, cfg, lib.kernel_stats(cfg, flavour)


def test_pair256_compiles_without_spills_under_both_ptxas(compiled):
    flavour, cfg, stats = compiled
    assert stats["target"] == cfg.arch.value, flavour
    assert stats["ldl"] == stats["stl"] == 0 and stats["frame_bytes"] == 0, \
        f"{cfg}, {flavour}: {stats['ldl']} LDL / {stats['stl']} STL, stack frame {stats['frame_bytes']} B"
    assert lib.static_problems(stats) == [], flavour


def test_pair256_is_cta_group_2_throughout(compiled):
    """Every MMA and commit is its 2-CTA form (M = 128 over the pair: an MMA of cta_group::1 would
    compute 64 of the 128 rows), as many MMAs as the tiles imply, every operand load a 2-CTA TMA and
    only the two per-CTA row loads (LSE, D) not; TMEM allocated, relinquished and freed once with
    cta_group::2; the budgets are the 1-CTA kernel's, one setmaxnreg each."""
    from tests.cpu.test_sm100_static import opcode_counts

    flavour, cfg, stats = compiled
    bwd, plan = kernel_of(cfg)
    ops = opcode_counts(cfg, flavour)
    assert ops["mma"] == ops["mma_2cta"] == expected_mma256(cfg) == stats["utcmma"], ops
    assert ops["commit"] == ops["commit_2cta"] > 0, ops
    # K, V, K^T once; Q, dO, Q^T, dO^T per step (in boxes of a swizzle atom's width): all 2-CTA.
    assert ops["tma_2cta"] >= 7 and ops["tma"] - ops["tma_2cta"] == 2, ops
    rows = "UTMALDG.2D" if cfg.varlen else "UTMALDG.3D"  # LSE, D: (seq, head[, batch])
    assert stats["opcodes"].get(rows, 0) == 2, stats["opcodes"]
    ptx = stats["ptx"]
    assert [(a["cta_group"], a["columns"]) for a in ptx["tmem_alloc"]] == [(2, TMEM_LIMIT)]
    assert [d["cta_group"] for d in ptx["tmem_dealloc"]] == [2] and ptx["tmem_relinquish"] == [2]
    assert stats["two_cta"] and stats["two_cta_ptx"] and stats["cta_group"] == 2
    assert stats["usetmaxreg"] == stats["setmaxnreg"]
    budgets = plan.registers
    assert budgets["dq"] + bwd.COMPUTE_GROUPS * budgets["compute"] + budgets["other"] == 4 * bwd.LAUNCH_REGISTERS
    expected = sorted(v if v > bwd.LAUNCH_REGISTERS else -v for v in set(budgets.values()) - {bwd.LAUNCH_REGISTERS})
    assert sorted(int(v) for v in stats["usetmaxreg"]) == expected


def test_pair256_tensor_memory_reads_and_exponentials(compiled):
    """TMEM loads, derived from the plan: per step a compute thread loads its 32 columns of S^T and
    of dP^T once each (the folded 64 columns split between the two warpgroups), the dQ warpgroup its
    d / 2 folded columns by 32; at the end each compute warpgroup its half of the lane's d / 2
    columns of dK and of dV. No TMEM store (P^T, dS^T go to shared memory). One exponential per
    element of the thread's chunk, in the masked and the unmasked variant, and dS's subtraction and
    product packed per column pair."""
    flavour, cfg, stats = compiled
    _, plan = kernel_of(cfg)
    compute = 2  # S^T, dP^T
    dq = cfg.head_dim // 2 // CHUNK
    out = 2 * (cfg.head_dim // 2 // 2 // CHUNK)  # dK, dV
    assert stats["ldtm"] == compute + dq + out and plan.out_loads * 2 == out and plan.dq_loads == dq, stats["ldtm"]
    assert stats["sttm"] == 0
    assert stats["mufu_ex2"] == 2 * CHUNK, stats["mufu_ex2"]
    # dS = P (dP - D) as packed f32x2: one FADD2 and one FMUL2 per column pair and variant.
    assert stats["fadd2"] == stats["fmul2"] == 2 * CHUNK // 2, (stats["fadd2"], stats["fmul2"])


def test_pair256_ds_crosses_through_distributed_shared_memory_and_dq_by_bulk_adds(compiled):
    """dS: every compute thread stores its 32 16-bit values into the dQ operand of the CTA of its
    query half through a shared::cluster address (mapa), 16 bytes at a time, after the masked or
    unmasked variant computed them; one async-proxy fence over the cluster's shared memory, then the release as a
    cluster-scope arrival on the even CTA's barrier, which the MMA warp follows with a cluster
    acq_rel fence. dQ: per 32-column load of a dQ thread's head-dim half, each half's staged chunk
    added in runs of this CTA's 64 rows (1-D bulk reduce-adds; no tensor-map reduce). Varlen adds
    pair_zero_kv_tail's zero stores and its two fences (test_pair256_kv_tail_rows_are_zeroed_...)."""
    from tests.cpu.test_sm100_bwd_static import PAIR_ZERO_STORE_PTX, reduce_adds

    flavour, cfg, stats = compiled
    _, plan = kernel_of(cfg)
    ptx = lib.kernel_artifacts(cfg, flavour)["ptx"].read_text()
    zeroing = len(PAIR_ZERO_STORE_PTX.findall(ptx))
    assert bool(zeroing) == cfg.varlen, zeroing
    tail = 1 if zeroing else 0
    # One store site: the masked and unmasked variants differ only in the values.
    assert ptx.count("st.shared::cluster.v4.b32") - zeroing == CHUNK * 2 // 16
    assert ptx.count("mapa.shared::cluster") >= 1
    assert ptx.count("fence.proxy.async.shared::cluster") == 1 + tail
    assert ptx.count("fence.acq_rel.cluster") == 1 + tail
    assert ptx.count("mbarrier.arrive.release.cluster.shared::cluster.b64") == 1
    assert plan.dq_runs == CHUNK // sm100_dq.VECTOR and plan.dq_loads == cfg.head_dim // 2 // CHUNK
    assert stats["opcodes"].get("UBLKRED.G.S.ADD.F32.RN", 0) == plan.dq_loads * 2
    assert reduce_adds(stats) == 0


def test_pair256_kv_tail_rows_are_zeroed_in_both_ctas_before_the_first_mma(compiled):
    """Varlen / seqused_k: the even CTA's MMA warp zeroes K's, V's (64 keys per CTA) and K^T's (the
    pair's 128 keys, a head-dim half per CTA) rows past the keys in both CTAs through shared::cluster
    addresses, after the K/V full barrier's wait and before the first MMA, then fences: the d = 128
    pair's test (bwd_pair.pair_zero_kv_tail is the same function on 64-key blocks); batched pairs have
    no zero store."""
    from tests.cpu.test_sm100_bwd_static import test_pair_kv_tail_rows_are_zeroed_in_both_ctas_before_the_first_mma

    test_pair_kv_tail_rows_are_zeroed_in_both_ctas_before_the_first_mma(compiled)


@pytest.mark.parametrize("fault", [None, "kt_keys_as_columns", "kv_keys_of_128_key_ctas"])
def test_pair256_zeroing_views_are_checked_against_both_ctas_mmas(fault, monkeypatch):
    """check_pair_key_rows on 64-key blocks (run when a varlen d = 256 pair is traced) accepts the
    (key, column) views pair_zero_kv_tail writes through, and refuses wrong ones: K^T's keys and
    columns swapped, or the odd CTA's keys counted from 128 (the d = 128 pair's blocks)."""
    from flash_attn4.fa4_kernels.sm100 import bwd_pair, bwd_pair256
    from tests.cpu.test_sm100_bwd_static import pair_key_rows_error, wrong_kt_key_rows

    _, plan = kernel_of(pair256_config(varlen=True))
    if fault == "kt_keys_as_columns":
        monkeypatch.setattr(bwd_pair, "kt_key_rows", wrong_kt_key_rows)
    keys = 2 * bwd_pair256.KEYS if fault == "kv_keys_of_128_key_ctas" else bwd_pair256.KEYS
    error = pair_key_rows_error(plan, plan.pair256_mmas, bwd_pair256.PAIR_KEYS, keys)
    assert (error is None) if fault is None else (error and "disagrees with the MMA" in error), error


def test_pair256_kernel_plan_is_the_tiles_plan():
    """The kernel's TMEM columns are tiles.backward_pair256_tmem_columns' (what the plan tests check),
    and nothing is placed over another accumulator."""
    _, plan = kernel_of(pair256_config())
    columns = sm100_tiles.backward_pair256_tmem_columns(256, 256)
    got = dict(dk=plan.tmem_dk, dv=plan.tmem_dv, s=plan.tmem_s, dp=plan.tmem_dp, dq=plan.tmem_dq)
    assert got == {name: start for name, (start, _) in columns.items()} and not plan.dq_over_dp


# ---- dispatch ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", [Arch.SM100, Arch.SM103], ids=lambda a: a.value)
@pytest.mark.parametrize("flags", [dict(), dict(causal=True), dict(local=True, has_softcap=True),
                                   dict(causal=True, deterministic=True), dict(varlen=True),
                                   dict(varlen=True, has_seqused_k=True, causal=True),
                                   dict(varlen=True, local=True, deterministic=True)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dispatch_runs_d256_on_the_pair_kernel_with_no_fallback(arch, flags, dtype):
    """Batched or varlen d = dv = 256 goes to the d = 256 pair (whatever BWD_TWO_CTA says: there is no 1-CTA
    kernel at this head dim), and a pair that fails its first-use self-check has no fallback (the
    failure raises)."""
    from flash_attn4 import dispatch
    from flash_attn4.fa4_kernels.sm100 import bwd_pair256

    base = dict(causal=False, local=False, has_softcap=False, varlen=False, has_seqused_k=False, deterministic=False)
    original = sm100_tiles.BWD_TWO_CTA
    try:
        for on in (True, False):
            sm100_tiles.BWD_TWO_CTA = on
            dispatch.backward_config.cache_clear()
            cfg = dispatch.backward_config(arch, dtype, 256, 256, **{**base, **flags})
            assert (cfg.cluster_m, cfg.num_stages, cfg.tile_m, cfg.tile_n) == (2, 1, 128, 128)
            assert isinstance(bwd_pair256.backward_kernel(cfg), bwd_pair256.FlashAttentionBackwardSm100Pair256)
            assert dispatch.self_check_fallback(cfg) is None
    finally:
        sm100_tiles.BWD_TWO_CTA = original
        dispatch.backward_config.cache_clear()


@pytest.mark.parametrize("flags", [dict(), dict(varlen=True), dict(varlen=True, has_seqused_k=True, causal=True)])
def test_d256_single_cta_is_refused_varlen_or_not(flags):
    """d = 256 has no 1-CTA kernel, varlen or not: cluster_m = 1 is refused naming the head dims,
    while the pair's configuration of the same problem is accepted."""
    with pytest.raises(NotImplementedError, match=r"sm_100a backward: head dims 256/256 are not implemented "
                                                  r"on single CTAs"):
        pair256_config(**flags).replace(cluster_m=1)
    assert pair256_config(**flags).cluster_m == 2


def test_the_d128_pair_and_other_head_dims_keep_their_kernels():
    """The registry's entry (bwd_pair256.backward_kernel) hands every other configuration to
    bwd_pair.backward_kernel: the d = 128 pair, its 1-CTA fallback, the serial 192 / 128 kernel."""
    from flash_attn4 import dispatch
    from flash_attn4.fa4_kernels.arch import KERNELS
    from flash_attn4.fa4_kernels.sm100 import bwd_pair, bwd_pair256, bwd_serial

    assert KERNELS[Arch.SM100].backward == KERNELS[Arch.SM103].backward == "bwd_pair256:backward_kernel"
    base = dict(causal=True, local=False, has_softcap=False, varlen=False, has_seqused_k=False, deterministic=False)
    d128 = dispatch.backward_config(Arch.SM100, "bfloat16", 128, 128, **base)
    single = dispatch.self_check_fallback(d128) or d128
    serial = dispatch.backward_config(Arch.SM100, "bfloat16", 192, 128, **base)
    for cfg in (d128, single, serial):
        assert type(bwd_pair256.backward_kernel(cfg)) is type(bwd_pair.backward_kernel(cfg))
    assert isinstance(bwd_pair256.backward_kernel(serial), bwd_serial.FlashAttentionBackwardSm100Serial)


@pytest.mark.parametrize("name", ["d256_causal_deterministic", "d256_causal_varlen_seqused_k"])
def test_pair256_verifier_reports_only_the_pair_baseline(name):
    """CUTE_DSL_COMPILER_OPT=warnings: exactly the reviewed entries of the d = 128 pair
    (tests/cpu/verifier_baseline.json, "sm100 bwd pair d128"): the d = 256 pair builds its barriers
    with the same make_pair_pipelines, and its own code (two load phases, shared-memory P^T / dS^T)
    adds no diagnostic, nor does the varlen pair's zeroing (its extra wait on the K/V barrier)."""
    import json
    from pathlib import Path

    baseline = json.loads((Path(__file__).parent / "verifier_baseline.json").read_text())["configs"]
    got = sorted(lib.diagnostic_key(d) for d in lib.verifier_diagnostics(pair256_config(**CASES[name]), "cu13"))
    assert got == sorted(baseline["sm100 bwd pair d128"]), (name, got)


# ---- the torch layer's path on a faked B200 / B300 (tests/cpu/test_sm100_bwd_dispatch.py's fixtures) ----


@pytest.mark.parametrize("d,causal", [(256, True), (248, False)])
def test_b200_d256_backward_runs_the_pair_after_its_self_check(blackwell, d, causal):
    """A user's d = 256 (or 248, padded) forward and backward on a faked B200 / B300: the pair's
    configuration (cluster_m 2, one Q/dO stage) is the only backward compiled, its self-check launch
    comes first, and the gradients (the stand-in's float32 math through sm100's dQ accumulator order)
    match autograd of the reference."""
    import torch

    from flash_attn4 import selfcheck
    from tests.cpu.test_selfcheck import BF16, leaves, rand_qkv
    from tests.cpu.test_sm100_bwd_dispatch import grads_of, ops_call, reference_grads

    q, k, v = rand_qkv(b=2, sq=150, sk=140, hq=4, hk=2, d=d)
    dout = torch.randn(2, 150, 4, d, dtype=BF16)
    got = grads_of(lambda *t: ops_call(*t, causal=causal), leaves(q, k, v), dout)
    want = reference_grads(q, k, v, dout, causal=causal)
    for name, g, w in zip("qkv", got, want):
        err = float((g.double() - w).abs().max())
        assert err <= 0.02 * float(w.abs().max()) + 1e-3, (name, err)
    mains = [c for c in blackwell["configs"] if isinstance(c, BackwardConfig)]
    assert len(mains) == 1
    cfg = mains[0]
    assert (cfg.arch, cfg.head_dim, cfg.head_dim_v, cfg.causal, cfg.cluster_m, cfg.num_stages) == \
        (blackwell["arch"], 256, 256, causal, 2, 1)
    assert len(blackwell["bwd_calls"]) == 2 and selfcheck.verdict(cfg, "cpu") == "passed"


def test_wrong_d256_backward_raises_without_a_fallback(b200):
    """The d = 256 pair has no other kernel to fall back to: a failed first-use check raises its
    SelfCheckError, and no gradient is returned."""
    import torch

    from flash_attn4 import dispatch, selfcheck
    from tests.cpu.test_selfcheck import dk_scaled, leaves, rand_qkv
    from tests.cpu.test_sm100_bwd_dispatch import ops_call

    b200["bwd_mutate"] = dk_scaled
    q, k, v = tensors = leaves(*rand_qkv(hq=4, hk=2, d=256))
    out = ops_call(q, k, v, causal=True)
    with pytest.raises(selfcheck.SelfCheckError, match=r"BackwardConfig\(arch=sm_100a") as info:
        out.backward(torch.randn_like(out))
    cfg = [c for c in b200["configs"] if isinstance(c, BackwardConfig)][0]
    assert (cfg.head_dim, cfg.head_dim_v, cfg.cluster_m) == (256, 256, 2)
    assert dispatch.self_check_fallback(cfg) is None and "head_dim=256" in str(info.value)
    assert all(t.grad is None for t in tensors) and len(b200["bwd_calls"]) == 1  # the check's launch only


@pytest.mark.parametrize("name", ["varlen", "varlen causal", "varlen seqused_k window softcap deterministic"])
def test_b200_d256_varlen_backward_runs_the_pair_after_a_varlen_self_check(b200, name):
    """A user's varlen backward at d = 256 (packed / padded batches) reaches the d = 256 pair
    (varlen flags), after a first-use check on a varlen problem whose sequences have odd numbers of
    64-key blocks (the last pair's odd block past the keys, its packed rows another sequence's) and
    a sequence of more than one pair; the gradients match autograd of the reference."""
    from flash_attn4 import selfcheck
    from tests.cpu.test_sm100_bwd_dispatch import FEATURES, feature_call, odd_blocks_past_the_keys, reference_grads

    opts = FEATURES[name]
    out, tensors, dout, ref = feature_call(opts, d=256)
    out.backward(dout)
    want = reference_grads(*tensors, dout, **ref)
    for label, t, w in zip("qkv", tensors, want):
        err = float((t.grad.double() - w).abs().max())
        assert err <= 0.02 * float(w.abs().max()) + 1e-3, (name, label, err)
    cfg = [c for c in b200["configs"] if isinstance(c, BackwardConfig)][0]
    assert (cfg.head_dim, cfg.cluster_m, cfg.varlen, cfg.has_seqused_k) == (256, 2, True, opts.get("seqused_k", False))
    assert selfcheck.verdict(cfg, "cpu") == "passed"
    check = selfcheck.build_backward_problem(cfg).fwd
    keys = sm100_tiles.BWD_PAIR256_KEYS
    assert check.varlen and odd_blocks_past_the_keys(check.cu_seqlens_k, check.seqused_k, keys)
    assert any(-(-used // keys) > 2 for _, _, used in check.lengths)  # a second pair


def test_d256_varlen_pair_storing_past_its_keys_fails_the_check_and_raises(b200, monkeypatch):
    """A varlen d = 256 pair whose odd CTA stores its 64-key block's dK / dV rows although the block
    lies past its sequence's keys (zeros into the next sequences' rows) fails its first-use check,
    and with no 1-CTA kernel at this head dim the backward raises (no gradient returned)."""
    from flash_attn4 import compile_cache, dispatch, selfcheck
    from tests.cpu.test_selfcheck import FakeBackward
    from tests.cpu.test_sm100_bwd_dispatch import feature_call, odd_blocks_past_the_keys

    keys = sm100_tiles.BWD_PAIR256_KEYS

    class OddCtaStoresPastItsKeys(FakeBackward):
        def __call__(self, q, k, v, dout, lse_log2, dpsum, dq_acc, dk, dv, cu_q, cu_k, seqused_k, *rest):
            super().__call__(q, k, v, dout, lse_log2, dpsum, dq_acc, dk, dv, cu_q, cu_k, seqused_k, *rest)
            for rows in odd_blocks_past_the_keys(cu_k, seqused_k, keys):
                dk[rows], dv[rows] = 0, 0

    monkeypatch.setattr(compile_cache, "_compile_backward", lambda cfg, **_: OddCtaStoresPastItsKeys(cfg, b200))
    out, tensors, dout, _ = feature_call(dict(varlen=True, causal=True), d=256)
    with pytest.raises(selfcheck.SelfCheckError, match=r"BackwardConfig\(arch=sm_100a"):
        out.backward(dout)
    cfg = dispatch.backward_config(Arch.SM100, "bfloat16", 256, 256, causal=True, local=False, has_softcap=False,
                                   varlen=True, has_seqused_k=False, deterministic=False)
    assert (cfg.head_dim, cfg.cluster_m, cfg.varlen) == (256, 2, True)
    assert dispatch.self_check_fallback(cfg) is None and selfcheck.verdict(cfg, "cpu") == "failed"
    assert all(t.grad is None for t in tensors)
