"""fa4_kernels on the CPU: the math emulated in numpy, and compile-only checks of the sm_90a kernels
(structure of the generated code) -- no GPU needed."""

from __future__ import annotations

import functools
import glob
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "torch-ext"))

from flash_attn4.fa4_kernels import exp2 as exp2_mod  # noqa: E402
from flash_attn4.fa4_kernels.arch import Arch  # noqa: E402
from flash_attn4.fa4_kernels.config import BackwardConfig, ForwardConfig  # noqa: E402
from scripts import sass_stats_lib as lib  # noqa: E402


def _exp2_like_the_kernel(x: np.ndarray) -> np.ndarray:
    """exp2_fma step by step in float32: clamp, floor via the round-down magic add, Horner, and the
    exponent-field add of floor(x) << 23."""
    x = np.maximum(x.astype(np.float32), np.float32(-127.0))
    floor = np.floor(x).astype(np.float32)  # what add.rm(x, 1.5 * 2^23) - 1.5 * 2^23 yields
    frac = (x - floor).astype(np.float32)
    poly = np.float32(exp2_mod.COEFFS[3])
    for c in exp2_mod.COEFFS[2::-1]:
        poly = (poly * frac + np.float32(c)).astype(np.float32)
    bits = poly.view(np.int32) + (floor.astype(np.int32) << 23)
    return bits.view(np.float32)


def test_exp2_polynomial_relative_error_is_below_1e_4():
    rng = np.random.default_rng()
    x = rng.uniform(-60.0, 20.0, size=200_000).astype(np.float32)
    got = _exp2_like_the_kernel(x).astype(np.float64)
    want = np.exp2(x.astype(np.float64))
    rel = np.abs(got - want) / want
    assert rel.max() < 1e-4, rel.max()


def test_exp2_round_down_magic_gives_floor_for_negative_and_positive_inputs():
    """The magic constant leaves floor(x) in the low mantissa bits, for |x| < 2^22."""
    magic = np.float64(exp2_mod.ROUND_DOWN_MAGIC)
    for x in (-126.7, -3.5, -0.25, 0.0, 0.75, 5.999, 126.2):
        rounded = np.float32(np.floor(np.float64(x) + magic))  # round-down add, exact in float32 here
        assert float(rounded - np.float32(magic)) == np.floor(x)
        low_bits = (np.array(rounded, dtype=np.float32).view(np.int32) << 23) >> 23
        assert int(low_bits) == int(np.floor(x))


def _compile_in_subprocess(tmp_path: Path, cfg_kwargs: dict, keep: str = "", arch: str = "SM90"):
    """Compile one forward configuration (of Arch.<arch>) in another interpreter (sass_stats_lib's
    compile workers), its files in ``tmp_path``: the CompileResult (returncode, stdout, stderr)."""
    cfg = ForwardConfig(arch=getattr(Arch, arch), dtype="bfloat16", **cfg_kwargs)
    return lib.compile_config(cfg, "auto", tmp_path, keep=keep)


