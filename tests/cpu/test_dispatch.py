"""Dispatch: capability -> compile target (with a mocked device table), tile choice, config building."""

from __future__ import annotations

import math
import random

import pytest

from flash_attn4 import device_info, dispatch
from flash_attn4.fa4_kernels import arch as arch_mod
from flash_attn4.fa4_kernels.arch import Arch


@pytest.fixture
def fake_device(monkeypatch):
    """Replace the torch device query with a table entry; returns a setter."""
    def set_device(name, capability, sm_count=132):
        info = device_info.DeviceInfo(index=0, name=name, capability=capability, sm_count=sm_count)
        monkeypatch.setattr(device_info, "get_device_info", lambda device: info)
    return set_device


def test_hopper_is_sm90(fake_device):
    fake_device("NVIDIA H200", (9, 0))
    assert dispatch.arch_for_device("cuda:0") is Arch.SM90


@pytest.mark.parametrize("cap,name,arch", [((10, 0), "NVIDIA B200", Arch.SM100), ((10, 3), "NVIDIA B300", Arch.SM103)])
def test_blackwell_forward_compiles_for_the_exact_target(fake_device, cap, name, arch):
    """sm_100a code does not run on sm_103 (the "a" targets are not forward compatible): each
    Blackwell capability gets its own compile target, both with the sm100 kernels, forward and backward."""
    fake_device(name, cap)
    assert dispatch.arch_for_device("cuda:0") is arch and dispatch.arch_for_device("cuda:0", "backward") is arch
    assert arch_mod.kernels_for(arch).forward == arch_mod.kernels_for(Arch.SM100).forward
    assert arch_mod.kernels_for(arch, "backward").backward == arch_mod.kernels_for(Arch.SM100, "backward").backward


@pytest.mark.parametrize("cap,name", [((8, 0), "NVIDIA A100-SXM4-80GB"), ((12, 0), "NVIDIA GeForce RTX 5090"),
                                      ((8, 9), "NVIDIA L4"), ((9, 1), "hypothetical sm91")])
def test_unsupported_gpu_names_device_capability_and_support(fake_device, cap, name):
    fake_device(name, cap)
    with pytest.raises(RuntimeError) as info:
        dispatch.arch_for_device("cuda:0")
    msg = str(info.value)
    assert name in msg
    assert f"{cap[0]}.{cap[1]}" in msg
    # What is supported comes from the registry: a family without kernels is not claimed.
    assert "supported: " + arch_mod.supported_devices() in msg
    assert "sm_90 (H100/H200)" in msg
    for arch, kernels in arch_mod.IMPLEMENTED.items():
        assert (arch.devices in msg) == bool(kernels), arch


def test_supported_devices_follows_the_registry():
    assert arch_mod.supported_devices({Arch.SM90: ("forward", "backward"), Arch.SM100: ()}) == "sm_90 (H100/H200)"
    assert arch_mod.supported_devices({Arch.SM90: ("forward", "backward"), Arch.SM100: ("forward",)}) == (
        "sm_90 (H100/H200) or sm_100 (B200/GB200) (forward only)")
    assert arch_mod.supported_devices() == "sm_90 (H100/H200) or sm_100 (B200/GB200) or sm_103 (B300/GB300)"


def test_backward_dispatch_hopper_b200_and_b300():
    """The sm_100a and sm_103a backward reach users (through their first-use self-check): a B300
    gets the sm100 backward compiled for sm_103a, not sm_100a's (which does not run there)."""
    assert dispatch.arch_for_capability((9, 0), "NVIDIA H100", kernel="backward") is Arch.SM90
    assert dispatch.arch_for_capability((10, 0), "NVIDIA B200", kernel="backward") is Arch.SM100
    assert dispatch.arch_for_capability((10, 3), "NVIDIA B300", kernel="backward") is Arch.SM103
    cfg = dispatch.backward_config(Arch.SM103, "bfloat16", 128, 128, causal=True, local=False, has_softcap=False,
                                   varlen=False, has_seqused_k=False, deterministic=False)
    assert cfg.arch is Arch.SM103 and cfg.postprocess().arch is Arch.SM103


