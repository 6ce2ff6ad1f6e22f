"""Paged KV caches on the CPU: validation, the append into pages, the torch layer's mapping onto the
paged kernel (stand-in kernels that read the pages through the table as the real one does), and
the TMA-box arithmetic of fa4_kernels/paged_kv.py."""

from __future__ import annotations

import pytest
import torch

from flash_attn4 import dispatch, flash_attn_varlen_func, flash_attn_with_kvcache
from flash_attn4.fa4_kernels.arch import Arch
from flash_attn4.fa4_kernels.config import ForwardConfig
from tests.cpu.test_kvcache_cpu import (append_kernel, as_i32, assert_close, kernels, problem,  # noqa: F401
                                       reference)  # (fixtures)
from tests.reference import attention_ref, random_pages, unpage

BF16 = torch.bfloat16


def to_pages(cache: torch.Tensor, table: torch.Tensor, num_pages: int, page_size: int) -> torch.Tensor:
    """A dense (b, s, h, d) cache stored in pages: row b's tokens [i * page_size, (i + 1) * page_size)
    in page table[b, i] for every page the table gives it; other pages hold fresh noise."""
    pages = torch.randn(num_pages, page_size, *cache.shape[2:], dtype=cache.dtype)
    for b in range(cache.shape[0]):
        for i in range(table.shape[1]):
            p = int(table[b, i])
            if 0 <= p < num_pages and (i + 1) * page_size <= cache.shape[1]:
                pages[p] = cache[b, i * page_size:(i + 1) * page_size]
    return pages


# ---- validation ----

def paged_problem(b=2, page_size=32, lens=(5, 20), s_new=2, hq=8, hk=2, d=64):
    q, kc, vc, k, v = problem(b=b, s_cache=64, hq=hq, hk=hk, d=d, s_new=s_new)
    table, num_pages = random_pages([n + s_new for n in lens], page_size)
    kp, vp = to_pages(kc, table, num_pages, page_size), to_pages(vc, table, num_pages, page_size)
    return dict(q=q, k_cache=kp, v_cache=vp, k=k, v=v, cache_seqlens=as_i32(list(lens)), page_table=table)


