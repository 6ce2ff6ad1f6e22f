"""Split-KV on the CPU: the automatic split count, argument validation, the combine math (a pure-torch
reference against attention computed in one piece), and the torch layer's split path with torch
stand-ins for the split kernel and the combine kernel (their call conventions: ForwardConfig.split_kv
and fa4_kernels/combine.py). The kernels' numerics are tests/gpu/test_splitkv.py's."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from flash_attn4 import (compile_cache, device_info, dispatch, flash_attn_combine, flash_attn_func,
                         flash_attn_varlen_func, flash_attn_with_kvcache, ops, validate)
from flash_attn4.fa4_kernels.arch import Arch, kernels_for
from flash_attn4.fa4_kernels.config import WORKSPACE_ALIGN, CombineConfig, ForwardConfig, SplitKVConfig
from tests.reference import (attention_ref, combine_ref, partial_attention_ref, random_cu_seqlens,
                             split_kv_workspace_views, unpage)

H200_SMS = 132


def heuristic(b, sq, sk, hq, hk, d=128, sms=H200_SMS, **window):
    """num_splits_heuristic with the sm90 tiles and GQA packing dispatch picks for the problem."""
    cfg = dispatch.forward_config(Arch.SM90, "bfloat16", d, d, causal=False, local=False, has_softcap=False,
                                  varlen=False, has_seqused_k=False, has_sink=False, qhead_per_kvhead=hq // hk)
    return dispatch.num_splits_heuristic(batch=b, num_heads=hq, num_heads_kv=hk, seqlen_q=sq, seqlen_k=sk,
                                         tile_m=cfg.tile_m, tile_n=cfg.tile_n, pack_gqa=cfg.pack_gqa, num_sms=sms,
                                         **window)


# ---- the automatic split count ----

# (b, sq, sk, hq, hk, d) -> splits on 132 SMs. Decoding with few (batch x KV head) tiles splits until
# the SMs are nearly full; tiles that already fill 0.8 of the SMs, or <= 4 KV blocks, run unsplit.
HEURISTIC_TABLE = [
    ((1, 1, 131072, 32, 8, 128), 16),  # 8 packed tiles: 128 CTAs
    ((1, 1, 65536, 32, 8, 128), 16),
    ((2, 1, 131072, 64, 8, 128), 8),  # 16 tiles: 128 CTAs
    ((8, 1, 16384, 32, 8, 128), 2),  # 64 tiles: 128 CTAs
    ((4, 1, 32768, 8, 4, 256), 8),  # d = 256: 80-key blocks
    ((1, 4, 32768, 32, 8, 128), 16),  # 4 tokens x 4 heads = 16 rows of one tile per KV head
    ((16, 1, 8192, 32, 8, 128), 1),  # 128 tiles >= 0.8 x 132
    ((32, 1, 8192, 28, 4, 128), 1),  # ratio 7 runs unpacked: 896 tiles
    ((16, 64, 8192, 32, 8, 128), 1),  # 256 packed rows: 2 tiles per KV head, 256 tiles
    ((1, 1, 512, 32, 8, 128), 1),  # 4 KV blocks: short
    ((1, 1, 640, 32, 8, 128), 5),  # 5 blocks, 8 tiles: one block per split
    ((1, 1, 0, 32, 8, 128), 1),  # no key
    ((1, 8192, 8192, 32, 32, 128), 1),  # prefill: 2048 tiles
]


@pytest.mark.parametrize("problem,expected", HEURISTIC_TABLE, ids=[str(p) for p, _ in HEURISTIC_TABLE])
def test_heuristic_table(problem, expected):
    assert heuristic(*problem) == expected


@pytest.mark.parametrize("sk", [0, 1, 127, 128, 129, 511, 513, 640, 1000, 5000, 131072, 10 ** 7])
@pytest.mark.parametrize("b,hq,hk", [(1, 32, 8), (1, 4, 4), (3, 6, 2), (1, 28, 4)])
@pytest.mark.parametrize("sms", [1, 16, 132, 1000])
def test_heuristic_never_more_splits_than_blocks_nor_the_caps(sk, b, hq, hk, sms):
    n_blocks = -(-sk // 128)
    s = heuristic(b, 1, sk, hq, hk, sms=sms)
    assert 1 <= s <= max(1, min(n_blocks, dispatch.AUTO_MAX_SPLITS, sms))


def test_heuristic_sliding_window_bounds_the_keys():
    full = heuristic(1, 1, 131072, 32, 8)
    windowed = heuristic(1, 1, 131072, 32, 8, window_left=256, window_right=0)
    assert full > 1 and windowed == 1  # a 256-key window: at most 4 blocks


# ---- argument validation ----

def q_kv(b=1, sq=1, sk=300, hq=8, hk=2, d=64, dv=None):
    dv = d if dv is None else dv
    return (torch.randn(b, sq, hq, d, dtype=torch.bfloat16), torch.randn(b, sk, hk, d, dtype=torch.bfloat16),
            torch.randn(b, sk, hk, dv, dtype=torch.bfloat16))


@pytest.mark.parametrize("bad", [-1, 257, 1.5, True, "2", None])
def test_num_splits_must_be_an_int_in_range(cpu_kernels, bad):
    q, k, v = q_kv()
    with pytest.raises(ValueError, match="num_splits"):
        flash_attn_func(q, k, v, num_splits=bad)
    cu = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="num_splits"):
        flash_attn_varlen_func(q[0], k[0], v[0], cu, torch.tensor([0, 300], dtype=torch.int32), 1, 300,
                               num_splits=bad)


def test_num_splits_times_heads_must_fit_the_grid():
    with pytest.raises(ValueError, match="65535"):
        validate.check_num_splits(256, 512)
    assert validate.check_num_splits(255, 257) == 255


@pytest.mark.parametrize("num_splits", [3, 0])
def test_num_splits_with_a_sink(cpu_kernels, num_splits):
    """The split kernel leaves the sink out; the combine kernel adds it to the denominator once."""
    q, k, v = q_kv(b=2, sk=2000)
    sink = torch.randn(q.shape[2]) * 3
    out, lse = flash_attn_func(q, k, v, learnable_sink=sink, num_splits=num_splits, return_lse=True)
    forward = [c for c in cpu_kernels if isinstance(c, ForwardConfig)]
    assert len(forward) == 1 and forward[0].split_kv and not forward[0].has_sink
    assert [c.has_sink for c in cpu_kernels if isinstance(c, CombineConfig)] == [True]
    close_to_reference(out, lse, q, k, v, learnable_sink=sink)


def test_split_kv_config_rules(monkeypatch):
    base = dict(arch=Arch.SM90, dtype="bfloat16", head_dim=128, head_dim_v=128)
    assert ForwardConfig(**base, split_kv=True).split_kv
    with pytest.raises(ValueError, match="combine kernel adds it"):
        ForwardConfig(**base, split_kv=True, has_sink=True)
    with pytest.raises(ValueError, match="persistent_ctas"):
        ForwardConfig(**base, split_kv=True, persistent_ctas=132)
    with pytest.raises(ValueError, match="float32"):
        ForwardConfig(**base, split_kv=True, tma_store_o=True)
    flags = dict(causal=False, local=False, has_softcap=False, varlen=False, has_seqused_k=False, has_sink=False)
    cfg = dispatch.forward_config(Arch.SM90, "bfloat16", 128, 128, **flags, split_kv=True)
    assert cfg.split_kv and not cfg.tma_store_o
    # The sm100 family has the split-KV variant too, with the softmax schedule of its plain kernel.
    for arch in (Arch.SM100, Arch.SM103):
        plain = dispatch.forward_config(arch, "bfloat16", 128, 128, **flags, qhead_per_kvhead=4)
        split = dispatch.forward_config(arch, "bfloat16", 128, 128, **flags, qhead_per_kvhead=4, split_kv=True)
        # (one CTA per (tile, split): the plain kernel's persistent grid and CTA pairs are not the
        # split kernel's)
        assert plain.persistent_ctas > 0 and split.persistent_ctas == 0 and split.cluster_m == 1
        assert split.split_kv and dataclasses.replace(split, split_kv=False, persistent_ctas=plain.persistent_ctas,
                                                      cluster_m=plain.cluster_m) == plain
    # An arch whose rules do not say FORWARD_SPLIT_KV refuses it, before anything compiles.
    monkeypatch.setattr(kernels_for(Arch.SM100, "forward").rules(), "FORWARD_SPLIT_KV", False)
    with pytest.raises(ValueError, match="no split-KV"):
        ForwardConfig(**dict(base, arch=Arch.SM100), split_kv=True)
    with pytest.raises(NotImplementedError, match="split-KV"):
        dispatch.forward_config(Arch.SM100, "bfloat16", 128, 128, **flags, split_kv=True)
    for dtype in ("bfloat16", "float16", "float32"):
        assert CombineConfig(arch=Arch.SM90, dtype=dtype, head_dim_v=64).dtype == dtype
    with pytest.raises(ValueError, match="dtype"):
        CombineConfig(arch=Arch.SM90, dtype="int8", head_dim_v=64)
    with pytest.raises(ValueError, match="head_dim_v"):
        CombineConfig(arch=Arch.SM90, dtype="float32", head_dim_v=12)
    for bad in (0, 17):
        with pytest.raises(ValueError, match="splits_in_flight"):
            CombineConfig(arch=Arch.SM90, dtype="float32", head_dim_v=64, splits_in_flight=bad)


def test_split_kv_pipeline_config():
    """A SplitKVConfig composes a split forward and the combine of its dtype and head dim; its key
    names both parts; its workspace holds every split's partial rows and LSEs, each split's start
    32-byte aligned; dispatch builds it from the same flags as the forward, and a pipeline falls
    back as its forward does (padded GQA groups: unpacked), keeping its combine."""
    flags = dict(causal=True, local=False, has_softcap=False, varlen=False, has_seqused_k=True)
    split = dispatch.forward_config(Arch.SM90, "bfloat16", 128, 64, **flags, has_sink=False, qhead_per_kvhead=7,
                                    pack_group=8, split_kv=True)
    combine = CombineConfig(arch=Arch.SM90, dtype="bfloat16", head_dim_v=64, has_sink=True)
    cfg = dispatch.split_kv_config(Arch.SM90, "bfloat16", 128, 64, **flags, has_sink=True, qhead_per_kvhead=7,
                                   pack_group=8)
    assert cfg == SplitKVConfig(forward=split, combine=combine) and cfg.arch == Arch.SM90
    key = cfg.key()
    assert key[0] == "SplitKVConfig" and "forward.pack_gqa_heads=7" in key and "combine.has_sink=True" in key
    assert key != dataclasses.replace(cfg, combine=combine.replace(has_sink=False)).key()
    assert key != dataclasses.replace(cfg, forward=split.replace(tile_n=64)).key()
    with pytest.raises(ValueError, match="split_kv=True"):
        SplitKVConfig(forward=split.replace(split_kv=False), combine=combine)
    for bad in (combine.replace(head_dim_v=128), combine.replace(dtype="float16"), combine.replace(arch=Arch.SM100)):
        with pytest.raises(ValueError, match="must match the forward"):
            SplitKVConfig(forward=split, combine=bad)
    for splits, rows in ((2, 1), (3, 7), (16, 28 * 4), (5, 1000)):
        shape = cfg.workspace_shape(splits, rows)
        assert shape[0] == splits and shape[1] % 8 == 0 and rows * 65 <= shape[1] < rows * 65 + 8
        workspace = torch.arange(math.prod(shape), dtype=torch.float32).view(shape)
        out_p, lse_p = split_kv_workspace_views(workspace, (1, rows, 64), (1, rows))
        seen = torch.cat([out_p.flatten(), lse_p.flatten()])
        assert seen.unique().numel() == seen.numel()  # no element of the workspace serves twice
    fallback = dispatch.self_check_fallback(cfg)
    assert fallback.combine == combine and fallback.forward == dispatch.self_check_fallback(split)
    assert fallback.forward.pack_gqa == 1 and fallback.forward.split_kv
    assert dispatch.self_check_fallback(dataclasses.replace(cfg, forward=split.replace(
        pack_gqa=4, pack_gqa_heads=0))) is None


def partials(splits=3, b=2, sq=5, h=4, dv=64):
    return torch.randn(splits, b, sq, h, dv), torch.randn(splits, b, h, sq)


@pytest.mark.parametrize("change,match", [
    (lambda o, l: (o.half(), l), "out_partial must be float32"),
    (lambda o, l: (o, l.double()), "lse_partial must be float32"),
    (lambda o, l: (o[0], l), r"out_partial must be \(num_splits, b, sq, h, dv\)"),
    (lambda o, l: (o, l[0]), r"lse_partial must be \(num_splits, b, h, sq\)"),
    (lambda o, l: (o, l.transpose(2, 3)), "lse_partial must have shape"),
    (lambda o, l: (o[..., :12], l), "multiple of 8"),
    (lambda o, l: (o[:0], l[:0]), "no split"),
    (lambda o, l: (o.numpy(), l), "must be a torch.Tensor"),
])
def test_flash_attn_combine_rejects_bad_arguments(cpu_kernels, change, match):
    o, l = change(*partials())
    with pytest.raises(ValueError, match=match):
        flash_attn_combine(o, l)


def test_flash_attn_combine_rejects_bad_dtype_device_and_grad(cpu_kernels, monkeypatch):
    o, l = partials()
    with pytest.raises(ValueError, match="out_dtype"):
        flash_attn_combine(o, l, out_dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="no backward"):
        flash_attn_combine(o.requires_grad_(), l)
    monkeypatch.setattr(validate, "DEVICE_TYPES", ("cuda",))
    with pytest.raises(ValueError, match="GPU only"):
        flash_attn_combine(o.detach(), l)


# ---- the combine math, in torch ----

def split_keys(sk, bounds):
    """Boolean key sets of the splits [bounds[i], bounds[i + 1])."""
    pos = torch.arange(sk)
    return [(pos >= lo) & (pos < hi) for lo, hi in zip(bounds[:-1], bounds[1:])]


@pytest.mark.parametrize("sq,sk,causal,bounds", [
    (1, 1000, False, [0, 128, 129, 500, 1000]),
    (7, 300, True, [0, 0, 150, 300, 300]),  # empty first and last splits
    (200, 100, True, [0, 64, 100]),  # sq > sk: the first 100 rows see no key
    (33, 257, False, [0, 257]),  # one split: the combine is the identity
])
@pytest.mark.parametrize("with_sink", [False, True])
def test_combine_reference_merges_partials_into_attention(sq, sk, causal, bounds, with_sink):
    hq, hk, d = 6, 2, 32
    q, k, v = torch.randn(sq, hq, d), torch.randn(sk, hk, d), torch.randn(sk, hk, d)
    sink = torch.randn(hq) * 3 if with_sink else None
    parts = [partial_attention_ref(q, k, v, keys, causal=causal) for keys in split_keys(sk, bounds)]
    out_partial = torch.stack([o for o, _ in parts])[:, None]  # (S, 1, sq, hq, d)
    lse_partial = torch.stack([lse for _, lse in parts])[:, None]  # (S, 1, hq, sq)
    # What an empty split holds is not read: garbage there must not matter.
    empty = torch.isneginf(lse_partial).transpose(-1, -2)[..., None].expand_as(out_partial)
    out_partial = out_partial.masked_fill(empty, float("nan"))
    out, lse = combine_ref(out_partial, lse_partial, sink)
    ref_out, ref_lse = attention_ref(q[None], k[None], v[None], causal=causal, learnable_sink=sink)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert (lse[finite] - ref_lse[finite]).abs().max() < 1e-4
    assert (out - ref_out).abs().max() < 1e-4
    assert (out[torch.isneginf(ref_lse).transpose(-1, -2)] == 0).all()
    if with_sink and sq > sk:  # rows without keys: out 0, lse the sink logit
        assert (out[0, :sq - sk] == 0).all()
        assert torch.allclose(lse[0, :, :sq - sk], sink[:, None].expand(hq, sq - sk))


# ---- the torch layer's split path, with stand-in kernels ----

def split_kernel_stand_in(cfg, calls):
    """The split-KV kernel's call convention (ForwardConfig.split_kv), computed with the reference: split
    s takes KV blocks [s * per, (s + 1) * per) of each sequence's ceil(sk / tile_n) (the kernel splits
    each tile's visible range; merged, both are the same attention)."""

    def run(q, k, v, out_p, lse_p, cu_q, cu_k, seqused_q, seqused_k, page_table, sink, scale, softcap, left, right,
            max_seqlen_q):
        calls.append(cfg)
        assert seqused_q is None  # (the split tests run no padded batches)
        if page_table is not None:
            k, v, cu_k = unpage(k, v, page_table, seqused_k)
        assert cfg.split_kv and sink is None and out_p.dtype == lse_p.dtype == torch.float32
        assert out_p[0].is_contiguous() and lse_p[0].is_contiguous()  # one split's rows (a workspace's views)
        num_splits = out_p.shape[0]
        window = (left, right) if cfg.local else (-1, -1)
        seqs = ([(b, slice(None), slice(None)) for b in range(q.shape[0])] if cu_q is None else
                [(None, slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1])))
                 for i in range(cu_q.shape[0] - 1)])
        for i, (b, rows, keys) in enumerate(seqs):
            qs, ks, vs = (q[b], k[b], v[b]) if b is not None else (q[rows], k[keys], v[keys])
            if seqused_k is not None:
                ks, vs = ks[:int(seqused_k[i])], vs[:int(seqused_k[i])]
            n_blocks = -(-ks.shape[0] // cfg.tile_n)
            per = -(-n_blocks // num_splits) * cfg.tile_n
            for s in range(num_splits):
                pos = torch.arange(ks.shape[0])
                o, lse = partial_attention_ref(qs, ks, vs, (pos >= s * per) & (pos < (s + 1) * per),
                                               softmax_scale=scale, causal=cfg.causal, window_size=window)
                if b is not None:
                    out_p[s, b], lse_p[s, b] = o, lse
                else:
                    out_p[s, rows], lse_p[s, :, rows] = o, lse

    return run


def combine_stand_in(cfg, calls):
    def run(out_p, lse_p, out, lse, sink):
        calls.append(cfg)
        assert out_p.dim() == 5 and lse_p.dim() == 4 and out.dim() == 4 and lse.dim() == 3
        assert (sink is not None) == cfg.has_sink and (sink is None or sink.dtype == torch.float32)
        o, l = combine_ref(out_p, lse_p, sink)
        out.copy_(o.to(out.dtype))
        lse.copy_(l)

    return run


def pipeline_stand_in(cfg, forward, combine):
    """The split-KV pipeline's call convention (fa4_kernels/split_kv.py) from stand-ins of its two
    kernels (``forward`` and ``combine``, called as the kernels' own conventions): the partials
    are views of the caller's workspace, laid out as the pipeline lays them out."""

    def run(q, k, v, out, lse, workspace, cu_q, cu_k, seqused_q, seqused_k, page_table, sink, *scalars):
        assert workspace.dtype == torch.float32 and workspace.shape[0] > 1
        # rows of at least the kernels' partials (the caller may keep its own data past them), 32-byte aligned
        needed = cfg.workspace_shape(workspace.shape[0], math.prod(out.shape[:-1]))[1]
        assert workspace.shape[1] >= needed and workspace.stride(1) == 1
        assert workspace.stride(0) % WORKSPACE_ALIGN == 0 and workspace.data_ptr() % 32 == 0
        if lse.untyped_storage().data_ptr() == workspace.untyped_storage().data_ptr():  # an LSE the caller drops
            rows = math.prod(out.shape[:-1])
            row, start = divmod(lse.storage_offset() - workspace.storage_offset(), workspace.stride(0))
            assert lse.is_contiguous() and 0 <= row < workspace.shape[0]
            # past the partials the kernels use in that split's row, and within it
            assert start >= rows * (out.shape[-1] + 1) and start + lse.numel() <= workspace.shape[1]
        out_p, lse_p = split_kv_workspace_views(workspace, out.shape, lse.shape)
        forward(q, k, v, out_p, lse_p, cu_q, cu_k, seqused_q, seqused_k, page_table, None, *scalars)
        if cfg.forward.varlen:  # combine.py's convention: the packed tokens as one batch entry
            combine(out_p.unsqueeze(1), lse_p.unsqueeze(1), out.unsqueeze(0), lse.unsqueeze(0), sink)
        else:
            combine(out_p, lse_p, out, lse, sink)

    return run


@pytest.fixture
def cpu_kernels(monkeypatch):
    """CPU tensors pass validation, dispatch says sm90 with 132 SMs, compiling yields torch stand-ins.
    Returns the configs the stand-ins were called with."""
    from tests.cpu.test_ops import torch_kernel

    calls = []
    monkeypatch.setattr(validate, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(dispatch, "arch_for_device", lambda device, kernel="forward": Arch.SM90)
    monkeypatch.setattr(device_info, "get_device_info",
                        lambda device: device_info.DeviceInfo(0, "stand-in H200", (9, 0), H200_SMS))
    monkeypatch.setattr(compile_cache, "_compile_forward",
                        lambda cfg, **_: (split_kernel_stand_in if cfg.split_kv else torch_kernel)(cfg, calls))
    monkeypatch.setattr(compile_cache, "_compile_combine", lambda cfg, **_: combine_stand_in(cfg, calls))
    monkeypatch.setattr(compile_cache, "_compile_split_kv", lambda cfg, **_: pipeline_stand_in(
        cfg, split_kernel_stand_in(cfg.forward, calls), combine_stand_in(cfg.combine, calls)))
    monkeypatch.setenv("FLASH_ATTN4_DISABLE_DISK_CACHE", "1")
    compile_cache.clear()
    yield calls
    compile_cache.clear()


def close_to_reference(out, lse, q, k, v, **kw):
    ref_out, ref_lse = attention_ref(q, k, v, **kw)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert (lse[finite] - ref_lse[finite]).abs().max() < 1e-3
    assert (out.float() - ref_out.float()).abs().max() < 2e-2  # bf16 output


@pytest.mark.parametrize("num_splits", [3, 0])
@pytest.mark.parametrize("hq,hk", [(28, 4), (12, 4)])
def test_split_path_packs_padded_groups_in_the_kernel(cpu_kernels, num_splits, hq, hk):
    """Decode with a ratio that does not divide 64 through split-KV: the split kernel packs padded
    groups itself (pack_gqa_heads = the real ratio) on the caller's q, its partials per real head
    feed the combine, and a sink reaches the combine (ratio 7 and 3)."""
    q, k, v = q_kv(b=2, sq=1, sk=3000, hq=hq, hk=hk, d=64)
    sink = torch.randn(hq)
    out, lse = flash_attn_func(q, k, v, causal=True, learnable_sink=sink, num_splits=num_splits, return_lse=True)
    (fwd,) = [c for c in cpu_kernels if isinstance(c, ForwardConfig)]
    assert fwd.split_kv and fwd.pack_gqa_heads == hq // hk and fwd.pack_gqa == dispatch.padded_pack(
        Arch.SM90, 64, 64, False, hq // hk, 1)
    assert [c.has_sink for c in cpu_kernels if isinstance(c, CombineConfig)] == [True]
    close_to_reference(out, lse, q, k, v, causal=True, learnable_sink=sink)


@pytest.mark.parametrize("num_splits", [2, 3, 7, 40])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_func_split_path(cpu_kernels, num_splits, causal):
    q, k, v = q_kv(b=2, sq=3, sk=700, hq=8, hk=2, d=64)
    out, lse = flash_attn_func(q, k, v, causal=causal, num_splits=num_splits, return_lse=True)
    splits = [c for c in cpu_kernels if isinstance(c, ForwardConfig)]
    combines = [c for c in cpu_kernels if isinstance(c, CombineConfig)]
    assert len(splits) == 1 and splits[0].split_kv and splits[0].pack_gqa == 4 and splits[0].causal == causal
    assert combines == [CombineConfig(arch=Arch.SM90, dtype="bfloat16", head_dim_v=64)]
    assert out.shape == (2, 3, 8, 64) and out.dtype == torch.bfloat16 and lse.shape == (2, 8, 3)
    close_to_reference(out, lse, q, k, v, causal=causal)


def test_flash_attn_func_num_splits_1_and_0(cpu_kernels):
    """1: the unsplit kernel only. 0 (automatic): a decode step against a long cache splits, a prefill
    does not."""
    q, k, v = q_kv(b=1, sq=1, sk=2000, hq=8, hk=2, d=64)
    flash_attn_func(q, k, v, num_splits=1)
    assert [c.split_kv for c in cpu_kernels] == [False]
    cpu_kernels.clear()
    out, lse = flash_attn_func(q, k, v, num_splits=0, return_lse=True)
    assert [type(c).__name__ for c in cpu_kernels] == ["ForwardConfig", "CombineConfig"]
    assert cpu_kernels[0].split_kv
    close_to_reference(out, lse, q, k, v)
    cpu_kernels.clear()
    q2, k2, v2 = q_kv(b=4, sq=512, sk=512, hq=32, hk=8, d=64)
    flash_attn_func(q2, k2, v2, num_splits=0)
    assert [c.split_kv for c in cpu_kernels] == [False]


@pytest.mark.parametrize("num_splits", [0, 2, 5])
def test_flash_attn_varlen_func_split_path(cpu_kernels, num_splits):
    torch.manual_seed(0)
    batch, hq, hk, d = 3, 4, 1, 32
    cu_q = random_cu_seqlens(batch, 4, allow_zero=False)
    cu_k = torch.tensor([0, 1000, 1000, 1129], dtype=torch.int32)  # an empty key sequence: rows masked
    q = torch.randn(int(cu_q[-1]), hq, d, dtype=torch.bfloat16)
    k, v = torch.randn(1129, hk, d, dtype=torch.bfloat16), torch.randn(1129, hk, d, dtype=torch.bfloat16)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 1000, causal=True, num_splits=num_splits,
                                      return_lse=True)
    assert any(c.split_kv for c in cpu_kernels if isinstance(c, ForwardConfig))
    assert out.shape == q.shape and lse.shape == (hq, q.shape[0])
    close_to_reference(out, lse, q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


@pytest.mark.parametrize("path", ["func", "varlen", "kvcache"])
def test_a_dropped_lse_is_written_into_the_workspace(cpu_kernels, monkeypatch, path):
    """A split-KV call whose caller drops the LSE (return_lse / return_softmax_lse False, the
    adapter's decode step) has the combine write it into the workspace's spare room (one allocation
    fewer per step; the pipeline stand-in checks that no partial lives there); one that returns it
    gets its own tensor. The output is the same either way."""
    launched = []
    real_launch = ops._launch

    def record(kernel, q, k, v, out, lse, *rest):
        launched.append((lse, rest[-1]))  # the workspace is _launch's last argument
        return real_launch(kernel, q, k, v, out, lse, *rest)

    monkeypatch.setattr(ops, "_launch", record)
    torch.manual_seed(0)
    q, k, v = q_kv(b=2, sq=2, sk=900, hq=8, hk=2, d=64)
    if path == "func":
        call = lambda lse: flash_attn_func(q, k, v, causal=True, num_splits=3, return_lse=lse)  # noqa: E731
    elif path == "varlen":
        cu = torch.tensor([0, 900, 1800], dtype=torch.int32)
        call = lambda lse: flash_attn_varlen_func(  # noqa: E731
            q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu * 2 // 900, cu, 2, 900, causal=True,
            num_splits=3, return_lse=lse)
    else:
        lens = torch.tensor([900, 517], dtype=torch.int32)
        call = lambda lse: flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, causal=True, num_splits=3,  # noqa: E731
                                                   return_softmax_lse=lse)
    dropped = call(False)
    kept, lse = call(True)
    (lse_dropped, ws_dropped), (lse_kept, ws_kept) = launched[-2:]
    assert ws_dropped is not None and ws_kept is not None  # both split
    assert lse_dropped.untyped_storage().data_ptr() == ws_dropped.untyped_storage().data_ptr()
    assert lse_kept.untyped_storage().data_ptr() != ws_kept.untyped_storage().data_ptr()
    assert lse.untyped_storage().data_ptr() != ws_kept.untyped_storage().data_ptr()
    assert torch.equal(dropped, kept)


def test_split_forward_backward_is_the_usual_backward(cpu_kernels, monkeypatch):
    """The autograd formula of a split call gets the combined out/lse and runs the unsplit backward."""
    seen = []
    monkeypatch.setattr(ops, "_bwd", lambda *args: seen.append(args) or (torch.zeros_like(args[1]),
                                                                         torch.zeros_like(args[2]),
                                                                         torch.zeros_like(args[3])))
    q, k, v = (t.requires_grad_() for t in q_kv(b=1, sq=2, sk=600, hq=4, hk=4, d=64))
    out, lse = flash_attn_func(q, k, v, num_splits=3, return_lse=True)
    out.float().sum().backward()
    assert len(seen) == 1
    assert torch.equal(seen[0][4], out.detach()) and torch.equal(seen[0][5], lse.detach())
    assert q.grad is not None and k.grad is not None


def test_flash_attn_combine_through_the_op(cpu_kernels):
    o, l = partials(splits=4, b=2, sq=3, h=5, dv=40)
    l[1] = float("-inf")  # an empty split
    l[:, 0, 2, 1] = float("-inf")  # a row with no key anywhere
    out, lse = flash_attn_combine(o, l)
    assert out.dtype == torch.float32 and out.shape == (2, 3, 5, 40) and lse.shape == (2, 5, 3)
    ref_out, ref_lse = combine_ref(o, l)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert torch.isneginf(lse[0, 2, 1]) and (out[0, 1, 2] == 0).all()
    out16, _ = flash_attn_combine(o, l, out_dtype=torch.float16)
    assert out16.dtype == torch.float16
    assert cpu_kernels == [CombineConfig(arch=Arch.SM90, dtype="float32", head_dim_v=40),
                           CombineConfig(arch=Arch.SM90, dtype="float16", head_dim_v=40)]


def test_combine_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        o, l = torch.empty(3, 2, 7, 4, 64), torch.empty(3, 2, 4, 7)
        out, lse = ops.combine(o, l, torch.bfloat16)
    assert out.shape == (2, 7, 4, 64) and out.dtype == torch.bfloat16
    assert lse.shape == (2, 4, 7) and lse.dtype == torch.float32