# exp_eighths_under_dp (how much of P^T is computed under dP^T's GEMM, in eighths) as measured per
# tiling: 3 at 80-query blocks, at 128-query blocks 2 without a mask and 3 with one (there with dS^T
# stored by stmatrix groups), 8 for the 64-query and split layouts (the field's default: nothing moved).
@pytest.mark.parametrize("d,dv,split,tile_m,tile_n,stages,eighths,eighths_causal", [
    (64, 64, False, 128, 128, 2, 2, 3), (96, 96, False, 64, 128, 2, 8, 8), (128, 128, False, 80, 128, 2, 3, 3),
    (128, 64, True, 64, 64, 2, 8, 8), (192, 192, True, 64, 64, 2, 8, 8), (192, 128, True, 64, 64, 2, 8, 8),
    (256, 256, True, 64, 64, 1, 8, 8)])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_tiles_per_head_dims(d, dv, split, tile_m, tile_n, stages, eighths, eighths_causal, causal):
    """The head dims whose dK/dV accumulators fit a warpgroup per 64 keys keep the unsplit layout
    (128-query blocks up to d = 64, 80 at d = 128); the rest split the head dim, with one Q/dO stage
    above 192 (shared memory)."""
    cfg = dispatch.backward_config(Arch.SM90, "bfloat16", d, dv, causal=causal, local=False, has_softcap=False,
                                   varlen=False, has_seqused_k=False, deterministic=False)
    assert (cfg.split_head_dim, cfg.tile_m, cfg.tile_n, cfg.num_stages) == (split, tile_m, tile_n, stages)
    assert cfg.exp_eighths_under_dp == (eighths_causal if causal else eighths)
    assert cfg.ds_store_by_group == (tile_m == 128 and causal)


@pytest.mark.parametrize("flag", ["local", "has_softcap"])
def test_backward_d128_keeps_64_query_blocks_with_local_or_softcap(flag):
    """80-query blocks spill far more under softcap (40) or a local window (9) and were not measured
    there: those keep 64."""
    flags = dict(causal=False, local=False, has_softcap=False, varlen=False, has_seqused_k=False,
                 deterministic=False)
    flags[flag] = True
    assert dispatch.backward_config(Arch.SM90, "bfloat16", 128, 128, **flags).tile_m == 64


def test_device_info_is_cached_per_index(monkeypatch):
    calls = []

    class Props:
        name, major, minor, multi_processor_count = "NVIDIA H100 80GB HBM3", 9, 0, 132

    def fake_props(index):
        calls.append(index)
        return Props()

    monkeypatch.setattr(device_info.torch.cuda, "get_device_properties", fake_props)
    device_info.clear_cache()
    try:
        for _ in range(3):
            info = device_info.get_device_info(1)
        device_info.get_device_info(2)
        assert info.capability == (9, 0) and info.sm_count == 132 and info.capability_str == "9.0"
        assert calls == [1, 2]
    finally:
        device_info.clear_cache()


def test_device_index_rejects_cpu():
    with pytest.raises(ValueError, match="expected a CUDA device"):
        device_info.device_index("cpu")


# ---- heuristics ----


@pytest.mark.parametrize("causal,local", [(False, False), (True, False), (False, True)])
def test_choose_tiles_table(causal, local):
    """The measured table: 192-row tiles (three consumer warpgroups) only where O fits their
    registers, K/V tiles shrinking with the head dim so two stages fit in shared memory."""
    tiles = lambda d, dv: dispatch.choose_tiles(Arch.SM90, d, dv, causal, local)  # noqa: E731
    assert tiles(64, 64)["tile_m"] == 192
    assert tiles(64, 128)["tile_m"] == 128  # O of 128 columns does not fit 160 registers
    for d in (96, 128, 192, 256):
        assert tiles(d, d)["tile_m"] == 128
    assert tiles(128, 128)["tile_n"] == 128


@pytest.mark.parametrize("d,dv", [(192, 192), (192, 128), (256, 256), (160, 160)])
def test_choose_tiles_large_head_dims_shrink_tile_n(d, dv):
    tiles = dispatch.choose_tiles(Arch.SM90, d, dv, False, False)
    assert tiles["tile_m"] == 128
    assert tiles["tile_n"] < 128
    assert tiles["tile_n"] % 16 == 0
    # larger head dim never gets a larger K/V tile
    assert dispatch.choose_tiles(Arch.SM90, 256, 256, False, False)["tile_n"] <= tiles["tile_n"]