@functools.cache
def _sass_report():
    """scripts/sass_report.py as a module (it imports only the standard library at the top)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("sass_report", ROOT / "scripts" / "sass_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _nvdisasm() -> str | None:
    return _sass_report().find_nvdisasm()


def _sass_or_skip(tmp_path: Path) -> str:
    """The SASS of the one cubin a compile left in ``tmp_path``; the test is skipped without nvdisasm."""
    nvdisasm = _nvdisasm()
    if nvdisasm is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm): SASS not checked")
    return subprocess.run([nvdisasm, "-c", glob.glob(str(tmp_path / "*.cubin"))[0]], capture_output=True,
                          text=True).stdout


def test_sm90_forward_uses_wgmma_tma_and_does_not_spill(tmp_path):
    proc = _compile_in_subprocess(tmp_path, dict(head_dim=128, head_dim_v=128, causal=True), keep="ptx,cubin")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ptx = Path(glob.glob(str(tmp_path / "*.ptx"))[0]).read_text()
    assert "wgmma.mma_async" in ptx
    assert "cp.async.bulk.tensor" in ptx  # TMA loads
    assert "setmaxnreg" in ptx  # producer/consumer register reallocation
    assert ".target sm_90a" in ptx
    sass = _sass_or_skip(tmp_path)
    assert "HGMMA" in sass
    assert "MUFU.EX2" in sass
    assert "STL" not in sass and "LDL" not in sass, "register spills to local memory"
    # The causal mask is one select per score of a masked block (two such blocks' worth of code, 64
    # scores per thread each): a branch per score once compiled to over a thousand FSEL (mask.py).
    fsel = len(re.findall(r"\bFSEL\b", sass))
    assert 0 < fsel < 400, f"{fsel} FSEL in the causal forward"


def test_sm90_forward_tma_store_o_uses_stmatrix_and_a_tma_store(tmp_path):
    proc = _compile_in_subprocess(tmp_path, dict(head_dim=128, head_dim_v=128, causal=True, tma_store_o=True),
                                  keep="ptx,cubin")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ptx = Path(glob.glob(str(tmp_path / "*.ptx"))[0]).read_text()
    assert "stmatrix" in ptx and "cp.async.bulk.tensor.4d.global.shared" in ptx
    sass = _sass_or_skip(tmp_path)
    assert "STL" not in sass and "LDL" not in sass, "register spills to local memory"


def test_sm90_forward_tma_store_o_stages_o_in_q_where_it_does_not_fit_beside(tmp_path):
    """At d = 256 Q, two K/V stages and O's slabs exceed shared memory: O is staged in Q's buffer
    behind a barrier of all consumer threads (named barrier 7, 256 threads); a persistent CTA, which
    needs Q's buffer for its next tile, is refused with a clear error."""
    proc = _compile_in_subprocess(tmp_path, dict(head_dim=256, head_dim_v=256, tile_n=80, causal=True,
                                                 tma_store_o=True), keep="cubin")
    assert proc.returncode == 0, proc.stderr[-3000:]
    nvdisasm = _nvdisasm()
    if nvdisasm is not None:
        sass = subprocess.run([nvdisasm, "-c", glob.glob(str(tmp_path / "*.cubin"))[0]], capture_output=True,
                              text=True).stdout
        assert "STSM" in sass and "UTMASTG" in sass
        assert re.search(r"BAR\.SYNC\S* 0x7, 0x100", sass), "no barrier of the consumers before O overwrites Q"
        assert "STL" not in sass and "LDL" not in sass, "register spills to local memory"
    proc = _compile_in_subprocess(tmp_path, dict(head_dim=256, head_dim_v=256, tile_n=80, tma_store_o=True,
                                                 persistent_ctas=132))
    assert proc.returncode != 0 and "persistent CTA needs" in proc.stderr, proc.stderr[-3000:]


def test_sm90_forward_with_one_consumer_warpgroup(tmp_path):
    """tile_m = 64 (an A/B variant for decoding, where a tile holds a few real rows): one consumer
    warpgroup beside the producer, 256 threads, WGMMAs, no spills; ping-pong, which hands the GEMMs
    between consumers, is refused for it."""
    with pytest.raises(ValueError, match="pingpong=False"):
        ForwardConfig(arch=Arch.SM90, dtype="bfloat16", head_dim=128, head_dim_v=128, tile_m=64)
    proc = _compile_in_subprocess(tmp_path, dict(head_dim=128, head_dim_v=128, causal=True, tile_m=64, pingpong=False,
                                                 split_kv=True, pack_gqa=4), keep="ptx,cubin")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ptx = Path(glob.glob(str(tmp_path / "*.ptx"))[0]).read_text()
    assert ".reqntid 256, 1, 1" in ptx and "wgmma.mma_async" in ptx
    sass = _sass_or_skip(tmp_path)
    assert "HGMMA" in sass and "STL" not in sass and "LDL" not in sass, "register spills to local memory"


