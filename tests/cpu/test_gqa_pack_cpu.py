"""GQA packing of head ratios that do not divide 64 in padded groups (ForwardConfig.pack_gqa_heads):
the config's rules, dispatch's choice, the self-check's problem, and sm_90a compiles - no GPU (the
sm_100a compiles: tests/cpu/test_sm100_static.py).
tests/gpu/test_gqa_pack.py checks the numbers and that dummy rows write nothing."""

from __future__ import annotations

import glob
import subprocess

import pytest

from flash_attn4 import dispatch, ops, selfcheck
from flash_attn4.fa4_kernels.arch import KERNELS, Arch
from flash_attn4.fa4_kernels.config import ForwardConfig
from flash_attn4.fa4_kernels.tiles import has_padded_pack
from tests.cpu.test_kernels import _compile_in_subprocess, _nvdisasm

BASE = dict(dtype="bfloat16", head_dim=128, head_dim_v=128)
FLAGS = dict(causal=True, local=False, has_softcap=False, varlen=False, has_seqused_k=False, has_sink=False)


# ---- the configuration ----


@pytest.mark.parametrize("group,heads", [(4, 3), (8, 5), (8, 6), (8, 7), (16, 12), (2, 1)])
def test_padded_group_configs_are_valid_and_keyed(group, heads):
    cfg = ForwardConfig(arch=Arch.SM90, **BASE, pack_gqa=group, pack_gqa_heads=heads)
    assert cfg.query_heads_per_group == heads
    full = ForwardConfig(arch=Arch.SM90, **BASE, pack_gqa=group)
    assert full.query_heads_per_group == group and full.pack_gqa_heads == 0
    assert cfg.key() != full.key() and f"pack_gqa_heads={heads}" in cfg.key()


@pytest.mark.parametrize("group,heads,error,match", [
    (8, 8, ValueError, r"pack_gqa_heads must be 0 .* in \[1, pack_gqa\).* got 8"),
    (8, 9, ValueError, r"pack_gqa_heads must be 0 .* got 9"),
    (8, -1, ValueError, r"pack_gqa_heads must be 0 .* got -1"),
    (1, 1, ValueError, r"pack_gqa=1 rows, got 1"),
    (12, 7, ValueError, "pack_gqa must divide 64"),
])
def test_padded_group_configs_reject_what_cannot_be_packed(group, heads, error, match):
    with pytest.raises(error, match=match):
        ForwardConfig(arch=Arch.SM90, **BASE, pack_gqa=group, pack_gqa_heads=heads)