@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_paged_tiles_load_whole_boxes(d):
    """A paged K/V tile loads in boxes of gcd(tile_n, page_size) rows: at d = 256 pages of 32 and
    more get 64-key tiles (boxes of 32 and more rows, one per tile from pages of 64) instead of 80
    (five 16-row boxes); pages of 16 keep 80. Other head dims take the dense tiles."""
    dense = dispatch.choose_tiles(Arch.SM90, d, d, False, False)
    boxes_at_d256 = {16: 5, 32: 2, 48: 4, 64: 1, 128: 1, 256: 1, 512: 1}
    for page_size, boxes in boxes_at_d256.items():
        tiles = dispatch.choose_tiles(Arch.SM90, d, d, False, False, page_size=page_size)
        if d == 256:
            assert tiles["tile_n"] // math.gcd(tiles["tile_n"], page_size) == boxes
            assert tiles == dict(dense, tile_n=80 if page_size == 16 else 64)
        else:
            assert tiles == dense
        cfg = dispatch.forward_config(Arch.SM90, "bfloat16", d, d, causal=False, local=False, has_softcap=False,
                                      varlen=False, has_seqused_k=True, has_sink=False, page_size=page_size)
        assert cfg.tile_n == tiles["tile_n"]


def test_kernel_set_of_the_compiler_is_what_dispatch_builds():
    """CI compiles (fa4_kernels.compile.kernel_set) exactly the configurations the torch layer asks
    for: tiles, epilogue and rescale placement included."""
    compile_mod = pytest.importorskip("flash_attn4.fa4_kernels.compile")
    configs = compile_mod.kernel_set(Arch.SM90)
    assert any(cfg.tma_store_o for cfg in configs) and any(cfg.rescale_o_before_pv for cfg in configs)
    for cfg in configs:
        flags = dict(causal=cfg.causal, local=cfg.local, has_softcap=cfg.has_softcap, varlen=cfg.varlen,
                     has_seqused_k=cfg.has_seqused_k, has_sink=cfg.has_sink,
                     qhead_per_kvhead=cfg.query_heads_per_group, pack_group=cfg.pack_gqa if cfg.pack_gqa_heads else 0,
                     page_size=cfg.page_size, split_kv=cfg.split_kv, has_seqused_q=cfg.has_seqused_q)
        assert dispatch.forward_config(cfg.arch, cfg.dtype, cfg.head_dim, cfg.head_dim_v, **flags) == cfg


FORWARD_FLAGS = ("causal", "local", "has_softcap", "varlen", "has_seqused_k", "has_sink")


@pytest.mark.parametrize("arch", [Arch.SM90, Arch.SM100])
def test_every_problem_class_input_gets_its_own_compile_key_and_one_cached_config(arch):
    """A kernel compiled for one problem class must never be reused for another: each mask flag, the
    dtype and each head dim change the compile key (a flag the key missed would silently reuse a
    stale kernel); the same arguments return the cached object itself."""
    base = dict.fromkeys(FORWARD_FLAGS, False)
    cfg = dispatch.forward_config(arch, "bfloat16", 128, 128, **base)
    assert dispatch.forward_config(arch, "bfloat16", 128, 128, **base) is cfg
    variants = {"float16": dispatch.forward_config(arch, "float16", 128, 128, **base),
                "head_dim": dispatch.forward_config(arch, "bfloat16", 64, 128, **base),
                "head_dim_v": dispatch.forward_config(arch, "bfloat16", 128, 64, **base)}
    for flag in FORWARD_FLAGS:
        flags = dict(base, **{flag: True}, **({"varlen": True} if flag == "has_seqused_k" else {}))
        variants[flag] = dispatch.forward_config(arch, "bfloat16", 128, 128, **flags)
    keys = {name: c.key() for name, c in variants.items()}
    assert cfg.key() not in keys.values()
    assert len(set(keys.values())) == len(keys), keys


def test_forward_config_stores_o_by_tma_for_batched_inputs_in_16_column_tiles():
    """Batched, and head_dim_v a multiple of stmatrix's 16 columns (d = 72 took an illegal address on
    the H200 when dispatch still chose it there); at d = 192/256 O goes through Q's buffer."""
    def tso(d, dv, varlen=False):
        return dispatch.forward_config(Arch.SM90, "bfloat16", d, dv, causal=True, local=False, has_softcap=False,
                                       varlen=varlen, has_seqused_k=False, has_sink=False).tma_store_o

    assert all(tso(d, d) for d in (64, 96, 128, 160, 192, 256))
    assert tso(128, 64) and tso(192, 128)
    assert not tso(128, 128, varlen=True)
    assert not any(tso(d, d) for d in (72, 88, 120, 200))