@pytest.mark.parametrize("head_dim,tile_n", [(256, 80), (192, 96)])
def test_sm90_forward_converts_p_in_pairs_at_kv_tiles_that_are_not_powers_of_two(tmp_path, head_dim, tile_n):
    """P's fragment holds tile_n / 2 scores per thread (40, 48): converted as one vector they became
    scalar cvt.rn.bf16.f32 plus packing moves between the P @ V WGMMAs, before each of which ptxas
    then injected a warpgroup.arrive (info C7519). fragments.store_converted converts pairs."""
    proc = _compile_in_subprocess(tmp_path, dict(head_dim=head_dim, head_dim_v=head_dim, tile_n=tile_n,
                                                 causal=True), keep="ptx")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ptx_path = glob.glob(str(tmp_path / "*.ptx"))[0]
    ptx = Path(ptx_path).read_text()
    assert "cvt.rn.bf16x2.f32" in ptx and "cvt.rn.bf16.f32" not in ptx
    if shutil.which("ptxas") is None:
        pytest.skip("ptxas not installed: its C7519 info not checked")
    ptxas = subprocess.run(["ptxas", "-arch=sm_90a", ptx_path, "-o", str(tmp_path / "check.cubin")],
                           capture_output=True, text=True)
    if "Unsupported .version" in ptxas.stderr:
        # The DSL's cu13 flavour writes PTX newer than a CUDA 13.0 ptxas on PATH reads.
        pytest.skip(f"the ptxas on PATH is older than the DSL's PTX: {ptxas.stderr.strip()[:200]}")
    assert ptxas.returncode == 0, ptxas.stderr[-3000:]
    assert "C7519" not in ptxas.stdout + ptxas.stderr, "ptxas injected warpgroup.arrive before a WGMMA"


@pytest.mark.parametrize("cfg", [dict(head_dim=32, head_dim_v=32, tile_m=192),
                                 dict(head_dim=80, head_dim_v=80),
                                 dict(head_dim=192, head_dim_v=128, tile_n=96, local=True, varlen=True),
                                 dict(head_dim=128, head_dim_v=128, causal=True, tma_store_o=True, persistent_ctas=132),
                                 dict(head_dim=64, head_dim_v=64, tile_m=192, varlen=True, persistent_ctas=132),
                                 dict(head_dim=128, head_dim_v=128, causal=True, pack_gqa=4, tma_store_o=True,
                                      has_sink=True),
                                 dict(head_dim=256, head_dim_v=256, tile_n=80, local=True, pack_gqa=8,
                                      has_softcap=True),
                                 dict(head_dim=128, head_dim_v=128, varlen=True, has_seqused_k=True, pack_gqa=4)])
def test_less_common_shapes_compile(tmp_path, cfg):
    proc = _compile_in_subprocess(tmp_path, cfg)
    assert proc.returncode == 0, proc.stderr[-3000:]


# The zeroing of V's rows past the keys (fa4_kernels/kv_tail.py) in the PTX: 16-byte zero stores to
# shared memory, the generic-to-async proxy fence, then the barrier before any MMA reads them.
_ZERO_STORE = re.compile(r"st\.shared\.v4\.b32\s+\[%r\d+\], \{0, 0, 0, 0\};")
_ZERO_THEN_SYNC = {"SM90": r"fence\.proxy\.async\.shared::cta;\s+bar\.sync\s+8, {threads};",
                   "SM100": r"fence\.proxy\.async\.shared::cta;\s+bar\.warp\.sync\s+-1;"}


@pytest.mark.parametrize("arch,cfg,threads", [
    ("SM90", dict(head_dim=128, head_dim_v=128), None),
    ("SM90", dict(head_dim=64, head_dim_v=64, tile_m=192, has_seqused_k=True), 384),
    ("SM90", dict(head_dim=128, head_dim_v=128, varlen=True, has_seqused_k=True, page_size=64, split_kv=True,
                  causal=True), 256),
    ("SM90", dict(head_dim=128, head_dim_v=128, tile_m=64, pingpong=False, has_seqused_k=True, split_kv=True,
                  pack_gqa=4), 128),
    ("SM100", dict(head_dim=128, head_dim_v=128, tile_m=256, varlen=True, has_seqused_k=True), 32),
], ids=["sm90-batched", "sm90-seqused_k-3wg", "sm90-paged-split", "sm90-one-consumer-split", "sm100-varlen"])
def test_v_rows_past_the_keys_are_zeroed_where_they_can_exist(tmp_path, arch, cfg, threads):
    """Issue 21 (NaN tail): kernels whose last KV tile can hold rows of the tensor past the keys
    (varlen, seqused_k, pages) zero those V rows, fenced for the async proxy and followed by the
    barrier of every thread that wrote (sm90: all consumer warpgroups, named barrier 8; sm100: the
    MMA warp); a batched kernel without seqused_k (TMA zero-fills past the tensor) has no such code."""
    proc = _compile_in_subprocess(tmp_path, cfg, keep="ptx", arch=arch)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ptx = Path(glob.glob(str(tmp_path / "*.ptx"))[0]).read_text()
    zero_stores = _ZERO_STORE.findall(ptx)
    if threads is None:
        assert not zero_stores and "bar.sync \t8," not in ptx
        return
    assert len(zero_stores) == 1, "one 16-byte zero store, in a loop over the rows"
    tail = ptx[ptx.index(zero_stores[0]):]
    assert re.search(_ZERO_THEN_SYNC[arch].format(threads=threads), tail), "fence + barrier after the zeroing"


