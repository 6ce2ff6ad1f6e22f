"""A CPU model of the forward kernel's per-tile arithmetic, for one head, with the kernel's constants.

What the model reproduces, and how exactly:

* KV blocks of ``tile_n`` keys visited from the last to the first, split the way the kernels split
  them (fa4_kernels/mask.py: the last block and blocks crossing a mask edge get the element-wise mask,
  full blocks none and may use the FMA-pipe exp2); masks with the project's semantics (bottom-right
  causal, local windows, sequence end). A block the schedule calls full but that hides an invisible
  key is an error (the kernel would attend to it).
* Scores S = Q K^T in float64 rounded to float32 (the tensor cores accumulate in fp32; their
  summation order is not modelled). Softcap: cap * tanh(S * scale / cap), tanh rounded to float32
  (optionally perturbed like tanh.approx).
* The online softmax of softmax.py in float32, op by op: the running max, the conditional rescale
  (keep the stale max unless (m_new - m_old) * scale_log2 > T), -inf-safe shifts, the exponent
  x = fma(S, scale_log2, -m * scale_log2), the row factor exp2(fma(m_old, scale_log2, -m_new *
  scale_log2)) as the compiled kernel evaluates it (the FFMA is what the sm_90a SASS shows), the
  row sums as each thread's pairwise tree plus the lanes' butterfly, rescaled with an FFMA.
* exp2: MUFU.EX2 as the exact value rounded to float32 (results below 2^-126 flushed to zero), with
  an optional bounded relative perturbation for its ~2 ulp error; ``exp2_fma`` bit-exactly (fma and
  the round-down add emulated with exact two-sums in float64), with the clamp, the coefficients and the
  magic constant imported from fa4_kernels.exp2 and the column rule ``exp2.emulated``.
* P rounded to the input dtype (bf16/fp16) before P @ V (the product in float64, accumulated into a
  float32 O), O rescaled by the row factor, normalised by 1 / rowsum at the end and rounded to the
  input dtype; LSE = (m * scale_log2 + log2(sum)) * ln 2; a learnable sink joins the denominator.

Parameters are a ``TileParams`` (tile shape, threshold, emulated eighths, P's dtype, fragment layout);
``TileParams.from_forward_config`` takes them from a ForwardConfig.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from flash_attn4.fa4_kernels import exp2 as kexp2

F32 = np.float32
F64 = np.float64
LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)
FTZ_MIN = 2.0 ** -126


# ---- float32 arithmetic, correctly rounded, from float64 pieces ------------------------------------

def _two_sum(a: np.ndarray, b: np.ndarray):
    """s + e == a + b exactly (float64), s = fl(a + b). Non-finite sums get e = 0."""
    with np.errstate(invalid="ignore", over="ignore"):
        s = a + b
        bb = s - a
        e = (a - (s - bb)) + (b - bb)
    e = np.where(np.isfinite(s), e, 0.0)
    return s, e


def _to_f32_nearest(s: np.ndarray, e: np.ndarray) -> np.ndarray:
    """float32 nearest-even of the exact value s + e (|e| <= half an ulp of s in float64)."""
    with np.errstate(invalid="ignore", over="ignore"):
        r = s.astype(F32)
        d = s - r.astype(F64)
        other = np.nextafter(r, np.where(d > 0, F32(np.inf), F32(-np.inf)))
        half = np.abs(other.astype(F64) - r.astype(F64)) / 2
        # s is exactly halfway between r and its neighbour: the tail e decides the side.
        tie = (d != 0) & (np.abs(d) == half) & (e != 0)
        return np.where(tie & (np.sign(e) == np.sign(d)), other, r)


def _to_f32_down(s: np.ndarray, e: np.ndarray) -> np.ndarray:
    """float32 rounded toward -inf of the exact value s + e."""
    r = s.astype(F32)
    r64 = r.astype(F64)
    down = (r64 > s) | ((r64 == s) & (e < 0))
    return np.where(down, np.nextafter(r, F32(-np.inf)), r)


def f32(x) -> np.ndarray:
    return np.asarray(x, dtype=F64).astype(F32)


def fma_f32(a, b, c) -> np.ndarray:
    """fp32 FMA: a * b + c rounded once (a * b of two float32 is exact in float64)."""
    a, b, c = (np.asarray(t, dtype=F32).astype(F64) for t in (a, b, c))
    with np.errstate(invalid="ignore"):
        p = a * b
    return _to_f32_nearest(*_two_sum(p, c))


def add_f32(a, b) -> np.ndarray:
    a, b = (np.asarray(t, dtype=F32).astype(F64) for t in (a, b))
    return _to_f32_nearest(*_two_sum(a, b))


def add_f32_round_down(a, b) -> np.ndarray:
    """fp32 add with round-toward-minus-infinity (add.rm.f32)."""
    a, b = (np.asarray(t, dtype=F32).astype(F64) for t in (a, b))
    return _to_f32_down(*_two_sum(a, b))


# ---- the two exponentials -----------------------------------------------------------------------

def exp2_fma(x) -> np.ndarray:
    """fa4_kernels.exp2.exp2_fma, bit for bit, on float32 inputs (finite, <= 127)."""
    x = np.maximum(np.asarray(x, dtype=F32), F32(kexp2.INPUT_MIN))
    magic = F32(kexp2.ROUND_DOWN_MAGIC)
    rounded = add_f32_round_down(x, magic)
    frac = add_f32(x, -add_f32(rounded, -magic))
    c0, c1, c2, c3 = (F32(c) for c in kexp2.COEFFS)
    poly = np.full_like(frac, c3)
    for c in (c2, c1, c0):
        poly = fma_f32(poly, frac, c)
    bits = poly.view(np.int32).astype(np.int64) + (rounded.view(np.int32).astype(np.int64) << 23)
    bits = ((bits + 2**31) % 2**32) - 2**31  # int32 wrap-around
    return bits.astype(np.int32).view(F32)


def exp2_mufu(x, rel_error: float = 0.0, rng: np.random.Generator | None = None) -> np.ndarray:
    """MUFU.EX2 (ex2.approx.ftz.f32): exact 2^x rounded to float32, times (1 + u) with
    |u| <= rel_error drawn from ``rng`` when rel_error > 0; results below 2^-126 flush to 0."""
    x = np.asarray(x, dtype=F32).astype(F64)
    with np.errstate(over="ignore"):
        y = np.exp2(x)
    if rel_error > 0:
        y = y * (1.0 + rng.uniform(-rel_error, rel_error, size=y.shape))
    y = np.where(y < FTZ_MIN, 0.0, y)
    return y.astype(F32)


# ---- which columns, which blocks ------------------------------------------------------------------

def fragment_column(key: np.ndarray, layout: str) -> np.ndarray:
    """The column index a key (0..tile_n-1 within its block) has in its thread's score fragment.
    'row': one thread owns a whole row (sm100's TMEM loads), the fragment column is the key.
    'wgmma': Hopper's accumulator, a quad of lanes shares a row; lane l holds keys 8 i + 2 l + j as
    fragment column 2 i + j (fragments.acc_rows_view)."""
    if layout == "row":
        return key
    if layout == "wgmma":
        return 2 * (key // 8) + key % 2
    raise ValueError(f"unknown layout {layout!r}")


def fragment_lane(key: np.ndarray, layout: str) -> np.ndarray:
    """Which of the row's lanes holds a key."""
    return np.zeros_like(key) if layout == "row" else (key % 8) // 2


def lanes_per_row(layout: str) -> int:
    return 1 if layout == "row" else 4


def emulated_keys(tile_n: int, eighths: int, layout: str) -> np.ndarray:
    """bool (tile_n,): the keys of a block whose exponential runs on the FMA pipe."""
    cols = fragment_column(np.arange(tile_n), layout)
    return np.array([kexp2.emulated(int(c), eighths) for c in cols], dtype=bool)


def visible(sq: int, sk: int, causal: bool, window: tuple[int, int]) -> np.ndarray:
    """(sq, sk) bool: query i sees key j (mask.py's semantics, bottom-right aligned)."""
    left, right = window
    if causal:
        right = 0
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    diag = i + sk - sq
    vis = np.ones((sq, sk), dtype=bool)
    if left >= 0:
        vis &= j >= diag - left
    if right >= 0:
        vis &= j <= diag + right
    return vis


def full_blocks(m_block: int, sq: int, sk: int, tile_m: int, tile_n: int, causal: bool,
                window: tuple[int, int]) -> tuple[int, int]:
    """mask.py's (n_block_min_full, n_block_max_full) of a query tile: KV blocks in [min, max) have
    no key past a mask edge for any row of the tile (the sequence's end, the causal diagonal, the
    window's sides)."""
    local = not causal and (window[0] >= 0 or window[1] >= 0)
    wl, wr = window
    offset = sk - sq
    hi = sk
    if causal or local:
        right = wr if local else 0
        first_hi = sk if local and wr < 0 else m_block * tile_m + offset + right + 1
        hi = min(hi, first_hi)
    full_min = 0
    if local and wl >= 0:
        last_lo = (m_block + 1) * tile_m - 1 + offset - wl
        full_min = (max(last_lo, 0) + tile_n - 1) // tile_n
    return full_min, max(hi, 0) // tile_n


def block_schedule(m_block: int, sq: int, sk: int, tile_m: int, tile_n: int, causal: bool,
                   window: tuple[int, int]) -> list[tuple[int, bool]]:
    """[(n_block, masked)] in the forward kernel's order (sm90/fwd.py with mask.py's block ranges):
    the last block (always masked), blocks crossing the right edge, full blocks, blocks crossing the
    left window edge."""
    local = not causal and (window[0] >= 0 or window[1] >= 0)
    wl, wr = window
    offset = sk - sq
    n_max = (sk + tile_n - 1) // tile_n
    n_min = 0
    if causal or local:
        last_row = min((m_block + 1) * tile_m, sq) - 1
        right = wr if local else 0
        hi = sk if local and wr < 0 else last_row + offset + right + 1
        n_max = min(n_max, (max(hi, 0) + tile_n - 1) // tile_n)
    if local and wl >= 0:
        n_min = max(m_block * tile_m + offset - wl, 0) // tile_n
    if n_max <= n_min:
        return []
    full_min, full_max = full_blocks(m_block, sq, sk, tile_m, tile_n, causal, window)
    full_max = max(full_max, n_min)
    full_min = max(full_min, n_min)
    full_max = min(max(full_max, full_min), n_max - 1)
    order = [(n_max - 1, True)]
    if causal or local:
        order += [(n, True) for n in range(n_max - 2, full_max - 1, -1)]
    order += [(n, False) for n in range(full_max - 1, full_min - 1, -1)]
    if local:
        left_end = min(full_min, n_max - 1)
        order += [(n, True) for n in range(left_end - 1, n_min - 1, -1)]
    return order


# ---- the model ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class TileParams:
    tile_m: int
    tile_n: int
    rescale_threshold: float = 0.0  # log2 units; 0: always rescale
    exp2_emulated_eighths: int = 0
    p_dtype: torch.dtype = torch.bfloat16  # P before P @ V, and the output
    layout: str = "wgmma"  # fragment layout: "wgmma" (sm90) or "row" (sm100, a thread per row)
    # How the row factor's exponent is formed: "ffma", fma(m_old, s, -(m_new * s)), as the
    # compiled kernel does today (not exactly 0 when the max did not move); "diff", (m_old - m_new) * s.
    factor_rule: str = "kernel"

    @staticmethod
    def from_forward_config(cfg, layout: str = "wgmma", factor_rule: str = "kernel") -> "TileParams":
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.dtype]
        return TileParams(tile_m=cfg.tile_m, tile_n=cfg.tile_n, rescale_threshold=float(cfg.rescale_threshold),
                          exp2_emulated_eighths=cfg.exp2_emulated_eighths, p_dtype=dtype, layout=layout,
                          factor_rule=factor_rule)


@dataclass
class TileStats:
    """What happened inside, summed over the tiles."""
    max_updates: int = 0  # (row, block) steps whose running max moved from a finite value
    stale_steps: int = 0  # steps whose block max exceeded the kept (stale) max
    factor_not_one: int = 0  # steps with a finite old max whose row factor was not exactly 1
    factor_not_one_stale: int = 0  # ... among steps where the max did not move
    p_max: float = 0.0  # largest P before rounding (<= 2^T with the threshold)
    emulated: int = 0  # exponentials on the FMA pipe
    mufu: int = 0
    blocks: list = field(default_factory=list)  # (m_block, n_block, masked) in visiting order


@dataclass
class TileResult:
    out: torch.Tensor  # (sq, dv) in p_dtype, as the kernel writes it
    out_f32: torch.Tensor  # (sq, dv) float32 before the final rounding
    lse: torch.Tensor  # (sq,) float32, natural log
    stats: TileStats
    probs: torch.Tensor | None = None  # (sq, sk) float32 P of the last visit of each key (unnormalised)


def _tree_sum(v: np.ndarray) -> np.ndarray:
    """softmax._tree_reduce with fp32 adds along the last axis."""
    parts = [v[..., i] for i in range(v.shape[-1])]
    while len(parts) > 1:
        nxt = [add_f32(parts[i], parts[i + 1]) for i in range(0, len(parts) - 1, 2)]
        if len(parts) % 2:
            nxt.append(parts[-1])
        parts = nxt
    return parts[0]


def _round_to(x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(x, dtype=F32)).to(dtype).to(torch.float64).numpy()


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: TileParams, *, softmax_scale: float,
            causal: bool = False, window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
            sink: float | None = None, mufu_rel_error: float = 0.0, tanh_rel_error: float = 0.0,
            seed: int = 0, keep_probs: bool = False) -> TileResult:
    """One head: q (sq, d), k (sk, d), v (sk, dv), values representable in p_dtype. Every query tile
    of tile_m rows, each walking its KV blocks as the kernel does. mufu_rel_error / tanh_rel_error:
    bounds of random relative perturbations of MUFU.EX2 and of softcap's tanh.approx.f32 (about
    2^-22 and 2^-11 on the hardware), drawn from ``seed``."""
    p = params
    q64, k64, v64 = (t.detach().to(torch.float64).numpy() for t in (q, k, v))
    sq, sk, dv = q64.shape[0], k64.shape[0], v64.shape[1]
    rng = np.random.default_rng(seed)
    vis = visible(sq, sk, causal, window)
    lanes = lanes_per_row(p.layout)
    if softcap:
        prescale = f32(F32(softmax_scale) / F64(F32(softcap)))  # fp32 divide, correctly rounded
        scale_log2 = f32(F32(softcap) * F64(F32(LOG2_E)))
    else:
        prescale = None
        scale_log2 = f32(F32(softmax_scale) * F64(F32(LOG2_E)))
    T = F32(p.rescale_threshold)
    out = np.zeros((sq, dv), dtype=F32)
    lse = np.full(sq, -np.inf, dtype=F32)
    probs_all = np.zeros((sq, sk), dtype=F32) if keep_probs else None
    stats = TileStats()
    emu_keys = emulated_keys(p.tile_n, p.exp2_emulated_eighths, p.layout)

    for m_block in range((sq + p.tile_m - 1) // p.tile_m):
        r0, r1 = m_block * p.tile_m, min((m_block + 1) * p.tile_m, sq)
        rows = r1 - r0
        m = np.full(rows, -np.inf, dtype=F32)
        row_sum = np.zeros((rows, lanes), dtype=F32)
        o = np.zeros((rows, dv), dtype=F32)
        for n_block, masked in block_schedule(m_block, sq, sk, p.tile_m, p.tile_n, causal, window):
            stats.blocks.append((m_block, n_block, masked))
            c0, c1 = n_block * p.tile_n, min((n_block + 1) * p.tile_n, sk)
            keys = np.arange(c0, c0 + p.tile_n)
            s = np.zeros((rows, p.tile_n), dtype=F64)  # keys past sk: K is zero-filled by TMA
            s[:, : c1 - c0] = q64[r0:r1] @ k64[c0:c1].T
            s = f32(s)
            if softcap:
                t = np.tanh(f32(s.astype(F64) * F64(prescale)).astype(F64))
                if tanh_rel_error > 0:
                    t = t * (1.0 + rng.uniform(-tanh_rel_error, tanh_rel_error, size=t.shape))
                s = f32(t)
            in_seq = keys < sk
            seen = np.zeros((rows, p.tile_n), dtype=bool)
            seen[:, in_seq] = vis[r0:r1, c0:c1]
            if masked:
                s = np.where(seen, s, F32(-np.inf))
            elif not seen.all():
                raise AssertionError(f"block {n_block} of tile {m_block} scheduled as full but has masked keys")

            # update_max
            m_old = m
            m_new = np.maximum(s.max(axis=1), m_old)
            if T > 0:
                with np.errstate(invalid="ignore"):
                    grow = f32(add_f32(m_new, -m_old).astype(F64) * F64(scale_log2))
                keep = grow <= T  # NaN (both -inf) compares False, as in the kernel
                stats.stale_steps += int((keep & (s.max(axis=1) > m_old)).sum())
                m_new = np.where(keep, m_old, m_new)
            m_scaled = f32(m_new.astype(F64) * F64(scale_log2))
            m_scaled = np.where(m_new == -np.inf, F32(0.0), m_scaled)
            if p.factor_rule in ("ffma", "kernel"):
                a = fma_f32(m_old, scale_log2, -m_scaled)
            elif p.factor_rule == "diff":
                with np.errstate(invalid="ignore"):
                    a = f32(add_f32(m_old, -m_new).astype(F64) * F64(scale_log2))
                a = np.where(m_old == -np.inf, F32(-np.inf), a)
            else:
                raise ValueError(p.factor_rule)
            factor = exp2_mufu(a, mufu_rel_error, rng)
            if p.factor_rule == "kernel" and T > 0:
                # softmax.update_max: a kept maximum gives a factor of exactly 1.
                factor = np.where(m_new == m_old, F32(1.0), factor)
            finite_old = np.isfinite(m_old)
            moved = finite_old & (m_new != m_old)
            stats.max_updates += int(moved.sum())
            stats.factor_not_one += int((finite_old & (factor != 1)).sum())
            stats.factor_not_one_stale += int((finite_old & ~moved & (factor != 1)).sum())
            m = m_new

            # exp2_rows
            x = fma_f32(s, scale_log2, -m_scaled[:, None])
            emu = np.broadcast_to(emu_keys if not masked else np.zeros(p.tile_n, dtype=bool), x.shape)
            pr = exp2_mufu(x, mufu_rel_error, rng)
            if emu.any():
                pr = np.where(emu, exp2_fma(np.where(emu, x, F32(0.0))), pr)
            stats.emulated += int(emu[:, in_seq].sum())
            stats.mufu += int((~emu[:, in_seq]).sum())
            stats.p_max = max(stats.p_max, float(pr[:, in_seq].max(initial=0.0)))
            if keep_probs:
                probs_all[r0:r1, c0:c1] = pr[:, : c1 - c0]

            # update_sum: each lane's tree over its fragment columns, then an FFMA with the factor
            key_lane = fragment_lane(np.arange(p.tile_n), p.layout)
            key_col = fragment_column(np.arange(p.tile_n), p.layout)
            for lane in range(lanes):
                mine = np.flatnonzero(key_lane == lane)
                mine = mine[np.argsort(key_col[mine])]
                row_sum[:, lane] = fma_f32(row_sum[:, lane], factor, _tree_sum(pr[:, mine]))

            # O *= factor; O += P V with P in the input dtype
            pv = _round_to(pr[:, : c1 - c0], p.p_dtype) @ v64[c0:c1]
            o = add_f32(f32(o.astype(F64) * factor.astype(F64)[:, None]), f32(pv))

        # finalize: the lanes' butterfly, then 1 / sum and the LSE
        total = row_sum[:, 0]
        if lanes == 4:
            total = add_f32(add_f32(row_sum[:, 0], row_sum[:, 1]), add_f32(row_sum[:, 2], row_sum[:, 3]))
        mm = f32(m.astype(F64) * F64(scale_log2))  # -inf for a row that saw nothing
        with np.errstate(divide="ignore", invalid="ignore"):
            if sink is not None:
                sink2 = f32(F64(F32(sink)) * F64(F32(LOG2_E)))
                top = np.maximum(mm, sink2)
                keep_f = exp2_mufu(add_f32(mm, -top))
                total = fma_f32(total, keep_f, exp2_mufu(add_f32(sink2, -top)))
                out_scale = f32(keep_f.astype(F64) / total.astype(F64))
                lse_r = f32(add_f32(top, f32(np.log2(total.astype(F64)))).astype(F64) * F64(F32(LN_2)))
            else:
                pos = total > 0
                out_scale = np.where(pos, f32(1.0 / total.astype(F64)), F32(0.0))
                lse_r = np.where(pos, f32(add_f32(mm, f32(np.log2(total.astype(F64)))).astype(F64)
                                          * F64(F32(LN_2))), F32(-np.inf))
        out[r0:r1] = f32(o.astype(F64) * out_scale.astype(F64)[:, None])
        lse[r0:r1] = lse_r

    out_t = torch.from_numpy(out)
    return TileResult(out=out_t.to(p.p_dtype), out_f32=out_t, lse=torch.from_numpy(lse), stats=stats,
                      probs=None if probs_all is None else torch.from_numpy(probs_all))
