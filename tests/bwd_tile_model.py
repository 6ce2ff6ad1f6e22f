"""A CPU model of the backward's tile algorithm, for one KV head and the query heads that share it, with
the kernels' constants and rounding points (tests/tile_model.py is the forward's; its float32 helpers
and masks are reused here).

What the model reproduces, and how exactly:

* The preprocessing (fa4_kernels/bwd_preprocess.py): D = rowsum(dO * O) in float32 with the kernel's
  order (each of a row's ``threads_per_row`` lanes an FMA chain over its 8-element vectors, then the
  lanes' butterfly), and the LSE in log2 units, +inf where the forward's LSE is -inf (so that P = 0).
* The main kernel's schedule (sm90/bwd.py with mask.py's block ranges): KV-stationary blocks of tile_n
  keys; each walks, query head by query head of the group, its query blocks of tile_m rows in
  [m_block_min, m_block_max); blocks on a mask edge or the sequence's end get the element-wise mask,
  full blocks none. A visible (query, key) pair that no visited block covers, or a block called full
  that hides an invisible key, is an error (the kernel would drop or attend to it).
* Per step, in float32: S^T = K Q_i^T and dP^T = V dO_i^T (float64 products rounded to float32; the
  tensor cores' summation order is not modelled); softcap t = tanh(S * scale / cap); P recomputed as
  exp2(fma(score, scale_log2, -LSE_log2)) on MUFU.EX2 (flushing below 2^-126); dS = P * (dP - D),
  with softcap P * fma(-t, t, 1) * (dP - D), without the softmax scale. P is rounded to the input
  dtype before dV += P^T dO_i, dS before dK += dS^T Q_i and dQ_i = dS K (dP is not rounded: the
  accumulator feeds dS directly; the serial sm100 kernel at 192 / 128 computes dS from the rounded
  P, ``ds_from_rounded_p``, and under softcap takes t from it too: softcap_tanh). dK and dV
  accumulate in float32 over every query head and block of the group, then dK * softmax_scale and
  dV are rounded to the input dtype once.
* dQ: each KV block's float32 dQ_i part is added into a float32 accumulator per query block; the
  arrival order is arbitrary (a permutation drawn from ``seed``) or, deterministic, in increasing KV
  block order (the semaphore of sm90/bwd.py's add_dq); the postprocessing rounds dq_accum *
  softmax_scale to the input dtype.
* dsink: the torch layer's formula (ops._sink_grad), in torch's float32: -sum_rows exp(sink - lse)
  rowsum(dO * O).
* Whole tiles: every KV block is loaded as tile_n rows, a pair's as 2 x tile_n (its odd block possibly
  wholly past the keys, run as masked steps of the pair's walk), so the last tile reads rows past the
  sequence's keys: zeros past the tensor's end (TMA's fill), or ``kv_tail``, the rows that follow in
  a packed (varlen) or cached (seqused_k) tensor (the next sequence's keys, anything: NaN included),
  which the kernels zero before their MMAs (``zero_kv_tail``, kv_tail.py; False: a kernel without
  it). Their scores are masked (P = 0), but dP, dS = P (dP - D) and dQ = dS K multiply them.

Parameters: ``BwdTileParams.from_backward_config`` takes them from a BackwardConfig (dispatch's).
``backward`` runs the three kernels from out, dout and the forward's LSE; ``main`` is the main kernel
alone, from the preprocessing's rows (a stand-in for it: tests/cpu/test_selfcheck.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tests.tile_model import (F32, F64, LOG2_E, _round_to, add_f32, exp2_mufu, f32, fma_f32, full_blocks,
                               visible)

VECTOR = 8  # bwd_preprocess.py: 16-bit elements per 16-byte load


@dataclass(frozen=True)
class BwdTileParams:
    tile_m: int
    tile_n: int
    dtype: torch.dtype = torch.bfloat16  # P, dS and the gradients
    # 2: CTA pairs (sm100/bwd_pair.py): KV blocks 2p and 2p + 1 walk one query-block list
    # (pair_query_block_range) and a query block's dQ part is the pair's, one product over both
    # blocks' keys (the M = 128 dQ MMA), added in pair order when deterministic.
    cluster_m: int = 1
    # The serial sm100 kernel (sm100/bwd_serial.py, head dims 192 / 128): dS = P16 * (dP - D) from the
    # P rounded to the input dtype (read back from TMEM), not from the float32 P.
    ds_from_rounded_p: bool = False

    @staticmethod
    def from_backward_config(cfg) -> "BwdTileParams":
        from flash_attn4.fa4_kernels.arch import Arch
        from flash_attn4.fa4_kernels.sm100.tiles import BWD_PAIR256_KEYS, backward_pair256, backward_serial

        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.dtype]
        serial = cfg.arch is Arch.SM100 and backward_serial(cfg.head_dim, cfg.head_dim_v)
        # The d = 256 pair (sm100/bwd_pair256.py): tile_n counts the pair's keys, each CTA has 64.
        pair256 = (cfg.arch is Arch.SM100 and getattr(cfg, "cluster_m", 1) == 2
                   and backward_pair256(cfg.head_dim, cfg.head_dim_v))
        return BwdTileParams(tile_m=cfg.tile_m, tile_n=BWD_PAIR256_KEYS if pair256 else cfg.tile_n, dtype=dtype,
                             cluster_m=getattr(cfg, "cluster_m", 1), ds_from_rounded_p=serial)


# ---- mask.py's block ranges, for the backward's orientation --------------------------------------

def query_block_range(n_block: int, sq: int, sk: int, tile_m: int, tile_n: int, causal: bool,
                      window: tuple[int, int]) -> range:
    """AttentionMask.m_block_range: the query blocks with a row that may see a key of KV block n."""
    local = not causal and (window[0] >= 0 or window[1] >= 0)
    wl, wr = window
    offset = sk - sq
    m_max = (sq + tile_m - 1) // tile_m
    m_min = 0
    if causal or local:
        right = wr if local else 0
        lo = 0 if local and wr < 0 else n_block * tile_n - offset - right
        m_min = max(lo, 0) // tile_m
    if local and wl >= 0:
        hi = (n_block + 1) * tile_n - 1 - offset + wl + 1
        m_max = min(m_max, (max(hi, 0) + tile_m - 1) // tile_m)
    return range(m_min, max(m_max, m_min))


def block_is_full(m_block: int, n_block: int, sq: int, sk: int, tile_m: int, tile_n: int, causal: bool,
                  window: tuple[int, int]) -> bool:
    """AttentionMask.block_is_full: every row of the query block inside the sequence and seeing every
    key of the KV block."""
    n_min_full, n_max_full = full_blocks(m_block, sq, sk, tile_m, tile_n, causal, window)
    return (m_block + 1) * tile_m <= sq and n_min_full <= n_block < n_max_full


# ---- the preprocessing ---------------------------------------------------------------------------

def rowsum_dout_out(dout: np.ndarray, out: np.ndarray) -> np.ndarray:
    """bwd_preprocess.py's D per row (rows along the first axes, dv last) in float32: lane l of T
    takes vectors l, l + T, ... and chains FMAs over them; then a butterfly over the T lanes."""
    dv = out.shape[-1]
    vectors = dv // VECTOR
    lanes = max(t for t in (1, 2, 4, 8, 16, 32) if vectors % t == 0)
    o, do = np.asarray(out, dtype=F32), np.asarray(dout, dtype=F32)
    part = np.zeros(out.shape[:-1] + (lanes,), dtype=F32)
    for lane in range(lanes):
        for vec in range(lane, vectors, lanes):
            for e in range(vec * VECTOR, (vec + 1) * VECTOR):
                part[..., lane] = fma_f32(o[..., e], do[..., e], part[..., lane])
    step = lanes // 2
    while step:
        part = add_f32(part, part[..., np.arange(lanes) ^ step])
        step //= 2
    return part[..., 0]


def lse_log2(lse: np.ndarray) -> np.ndarray:
    """The LSE in log2 units (float32 product), +inf where the row saw no key."""
    lse = np.asarray(lse, dtype=F32)
    with np.errstate(invalid="ignore"):
        return np.where(lse == -np.inf, F32(np.inf), f32(lse.astype(F64) * F64(F32(LOG2_E))))


# ---- the model -------------------------------------------------------------------------------------

@dataclass
class BwdStats:
    blocks: list = field(default_factory=list)  # (head, m_block, n_block, masked) in visiting order
    masked_steps: int = 0
    full_steps: int = 0
    p_max: float = 0.0


@dataclass
class BwdResult:
    dq: torch.Tensor  # (sq, g, d) in the input dtype
    dk: torch.Tensor  # (sk, d)
    dv: torch.Tensor  # (sk, dv)
    dq_accum: np.ndarray  # (sq, g, d) float32 before the postprocessing (dQ / softmax_scale)
    dpsum: np.ndarray  # (g, sq) float32: D
    dsink: torch.Tensor | None  # (g,) float32
    stats: BwdStats


def backward(q, k, v, out, dout, lse, params: BwdTileParams, *, softmax_scale: float, causal: bool = False,
             window: tuple[int, int] = (-1, -1), softcap: float = 0.0, sink=None, deterministic: bool = False,
             seed: int = 0, tanh_rel_error: float = 0.0, mufu_rel_error: float = 0.0, kv_tail=None,
             zero_kv_tail: bool = True) -> BwdResult:
    """One KV head and its g query heads: q (sq, g, d), k (sk, d), v (sk, dv), out and dout (sq, g, dv)
    in the input dtype, lse (g, sq) float32 (natural log, -inf for rows that saw no key), sink (g,)
    or None. ``seed`` draws the dQ arrival order (non-deterministic mode) and the tanh / MUFU
    perturbations (bounds ``*_rel_error``); ``kv_tail`` (k rows, v rows) and ``zero_kv_tail``: the
    rows past the keys (module docstring). The preprocessing, ``main`` and the postprocessing."""
    lse = lse.detach().numpy().astype(F32)
    out64, do64 = (t.detach().to(torch.float64).numpy() for t in (out, dout))
    D = np.stack([rowsum_dout_out(do64[:, h], out64[:, h]) for h in range(q.shape[1])])
    dq_accum, dk, dv, stats = main(q, k, v, dout, D, lse_log2(lse), params, softmax_scale=softmax_scale,
                                   causal=causal, window=window, softcap=softcap, deterministic=deterministic,
                                   seed=seed, tanh_rel_error=tanh_rel_error, mufu_rel_error=mufu_rel_error,
                                   kv_tail=kv_tail, zero_kv_tail=zero_kv_tail)
    dq = _round_to(f32(dq_accum.astype(F64) * F64(F32(softmax_scale))), params.dtype)
    dsink = None
    if sink is not None:  # ops._sink_grad: torch's own rowsum(dO * O), not the preprocessing's
        rows = (dout.float() * out.float()).sum(-1).t()  # (g, sq)
        dsink = -(torch.exp(sink.float()[:, None] - torch.from_numpy(lse)) * rows).sum(-1)
    to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(params.dtype)  # noqa: E731
    return BwdResult(dq=to(dq), dk=dk, dv=dv, dq_accum=dq_accum, dpsum=D, dsink=dsink, stats=stats)


def main(q, k, v, dout, D, L2, params: BwdTileParams, *, softmax_scale: float, causal: bool = False,
         window: tuple[int, int] = (-1, -1), softcap: float = 0.0, deterministic: bool = False, seed: int = 0,
         tanh_rel_error: float = 0.0, mufu_rel_error: float = 0.0, kv_tail=None, zero_kv_tail: bool = True):
    """The main kernel and the dQ reduction, from the preprocessing's rows D and L2 (g, sq) float32:
    (dq_accum (sq, g, d) float32, i.e. dQ / softmax_scale; dk (sk, d), dv (sk, dv) in the input dtype;
    BwdStats)."""
    p = params
    rng = np.random.default_rng(seed)
    q64, k64, v64, do64 = (t.detach().to(torch.float64).numpy() for t in (q, k, v, dout))
    sq, g, d = q64.shape
    sk, dvd = k64.shape[0], v64.shape[1]
    # The tiles as loaded: whole blocks (a pair's two), the rows past the keys what follows them.
    n_blocks = (sk + p.tile_n - 1) // p.tile_n
    rows = -(-n_blocks // p.cluster_m) * p.cluster_m * p.tile_n
    k64, v64 = (np.concatenate([x, np.zeros((rows - sk, x.shape[1]), dtype=F64)]) for x in (k64, v64))
    if kv_tail is not None and not zero_kv_tail:
        for x, tail in zip((k64, v64), kv_tail):
            tail = torch.as_tensor(tail).detach().to(torch.float64).numpy()[:rows - sk]
            x[sk:sk + tail.shape[0]] = tail
    vis = np.zeros((sq, rows), dtype=bool)
    vis[:, :sk] = visible(sq, sk, causal, window)
    if softcap:
        prescale = f32(F32(softmax_scale) / F64(F32(softcap)))
        scale_log2 = f32(F32(softcap) * F64(F32(LOG2_E)))
    else:
        prescale = None
        scale_log2 = f32(F32(softmax_scale) * F64(F32(LOG2_E)))
    stats = BwdStats()
    covered = np.zeros((g, sq, rows), dtype=bool)
    # dQ parts per (head, query block): [(n_block or pair, float32 part)], summed in arrival order below
    dq_parts: dict = {}
    dk_out = np.zeros((sk, d), dtype=F64)
    dv_out = np.zeros((sk, dvd), dtype=F64)
    keys = [(n * p.tile_n, (n + 1) * p.tile_n) for n in range(rows // p.tile_n)]
    acc_dk = [np.zeros((c1 - c0, d), dtype=F32) for c0, c1 in keys]
    acc_dv = [np.zeros((c1 - c0, dvd), dtype=F32) for c0, c1 in keys]

    def step(n_block, h, m_block):
        """One KV block's step for query block m_block of head h: dK, dV accumulated; dS returned."""
        c0, c1 = keys[n_block]
        r0, r1 = m_block * p.tile_m, min((m_block + 1) * p.tile_m, sq)
        full = block_is_full(m_block, n_block, sq, sk, p.tile_m, p.tile_n, causal, window)
        seen = vis[r0:r1, c0:c1]
        if full and not seen.all():
            raise AssertionError(f"query block {m_block} x KV block {n_block} called full but has masked keys")
        stats.blocks.append((h, m_block, n_block, not full))
        stats.full_steps += full
        stats.masked_steps += not full
        covered[h, r0:r1, c0:c1] = True
        # S^T and dP^T (here as S and dP, queries x keys), float32 accumulators
        with np.errstate(invalid="ignore"):  # NaN rows past the keys, unzeroed (zero_kv_tail=False)
            s = f32(q64[r0:r1, h] @ k64[c0:c1].T)
            dp = f32(do64[r0:r1, h] @ v64[c0:c1].T)
        if softcap:
            t = np.tanh(f32(s.astype(F64) * F64(prescale)).astype(F64))
            if tanh_rel_error > 0:
                t = t * (1.0 + rng.uniform(-tanh_rel_error, tanh_rel_error, size=t.shape))
            s = f32(t)
        with np.errstate(invalid="ignore"):
            x = fma_f32(s, scale_log2, -L2[h, r0:r1, None])
        prob = exp2_mufu(x, mufu_rel_error, rng)
        if not full:
            prob = np.where(seen, prob, F32(0.0))
        stats.p_max = max(stats.p_max, float(prob.max(initial=0.0)))
        grad_p = f32(_round_to(prob, p.dtype)) if p.ds_from_rounded_p else prob
        if softcap:
            # The serial kernel no longer has S^T in phase 2: t comes back from the rounded P.
            t = softcap_tanh(grad_p, L2[h, r0:r1, None], scale_log2) if p.ds_from_rounded_p else s
            grad_p = f32(grad_p.astype(F64) * fma_f32(-t, t, F32(1.0)).astype(F64))
        with np.errstate(invalid="ignore"):
            ds = f32(grad_p.astype(F64) * add_f32(dp, -D[h, r0:r1, None]).astype(F64))
        p16 = _round_to(prob, p.dtype)
        ds16 = _round_to(ds, p.dtype)
        acc_dv[n_block] = add_f32(acc_dv[n_block], f32(p16.T @ do64[r0:r1, h]))
        acc_dk[n_block] = add_f32(acc_dk[n_block], f32(ds16.T @ q64[r0:r1, h]))
        return ds16

    if p.cluster_m == 1:
        for n_block in range(n_blocks):
            for h in range(g):
                for m_block in query_block_range(n_block, sq, sk, p.tile_m, p.tile_n, causal, window):
                    ds16 = step(n_block, h, m_block)
                    c0, c1 = keys[n_block]
                    dq_parts.setdefault((h, m_block), []).append((n_block, f32(ds16 @ k64[c0:c1])))
    else:
        assert p.cluster_m == 2
        for pair in range(-(-n_blocks // 2)):
            blocks = [2 * pair, 2 * pair + 1]  # the odd one's steps where it lies past the keys: masked
            for h in range(g):
                for m_block in pair_query_block_range(pair, sq, sk, p.tile_m, p.tile_n, causal, window):
                    ds16 = np.concatenate([step(n, h, m_block) for n in blocks], axis=1)
                    c0, c1 = keys[blocks[0]][0], keys[blocks[-1]][1]
                    dq_parts.setdefault((h, m_block), []).append((pair, f32(ds16 @ k64[c0:c1])))
    for n_block, (c0, c1) in enumerate(keys):  # stored for the keys only (past them: another's rows)
        c1 = min(c1, sk)
        if c0 < c1:
            dk_out[c0:c1] = _round_to(f32(acc_dk[n_block][:c1 - c0].astype(F64) * F64(F32(softmax_scale))), p.dtype)
            dv_out[c0:c1] = _round_to(acc_dv[n_block][:c1 - c0], p.dtype)

    missed = np.broadcast_to(vis, covered.shape) & ~covered
    if missed.any():
        h, i, j = np.argwhere(missed)[0]
        raise AssertionError(f"head {h} query {i} sees key {j} but no visited block covers the pair")

    dq_accum = np.zeros((sq, g, d), dtype=F32)
    for (h, m_block), parts in dq_parts.items():
        order = sorted(parts, key=lambda x: x[0]) if deterministic else [parts[i] for i in rng.permutation(len(parts))]
        r0, r1 = m_block * p.tile_m, min((m_block + 1) * p.tile_m, sq)
        acc = np.zeros((r1 - r0, d), dtype=F32)
        for _, part in order:
            acc = add_f32(acc, part)
        dq_accum[r0:r1, h] = acc
    to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(p.dtype)  # noqa: E731
    return dq_accum, to(dk_out), to(dv_out), stats


def softcap_tanh(p16: np.ndarray, L2: np.ndarray, scale_log2) -> np.ndarray:
    """bwd_serial.softcap_tanh: t = max((log2(P) + LSE_log2) * (1 / scale_log2), -1) in float32 from
    the 16-bit P (as float32): MUFU.LG2 flushes denormal inputs (log2 -> -inf), and max returns its
    non-NaN operand (P = 0 on a row without keys: -inf + inf)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        x = np.where(np.abs(p16) < F32(2.0 ** -126), F32(-np.inf), f32(np.log2(p16.astype(F64))))
        inv = f32(F64(1.0) / F64(scale_log2))
        t = f32(add_f32(x, L2).astype(F64) * F64(inv))
    return np.fmax(t, F32(-1.0))


def pair_query_block_range(pair: int, sq: int, sk: int, tile_m: int, tile_n: int, causal: bool,
                           window: tuple[int, int]) -> range:
    """FlashAttentionBackwardSm100Pair.pair_tile_work: the query blocks a CTA pair (KV blocks 2p and
    2p + 1) walks: from the even block's first to, with a window, the odd block's last when the odd
    block holds keys (else the even block's last); none for a pair past the keys."""
    if 2 * pair * tile_n >= sk:
        return range(0)
    local = not causal and (window[0] >= 0 or window[1] >= 0)
    even = query_block_range(2 * pair, sq, sk, tile_m, tile_n, causal, window)
    m_max = even.stop
    if local and (2 * pair + 1) * tile_n < sk:
        m_max = query_block_range(2 * pair + 1, sq, sk, tile_m, tile_n, causal, window).stop
    return range(even.start, max(m_max, even.start))