_SPLIT = dict(split_head_dim=True, tile_n=64)


@pytest.mark.parametrize("cfg", [dict(head_dim=128, head_dim_v=128, causal=True), dict(head_dim=64, head_dim_v=64),
                                 dict(head_dim=96, head_dim_v=96, varlen=True, has_seqused_k=True, local=True,
                                      has_softcap=True, deterministic=True),
                                 dict(head_dim=128, head_dim_v=128, deterministic=True),
                                 dict(head_dim=64, head_dim_v=64, tile_m=128, causal=True),
                                 dict(head_dim=128, head_dim_v=128, tile_m=80, deterministic=True),
                                 dict(head_dim=256, head_dim_v=256, num_stages=1, causal=True, **_SPLIT),
                                 dict(head_dim=192, head_dim_v=128, varlen=True, has_softcap=True, **_SPLIT)])
def test_sm90_backward_compiles_with_wgmma_and_tma_reduce(tmp_path, cfg):
    """The backward's GEMMs are WGMMAs and dQ leaves through TMA reduce-adds (no per-element atomics);
    the split-head-dim layout, whose point is to fit the registers, does not spill."""
    proc = lib.compile_config(BackwardConfig(arch=Arch.SM90, dtype="bfloat16", **cfg), "auto", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ptx = Path(glob.glob(str(tmp_path / "*.ptx"))[0]).read_text()
    assert "wgmma.mma_async" in ptx and "cp.reduce.async.bulk.tensor" in ptx
    assert "red.relaxed.gpu.global.add.f32" not in ptx
    if cfg.get("split_head_dim"):
        nvdisasm = _nvdisasm()
        if nvdisasm is None:
            pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm): SASS not checked")
        sass = subprocess.run([nvdisasm, "-c", glob.glob(str(tmp_path / "*.cubin"))[0]], capture_output=True,
                              text=True).stdout
        assert "HGMMA" in sass and "STL" not in sass and "LDL" not in sass, "register spills to local memory"


def test_backward_refuses_what_it_does_not_do_yet():
    from flash_attn4.fa4_kernels.config import BackwardConfig
    from flash_attn4.fa4_kernels.sm90.bwd import FlashAttentionBackwardSm90

    with pytest.raises(NotImplementedError, match="head_dim"):  # d != dv needs the split layout
        FlashAttentionBackwardSm90(BackwardConfig(arch=Arch.SM90, dtype="bfloat16", head_dim=192, head_dim_v=128))
    with pytest.raises(NotImplementedError, match="multiples of 16"):
        FlashAttentionBackwardSm90(BackwardConfig(arch=Arch.SM90, dtype="bfloat16", head_dim=200, head_dim_v=200,
                                                  split_head_dim=True, tile_n=64))


