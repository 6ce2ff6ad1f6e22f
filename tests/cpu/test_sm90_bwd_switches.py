"""The sm90 backward's schedule switches (BackwardConfig.separate_do_barrier, dq_bulk_reduce,
tma_store_dkv, one_step_body, exp2_emulated_eighths, ds_store_by_group, query_rows_by_shuffle; off in the config,
tma_store_dkv switched on by dispatch where the layout allows it): what the configuration accepts,
what the sm100 backward refuses, and what each compiles to for sm_90a (no GPU). tests/gpu/test_bwd.py
checks their gradients."""

from __future__ import annotations

import importlib.util
import re
from collections import Counter
from pathlib import Path

import pytest

from flash_attn4.fa4_kernels.arch import Arch
from flash_attn4.fa4_kernels.config import BackwardConfig

ROOT = Path(__file__).resolve().parents[2]
SWITCHES = ("separate_do_barrier", "dq_bulk_reduce", "tma_store_dkv", "one_step_body", "ds_store_by_group",
            "query_rows_by_shuffle")
SM90_D128 = dict(arch=Arch.SM90, dtype="bfloat16", head_dim=128, head_dim_v=128)


def test_switches_are_off_by_default_and_part_of_the_compile_key():
    base = BackwardConfig(**SM90_D128)
    for name in SWITCHES:
        assert getattr(base, name) is False, name
        assert base.replace(**{name: True}).key() != base.key(), name


@pytest.mark.parametrize("layout", [dict(varlen=True), dict(split_head_dim=True, tile_n=64)])
def test_tma_store_dkv_is_refused_where_a_tma_box_cannot_write_dk_dv(layout):
    with pytest.raises(ValueError, match="tma_store_dkv is for batched inputs in the unsplit layout"):
        BackwardConfig(**SM90_D128, tma_store_dkv=True, **layout)
    # the other switches take every layout
    for name in ("separate_do_barrier", "dq_bulk_reduce", "one_step_body"):
        assert getattr(BackwardConfig(**SM90_D128, **layout, **{name: True}), name)


def test_ds_store_by_group_is_refused_in_the_split_layout():
    with pytest.raises(ValueError, match="ds_store_by_group is for the unsplit layout"):
        BackwardConfig(**SM90_D128, ds_store_by_group=True, split_head_dim=True, tile_n=64)


@pytest.mark.parametrize("name", SWITCHES + ("exp2_emulated_eighths",))
def test_sm100_backward_refuses_the_hopper_switches(name):
    """sm100/tiles.py check_backward: a Hopper schedule switch is a ValueError there, naming it."""
    sm100 = dict(arch=Arch.SM100, dtype="bfloat16", head_dim=128, head_dim_v=128, tile_m=128, tile_n=128,
                 num_stages=1)
    assert BackwardConfig(**sm100).arch is Arch.SM100
    with pytest.raises(ValueError, match=name):
        BackwardConfig(**sm100, **{name: 2 if name == "exp2_emulated_eighths" else True})


@pytest.mark.parametrize("eighths", [-1, 9])
def test_exp2_emulated_eighths_is_a_count_of_eighths(eighths):
    assert BackwardConfig(**SM90_D128).exp2_emulated_eighths == 0
    with pytest.raises(ValueError, match="exp2_emulated_eighths must be in"):
        BackwardConfig(**SM90_D128, exp2_emulated_eighths=eighths)


def _sass_report():
    spec = importlib.util.spec_from_file_location("sass_report", ROOT / "scripts" / "sass_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if module.find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm): SASS not checked")
    return module


def _opcodes(report, spec: str) -> Counter:
    sass = report.compile_sass("bwd", "sm_90a", spec)
    return Counter(re.findall(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, flags=re.M))


def _no_spills_nor_serialised_wgmmas(ops: Counter, base: Counter):
    assert not any(op.startswith(("STL", "LDL")) for op in ops), "register spills"
    # one arrive per WGMMA group, as without the switch (ptxas fencing each WGMMA is a slowdown)
    assert ops["WARPGROUP.ARRIVE"] == base["WARPGROUP.ARRIVE"], (ops["WARPGROUP.ARRIVE"], base["WARPGROUP.ARRIVE"])


def test_separate_do_barrier_gives_do_its_own_mbarriers():
    """A full and an empty mbarrier per stage more (num_stages = 2 at d = 128: 4 more inits), and a wait
    on dO's between the S^T and dP^T GEMMs."""
    report = _sass_report()
    base = _opcodes(report, "d=128,causal=true")
    ops = _opcodes(report, "d=128,causal=true,separate_do_barrier=true")
    assert ops["SYNCS.EXCH.64"] == base["SYNCS.EXCH.64"] + 4
    assert ops["SYNCS.PHASECHK.TRANS64.TRYWAIT"] > base["SYNCS.PHASECHK.TRANS64.TRYWAIT"]
    _no_spills_nor_serialised_wgmmas(ops, base)