def test_forward_config_has_no_size_parameters():
    """The compile key can only contain what forward_config is given; no batch/length parameter exists,
    and the key of random configs never mentions sizes."""
    import inspect

    params = set(inspect.signature(dispatch.forward_config).parameters)
    assert not params & {"batch", "seqlen_q", "seqlen_k", "max_seqlen_q", "total_q", "num_heads"}
    rng = random.Random()
    d = rng.choice([64, 128, 256])
    cfg = dispatch.forward_config(Arch.SM90, "bfloat16", d, d, causal=False, local=False, has_softcap=False,
                                  varlen=False, has_seqused_k=False, has_sink=False)
    assert not any(part.startswith(("batch", "seqlen", "max_seqlen")) for part in cfg.key()[1:])


def test_dtype_name():
    import torch

    assert dispatch.dtype_name(torch.bfloat16) == "bfloat16"
    assert dispatch.dtype_name(torch.float16) == "float16"
    with pytest.raises(ValueError, match="unsupported dtype"):
        dispatch.dtype_name(torch.float32)


def test_forward_config_rescales_o_before_pv_with_two_consumer_warpgroups():
    """O *= row_scale moves under the next Q K^T wherever two consumer warpgroups share the tile
    (head_dim_v > 64: d = 128 measured 1.01-1.02x, d_v = 256 1.00-1.02x); the three-warpgroup d <= 64
    tiles keep the rescale after P V (1-3% slower with the move)."""
    def rb(d, dv):
        return dispatch.forward_config(Arch.SM90, "bfloat16", d, dv, causal=False, local=False, has_softcap=False,
                                       varlen=False, has_seqused_k=False, has_sink=False).rescale_o_before_pv

    assert rb(256, 256) and rb(192, 192) and rb(192, 128) and rb(128, 128) and rb(96, 96)
    assert not rb(64, 64) and not rb(48, 48)


def test_forward_config_issues_whole_k_gemms_above_d_128():
    """GEMMs as one call over their k slices (compile time) at head dims above 128, where they ran at
    the same speed; per slice at d <= 128 (whole-K P @ V ran 4% slower at d = 64)."""
    def wk(d, dv, causal=False):
        return dispatch.forward_config(Arch.SM90, "bfloat16", d, dv, causal=causal, local=False, has_softcap=False,
                                       varlen=False, has_seqused_k=False, has_sink=False).whole_k_gemms

    assert wk(256, 256) and wk(192, 192, causal=True) and wk(192, 128) and wk(136, 136)
    assert not wk(128, 128) and not wk(64, 64, causal=True) and not wk(96, 96)


def test_forward_config_packs_gqa_where_the_kernel_can():
    """The query heads of a KV head share tiles where the head ratio divides 64, batched or varlen
    (the ratio is a model property, not a size: one kernel per model)."""
    def pack(g, varlen=False):
        return dispatch.forward_config(Arch.SM90, "bfloat16", 128, 128, causal=True, local=False, has_softcap=False,
                                       varlen=varlen, has_seqused_k=False, has_sink=False,
                                       qhead_per_kvhead=g).pack_gqa

    assert [pack(g) for g in (1, 2, 4, 8, 32, 64)] == [1, 2, 4, 8, 32, 64]
    assert pack(3) == pack(6) == pack(128) == 1
    assert pack(4, varlen=True) == 4 and pack(3, varlen=True) == 1


@pytest.mark.parametrize("arch,d,dv", [(Arch.SM90, 64, 8), (Arch.SM100, 8, 8), (Arch.SM103, 64, 8)])
def test_head_dims_no_kernel_implements_are_refused_by_dispatch(arch, d, dv):
    """Before any compile or launch: the arch's rules name the head dim and the target."""
    with pytest.raises(NotImplementedError, match=f"{arch.value[:6]}.*head") as info:
        dispatch.forward_config(arch, "bfloat16", d, dv, causal=False, local=False, has_softcap=False, varlen=False,
                                has_seqused_k=False, has_sink=False)
    assert str(dv) in str(info.value)


@pytest.mark.parametrize("arch", [Arch.SM90, Arch.SM100])
def test_padded_pack_takes_the_next_ratio_that_packs_for_short_queries(arch):
    """Ratios that do not divide 64 (Qwen2.5: 7, 5, 6) run packed with dummy heads up to the next one
    that does, while the queries are short; ratios that pack, and long queries, run as they are."""
    pad = lambda g, sq=1: dispatch.padded_pack(arch, 128, 128, True, g, sq)  # noqa: E731
    assert [pad(g) for g in (7, 5, 3, 6, 12, 28, 33)] == [8, 8, 4, 8, 16, 32, 64]
    assert [pad(g) for g in (1, 2, 4, 8, 64)] == [0] * 5
    assert pad(7, dispatch.PAD_PACK_MAX_QUERIES) == 8 and pad(7, dispatch.PAD_PACK_MAX_QUERIES + 1) == 0
    assert pad(65) == 0  # no packable ratio above it


