"""Paged KV caches on a real GPU: flash_attn_with_kvcache and flash_attn_varlen_func over pages in
shuffled order, against the same call on the dense cache holding the same keys (bit for bit: the
dense call takes the paged call's tiles (same_tiles), so the kernel visits the same blocks, only
the loads differ) and against tests/reference.py under FlashAttention's accuracy rule
(test_fwd.check).

Every page holds finite random values, also the pages no sequence uses; the page table's entries
past a sequence's pages hold 10**6, far out of range (the kernel must never read them). Outputs are
poisoned right after allocation (test_fwd's fixture). Page sizes: powers of two from 16 to 256 and
48 (any multiple of 16 is a page size); head dims 64, 128, 256 and 192/128, whose tiles (128, 128,
80 at page 16 else 64, and 96 keys) make a K/V tile one box, several boxes, or boxes of part of a
page.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from flash_attn4 import compile_cache, dispatch, flash_attn_varlen_func, flash_attn_with_kvcache
from tests.gpu.helpers import DEVICE, rand
from tests.gpu.test_fwd import check, route_forward_config
from tests.gpu.test_kvcache import check_against_gathered, i32
from tests.reference import random_pages, unpage

pytestmark = pytest.mark.gpu

from tests.gpu.test_fwd import poison_outputs, seed  # noqa: E402,F401

RATIOS = {1: (4, 4), 4: (8, 2), 7: (14, 2), 8: (16, 2)}  # GQA ratio -> (hq, hk); 7 runs in groups of 8 for short queries


def paged_copy(dense: torch.Tensor, table: torch.Tensor, num_pages: int, page_size: int) -> torch.Tensor:
    """The dense (b, s, h, d) cache in pages: row b's page i is page table[b, i] where the table gives
    one; every other page is fresh noise."""
    pages = rand(num_pages, page_size, *dense.shape[2:], dtype=dense.dtype)
    for b in range(dense.shape[0]):
        for i in range(table.shape[1]):
            p = int(table[b, i])
            if p < num_pages:
                pages[p] = dense[b, i * page_size:(i + 1) * page_size]
    return pages


@contextlib.contextmanager
def same_tiles(page_size: int):
    """Calls on contiguous keys take the tiles dispatch gives a paged cache of ``page_size`` (at
    d = 256 paged tiles are 64 keys, contiguous ones 80), and the split count those tiles give."""
    real = dispatch.forward_config

    def paged_tiles(arch, dtype, d, dv, **flags):
        cfg = real(arch, dtype, d, dv, **flags)
        if flags.get("page_size"):
            return cfg
        return cfg.replace(**dispatch.choose_tiles(arch, d, dv, flags["causal"], flags["local"], page_size=page_size))

    with pytest.MonkeyPatch.context() as m:
        route_forward_config(m, paged_tiles)
        yield


def run_paged(seqlens, *, page_size, sq, s_new, ratio=4, d=128, dv=None, causal=False, num_splits=0,
              dtype=torch.bfloat16, **opts):
    """One paged call and the dense call on the same keys; checks the pages after the append, the
    bitwise equality of the two, and the output against the reference."""
    b, (hq, hk), dv = len(seqlens), RATIOS[ratio], d if dv is None else dv
    table, num_pages = random_pages([n + s_new for n in seqlens], page_size)
    s_cache = table.shape[1] * page_size  # the dense twin holds what the table can
    q = rand(b, sq, hq, d, dtype=dtype)
    k_dense, v_dense = rand(b, s_cache, hk, d, dtype=dtype), rand(b, s_cache, hk, dv, dtype=dtype)
    k_pages, v_pages = (paged_copy(x, table, num_pages, page_size) for x in (k_dense, v_dense))
    k = rand(b, s_new, hk, d, dtype=dtype) if s_new else None
    v = rand(b, s_new, hk, dv, dtype=dtype) if s_new else None
    table = table.to(DEVICE)
    lens = i32(seqlens)
    out, lse = flash_attn_with_kvcache(q, k_pages, v_pages, k, v, cache_seqlens=lens, page_table=table,
                                       causal=causal, num_splits=num_splits, return_softmax_lse=True, **opts)
    with same_tiles(page_size):
        out_d, lse_d = flash_attn_with_kvcache(q, k_dense, v_dense, k, v, cache_seqlens=lens, causal=causal,
                                               num_splits=num_splits, return_softmax_lse=True, **opts)
    ends = [n + s_new for n in seqlens]
    got_k, got_v, _ = unpage(k_pages, v_pages, table, ends)
    assert torch.equal(got_k, torch.cat([k_dense[i, :n] for i, n in enumerate(ends)])), "the append (k)"
    assert torch.equal(got_v, torch.cat([v_dense[i, :n] for i, n in enumerate(ends)])), "the append (v)"
    assert torch.equal(out, out_d) and torch.equal(lse, lse_d), "paged and dense differ"
    check_against_gathered(out, lse, q, k_dense, v_dense, seqlens, s_new, list(range(b)), [0] * b, causal=causal,
                           **opts)
    return out, lse


def grid_cases():
    """Per page size, four calls cycling through head dims, GQA ratios, masks, split counts, query
    and new-token counts; key counts 1, a tile -1 / +1 and a few pages."""
    shapes = [(64, 64), (128, 128), (256, 256), (192, 128)]
    cases = []
    for p, page_size in enumerate([16, 32, 48, 64, 128, 256]):
        for j in range(4):
            n = 4 * p + j
            sq = (1, 4, 1, 3)[n % 4]
            cases.append(dict(page_size=page_size, d=shapes[n % 4][0], dv=shapes[n % 4][1],
                              ratio=(4, 1, 8, 7)[(n + 2 * p) % 4], causal=bool((n // 2) % 2), num_splits=(1, 0, 3, 64)[(n + p) % 4], sq=sq,
                              s_new=(0, 1, sq)[n % 3],
                              keys=[(1, 127, 129, 700)[j], (700, 129, 1, 127)[(j + p) % 4], 3 * page_size + 5]))
    return cases


def case_id(c):
    return (f"page{c['page_size']}-d{c['d']}x{c['dv']}-r{c['ratio']}-sq{c['sq']}-new{c['s_new']}-"
            f"splits{c['num_splits']}-{'causal' if c['causal'] else 'full'}")


@pytest.mark.parametrize("case", grid_cases(), ids=case_id)
def test_paged_grid(seed, case):
    s_new = case["s_new"]
    seqlens = [max(n - s_new, 0) for n in case["keys"]]
    run_paged(seqlens, page_size=case["page_size"], sq=case["sq"], s_new=s_new, ratio=case["ratio"], d=case["d"],
              dv=case["dv"], causal=case["causal"], num_splits=case["num_splits"])


# Chunked decoding / speculative steps: many queries per sequence, so that GQA-packed rows fill
# several 128- or 192-row tiles, whose O leaves by TMA stores (sm90) that must stop at each batch
# entry's own rows. (page size, head dim, ratio, s_q, s_new, causal, num_splits, keys)
MANY_QUERIES = [
    (256, 128, 4, 64, 64, True, 1, [1, 127, 129, 2000]),
    (16, 128, 8, 64, 0, True, 3, [700, 1, 129]),
    (256, 128, 8, 64, 0, False, 0, [3000, 5]),
    (16, 128, 4, 64, 64, False, 64, [300, 1000]),
    (16, 128, 4, 4, 4, True, 1, [127, 129, 40]),
    (256, 128, 8, 1, 1, True, 3, [255, 257, 1]),
    (64, 256, 4, 64, 64, True, 1, [129, 500]),
    (16, 64, 8, 64, 0, True, 0, [64, 1500, 2]),
]


@pytest.mark.parametrize("page_size,d,ratio,sq,s_new,causal,num_splits,keys", MANY_QUERIES,
                         ids=[f"page{c[0]}-d{c[1]}-r{c[2]}-sq{c[3]}-new{c[4]}-{'causal' if c[5] else 'full'}-"
                              f"splits{c[6]}" for c in MANY_QUERIES])
def test_paged_many_queries(seed, page_size, d, ratio, sq, s_new, causal, num_splits, keys):
    """The batched kernel over pages (flash_attn_with_kvcache), s_q up to 64: equal to the dense cache
    bit for bit and to the reference."""
    run_paged([max(n - s_new, 0) for n in keys], page_size=page_size, sq=sq, s_new=s_new, ratio=ratio, d=d,
              causal=causal, num_splits=num_splits)


@pytest.mark.parametrize("page_size,num_splits", [(16, 0), (256, 0), (64, 5)])
def test_paged_100k(seed, page_size, num_splits):
    """A 100k-token sequence beside a short one: thousands of pages, split-KV."""
    run_paged([100_000, 300], page_size=page_size, sq=1, s_new=1, causal=True, num_splits=num_splits)


def test_paged_fp16_window_softcap_sink(seed):
    sink = torch.randn(8, device=DEVICE)
    run_paged([500, 40, 0], page_size=32, sq=2, s_new=2, dtype=torch.float16, causal=False,
              window_size=(100, 0), softcap=20.0, learnable_sink=sink, num_splits=1)


def test_varlen_func_over_pages_equals_packed_keys(seed):
    """flash_attn_varlen_func(page_table=...) against the same keys packed, and the reference."""
    hq, hk, d, page_size = 16, 2, 128, 64
    lens_q, lens_k = [5, 0, 64, 1], [300, 17, 1000, 1]
    cu_q = i32([0, 5, 5, 69, 70])
    table, num_pages = random_pages(lens_k, page_size)
    k_pages, v_pages = rand(num_pages, page_size, hk, d), rand(num_pages, page_size, hk, d)
    q = rand(sum(lens_q), hq, d)
    table, used = table.to(DEVICE), i32(lens_k)
    for num_splits in (1, 3):
        out, lse = flash_attn_varlen_func(q, k_pages, v_pages, cu_q, None, max_seqlen_q=64, seqused_k=used,
                                          page_table=table, causal=True, num_splits=num_splits, return_lse=True)
        k, v, cu_k = unpage(k_pages, v_pages, table, lens_k)
        out_p, lse_p = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_seqlen_q=64, causal=True,
                                              num_splits=num_splits, return_lse=True)
        assert torch.equal(out, out_p) and torch.equal(lse, lse_p)
        check(out, lse, q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)


@pytest.mark.parametrize("sq", [1, 4])
def test_paged_cuda_graph_replay_with_changing_lengths(seed, sq):
    """Captured once, replayed with new cache_seqlens and a new page table (copied into the captured
    tensors): each replay equals an eager call bit for bit, and nothing compiles after the warm-up.
    ``sq`` queries per sequence against one new token each."""
    b, page_size, max_pages, hq, hk, d = 2, 64, 40, 8, 2, 128
    num_pages = b * max_pages + 7
    base_k, base_v = rand(num_pages, page_size, hk, d), rand(num_pages, page_size, hk, d)
    k_pages, v_pages = base_k.clone(), base_v.clone()
    q, k, v = rand(b, sq, hq, d), rand(b, 1, hk, d), rand(b, 1, hk, d)
    lens = i32([100, 7])
    table = i32(torch.randperm(num_pages)[:b * max_pages].view(b, max_pages).tolist())

    def step():
        return flash_attn_with_kvcache(q, k_pages, v_pages, k, v, cache_seqlens=lens, page_table=table,
                                       causal=True, num_splits=0, return_softmax_lse=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    compiled_before = compile_cache.stats()["compiled"]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g, lse_g = step()
    for new_lens in ([0, max_pages * page_size - 1], [1000, 1], [64, 129]):
        k_pages.copy_(base_k)
        v_pages.copy_(base_v)
        lens.copy_(i32(new_lens))
        table.copy_(i32(torch.randperm(num_pages)[:b * max_pages].view(b, max_pages).tolist()))
        for dst in (q, k, v):
            dst.copy_(rand(*dst.shape))
        graph.replay()
        torch.cuda.synchronize()
        graph_k = k_pages.clone()
        eager_k, eager_v = base_k.clone(), base_v.clone()
        out_e, lse_e = flash_attn_with_kvcache(q, eager_k, eager_v, k, v, cache_seqlens=lens, page_table=table,
                                               causal=True, num_splits=0, return_softmax_lse=True)
        assert torch.equal(graph_k, eager_k)
        assert torch.equal(out_g, out_e) and torch.equal(lse_g, lse_e)
        keys, values, _ = unpage(eager_k, eager_v, table, [n + 1 for n in new_lens])
        dense_k = torch.zeros(b, max_pages * page_size, hk, d, dtype=keys.dtype, device=DEVICE)
        dense_v = torch.zeros_like(dense_k)
        start = 0
        for i, n in enumerate(new_lens):
            dense_k[i, :n + 1], dense_v[i, :n + 1] = keys[start:start + n + 1], values[start:start + n + 1]
            start += n + 1
        check_against_gathered(out_g, lse_g, q, dense_k, dense_v, new_lens, 1, [0, 1], [0, 0], causal=True)
    assert compile_cache.stats()["compiled"] == compiled_before


def test_out_of_range_page_raises_when_checked(seed, monkeypatch):
    monkeypatch.setenv("FLASH_ATTN4_CHECK_CU_SEQLENS", "1")
    table, num_pages = random_pages([100, 30], 16)
    table[0, 2] = num_pages
    k_pages, v_pages = rand(num_pages, 16, 2, 128), rand(num_pages, 16, 2, 128)
    with pytest.raises(ValueError, match="num_pages"):
        flash_attn_with_kvcache(rand(2, 1, 8, 128), k_pages, v_pages, cache_seqlens=i32([100, 30]),
                                page_table=table.to(DEVICE))