@pytest.mark.parametrize("spec", ["d=64", "d=128,causal=true,deterministic=true"])
def test_dq_bulk_reduce_adds_dq_without_a_tensor_map(spec):
    report = _sass_report()
    base = _opcodes(report, spec)
    ops = _opcodes(report, spec + ",dq_bulk_reduce=true")
    assert any(op.startswith("UTMAREDG") for op in base)
    assert any(op.startswith("UBLKRED.G.S.ADD.F32") for op in ops)
    assert not any(op.startswith("UTMAREDG") for op in ops), "a TMA tensor reduce left"
    _no_spills_nor_serialised_wgmmas(ops, base)


@pytest.mark.parametrize("spec", ["d=64", "d=128,causal=true"])
def test_tma_store_dkv_writes_dk_dv_through_shared_memory(spec):
    """dK and dV into K's and V's tiles by stmatrix and out by TMA stores (dispatch's default for
    batched inputs): no 32-bit global stores from the accumulators left. At d = 128 (80-query blocks) this serialised every WGMMA (34 arrives) when
    it was first tried (docs/perf.md, 2026-12-03); since dQ is staged in register order it does not."""
    report = _sass_report()
    base = _opcodes(report, spec + ",tma_store_dkv=false")
    ops = _opcodes(report, spec)  # dispatch's choice for batched inputs (tiles.backward_schedule)
    assert base["STG.E"] > 0 and ops["STG.E"] == 0
    assert any(op.startswith("UTMASTG") for op in ops) and ops["STSM.16.M88.4"] > base["STSM.16.M88.4"]
    _no_spills_nor_serialised_wgmmas(ops, base)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_bench_variants_of_the_switches_build_for_the_bench_cases(d, causal):
    """`bench.py --mode bwd --variant NAME:field=true` replaces dispatch's BackwardConfig fields for
    its batched cases: each switch, and all three, must make a valid config there (tma_store_dkv
    except in the split layout, d = 256)."""
    from flash_attn4 import dispatch
    from flash_attn4.fa4_kernels.config import parse_overrides

    base = dispatch.backward_config(Arch.SM90, "bfloat16", d, d, causal=causal, local=False, has_softcap=False,
                                    varlen=False, has_seqused_k=False, deterministic=False)
    for spec in ("separate_do_barrier=true", "dq_bulk_reduce=true", "tma_store_dkv=true",
                 "separate_do_barrier=true,dq_bulk_reduce=true,tma_store_dkv=true"):
        fields = parse_overrides(spec)
        if d > 128 and "tma_store_dkv" in fields:
            with pytest.raises(ValueError, match="tma_store_dkv"):
                base.replace(**fields)
            continue
        cfg = base.replace(**fields)
        assert all(getattr(cfg, name) is True for name in fields) and cfg.tile_m == base.tile_m


@pytest.mark.parametrize("spec,exponentials", [("d=128,causal=true", 40), ("d=64", 64)])
def test_one_step_body_builds_the_step_once(spec, exponentials):
    """one_step_body: the masked step for every query block, as flash-attn-4's loop (one copy of the
    step's code: the thread's exponentials once, each with its select), without spills or serialised
    WGMMAs; the default has a mask-free copy beside it (twice the exponentials in the code)."""
    report = _sass_report()
    base = _opcodes(report, spec)
    ops = _opcodes(report, spec + ",one_step_body=true")
    assert base["MUFU.EX2"] == 2 * exponentials and ops["MUFU.EX2"] == exponentials
    assert ops["FSEL"] >= exponentials
    _no_spills_nor_serialised_wgmmas(ops, base)