@pytest.mark.parametrize("arch", [Arch.SM90, Arch.SM100, Arch.SM103], ids=lambda a: a.value)
def test_every_head_dim_has_a_backward_at_the_smallest_kernel_holding_it(arch):
    """dispatch.backward_head_dims: for every pair of head dims the library takes (multiples of 8 in
    [16, 256]) the dims the backward runs at hold them (zero-padding only grows), a BackwardConfig
    builds there under every mask, and no smaller kernel that builds holds them (the padded work is
    the least the arch's kernels allow; smaller = fewer padded columns in both dims)."""
    dims = range(16, 257, 8)
    flags = [dict(causal=False, local=False, has_softcap=False, varlen=False, has_seqused_k=False),
             dict(causal=True, local=False, has_softcap=True, varlen=True, has_seqused_k=True),
             dict(causal=False, local=True, has_softcap=False, varlen=False, has_seqused_k=False)]

    def builds(d, dv):
        try:
            for f in flags:
                dispatch.backward_config(arch, "bfloat16", d, dv, deterministic=False, **f)
        except (NotImplementedError, ValueError):
            return False
        return True

    # From 32 columns: sm90's configuration builds at 16 too, but 16-column tiles are never run.
    kernels = {(d, dv) for d in range(32, 257, 16) for dv in range(32, 257, 16) if builds(d, dv)}
    assert kernels, "no backward kernel at all"
    for d in dims:
        for dv in dims:
            kd, kdv = dispatch.backward_head_dims(arch, d, dv)
            assert (kd, kdv) in kernels and kd >= d and kdv >= dv, (d, dv, kd, kdv)
            holding = [(a, b) for a, b in kernels if a >= d and b >= dv]
            assert not [(a, b) for a, b in holding if a <= kd and b <= kdv and (a, b) != (kd, kdv)], (d, dv)
    if arch is Arch.SM90:  # every multiple of 16 from 32 is a kernel of its own
        assert dispatch.backward_head_dims(arch, 72, 200) == (80, 208)
    else:  # a few classes: 80 at 96, 160 and 192 / 192 on the d = dv = 256 pair, 184 / 120 serially
        assert [dispatch.backward_head_dims(arch, *p) for p in ((80, 80), (160, 160), (192, 192), (184, 120))] == [
            (96, 96), (256, 256), (256, 256), (192, 128)]


def test_sm90_masked_backward_orders_tiles_longest_first_where_measured():
    """sm90/tiles.py: causal and local backwards of the unsplit layout (d = dv <= 128) take KV
    tiles longest first within L2 groups of at least BWD_LONGEST_FIRST_MIN_GROUP heads, for heads of
    at least BWD_LONGEST_FIRST_MIN_BLOCKS KV tiles (the kernel falls back to the launch order below
    either, at run time); unmasked problems and the split layout (d > 128, d != dv) keep the launch
    order; varlen has no host-side order."""
    from flash_attn4.fa4_kernels.scheduler import longest_first_applies
    from flash_attn4.fa4_kernels.sm90 import tiles as sm90_tiles

    def cfg(d, dv, causal=False, local=False, varlen=False):
        return dispatch.backward_config(Arch.SM90, "bfloat16", d, dv, causal=causal, local=local, has_softcap=False,
                                        varlen=varlen, has_seqused_k=False, deterministic=False)

    for d in (64, 96, 128):
        for mask in (dict(causal=True), dict(local=True)):
            c = cfg(d, d, **mask)
            assert c.longest_first and c.longest_first_min_group == sm90_tiles.BWD_LONGEST_FIRST_MIN_GROUP > 1
            assert c.longest_first_min_blocks == sm90_tiles.BWD_LONGEST_FIRST_MIN_BLOCKS > 1
            assert longest_first_applies(c) and not longest_first_applies(cfg(d, d, varlen=True, **mask))
        assert not cfg(d, d).longest_first
    for d, dv in ((256, 256), (192, 128), (128, 64)):
        assert not cfg(d, dv, causal=True).longest_first