def test_backward_config_rejects_mismatched_layouts():
    from flash_attn4.fa4_kernels.config import BackwardConfig

    base = dict(arch=Arch.SM90, dtype="bfloat16", head_dim=192, head_dim_v=192)
    with pytest.raises(ValueError, match="64 queries x 64 keys"):
        BackwardConfig(**base, split_head_dim=True)  # tile_n stays 128
    with pytest.raises(ValueError, match="64 or 80 queries x 128 keys"):
        BackwardConfig(**dict(base, head_dim=128, head_dim_v=128), tile_n=64)
    with pytest.raises(ValueError, match="64 queries x 128 keys"):  # 128-query blocks only up to d = 64
        BackwardConfig(**dict(base, head_dim=96, head_dim_v=96), tile_m=128)
    assert BackwardConfig(**dict(base, head_dim=64, head_dim_v=64), tile_m=128).tile_m == 128
    with pytest.raises(ValueError, match="64 queries x 128 keys"):  # 80-query blocks only at d = 128
        BackwardConfig(**dict(base, head_dim=96, head_dim_v=96), tile_m=80)
    with pytest.raises(ValueError, match="64 or 128 queries"):
        BackwardConfig(**dict(base, head_dim=64, head_dim_v=64), tile_m=80)
    assert BackwardConfig(**dict(base, head_dim=128, head_dim_v=128), tile_m=80).tile_m == 80
    for eighths in (-1, 9):
        with pytest.raises(ValueError, match=r"exp_eighths_under_dp must be in \[0, 8\]"):
            BackwardConfig(**base, split_head_dim=True, tile_n=64, exp_eighths_under_dp=eighths)


def test_head_dim_v_below_16_is_a_clear_error():
    """Refused when the configuration is built (sm90/tiles.check_forward), before any compile."""
    with pytest.raises(NotImplementedError, match="head_dim_v below 16 is not implemented"):
        ForwardConfig(arch=Arch.SM90, dtype="bfloat16", head_dim=64, head_dim_v=8)


def test_config_rejects_what_no_kernel_can_do():
    base = dict(arch=Arch.SM90, dtype="bfloat16", head_dim=128, head_dim_v=128)
    with pytest.raises(ValueError, match="head_dim"):
        ForwardConfig(**dict(base, head_dim=100))
    with pytest.raises(ValueError, match="dtype"):
        ForwardConfig(**dict(base, dtype="float32"))
    with pytest.raises(ValueError, match="exclusive"):
        ForwardConfig(**dict(base, causal=True, local=True))
    with pytest.raises(ValueError, match="exp2_emulated_eighths"):
        ForwardConfig(**dict(base, exp2_emulated_eighths=9))
    with pytest.raises(ValueError, match="tma_store_o is for batched inputs"):
        ForwardConfig(**dict(base, tma_store_o=True, varlen=True))
    with pytest.raises(ValueError, match="multiple of 16, got 72"):
        ForwardConfig(**dict(base, head_dim=72, head_dim_v=72, tma_store_o=True))
    with pytest.raises(ValueError, match="persistent_ctas"):
        ForwardConfig(**dict(base, persistent_ctas=-1))
    with pytest.raises(ValueError, match="pack_gqa must divide 64"):
        ForwardConfig(**dict(base, pack_gqa=3))


def test_pre_and_postprocess_configs_reject_other_dtypes():
    from flash_attn4.fa4_kernels.config import PostprocessConfig, PreprocessConfig

    with pytest.raises(ValueError, match="dtype must be one of"):
        PreprocessConfig(arch=Arch.SM90, dtype="float32", head_dim_v=128)
    with pytest.raises(ValueError, match="dtype must be one of"):
        PostprocessConfig(arch=Arch.SM90, dtype="float32", head_dim=64, tile_m=128)
    assert PostprocessConfig(arch=Arch.SM90, dtype="float16", head_dim=64, tile_m=128).dtype == "float16"
    with pytest.raises(ValueError, match="query blocks"):
        PostprocessConfig(arch=Arch.SM90, dtype="float16", head_dim=64, tile_m=96)
    with pytest.raises(ValueError, match="multiple of 16"):
        PostprocessConfig(arch=Arch.SM90, dtype="float16", head_dim=72, tile_m=64)


def test_compile_key_covers_every_field_and_no_sizes():
    a = ForwardConfig(arch=Arch.SM90, dtype="bfloat16", head_dim=128, head_dim_v=128)
    assert a.key() == ForwardConfig(arch=Arch.SM90, dtype="bfloat16", head_dim=128, head_dim_v=128).key()
    for change in (dict(causal=True), dict(pingpong=False), dict(tile_n=96), dict(exp2_emulated_eighths=2)):
        assert a.replace(**change).key() != a.key(), change
    assert not any(word in " ".join(a.key()) for word in ("seqlen", "batch", "num_heads"))


