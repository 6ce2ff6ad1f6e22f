"""The sm100 backward at d = dv = 256 (sm100/bwd_pair256.py) emulated thread by thread on the CPU,
against autograd through tests/reference.py's attention_ref (the GPU suite's rule, as
tests/cpu/test_bwd_tile_emulation.py applies it) and against the tile model in pair mode
(tests/bwd_tile_model.py with 64-key blocks).

What the emulation takes from the kernel, rather than restating it: the TMEM plan
(tiles.backward_pair256_tmem_columns), the fold of the M = 128 cta_group::2 accumulators
(bwd_pair256.folded), which lane and columns a compute thread reads and which queries they are
(compute_lane), where dK / dV chunks of an epilogue thread go (out_chunk_index), and the pair's walk
(bwd_tile_model.pair_query_block_range on 64-key blocks, the rule of tile_work256). Per step it
places S^T, dP^T in each CTA's TMEM by the fold, lets every compute thread of both CTAs read its
chunk, compute P and dS (the 1-CTA kernel's formulas, float32 with the kernel's rounding points) and
write P^T, dS^T into its CTA's shared memory and dS into the dQ operand of the CTA of its query half;
every element must be written exactly once. dV / dK / dQ are products of those buffers; dQ and, at
the end, dK / dV are folded into TMEM and read back by the dQ warpgroup's (bwd_pair.pair_reduce_dq)
and the epilogue's indexing. A wrong fold, lane, half or chunk index misplaces whole blocks of a
gradient (test_a_wrong_fold_is_caught)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from flash_attn4.fa4_kernels.sm100 import bwd_pair256 as k256
from flash_attn4.fa4_kernels.sm100 import tiles as sm100_tiles
from tests import bwd_tile_model as bm
from tests import tile_model as tm
from tests.cpu.test_bwd_tile_emulation import _rand, check_rule, configs, forward_outputs
from tests.tile_model import F32, F64, LOG2_E, _round_to, add_f32, exp2_mufu, f32, fma_f32

KEYS = sm100_tiles.BWD_PAIR256_KEYS
TILE_M = sm100_tiles.BWD_TILE_M
CHUNK = sm100_tiles.BWD_DQ_CHUNK
LANES, COLUMNS, GROUPS, WARPGROUP = 128, 512, 2, 128


def place(tmem, first_col, acc):
    """acc (this CTA's 64 rows x N) into ``tmem`` (lanes x columns) from ``first_col`` by the fold."""
    rows, cols = np.meshgrid(np.arange(acc.shape[0]), np.arange(acc.shape[1]), indexing="ij")
    lane, col = k256.folded(rows, cols, acc.shape[1])
    assert np.isnan(tmem[lane, first_col + col]).all(), "two accumulator elements share a TMEM cell"
    tmem[lane, first_col + col] = acc


def padded(a, start, stop, rows):
    """Rows start..stop of ``a`` in a block of ``rows`` (rows past the tensor are zeros: TMA fill)."""
    out = np.zeros((rows,) + a.shape[1:], dtype=F64)
    stop = min(stop, a.shape[0])
    out[:max(stop - start, 0)] = a[start:stop]
    return out


def first_row_past_keys(seqlen_k, n_block, tile_n):
    """kv_tail.first_row_past_keys on Python ints: the first row of block ``n_block`` past the keys."""
    return min(max(seqlen_k - n_block * tile_n, 0), tile_n)


def emulate(q, k, v, dout, D, L2, *, softmax_scale, causal=False, window=(-1, -1), softcap=0.0,
            deterministic=False, seed=0, kv_tail=None, zero_kv_tail=True):
    """(dq_accum (sq, g, d) float32, dk, dv in the input dtype) of one KV head and its g query heads,
    computed the way the d = 256 pair kernel distributes the work (module docstring). ``kv_tail``
    (k rows, v rows): what follows the keys in a packed varlen (or seqused_k) tensor, which the
    pair's TMA tiles load past the keys (else zeros: TMA's fill past a tensor's end); the kernel
    zeroes them (pair_zero_kv_tail: K's, V's rows of each CTA's block, K^T's over the pair's keys)
    unless ``zero_kv_tail`` is False."""
    dtype = q.dtype
    q64, k64, v64, do64 = (t.detach().to(torch.float64).numpy() for t in (q, k, v, dout))
    sk_keys = k64.shape[0]
    if kv_tail is not None:  # the rows as loaded: the keys, then what follows them in the tensor
        k64, v64 = (np.concatenate([x, torch.as_tensor(t).detach().to(torch.float64).numpy()])
                    for x, t in zip((k64, v64), kv_tail))
    sq, g, d = q64.shape
    sk, dv = sk_keys, v64.shape[1]
    plan = sm100_tiles.backward_pair256_tmem_columns(d, dv)
    vis = tm.visible(sq, sk, causal, window)
    if softcap:
        prescale = f32(F32(softmax_scale) / F64(F32(softcap)))
        scale_log2 = f32(F32(softcap) * F64(F32(LOG2_E)))
    else:
        scale_log2 = f32(F32(softmax_scale) * F64(F32(LOG2_E)))
    n_blocks = -(-sk // KEYS)
    pairs = -(-n_blocks // 2)
    acc_dk = np.zeros((2 * pairs, KEYS, d), dtype=F32)
    acc_dv = np.zeros((2 * pairs, KEYS, dv), dtype=F32)
    dq_parts: dict = {}
    loads = d // 2 // CHUNK  # a dQ thread's 32-column loads (pair_reduce_dq's dq_loads)
    for pair in range(pairs):
        kpair = padded(k64, pair * 2 * KEYS, (pair + 1) * 2 * KEYS, 2 * KEYS)
        vpair = padded(v64, pair * 2 * KEYS, (pair + 1) * 2 * KEYS, 2 * KEYS)
        ktpair = kpair.copy()  # K^T: its own buffer (each CTA a head-dim half over the pair's keys)
        if zero_kv_tail:
            for rank in range(2):
                first = rank * KEYS + first_row_past_keys(sk, 2 * pair + rank, KEYS)
                kpair[first:(rank + 1) * KEYS] = 0.0
                vpair[first:(rank + 1) * KEYS] = 0.0
            ktpair[first_row_past_keys(sk, pair, 2 * KEYS):] = 0.0
        for h in range(g):
            for m in bm.pair_query_block_range(pair, sq, sk, TILE_M, KEYS, causal, window):
                qblk = padded(q64[:, h], m * TILE_M, (m + 1) * TILE_M, TILE_M)
                doblk = padded(do64[:, h], m * TILE_M, (m + 1) * TILE_M, TILE_M)
                tmem = [np.full((LANES, COLUMNS), np.nan, dtype=F32) for _ in range(2)]
                pt = [np.zeros((KEYS, TILE_M)) for _ in range(2)]
                dst = [np.zeros((KEYS, TILE_M)) for _ in range(2)]
                ds = [np.zeros((TILE_M // 2, 2 * KEYS)) for _ in range(2)]  # dQ operand of each CTA
                # Which elements a compute thread wrote (the values may be NaN: an unzeroed tail).
                pt_w, dst_w = [np.zeros((KEYS, TILE_M), bool) for _ in range(2)], [np.zeros((KEYS, TILE_M), bool)
                                                                                  for _ in range(2)]
                ds_w = [np.zeros((TILE_M // 2, 2 * KEYS), bool) for _ in range(2)]
                for rank in range(2):  # S^T = K Q^T, dP^T = V dO^T of this CTA's keys
                    own = slice(rank * KEYS, (rank + 1) * KEYS)
                    with np.errstate(invalid="ignore", over="ignore"):  # NaN / Inf past the keys, unzeroed
                        place(tmem[rank], plan["s"][0], f32(kpair[own] @ qblk.T))
                        place(tmem[rank], plan["dp"][0], f32(vpair[own] @ doblk.T))
                for rank in range(2):
                    n = 2 * pair + rank
                    full = bm.block_is_full(m, n, sq, sk, TILE_M, KEYS, causal, window)
                    for group in range(GROUPS):
                        for thread in range(WARPGROUP):
                            key, half, first = k256.compute_lane(group, thread)
                            s = tmem[rank][thread, plan["s"][0] + group * CHUNK:][:CHUNK]
                            dp = tmem[rank][thread, plan["dp"][0] + group * CHUNK:][:CHUNK]
                            rows = m * TILE_M + first + np.arange(CHUNK)
                            inside = rows < sq
                            rows_c = np.minimum(rows, sq - 1)
                            if softcap:
                                s = f32(np.tanh(f32(s.astype(F64) * F64(prescale)).astype(F64)))
                            lse = np.where(inside, L2[h, rows_c], F32(0.0)).astype(F32)
                            with np.errstate(invalid="ignore", over="ignore"):
                                prob = exp2_mufu(fma_f32(s, scale_log2, -lse))
                            if not full:
                                key_g = n * KEYS + key
                                seen = inside & (key_g < sk) & vis[rows_c, min(key_g, sk - 1)]
                                prob = np.where(seen, prob, F32(0.0))
                            grad_p = prob
                            if softcap:
                                grad_p = f32(prob.astype(F64) * fma_f32(-s, s, F32(1.0)).astype(F64))
                            dpsum = np.where(inside, D[h, rows_c], F32(0.0)).astype(F32)
                            with np.errstate(invalid="ignore"):
                                d_s = _round_to(f32(grad_p.astype(F64) * add_f32(dp, -dpsum).astype(F64)), dtype)
                            cols = slice(first, first + CHUNK)
                            for wrote in (pt_w[rank][key, cols], dst_w[rank][key, cols]):
                                assert not wrote.any(), "a P^T / dS^T element written twice in a step"
                            pt[rank][key, cols] = _round_to(prob, dtype)
                            dst[rank][key, cols] = d_s
                            pt_w[rank][key, cols] = dst_w[rank][key, cols] = True
                            local = slice(first - half * TILE_M // 2, first - half * TILE_M // 2 + CHUNK)
                            assert not ds_w[half][local, rank * KEYS + key].any(), \
                                "a dS element of a dQ operand written twice"
                            ds[half][local, rank * KEYS + key] = d_s
                            ds_w[half][local, rank * KEYS + key] = True
                for wrote in pt_w + dst_w + ds_w:
                    assert wrote.all(), "a P^T / dS^T / dS element no compute thread wrote"
                part = np.zeros((TILE_M, d), dtype=F32)
                for rank in range(2):
                    n = 2 * pair + rank
                    acc_dv[n] = add_f32(acc_dv[n], f32(pt[rank] @ doblk))
                    acc_dk[n] = add_f32(acc_dk[n], f32(dst[rank] @ qblk))
                    # dQ of this CTA's query half over the pair's keys, read out as pair_reduce_dq
                    # does: thread t row t % 64, head-dim half t // 64, load j = 32 columns.
                    dq_tmem = np.full((LANES, COLUMNS), np.nan, dtype=F32)
                    with np.errstate(invalid="ignore", over="ignore"):  # NaN / Inf past the keys, unzeroed
                        place(dq_tmem, plan["dq"][0], f32(ds[rank] @ ktpair))
                    for thread in range(WARPGROUP):
                        row, half = thread % KEYS, thread // KEYS
                        for j in range(loads):
                            col = plan["dq"][0] + j * CHUNK
                            part[rank * KEYS + row, (half * loads + j) * CHUNK:][:CHUNK] = \
                                dq_tmem[thread, col:col + CHUNK]
                rows = min(TILE_M, sq - m * TILE_M)
                dq_parts.setdefault((h, m), []).append((pair, part[:rows]))
    dk_out = np.full((sk, d), np.nan)
    dv_out = np.full((sk, dv), np.nan)
    for n in range(n_blocks):  # pair_store_dkv
        for out, acc, scale, dim in ((dk_out, acc_dk[n], softmax_scale, d), (dv_out, acc_dv[n], 1.0, dv)):
            t = np.full((LANES, COLUMNS), np.nan, dtype=F32)
            place(t, 0, _round_to(f32(acc.astype(F64) * F64(F32(scale))), dtype))
            per_group = dim // 2 // GROUPS // CHUNK
            for group in range(GROUPS):
                for thread in range(WARPGROUP):
                    key, half, _ = k256.compute_lane(group, thread)
                    if n * KEYS + key >= sk:
                        continue
                    for c in range(per_group):
                        src = (group * per_group + c) * CHUNK
                        dst_col = k256.out_chunk_index(group, half, c, dim, per_group) * CHUNK
                        assert np.isnan(out[n * KEYS + key, dst_col:dst_col + CHUNK]).all(), "dK/dV written twice"
                        out[n * KEYS + key, dst_col:dst_col + CHUNK] = t[thread, src:src + CHUNK]
    assert not np.isnan(dk_out).any() and not np.isnan(dv_out).any(), "a dK / dV element never written"
    rng = np.random.default_rng(seed)
    dq_accum = np.zeros((sq, g, d), dtype=F32)
    for (h, m), parts in dq_parts.items():
        order = sorted(parts, key=lambda x: x[0]) if deterministic else [parts[i] for i in rng.permutation(len(parts))]
        acc = np.zeros_like(parts[0][1])
        for _, p in order:
            acc = add_f32(acc, p)
        dq_accum[m * TILE_M:m * TILE_M + acc.shape[0], h] = acc
    to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dtype)  # noqa: E731
    return dq_accum, to(dk_out), to(dv_out)


def run(sq, sk, g=1, causal=False, window=(-1, -1), softcap=0.0, deterministic=False, dtype=torch.bfloat16):
    """Random inputs, the forward model's out and LSE, the emulation; (emulated grads, model grads,
    inputs, kwargs)."""
    d = 256
    gen = torch.Generator().manual_seed(zlib.crc32(repr((sq, sk, g, causal, window, softcap)).encode()))
    q, k, v, dout = (_rand(gen, sq, g, d, dtype=dtype), _rand(gen, sk, d, dtype=dtype), _rand(gen, sk, d, dtype=dtype),
                     _rand(gen, sq, g, d, dtype=dtype))
    name = {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    _, fwd_cfg = configs(name, d=d, causal=causal, local=window != (-1, -1), softcap=softcap)
    kw = dict(softmax_scale=d ** -0.5, causal=causal, window=window, softcap=softcap)
    out, lse = forward_outputs(q, k, v, fwd_cfg, **kw)
    lse_np = lse.detach().numpy().astype(F32)
    out64, do64 = (t.detach().to(torch.float64).numpy() for t in (out, dout))
    D = np.stack([bm.rowsum_dout_out(do64[:, h], out64[:, h]) for h in range(g)])
    L2 = bm.lse_log2(lse_np)
    dq_accum, dk, dv = emulate(q, k, v, dout, D, L2, deterministic=deterministic, **kw)
    params = bm.BwdTileParams(TILE_M, KEYS, dtype, cluster_m=2)
    model = bm.main(q, k, v, dout, D, L2, params, deterministic=True, **kw)
    return (dq_accum, dk, dv), model, (q, k, v, dout), kw


CASES = {
    "plain": dict(sq=200, sk=300),
    "causal-gqa2": dict(sq=300, sk=200, g=2, causal=True),
    "local": dict(sq=150, sk=333, window=(60, 90)),
    "softcap": dict(sq=170, sk=190, softcap=5.0),
    "causal-deterministic": dict(sq=260, sk=260, causal=True, deterministic=True),
    "fp16-keys-end-in-the-even-block": dict(sq=100, sk=60, dtype=torch.float16),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pair256_emulation_matches_the_reference_and_the_model(case):
    """The thread-level emulation within the GPU suite's rule against the float32 reference's
    autograd gradients, and equal to the pair-mode tile model (64-key blocks) up to float32
    summation order: every element where the model has it."""
    (dq_accum, dk, dv), model, (q, k, v, dout), kw = run(**CASES[case])
    scale = F32(kw["softmax_scale"])
    dq = torch.from_numpy(f32(dq_accum.astype(F64) * F64(scale))).to(q.dtype)
    check_rule(bm.BwdResult(dq=dq, dk=dk, dv=dv, dq_accum=dq_accum, dpsum=None, dsink=None, stats=None),
               q, k, v, dout, None, **kw)
    m_dq, m_dk, m_dv, _ = model
    np.testing.assert_allclose(dq_accum, m_dq, rtol=1e-5, atol=1e-5)
    # dK, dV are rounded to 16 bits: allow one unit in the last place where float32 order differs.
    for got, want in ((dk, m_dk), (dv, m_dv)):
        ulp = 2.0 ** -7 if got.dtype is torch.bfloat16 else 2.0 ** -10
        assert torch.allclose(got.double(), want.double(), rtol=ulp, atol=1e-6)


# (seqlen_q, seqlen_k) per sequence of a packed varlen batch on d = 256 pairs (64-key blocks): an odd
# number of blocks, the last pair's odd block wholly past the keys (40: one block; 290: five, block 4
# holding 34 keys; 190: three, block 2 holding 62); the last pair's odd block partly inside (200: block
# 3 holds 8 keys); whole pairs, no row past the keys (128).
VARLEN_SEQUENCES = ((100, 40), (130, 290), (150, 200), (64, 128), (90, 190))


@pytest.mark.parametrize("flags", [dict(), dict(causal=True), dict(window=(60, 8)),
                                   dict(softcap=4.0, causal=True, deterministic=True)])
def test_pair256_varlen_zeroes_the_rows_past_the_keys(flags):
    """Varlen on the d = 256 pair: each sequence runs at its offsets as its own problem, its pairs'
    K / V / K^T tiles loaded whole (128 keys), the rows past its keys being the next sequence's keys
    and then an unused cache's rows (NaN, Inf, as seqused_k leaves them). With the kernel's zeroing
    (pair_zero_kv_tail on 64-key blocks) every gradient is within the GPU suite's rule against
    autograd of the float32 reference and bit for bit what zeros past the keys give; the odd CTA past
    the keys stores no dK / dV row (the emulation's epilogue writes keys < seqlen_k only and checks
    each is written once). Without the zeroing the NaN reaches dQ (not vacuous)."""
    import math

    gen = torch.Generator().manual_seed(zlib.crc32(repr(flags).encode()))
    d, causal, window = 256, flags.get("causal", False), flags.get("window", (-1, -1))
    softcap = flags.get("softcap", 0.0)
    _, fwd_cfg = configs(d=d, causal=causal, local=window != (-1, -1), softcap=softcap)
    kw = dict(softmax_scale=d ** -0.5, causal=causal, window=window, softcap=softcap)
    seqs = [(_rand(gen, sq, 1, d), _rand(gen, sk, d), _rand(gen, sk, d), _rand(gen, sq, 1, d))
            for sq, sk in VARLEN_SEQUENCES]
    packed_k, packed_v = torch.cat([s[1] for s in seqs]), torch.cat([s[2] for s in seqs])
    garbage = torch.tensor([math.nan, math.inf, -math.inf]).to(torch.bfloat16)
    poisoned = 0
    for b, (q, k, v, dout) in enumerate(seqs):
        sk = k.shape[0]
        start = sum(s[1].shape[0] for s in seqs[:b + 1])
        tail = [torch.cat([x[start:start + 30], garbage.repeat(100)[:, None].expand(-1, d)])
                for x in (packed_k, packed_v)]
        out, lse = forward_outputs(q, k, v, fwd_cfg, **kw)
        out64, do64 = (t.detach().to(torch.float64).numpy() for t in (out, dout))
        D = bm.rowsum_dout_out(do64[:, 0], out64[:, 0])[None]
        L2 = bm.lse_log2(lse.detach().numpy().astype(F32))
        common = dict(deterministic=flags.get("deterministic", False), seed=b, **kw)
        dq_accum, dk, dv = emulate(q, k, v, dout, D, L2, kv_tail=tail, **common)
        dq = torch.from_numpy(f32(dq_accum.astype(F64) * F64(F32(kw["softmax_scale"])))).to(q.dtype)
        check_rule(bm.BwdResult(dq=dq, dk=dk, dv=dv, dq_accum=dq_accum, dpsum=None, dsink=None, stats=None),
                   q, k, v, dout, None, **kw)
        clean = emulate(q, k, v, dout, D, L2, **common)
        assert np.array_equal(dq_accum.view(np.int32), clean[0].view(np.int32)), (b, "dq")
        assert torch.equal(dk, clean[1]) and torch.equal(dv, clean[2]), b
        raw = emulate(q, k, v, dout, D, L2, kv_tail=tail, zero_kv_tail=False, **common)[0]
        last_pair = (sk - 1) // (2 * KEYS)
        if sk % (2 * KEYS) and bm.pair_query_block_range(last_pair, q.shape[0], sk, TILE_M, KEYS, causal, window):
            assert not np.isfinite(raw).all(), (b, "the unzeroed tail did not reach dQ")
            poisoned += 1
    assert poisoned >= 3, poisoned  # the case is not vacuous: most sequences' last pairs hold a tail


def test_a_wrong_fold_is_caught(monkeypatch):
    """Not vacuous: with the column halves of the fold swapped (a layout the kernel's check_folded
    rejects) while the threads still read lane t as key t % 64, the emulated gradients leave the
    model (and the rule)."""
    original = k256.folded

    def swapped(row, col, cols):
        lane, column = original(row, col, cols)
        return (lane + KEYS) % (2 * KEYS), column

    monkeypatch.setattr(k256, "folded", swapped)
    (dq_accum, dk, dv), model, _, _ = run(**CASES["plain"])
    assert not np.allclose(dq_accum, model[0], rtol=1e-3, atol=1e-3)
    assert not torch.allclose(dk.double(), model[1].double(), rtol=2.0 ** -7, atol=1e-6)
    assert not torch.allclose(dv.double(), model[2].double(), rtol=2.0 ** -7, atol=1e-6)


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (200, 0)),
                                           (False, (70, 5)), (False, (0, 300)), (False, (-1, 40)), (False, (5, 5))])
def test_pair256_walk_covers_every_visible_key_and_semaphore_turns_count_the_earlier_pairs(causal, window):
    """The pair walk on 64-key blocks (tile_work256, modelled by pair_query_block_range): every
    visible (query, key) of either block has its query block in the walk, and the pairs that visit
    a query block are exactly n_first // 2 onwards, contiguous (pair_turn's count: anything else
    deadlocks the deterministic order or lets a pair add out of turn)."""
    tn = KEYS
    for sq, sk in [(1, 1), (128, 128), (300, 333), (333, 300), (129, 1000), (1000, 129), (5, 700), (257, 385),
                   (100, 60), (70, 130)]:
        vis = tm.visible(sq, sk, causal, window)
        visits = {}
        for pair in range(-(-sk // (2 * tn))):
            walk = bm.pair_query_block_range(pair, sq, sk, TILE_M, tn, causal, window)
            for m in walk:
                visits.setdefault(m, []).append(pair)
            keys = vis[:, 2 * pair * tn:(2 * pair + 2) * tn]
            for i in np.nonzero(keys.any(axis=1))[0]:
                assert i // TILE_M in walk, (sq, sk, pair, i)
        for m in range(-(-sq // TILE_M)):
            blocks = [n for n, _ in tm.block_schedule(m, sq, sk, TILE_M, tn, causal, window)]
            if not blocks:
                assert m not in visits, (sq, sk, m)
                continue
            first = min(blocks) // 2
            assert visits[m] == list(range(first, first + len(visits[m]))), (sq, sk, m, visits[m], first)


def test_the_model_takes_64_key_blocks_for_the_d256_pair():
    """BwdTileParams.from_backward_config: the d = 256 pair's config (tile_n = the pair's 128 keys)
    gives the model 64-key blocks in pair mode."""
    from flash_attn4.fa4_kernels.arch import Arch
    from flash_attn4.fa4_kernels.config import BackwardConfig

    cfg = BackwardConfig(arch=Arch.SM100, dtype="bfloat16", head_dim=256, head_dim_v=256, tile_m=TILE_M,
                         tile_n=sm100_tiles.TILE_N, cluster_m=2, num_stages=1)
    params = bm.BwdTileParams.from_backward_config(cfg)
    assert (params.tile_m, params.tile_n, params.cluster_m) == (TILE_M, KEYS, 2)


def test_pair256_deterministic_dq_is_bitwise_reproducible_and_arrival_order_is_not():
    """dQ parts added in pair order (pair_turn / pair_done) give the same bits whatever the arrival
    order would be; the non-deterministic mode's arrival orders differ somewhere (so the check can
    fail): causal, three pairs per query block at most."""
    gen = torch.Generator().manual_seed(7)
    sq, sk, d = 200, 330, 256
    q, k, v, dout = _rand(gen, sq, 1, d), _rand(gen, sk, d), _rand(gen, sk, d), _rand(gen, sq, 1, d)
    _, fwd_cfg = configs(d=d, causal=True)
    kw = dict(softmax_scale=d ** -0.5, causal=True)
    out, lse = forward_outputs(q, k, v, fwd_cfg, **kw)
    out64, do64 = (t.detach().to(torch.float64).numpy() for t in (out, dout))
    D = bm.rowsum_dout_out(do64[:, 0], out64[:, 0])[None]
    L2 = bm.lse_log2(lse.detach().numpy().astype(F32))
    runs = {(det, seed): emulate(q, k, v, dout, D, L2, deterministic=det, seed=seed, **kw)[0]
            for det in (True, False) for seed in (1, 2, 3)}
    bits = lambda a: a.view(np.int32)  # noqa: E731
    assert all(np.array_equal(bits(runs[(True, 1)]), bits(runs[(True, s)])) for s in (2, 3))
    assert any(not np.array_equal(bits(runs[(False, 1)]), bits(runs[(False, s)])) for s in (2, 3))