BAD = {
    "int64 table": (dict(page_table=lambda a: a["page_table"].long()), ValueError, "page_table must have dtype"),
    "1-D table": (dict(page_table=lambda a: a["page_table"][0]), ValueError, "page_table must have shape"),
    "table batch": (dict(page_table=lambda a: a["page_table"][:1]), ValueError, "page_table must have shape"),
    "page size 24": (dict(k_cache=lambda a: a["k_cache"][:, :24], v_cache=lambda a: a["v_cache"][:, :24]),
                     ValueError, "multiple of 16"),
    "v pages differ": (dict(v_cache=lambda a: a["v_cache"][:-1]), ValueError, "v_cache must match k_cache"),
    "both tables": (dict(block_table=lambda a: a["page_table"]), ValueError, "not both"),
    "cache_batch_idx": (dict(cache_batch_idx=lambda a: as_i32([0, 1])), NotImplementedError, "cache_batch_idx"),
    "cache_leftpad": (dict(cache_leftpad=lambda a: as_i32([0, 0])), NotImplementedError, "cache_leftpad"),
    "int lengths past the table": (dict(cache_seqlens=lambda a: a["k_cache"].shape[1] * a["page_table"].shape[1] - 1),
                                   ValueError,
                                   "max_pages x page_size"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_paged_arguments_raise_before_any_launch(kernels, name):
    change, exc, match = BAD[name]
    args = paged_problem()
    args.update({key: make(args) for key, make in change.items()})
    before = args["k_cache"].clone()
    with pytest.raises(exc, match=match):
        flash_attn_with_kvcache(**args)
    assert kernels == [] and torch.equal(args["k_cache"], before)


@pytest.mark.parametrize("bad,match", [
    ("page out of range", r"in \[0, num_pages"),
    ("negative page", r"in \[0, num_pages"),
    ("lengths past the table", "new tokens must be <= s_cache"),
])
def test_page_table_values_checked_on_request(kernels, monkeypatch, bad, match):
    """FLASH_ATTN4_CHECK_CU_SEQLENS=1: a used entry out of range, or lengths the table cannot hold,
    raise before the append; unused entries (random_pages fills them with 10**6) never matter."""
    monkeypatch.setenv("FLASH_ATTN4_CHECK_CU_SEQLENS", "1")
    args = paged_problem()
    table = args["page_table"]
    if bad == "page out of range":
        table[1, 0] = args["k_cache"].shape[0]
    elif bad == "negative page":
        table[0, 0] = -1
    else:
        args["cache_seqlens"] = as_i32([5, args["k_cache"].shape[1] * table.shape[1] - 1])
    before = args["k_cache"].clone()
    with pytest.raises(ValueError, match=match):
        flash_attn_with_kvcache(**args)
    assert kernels == [] and torch.equal(args["k_cache"], before)


def test_valid_table_with_garbage_past_the_pages_passes_the_value_check(kernels, monkeypatch):
    monkeypatch.setenv("FLASH_ATTN4_CHECK_CU_SEQLENS", "1")
    args = paged_problem()
    assert (args["page_table"] == 10 ** 6).any()
    flash_attn_with_kvcache(**args)
    assert len(kernels) == 1


# ---- the append and the attention, against the dense path's reference ----

@pytest.mark.parametrize("page_size", [16, 32, 64, 256, 48])
@pytest.mark.parametrize("sq,s_new,causal,num_splits,hq,hk", [
    (1, 1, False, 1, 8, 2), (1, 1, True, 3, 8, 2), (4, 4, True, 1, 8, 1), (3, 1, True, 0, 4, 4),
    (2, 0, False, 2, 8, 2),
])
def test_paged_append_and_attention_match_the_dense_reference(kernels, page_size, sq, s_new, causal, num_splits,
                                                              hq, hk):
    """Shuffled pages with unread garbage entries: the new tokens land in the right rows of the right
    pages (and nowhere else), and the attention is the dense cache's."""
    b, s_cap = 3, 320
    q, kc, vc, k, v = problem(b=b, sq=sq, s_cache=s_cap, hq=hq, hk=hk, s_new=s_new)
    lens = torch.randint(0, s_cap - s_new - page_size + 1, (b,), dtype=torch.int32)
    lens[0] = 0  # an empty row
    table, num_pages = random_pages((lens + s_new).tolist(), page_size)
    kp, vp = to_pages(kc, table, num_pages, page_size), to_pages(vc, table, num_pages, page_size)
    kp_before = kp.clone()
    out, lse = flash_attn_with_kvcache(q, kp, vp, k, v, cache_seqlens=lens, page_table=table, causal=causal,
                                       num_splits=num_splits, return_softmax_lse=True)
    ref_kc, ref_vc, ro, rl = reference(q, kc, vc, k, v, lens, causal=causal)
    keys, values, _ = unpage(kp, vp, table, lens + s_new)
    expect_k = torch.cat([ref_kc[i, :int(n)] for i, n in enumerate(lens + s_new)])
    expect_v = torch.cat([ref_vc[i, :int(n)] for i, n in enumerate(lens + s_new)])
    assert torch.equal(keys, expect_k) and torch.equal(values, expect_v)
    written = (kp != kp_before).flatten(1).any(1).nonzero().flatten().tolist()
    assert set(written) <= set(table[table < num_pages].tolist())  # only the sequences' own pages
    assert_close(out, lse, ro, rl)
    cfg, args = kernels[0]
    assert cfg.page_size == page_size and args["page_table"] is not None
    # The batched kernel on q as it is (no packed cu_seqlens_q), its lengths in seqused_k.
    assert not cfg.varlen and args["cu_q"] is None and args["max_seqlen_q"] == sq
    assert torch.equal(args["seqused_k"], lens + s_new)
    if num_splits:
        assert cfg.split_kv == (num_splits > 1)


def test_automatic_splits_of_a_paged_cache_are_sized_by_the_table(kernels):
    """num_splits=0 over pages: the heuristic's count for a table row's capacity (max_pages x
    page_size), as the dense cache's is for s_cache - not for k's extent (one page, too short to
    split) nor for the fill, so that a captured graph stays valid as the cache fills."""
    page_size, hq, hk = 64, 8, 2
    q, kc, vc, k, v = problem(b=1, sq=1, s_cache=4096, hq=hq, hk=hk, s_new=1, seed=7)
    table, num_pages = random_pages([4096], page_size)
    kp, vp = to_pages(kc, table, num_pages, page_size), to_pages(vc, table, num_pages, page_size)
    cfg = dispatch.forward_config(Arch.SM90, "bfloat16", 64, 64, causal=False, local=False, has_softcap=False,
                                  varlen=False, has_seqused_k=True, has_sink=False, qhead_per_kvhead=hq // hk,
                                  page_size=page_size, split_kv=True)
    heuristic = dict(batch=1, num_heads=hq, num_heads_kv=hk, seqlen_q=1, tile_m=cfg.tile_m, tile_n=cfg.tile_n,
                     pack_gqa=cfg.pack_gqa, num_sms=132)
    expected = dispatch.num_splits_heuristic(seqlen_k=table.shape[1] * page_size, **heuristic)
    assert expected > 1 and dispatch.num_splits_heuristic(seqlen_k=page_size, **heuristic) == 1
    for n in (0, 4094):
        out, lse = flash_attn_with_kvcache(q, kp.clone(), vp.clone(), k, v, cache_seqlens=as_i32([n]),
                                           page_table=table, return_softmax_lse=True)
        _, _, ro, rl = reference(q, kc, vc, k, v, as_i32([n]))
        assert_close(out, lse, ro, rl)
    assert [(c.split_kv, c.page_size, a["splits"]) for c, a in kernels] == [(True, page_size, expected)] * 2


def test_block_table_is_page_table(kernels):
    args = paged_problem(page_size=32)
    a = dict(args)
    a["block_table"] = a.pop("page_table")
    k_before, v_before = args["k_cache"].clone(), args["v_cache"].clone()
    out_b = flash_attn_with_kvcache(**dict(a, k_cache=k_before.clone(), v_cache=v_before.clone()))
    out_p = flash_attn_with_kvcache(**dict(args, k_cache=k_before.clone(), v_cache=v_before.clone()))
    assert torch.equal(out_b, out_p)


def test_varlen_func_reads_paged_keys(kernels):
    """flash_attn_varlen_func(page_table=...) is the packed-keys call on the same keys."""
    hq, hk, d, page_size = 8, 2, 64, 64
    lens_q, lens_k = [3, 0, 5], [100, 7, 260]
    cu_q = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    q = torch.randn(8, hq, d, dtype=BF16)
    table, num_pages = random_pages(lens_k, page_size)
    kp = torch.randn(num_pages, page_size, hk, d, dtype=BF16)
    vp = torch.randn(num_pages, page_size, hk, d, dtype=BF16)
    used = as_i32(lens_k)
    out, lse = flash_attn_varlen_func(q, kp, vp, cu_q, None, max_seqlen_q=5, seqused_k=used, page_table=table,
                                      causal=True, return_lse=True)
    k, v, cu_k = unpage(kp, vp, table, used)
    ro, rl = attention_ref(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert_close(out[None], lse.T[None], ro[None], rl.T[None])
    assert sum(lens_q) == out.shape[0]


@pytest.mark.parametrize("change,exc,match", [
    (dict(cu_seqlens_k=torch.tensor([0, 1, 2, 3], dtype=torch.int32)), ValueError, "cu_seqlens_k must be None"),
    (dict(seqused_k=None), ValueError, "needs seqused_k"),
    (dict(q=torch.randn(8, 8, 64, dtype=BF16).requires_grad_()), NotImplementedError, "no backward"),
])
def test_varlen_func_paged_validation(kernels, change, exc, match):
    table, num_pages = random_pages([20, 20, 20], 16)
    args = dict(q=torch.randn(8, 8, 64, dtype=BF16), k=torch.randn(num_pages, 16, 2, 64, dtype=BF16),
                v=torch.randn(num_pages, 16, 2, 64, dtype=BF16), cu_seqlens_q=torch.tensor([0, 3, 3, 8], dtype=torch.int32),
                cu_seqlens_k=None, seqused_k=as_i32([20, 20, 20]), page_table=table)
    with pytest.raises(exc, match=match):
        flash_attn_varlen_func(**dict(args, **change))
    assert kernels == []


# ---- configuration and the TMA-box arithmetic ----

def test_page_size_is_part_of_the_kernel_and_checked():
    flags = dict(causal=False, local=False, has_softcap=False, varlen=True, has_seqused_k=True, has_sink=False)
    dense = dispatch.forward_config(Arch.SM90, "bfloat16", 128, 128, **flags)
    paged = dispatch.forward_config(Arch.SM90, "bfloat16", 128, 128, page_size=16, **flags)
    assert paged.key() != dense.key() and paged.page_size == 16 and dense.page_size == 0
    with pytest.raises(ValueError, match="multiple of 16"):
        dense.replace(page_size=24)
    # The key lengths come from seqused_k, batched or varlen queries alike.
    for varlen in (False, True):
        with pytest.raises(ValueError, match="page_size > 0 needs has_seqused_k=True"):
            ForwardConfig(arch=Arch.SM90, dtype="bfloat16", head_dim=128, head_dim_v=128, page_size=16, varlen=varlen)
    # The sm100 family reads pages too, with its own tiles (two 128-row query tiles, 128-key blocks).
    sm100 = dispatch.forward_config(Arch.SM100, "bfloat16", 128, 128, page_size=16, **flags)
    assert sm100.page_size == 16 and sm100.tile_n == 128


@pytest.mark.parametrize("arch", [Arch.SM90, Arch.SM100])
@pytest.mark.parametrize("causal", [False, True])
def test_batched_queries_over_a_paged_cache_get_the_batched_kernel(arch, causal):
    """flash_attn_with_kvcache's paged call: q (b, s_q, h, d) as it is, the lengths in seqused_k. Its
    config is the batched one (sm90: O stored by TMA) but for the page size, and runs one CTA per
    tile (sm100 would run the dense non-causal class persistent)."""
    flags = dict(causal=causal, local=False, has_softcap=False, varlen=False, has_seqused_k=True, has_sink=False,
                 qhead_per_kvhead=4)
    dense = dispatch.forward_config(arch, "bfloat16", 128, 128, **flags)
    paged = dispatch.forward_config(arch, "bfloat16", 128, 128, page_size=64, **flags)
    assert not paged.varlen and paged.page_size == 64 and paged.persistent_ctas == 0
    assert paged.replace(page_size=0, persistent_ctas=dense.persistent_ctas) == dense
    if arch is Arch.SM90:
        assert paged.tma_store_o and paged.pack_gqa == 4
    split = dispatch.forward_config(arch, "bfloat16", 128, 128, page_size=16, split_kv=True, **flags)
    assert split.split_kv and not split.varlen and not split.tma_store_o


@pytest.mark.parametrize("tile_n", [80, 96, 128, 176])
@pytest.mark.parametrize("page_size", [16, 32, 48, 64, 128, 256, 1024])
def test_every_tma_box_reads_one_page(tile_n, page_size):
    """The kernel's boxes (paged_kv.PagedKV: rows_per_copy rows at multiples of it) tile each K/V tile
    exactly and never cross a page boundary, for the sm90 tiles and page sizes that divide or not."""
    from flash_attn4.fa4_kernels.paged_kv import rows_per_copy

    rows = rows_per_copy(tile_n, page_size)
    assert tile_n % rows == 0 and rows % 16 == 0
    for n_block in range(6):
        for box in range(tile_n // rows):
            first = n_block * tile_n + box * rows
            assert first // page_size == (first + rows - 1) // page_size


def test_opcheck_of_the_paged_forward(kernels):
    """torch.library.opcheck of ops.fwd with a page table (schema, fake vs real; inputs without grad:
    the paged forward has no backward)."""
    from flash_attn4 import ops

    table, num_pages = random_pages([40, 0, 17], 16)
    q = torch.randn(6, 8, 64, dtype=BF16)
    k, v = torch.randn(num_pages, 16, 2, 64, dtype=BF16), torch.randn(num_pages, 16, 2, 64, dtype=BF16)
    cu_q, used = as_i32([0, 2, 2, 6]), as_i32([40, 0, 17])
    torch.library.opcheck(ops.fwd, (q, k, v, cu_q, None, used, None, 0.125, 0.0, True, -1, 0, 4, -1, False, 1, table))
    # batched queries over the same pages (flash_attn_with_kvcache's call)
    q = torch.randn(3, 2, 8, 64, dtype=BF16)
    torch.library.opcheck(ops.fwd, (q, k, v, None, None, used, None, 0.125, 0.0, True, -1, 0, 2, -1, False, 1, table))


# ---- compile-only: the kernels a paged flash_attn_with_kvcache call runs ----

# (arch, head dim, flags, page size): small pages (8 boxes per K/V tile, read after each wait on sm90),
# whole-tile pages through split-KV, and the d = 256 tile (80 keys, O staged in Q's buffer) at page 64.
BATCHED_PAGED = [
    (Arch.SM90, 128, dict(causal=True, qhead_per_kvhead=4), 16),
    (Arch.SM90, 128, dict(causal=True, qhead_per_kvhead=8, split_kv=True), 256),
    (Arch.SM90, 64, dict(qhead_per_kvhead=4), 64),
    (Arch.SM100, 128, dict(causal=True, qhead_per_kvhead=4), 16),
    (Arch.SM100, 128, dict(qhead_per_kvhead=4, split_kv=True), 256),
]


@pytest.mark.parametrize("arch,d,flags,page_size", BATCHED_PAGED,
                         ids=[f"{a.value}-d{d}-page{p}" + "".join(f"-{k}" for k in f) for a, d, f, p in BATCHED_PAGED])
def test_batched_paged_kernels_compile_without_local_memory(arch, d, flags, page_size):
    """What a paged flash_attn_with_kvcache call dispatches to compiles for its arch (cu13 ptxas)
    with no spills and none of sass_stats_lib's static problems, one CTA per tile, and on sm90 (not
    split) O leaving by a TMA store."""
    from scripts import sass_stats_lib as lib

    if lib.find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm): SASS not checked")
    flags = dict(flags)
    ratio = flags.pop("qhead_per_kvhead")
    cfg = dispatch.forward_config(arch, "bfloat16", d, d, **{**dict(causal=False, local=False, has_softcap=False,
                                                                    has_sink=False), **flags},
                                  varlen=False, has_seqused_k=True, qhead_per_kvhead=ratio, page_size=page_size)
    assert not cfg.varlen and cfg.persistent_ctas == 0
    stats = lib.kernel_stats(cfg, "cu13")
    assert stats["ldl"] == stats["stl"] == 0 and stats["frame_bytes"] == 0, (stats["ldl"], stats["stl"])
    assert lib.static_problems(stats) == []
    assert not stats["ptx"]["grid_stride"]
    tma_stores = sum(n for op, n in stats["opcodes"].items() if op.startswith("UTMASTG"))
    assert cfg.tma_store_o == (arch is Arch.SM90 and not cfg.split_kv)
    assert (tma_stores > 0) == cfg.tma_store_o


@pytest.mark.parametrize("page_size", [16, 48])
def test_paged_append_through_the_append_kernel(kernels, append_kernel, page_size):
    """The paged case through the (stand-in) append kernel: one launch, the pages as the reference's."""
    test_paged_append_and_attention_match_the_dense_reference(kernels, page_size, 1, 1, True, 3, 8, 2)
    assert len(append_kernel) == 1 and append_kernel[0].paged