def test_sass_report_normalises_addresses_labels_and_parameter_offsets():
    report = _sass_report()
    a = "        /*0040*/                   LDC R1, c[0x0][0x28] ;\n.L_x_12:\n        /*0050*/  @P0 BRA `(.L_x_12) ;\n"
    b = "        /*0810*/                   LDC R1, c[0x0][0x3a8] ;\n.L_x_7:\n        /*0820*/  @P0 BRA `(.L_x_7) ;\n"
    assert report.normalised(a) == report.normalised(b) == "LDC R1, c[] ;\nL:\n@P0 BRA `(L) ;\n"
    assert report.normalised(a) != report.normalised(a.replace("R1", "R2"))
    counts = report.summary("  /*0000*/ HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24 ;\n"
                            "  /*0010*/ @!P1 STL [R1], R6 ;\n  /*0020*/ MUFU.EX2 R3, R3 ;\n"
                            "  /*0030*/ @P0 BRA.U.ANY `(.L_x_3) ;\n")
    assert (counts["HGMMA"], counts["STL (spill stores)"], counts["MUFU.EX2"], counts["instructions"]) == (1, 1, 1, 4)
    assert counts["BRA.U.ANY (uniformity loops)"] == 1 and counts["WARPGROUP.ARRIVE"] == 0


@pytest.mark.parametrize("spec,max_spills", [
    ("d=64", 0), ("d=64,causal=true", 0), ("d=128,tile_m=64", 0), ("d=128,causal=true,tile_m=64", 0),
    ("d=128", 0), ("d=128,causal=true", 0)])
def test_backward_kernel_spills_stay_bounded(spec, max_spills):
    """The unsplit layouts keep every value in registers (a spill in the step loop costs a
    local-memory round trip per step). The 80-query blocks the tiles pick at d = 128 spilled a few
    (3 to 24) until dQ was staged in register order; a bound, so that a change that spills shows up
    here before it does on the GPU."""
    if _nvdisasm() is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm): SASS not checked")
    report = _sass_report()
    counts = report.summary(report.compile_sass("bwd", "sm_90a", spec))
    assert counts["HGMMA"] > 0
    assert counts["STL (spill stores)"] <= max_spills and counts["LDL (spill loads)"] <= max_spills, counts


@pytest.mark.parametrize("spec,copies", [("d=128", 2), ("d=128,causal=true", 3), ("d=256", 2),
                                          ("d=256,causal=true", 3), ("d=256,causal=true,whole_k_gemms=false", 3)])