ARCHS = [Arch.SM90, Arch.SM100, Arch.SM103]
# Each arch's tiles at d = 128 (sm100 checks them against its own rule).
ARCH_TILES = {arch: dispatch.choose_tiles(arch, 128, 128, False, False) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_every_arch_packs_padded_groups(arch):
    assert has_padded_pack(arch)
    cfg = ForwardConfig(arch=arch, **BASE, pack_gqa=8, pack_gqa_heads=7, **ARCH_TILES[arch])
    assert cfg.query_heads_per_group == 7


@pytest.mark.parametrize("arch", ARCHS)
def test_an_arch_without_padded_packing_refuses_it_by_name(monkeypatch, arch):
    """An arch whose rules do not say FORWARD_PADDED_PACK (each of ours does: switched off here)
    refuses the config and dispatch's request by name, and dispatch never asks it for one: such
    ratios run unpacked."""
    monkeypatch.setattr(KERNELS[arch].rules(), "FORWARD_PADDED_PACK", False)
    assert not has_padded_pack(arch)
    assert dispatch.padded_pack.__wrapped__(arch, 128, 128, False, 7, 1) == 0
    with pytest.raises(NotImplementedError, match=f"pack_gqa_heads=7: the {arch} forward does not pack"):
        ForwardConfig(arch=arch, **BASE, pack_gqa=8, pack_gqa_heads=7, **ARCH_TILES[arch])
    with pytest.raises(NotImplementedError, match="padded GQA groups"):
        dispatch.forward_config.__wrapped__(arch, "bfloat16", 128, 128, **FLAGS, qhead_per_kvhead=7, pack_group=8)


# ---- dispatch ----


@pytest.mark.parametrize("hq,hk", [(6, 2), (10, 2), (12, 2), (14, 2), (28, 4), (40, 8), (12, 4)])
@pytest.mark.parametrize("varlen", [False, True])
def test_decode_with_a_ratio_that_does_not_divide_64_packs_in_the_kernel(monkeypatch, hq, hk, varlen):
    """Ratios 3, 5, 6, 7 (and 28/4, 40/8, 12/4 heads) at decode shapes: the sm90, sm100 and sm103
    kernels pack them in padded groups (no host padding); long queries run unpacked."""
    import torch

    ratio = hq // hk
    q, k, v = torch.empty(2, 1, hq, 128), torch.empty(2, 9, hk, 128), torch.empty(2, 9, hk, 128)
    for arch in ARCHS:
        monkeypatch.setattr(dispatch, "arch_for_device", lambda device, kernel="forward", a=arch: a)
        for sq in (1, 4, 17, dispatch.PAD_PACK_MAX_QUERIES):
            group = ops._padded_group(q, k, v, varlen, sq)
            assert group == next(g for g in (4, 8, 16, 32, 64) if g > ratio and 64 % g == 0)
        assert ops._padded_group(q, k, v, varlen, dispatch.PAD_PACK_MAX_QUERIES + 1) == 0
        cfg = dispatch.forward_config(arch, "bfloat16", 128, 128, **dict(FLAGS, varlen=varlen),
                                      qhead_per_kvhead=ratio, pack_group=group)
        assert (cfg.pack_gqa, cfg.pack_gqa_heads, cfg.query_heads_per_group) == (group, ratio, ratio)
        unpacked = dispatch.forward_config(arch, "bfloat16", 128, 128, **dict(FLAGS, varlen=varlen),
                                           qhead_per_kvhead=ratio)
        assert unpacked.pack_gqa == 1 and cfg.replace(pack_gqa=1, pack_gqa_heads=0) == unpacked


def test_split_heuristic_counts_padded_tiles_per_kv_head():
    """28/4 heads packed in groups of 8: one tile per KV head (32 rows), not 28 // 8 = 3."""
    common = dict(batch=1, num_heads=28, num_heads_kv=4, seqlen_q=1, seqlen_k=65536, tile_m=128, tile_n=128,
                  num_sms=132)
    padded = dispatch.num_splits_heuristic(**common, pack_gqa=8)
    as_eight = dispatch.num_splits_heuristic(**dict(common, num_heads=32), pack_gqa=8)
    assert padded == as_eight > 1


# ---- the first-use self-check ----


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("group,heads", [(4, 3), (8, 7)])
@pytest.mark.parametrize("flags", [dict(), dict(varlen=True, has_seqused_k=True),
                                   dict(split_kv=True, varlen=True, has_seqused_k=True, page_size=16)])
def test_self_check_problem_has_the_real_ratio(arch, group, heads, flags):
    cfg = dispatch.forward_config(arch, "bfloat16", 64, 64, **{**FLAGS, **flags}, qhead_per_kvhead=heads,
                                  pack_group=group)
    p = selfcheck.build_forward_problem(cfg)
    hq, hk = p.q.shape[-2], p.k.shape[-2]
    assert hq // hk == heads and hq % hk == 0 and hk >= 2  # the last KV head's dummy rows reach past q
    assert p.q.is_contiguous() and p.q.storage_offset() == 0  # q exactly its size: no slack past its end


# ---- compiles (sm_90a, no GPU) ----


@pytest.mark.parametrize("cfg,spill_free", [
    (dict(causal=True, has_sink=True, pack_gqa=8, pack_gqa_heads=7, tma_store_o=True, has_seqused_k=True), True),
    (dict(head_dim=64, head_dim_v=64, tile_m=192, varlen=True, has_seqused_k=True, has_sink=True, pack_gqa=4,
          pack_gqa_heads=3), True),
    (dict(split_kv=True, varlen=True, has_seqused_k=True, page_size=256, causal=True, pack_gqa=8, pack_gqa_heads=5),
     True),
    (dict(split_kv=True, has_seqused_k=True, pack_gqa=8, pack_gqa_heads=6), True),
    # (spills 70 registers with pack_gqa_heads=0 as well: the 3-warpgroup tile with softcap and a window)
    (dict(head_dim=64, head_dim_v=64, tile_m=192, varlen=True, has_seqused_k=True, local=True, has_softcap=True,
          page_size=16, pack_gqa=4, pack_gqa_heads=3), False),
], ids=["batched-causal-sink-tma_store_o", "varlen-sink-3wg", "split-paged-causal", "split-batched",
        "paged-local-softcap-3wg"])
def test_padded_packing_compiles_for_sm90(tmp_path, cfg, spill_free):
    proc = _compile_in_subprocess(tmp_path, {"head_dim": 128, "head_dim_v": 128, **cfg}, keep="cubin")
    assert proc.returncode == 0, proc.stderr[-3000:]
    nvdisasm = _nvdisasm()
    if not spill_free:
        return
    if nvdisasm is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm): SASS not checked")
    sass = subprocess.run([nvdisasm, "-c", glob.glob(str(tmp_path / "*.cubin"))[0]], capture_output=True,
                          text=True).stdout
    assert "HGMMA" in sass and "STL" not in sass and "LDL" not in sass, "register spills to local memory"