@pytest.mark.parametrize("spec,exponentials", [("d=64,causal=true", 64), ("d=128", 40)])
@pytest.mark.parametrize("eighths", [2, 8])
def test_exp2_emulated_eighths_moves_unmasked_exponentials_to_the_fma_pipe(spec, exponentials, eighths):
    """exp2_emulated_eighths: that many eighths of the thread's P^T columns take the polynomial
    (exp2.exp2_fma: 3 FFMA each, beside its floor) in the mask-free step only; the masked step keeps
    every exponential on MUFU (its -inf exponents), so MUFU.EX2 drops by exactly the emulated share
    of one step; no spills nor serialised WGMMAs."""
    from flash_attn4.fa4_kernels.exp2 import emulated

    report = _sass_report()
    base = _opcodes(report, spec)
    ops = _opcodes(report, f"{spec},exp2_emulated_eighths={eighths}")
    # the thread's S^T fragment: 2 key rows x (exponentials / 2) query columns, chosen by column pair
    moved = 2 * sum(emulated(c, eighths) for c in range(exponentials // 2))
    assert moved == exponentials * eighths // 8 or spec == "d=128"  # 20 columns at 80-query blocks
    assert base["MUFU.EX2"] == 2 * exponentials and ops["MUFU.EX2"] == 2 * exponentials - moved
    assert ops["FFMA"] >= base["FFMA"] + 3 * moved
    _no_spills_nor_serialised_wgmmas(ops, base)


def _stsm_gaps(report, spec: str) -> list[int]:
    """Instructions between consecutive stmatrix of the step's dS^T (the kernel's first 8 STSM; the
    others store dK and dV after the loop)."""
    sass = report.compile_sass("bwd", "sm_90a", spec)
    lines = re.findall(r"^\s*/\*[0-9a-f]+\*/\s+(.*)$", sass, flags=re.M)
    stores = [i for i, line in enumerate(lines) if "STSM" in line][:8]
    return [b - a - 1 for a, b in zip(stores, stores[1:])]


def test_ds_store_by_group_spreads_the_ds_stores_over_the_gradient_arithmetic():
    """ds_store_by_group at d = 64 causal (128-query blocks) with all of P^T under dP^T: the same
    code reordered, the 8 stmatrix of dS^T each after its 4 columns' arithmetic (8 scores, 4
    conversions) instead of back to back after dV's GEMM is issued; the same instruction count, no
    spills nor serialised WGMMAs; with 3/8 of P^T under dP^T (flash-attn-4's step shape: dispatch's
    masked d = 64 kernels) still spread and without spills."""
    report = _sass_report()
    spec = "d=64,causal=true,exp_eighths_under_dp=8"
    base = _opcodes(report, spec + ",ds_store_by_group=false")
    ops = _opcodes(report, spec + ",ds_store_by_group=true")
    assert ops["STSM.16.M88.4"] == base["STSM.16.M88.4"]
    assert sum(ops.values()) == sum(base.values())
    _no_spills_nor_serialised_wgmmas(ops, base)
    assert max(_stsm_gaps(report, spec + ",ds_store_by_group=false")) <= 2
    assert min(_stsm_gaps(report, spec + ",ds_store_by_group=true")) >= 8
    for spec in ("d=64,causal=true", "d=64,exp_eighths_under_dp=3,ds_store_by_group=true"):
        assert min(_stsm_gaps(report, spec)) >= 8, spec
        assert not any(op.startswith(("STL", "LDL")) for op in _opcodes(report, spec)), spec


@pytest.mark.parametrize("columns", [16, 20, 32])  # 64-, 80- and 128-query blocks
@pytest.mark.parametrize("eighths", range(9))
def test_ds_groups_store_each_group_once_after_its_last_column(columns, eighths):
    """DsGroups.completed_by in the step's computing order (columns [under_dp, end), then [0,
    under_dp)): every stmatrix group is stored exactly once, and only when all 4 of its columns are
    done."""
    from flash_attn4.fa4_kernels.sm90.bwd import DsGroups

    groups = DsGroups(None, None, None, None)
    under_dp = columns * eighths // 8
    done, stored = set(), []
    for c in list(range(under_dp, columns)) + list(range(under_dp)):
        done.add(c)
        g = groups.completed_by(c, under_dp)
        if g is not None:
            assert set(range(4 * g, 4 * g + 4)) <= done, (c, g)
            stored.append(g)
    assert sorted(stored) == list(range(columns // 4))


def _count(ops: Counter, prefix: str) -> int:
    return sum(n for op, n in ops.items() if op.startswith(prefix))


@pytest.mark.parametrize("spec", ["d=64,causal=true", "d=64", "d=128,causal=true"])
def test_query_rows_by_shuffle_takes_lse_and_rowsum_off_shared_memory(spec):
    """query_rows_by_shuffle at 128- and 80-query blocks: each column pair's LSE or rowsum load
    (LDS, all of the kernel's) becomes two warp shuffles (SHFL.IDX), and one step loads four
    values a lane: two LDS.64 per row; no spills nor serialised WGMMAs."""
    report = _sass_report()
    base, ops = _opcodes(report, spec), _opcodes(report, spec + ",query_rows_by_shuffle=true")
    assert _count(ops, "LDS") <= 4 < _count(base, "LDS"), (_count(ops, "LDS"), _count(base, "LDS"))
    assert _count(ops, "SHFL") - _count(base, "SHFL") >= 2 * (_count(base, "LDS") - 4)
    _no_spills_nor_serialised_wgmmas(ops, base)


@pytest.mark.parametrize("queries", [80, 128])
def test_query_rows_by_shuffle_fetches_each_columns_own_query(queries):
    """QueryRowValues.by_shuffle's lanes and registers: for every lane t and column c of a WGMMA
    accumulator (query 8 * (c // 2) + 2 * (t % 4) + c % 2), the register and lane shuffle_source
    names hold exactly that query (held_queries), and the register is the same on every lane."""
    from flash_attn4.fa4_kernels.sm90.fragments import QueryRowValues

    held = [QueryRowValues.held_queries(lane, queries) for lane in range(32)]
    columns = queries // 4  # per thread: 2 adjacent columns in each 8-column group
    for c in range(columns):
        register, source = QueryRowValues.shuffle_source(c)
        for t in range(32):
            query = 8 * (c // 2) + 2 * (t % 4) + c % 2
            assert query < queries
            assert held[source + t % 4][register] == query, (queries, c, t)