def test_forward_builds_the_main_loop_copies_it_runs(spec, copies):
    """The forward's code holds Q K^T and P @ V this many times: the prologue's Q K^T, each step loop's
    pair, the loop epilogue's P @ V. Without a causal or local mask only the last KV block crosses a
    mask edge, and the prologue takes it: no masked step loop (two copies). Causal: masked and
    mask-free loops (three). Whole-K GEMM calls change the IR, not the WGMMAs."""
    if _nvdisasm() is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm): SASS not checked")
    from flash_attn4 import dispatch

    d = int(spec.split(",")[0].split("=")[1])
    tile_n = dispatch.forward_config(Arch.SM90, "bfloat16", d, d, causal=False, local=False, has_softcap=False,
                                     varlen=False, has_seqused_k=False, has_sink=False).tile_n
    report = _sass_report()
    counts = report.summary(report.compile_sass("fwd", "sm_90a", spec))
    assert counts["HGMMA"] == copies * (d // 16 + tile_n // 16), counts
    assert counts["STL (spill stores)"] == 0 and counts["LDL (spill loads)"] == 0, counts


def test_schedule_model_orders_groups_like_the_scheduler():
    """scripts/schedule_model.py (the tail model behind the partial-group-first order and the
    backward's longest_first) splits heads into L2 groups as TileScheduler.create does and orders each group
    longest-first."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("schedule_model", ROOT / "scripts" / "schedule_model.py")
    model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(model)
    four_mib = 4 * 1024 * 1024  # d=256, 4k: K and V of one head
    assert model.group_sizes(32, four_mib, small_first=False) == [6, 6, 6, 6, 6, 2]
    assert model.group_sizes(32, four_mib, small_first=True) == [2, 6, 6, 6, 6, 6]
    assert model.group_sizes(12, four_mib, small_first=True) == [6, 6]  # no remainder: nothing moves
    assert model.grouped_order([1, 3, 2], [2, 1]) == [3, 3, 2, 2, 1, 1, 3, 2, 1]
    assert model.busy_share([5, 1, 1, 1, 1, 1], sms=2) == 1.0  # longest first: no tail
    assert model.busy_share([1, 1, 1, 1, 5], sms=2) == 9 / 2 / 7  # longest last: one SM runs on


@pytest.mark.parametrize("spec,values", [("d=64", 32), ("d=128", 40), ("d=128,tile_m=64,local=true", 32)])
def test_backward_stages_dq_in_register_order_with_128_bit_stores(spec, values):
    """dQ's staging for the TMA reduce-add is one 16-byte store per 4 accumulator values
    (sm90/dq_accum.py): 8 per step at d = 64, 10 at d = 128 with 80-query blocks, where the
    (row, column) order took 16 64-bit and 40 32-bit stores. The unsplit layouts store nothing else
    to shared memory with STS (dS leaves by stmatrix)."""
    if _nvdisasm() is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm): SASS not checked")
    report = _sass_report()
    sass = report.compile_sass("bwd", "sm_90a", spec)
    stores = re.findall(r"\bSTS(\.\w+)?\s", sass)
    assert stores == [".128"] * (values // 4), stores


@pytest.mark.parametrize("tile_m,head_dim", [(128, 64), (128, 32), (80, 128), (64, 128), (64, 48), (64, 256)])
def test_dq_register_order_is_a_permutation_of_the_block_with_the_wgmma_fragment_layout(tile_m, head_dim):
    from flash_attn4.fa4_kernels.sm90.dq_accum import DqTiling

    tiling = DqTiling(tile_m, head_dim)
    order = tiling.block_order()
    assert sorted(order) == list(range(tile_m * head_dim)) and tiling.rows_per_block * 128 == len(order)
    # each part is one rectangle of the block: (64 rows, all columns), (all rows, half the columns)
    rows, cols = tiling.part
    for part in range(2):
        cells = order[part * rows * cols:(part + 1) * rows * cols]
        row_set, col_set = {x // head_dim for x in cells}, {x % head_dim for x in cells}
        assert len(row_set) == rows and len(col_set) == cols
    # thread 0 of part 0 holds (M, N) = (0, 0), (0, 1), (8, 0), (8, 1) first; thread 1 the next pair
    # of N; thread 4 row 1 (the accumulator's quad layout). dQ^T's M is the head dim.
    def cell(m, n):
        return n * head_dim + m if tiling.transposed else m * head_dim + n
    assert order[:4] == [cell(0, 0), cell(0, 1), cell(8, 0), cell(8, 1)]
    assert order[4:8] == [cell(0, 2), cell(0, 3), cell(8, 2), cell(8, 3)]
    assert order[16:20] == [cell(1, 0), cell(1, 1), cell(9, 0), cell(9, 1)]
    assert order[128:132] == [cell(16, 0), cell(16, 1), cell(24, 0), cell(24, 1)]  # warp 1
    assert order[512:516] == [cell(0, 8), cell(0, 9), cell(8, 8), cell(8, 9)]  # thread 0's values 4..7


@pytest.mark.parametrize("spec,values", [("d=64", 64), ("d=64,causal=true", 64), ("d=128", 40),
                                          ("d=128,causal=true", 40), ("d=128,causal=true,tile_m=64", 32)])
def test_backward_masked_step_selects_once_per_score(spec, values):
    """The backward's step loop has two bodies (scripts/sass_paths.py counts what one trip executes):
    a block inside the mask takes the thread's `values` exponentials and no select; a block on a
    mask edge or the sequence's end one FSEL per score on top (its exponent to -inf), not two: the
    branch per score it had before made ptxas select twice (80 FSEL for 40 scores at d = 128)."""
    if _nvdisasm() is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm): SASS not checked")
    import importlib.util

    loader = importlib.util.spec_from_file_location("sass_paths", ROOT / "scripts" / "sass_paths.py")
    paths = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(paths)
    trips = paths.main_loop_trips(_sass_report().compile_sass("bwd", "sm_90a", spec))
    assert {t["MUFU.EX2"] for t in trips} == {values}, trips
    selects = {t["FSEL"] for t in trips}
    assert min(selects) == 0 and max(selects) == values, trips
    assert all(t["HGMMA"] == max(x["HGMMA"] for x in trips) for t in trips), "a trip without every GEMM"


def test_sass_paths_counts_what_one_loop_trip_executes():
    """scripts/sass_paths.py on a hand-written loop: a head, a guarded forward branch around two
    instructions (two trips: 7 and 5 executed), a wait whose retry block sits after EXIT (its first
    try only), and the back edge; the kernel's out-of-line retry block is no loop."""
    import importlib.util

    loader = importlib.util.spec_from_file_location("sass_paths", ROOT / "scripts" / "sass_paths.py")
    paths = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(paths)
    sass = "\n".join([
        "        /*0000*/                   MOV R0, RZ ;",
        ".L_x_0:",
        "        /*0010*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R0 ;",
        "        /*0020*/              @!P0 BRA `(.L_x_2) ;",
        ".L_x_3:",
        "        /*0030*/              @P1 BRA `(.L_x_1) ;",
        "        /*0040*/                   MUFU.EX2 R1, R1 ;",
        "        /*0050*/                   FSEL R1, R1, RZ, P2 ;",
        ".L_x_1:",
        "        /*0060*/                   HGMMA.64x80x16.F32.BF16 R24, gdesc[UR8], R24 ;",
        "        /*0070*/              @P3 BRA `(.L_x_0) ;",
        "        /*0080*/                   EXIT ;",
        ".L_x_2:",
        "        /*0090*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R0 ;",
        "        /*00a0*/              @!P0 BRA `(.L_x_2) ;",
        "        /*00b0*/                   BRA `(.L_x_3) ;",
    ])
    code = paths.parse(sass)
    assert len(code) == 12 and code[2]["to"] == 9 and code[11]["to"] == 3
    assert [hl for hl in paths.loops(code) if hl[1] - hl[0] > 1] == [(1, 7)]
    trips = sorted((t["instructions"], t["MUFU.EX2"], t["FSEL"], t["HGMMA"]) for t in paths.main_loop_trips(sass))
    assert trips == [(5, 0, 0, 1), (7, 1, 1, 1)]


@pytest.mark.parametrize("switch", [False, True])
def test_backward_kv_tail_zeroing_is_built_only_when_switched_on(tmp_path, switch):
    """sm90/bwd.py zero_kv_tail (issue 21, the backward's NaN tail; ZERO_KV_TAIL, on since it passed
    on a GPU): off, a varlen + seqused_k backward has no zero stores; on, K's and V's tail rows
    are zeroed (one 16-byte zero store each, in loops), fenced for WGMMA and followed by the
    consumers' barrier (KV_TAIL = 7, 256 threads) before any GEMM."""
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT / 'torch-ext')!r})
        from flash_attn4 import dispatch
        from flash_attn4.fa4_kernels.arch import Arch
        from flash_attn4.fa4_kernels.compile import compile_backward
        from flash_attn4.fa4_kernels.sm90 import bwd
        bwd.ZERO_KV_TAIL = {switch!r}
        compile_backward(dispatch.backward_config(Arch.SM90, "bfloat16", 128, 128, causal=True, local=False,
                                                  has_softcap=False, varlen=True, has_seqused_k=True,
                                                  deterministic=False))
    """)
    env = dict(os.environ, CUTE_DSL_DUMP_DIR=str(tmp_path), CUTE_DSL_KEEP="ptx")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ptx = Path(glob.glob(str(tmp_path / "*.ptx"))[0]).read_text()
    zero_stores = _ZERO_STORE.findall(ptx)
    if not switch:
        assert not zero_stores and "bar.sync \t7," not in ptx
        return
    assert len(zero_stores) == 2, "K's and V's rows, one 16-byte zero store each"
    tail = ptx[ptx.index(zero_stores[-1]):]
    assert re.search(r"fence\.proxy\.async\.shared::cta;\s+bar\.sync\s+7, 256;", tail), "fence + barrier after"
