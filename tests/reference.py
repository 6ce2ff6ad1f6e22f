"""Plain-torch attention reference and the FlashAttention accuracy rule, for the tests.

``attention_ref`` implements exactly the semantics of docs/CONTRACTS.md, written the obvious way
(materialised score matrix, explicit boolean mask) so it can be read and trusted:

* layout (b, s, h, d), or varlen (total, h, d) with int32 cu_seqlens; GQA/MQA by repeating K/V heads
  (query head h reads KV head h // (hq // hk));
* scores s = softmax_scale * q.k; with softcap > 0, s = softcap * tanh(s / softcap);
* masks aligned bottom-right: query i sees key j iff i + sk - sq - left <= j <= i + sk - sq + right
  (-1 = unbounded; causal forces right = 0), where sk is seqused_k[b] when given;
* learnable_sink: one extra logit per head in the softmax denominator only (gpt-oss); lse includes it;
* a row that sees no key: out = 0, lse = -inf (with a sink: lse = the sink logit, out = 0).

``upcast=True`` computes in float32 (the "out_ref" of the FlashAttention test rule); ``upcast=False``
keeps q, k, v and the probabilities in the input dtype (the "out_pt"), with only the softmax itself in
float32 as torch does.
"""

from __future__ import annotations

import math

import torch


def _mask(sq: int, sk: int, causal: bool, window_size, device) -> torch.Tensor:
    """(sq, sk) bool, True where query i may see key j."""
    left, right = window_size
    if causal:
        right = 0
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    diag = i + sk - sq
    visible = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if left is not None and left >= 0:
        visible &= j >= diag - left
    if right is not None and right >= 0:
        visible &= j <= diag + right
    return visible


def _attention_one(q, k, v, *, softmax_scale, causal, window_size, softcap, sink, upcast):
    """q (sq, hq, d), k (sk, hk, d), v (sk, hk, dv) -> out (sq, hq, dv) in q.dtype, lse (hq, sq) float32."""
    sq, hq, _ = q.shape
    sk, hk, _ = k.shape
    dv = v.shape[-1]
    out_dtype = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    group = hq // hk
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * softmax_scale  # (hq, sq, sk), in the compute dtype
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.float()
    visible = _mask(sq, sk, causal, window_size, q.device)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sink is not None:
        logits = torch.cat([scores, sink.float()[:, None, None].expand(hq, sq, 1)], dim=-1)
    else:
        logits = scores
    if logits.shape[-1] == 0:
        lse = torch.full((hq, sq), float("-inf"), device=q.device)
        return torch.zeros(sq, hq, dv, dtype=out_dtype, device=q.device), lse
    lse = torch.logsumexp(logits, dim=-1)  # (hq, sq); -inf for rows that see nothing
    finite = torch.isfinite(lse)
    probs = torch.exp(scores - torch.where(finite, lse, 0.0)[..., None])  # sink column dropped
    probs = torch.where(finite[..., None], probs, 0.0)
    if not upcast:
        probs = probs.to(v.dtype)
    out = torch.einsum("hqk,khd->qhd", probs, v)
    return out.to(out_dtype), lse


def attention_ref(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                  learnable_sink=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None, upcast=True):
    """Reference attention. Batched: q (b, sq, hq, d) -> out (b, sq, hq, dv), lse (b, hq, sq).
    Varlen (cu_seqlens given): q (total_q, hq, d) -> out (total_q, hq, dv), lse (hq, total_q)."""
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    window_size = tuple(-1 if w is None else w for w in window_size)
    opts = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                sink=learnable_sink, upcast=upcast)
    if cu_seqlens_q is None:
        b = q.shape[0]
        outs, lses = [], []
        for i in range(b):
            sk = k.shape[1] if seqused_k is None else int(seqused_k[i])
            o, l = _attention_one(q[i], k[i, :sk], v[i, :sk], **opts)
            outs.append(o)
            lses.append(l)
        out = torch.stack(outs) if b else q.new_empty(0, q.shape[1], q.shape[2], v.shape[-1])
        lse = torch.stack(lses) if b else q.new_empty(0, q.shape[2], q.shape[1], dtype=torch.float32)
        return out, lse
    cq = [int(x) for x in cu_seqlens_q.tolist()]
    ck = [int(x) for x in cu_seqlens_k.tolist()]
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=q.device)
    for i in range(len(cq) - 1):
        ks, ke = ck[i], ck[i + 1]
        if seqused_k is not None:
            ke = ks + int(seqused_k[i])
        o, l = _attention_one(q[cq[i]:cq[i + 1]], k[ks:ke], v[ks:ke], **opts)
        out[cq[i]:cq[i + 1]] = o
        lse[:, cq[i]:cq[i + 1]] = l
    return out, lse


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in float32, treating matching infinities as equal and any NaN as infinite error."""
    a, b = a.float(), b.float()
    if a.numel() == 0:
        return 0.0
    if torch.isnan(a).any() or torch.isnan(b).any():
        return float("inf")
    same_inf = torch.isinf(a) & (a == b)
    diff = torch.where(same_inf, 0.0, (a - b).abs())
    return float(diff.max())


def assert_close_fa_rule(out, out_ref, out_pt, atol: float = 1e-5, name: str = "out") -> None:
    """FlashAttention's rule: max|out - out_ref| <= 2 * max|out_pt - out_ref| + atol.

    out_ref: float32 reference, out_pt: the same computation in the input precision. The kernel may be
    at most twice as far from the exact answer as a plain low-precision implementation, plus atol.
    """
    assert out.shape == out_ref.shape == out_pt.shape, (out.shape, out_ref.shape, out_pt.shape)
    err = max_abs_diff(out, out_ref)
    base = max_abs_diff(out_pt, out_ref)
    assert math.isfinite(base), f"{name}: the low-precision reference itself is not finite"
    assert err <= 2 * base + atol, (
        f"{name}: max|out - ref| = {err:.3e} exceeds 2 * max|out_pt - ref| + atol = "
        f"2 * {base:.3e} + {atol:.1e}"
    )


def random_cu_seqlens(batch: int, max_len: int, *, generator=None, allow_zero: bool = True,
                      device="cpu") -> torch.Tensor:
    """int32 (batch + 1,) offsets of random lengths in [0 or 1, max_len]."""
    low = 0 if allow_zero else 1
    lens = torch.randint(low, max_len + 1, (batch,), generator=generator)
    return torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(torch.int32).to(device)


def combine_ref(out_partial, lse_partial, sink=None):
    """Merge attention over disjoint key sets, the obvious way (flash_attn_combine's reference):
    out_partial (S, b, sq, h, dv), lse_partial (S, b, h, sq) -> out (b, sq, h, dv) float32, lse (b, h, sq).
    lse = log sum_s exp(lse_s); out = sum_s exp(lse_s - lse) out_s; a split with lse_s = -inf adds
    nothing, whatever its out_s holds; rows where every split is empty give out 0, lse -inf. A
    learnable sink (h,) is one more split whose output is 0."""
    lse_partial = lse_partial.float()
    if sink is not None:
        sink_split = sink.float()[None, None, :, None].expand(1, *lse_partial.shape[1:])
        lse_partial = torch.cat([lse_partial, sink_split])
        out_partial = torch.cat([out_partial, out_partial.new_zeros(1, *out_partial.shape[1:])])
    lse = torch.logsumexp(lse_partial, dim=0)  # -inf where every split is -inf
    finite = torch.isfinite(lse)
    weight = torch.exp(lse_partial - torch.where(finite, lse, 0.0))  # (S, b, h, sq)
    weight = torch.where(finite & (lse_partial > float("-inf")), weight, 0.0).transpose(-1, -2)[..., None]
    terms = torch.where(weight > 0, weight * out_partial.float(), 0.0)
    return terms.sum(0), lse


def split_kv_workspace_views(workspace, out_shape, lse_shape):
    """A split-KV pipeline's float32 workspace (num_splits, per_split) as the partials it holds
    (fa4_kernels/split_kv.py: split s's rows x dv partial outputs, then its rows LSEs):
    (num_splits, *out_shape) and (num_splits, *lse_shape) views."""
    splits = workspace.shape[0]
    n_out, n_lse = math.prod(out_shape), math.prod(lse_shape)
    assert workspace.shape[1] >= n_out + n_lse and workspace.stride(1) == 1
    return (workspace[:, :n_out].view(splits, *out_shape),
            workspace[:, n_out:n_out + n_lse].view(splits, *lse_shape))


def partial_attention_ref(q, k, v, keys, *, softmax_scale=None, causal=False, window_size=(-1, -1)):
    """Attention of one sequence over the key positions ``keys`` only (bool (sk,)), in float32, with the
    masks of the whole sequence (bottom-right alignment by all sk keys): q (sq, hq, d), k (sk, hk, d),
    v (sk, hk, dv) -> out (sq, hq, dv) float32 (0 where a row sees none of the keys), lse (hq, sq)
    (-inf there). A split of a split-KV forward computes this for its share of the keys."""
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    sq, hq, _ = q.shape
    sk, hk, _ = k.shape
    group = hq // hk
    kf, vf = k.float().repeat_interleave(group, dim=1), v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * softmax_scale
    visible = _mask(sq, sk, causal, window_size, q.device) & keys[None, :]
    scores = scores.masked_fill(~visible, float("-inf"))
    if sk == 0:
        return torch.zeros(sq, hq, v.shape[-1], device=q.device), torch.full((hq, sq), float("-inf"), device=q.device)
    lse = torch.logsumexp(scores, dim=-1)
    finite = torch.isfinite(lse)
    probs = torch.where(finite[..., None], torch.exp(scores - torch.where(finite, lse, 0.0)[..., None]), 0.0)
    return torch.einsum("hqk,khd->qhd", probs, vf), lse


def unpage(k_cache, v_cache, page_table, seqlens, batched: bool = False):
    """A paged cache's keys and values as a packed varlen batch (k, v, cu_seqlens_k): sequence b's
    first seqlens[b] tokens, token t from row t % page_size of page page_table[b, t // page_size].
    ``batched``: as a padded batch (k, v, None) instead, (b, max(seqlens), h, d), NaN past each
    entry's seqlens[b] keys (a reader must stop at them, as a kernel given seqused_k does)."""
    if batched:
        k, v, cu = unpage(k_cache, v_cache, page_table, seqlens)
        longest = max([int(n) for n in seqlens] + [0])
        kb, vb = (t.new_full((len(cu) - 1, longest, *t.shape[1:]), float("nan")) for t in (k, v))
        for b in range(len(cu) - 1):
            n = int(cu[b + 1] - cu[b])
            kb[b, :n], vb[b, :n] = k[int(cu[b]):int(cu[b + 1])], v[int(cu[b]):int(cu[b + 1])]
        return kb, vb, None
    page_size = k_cache.shape[1]
    ks, vs, lens = [], [], []
    for b in range(page_table.shape[0]):
        n = int(seqlens[b])
        pages = page_table[b, :-(-n // page_size)].long()
        ks.append(k_cache[pages].flatten(0, 1)[:n])
        vs.append(v_cache[pages].flatten(0, 1)[:n])
        lens.append(n)
    cu = torch.tensor([0] + lens, dtype=torch.int32, device=k_cache.device).cumsum(0, dtype=torch.int32)
    return torch.cat(ks), torch.cat(vs), cu


def random_pages(seqlens, page_size: int, *, spare: int = 3, generator=None):
    """A shuffled page table for sequences of these lengths: (page_table (b, max_pages) int32,
    num_pages). Pages in random order across sequences, ``spare`` unused pages among them, and the
    table's unused entries filled with out-of-range garbage (they must never be read)."""
    need = [-(-int(n) // page_size) for n in seqlens]
    max_pages = max(need + [1]) + 1
    num_pages = sum(need) + spare
    order = torch.randperm(num_pages, generator=generator)
    table = torch.full((len(seqlens), max_pages), 10 ** 6, dtype=torch.int32)
    taken = 0
    for b, n in enumerate(need):
        table[b, :n] = order[taken:taken + n].to(torch.int32)
        taken += n
    return table, num_pages


def attention_used_into(out, lse, q, k, v, *, seqused_q, cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None,
                        **opts):
    """What a kernel with seqused_q writes: each sequence's first seqused_q[b] queries attend to its
    keys (the first seqused_k[b] where given), into their rows of out and lse (batched: out (b, sq, h,
    dv), lse (b, h, sq); varlen: out (total, h, dv), lse (h, total)); the other rows stay untouched."""
    varlen = cu_seqlens_q is not None
    for b in range(seqused_q.shape[0]):
        nq = int(seqused_q[b])
        if varlen:
            q0, k0 = int(cu_seqlens_q[b]), int(cu_seqlens_k[b])
            nk = int(seqused_k[b]) if seqused_k is not None else int(cu_seqlens_k[b + 1]) - k0
            qb, kb, vb = q[None, q0:q0 + nq], k[None, k0:k0 + nk], v[None, k0:k0 + nk]
        else:
            nk = int(seqused_k[b]) if seqused_k is not None else k.shape[1]
            qb, kb, vb = q[b:b + 1, :nq], k[b:b + 1, :nk], v[b:b + 1, :nk]
        if nq == 0:
            continue
        o, l = attention_ref(qb, kb, vb, **opts)
        if varlen:
            out[q0:q0 + nq], lse[:, q0:q0 + nq] = o[0], l[0]
        else:
            out[b, :nq], lse[b, :, :nq] = o[0], l[0]


def rotary_ref(x, angle, pos, interleaved):
    """x (b, s, h, d) rotated by ``angle`` (seqlen_ro, r / 2) at rows pos (b, s), written independently of
    the library: interleaved as complex multiplication of (x[2i], x[2i + 1]), else GPT-NeoX's
    x * cos + rotate_half(x) * sin over the first r dims."""
    half = angle.shape[1]
    a = angle[pos.long()][:, :, None, :].double()  # (b, s, 1, half)
    xr, rest = x[..., :2 * half].double(), x[..., 2 * half:]
    if interleaved:
        z = torch.view_as_complex(xr.reshape(*xr.shape[:-1], half, 2).contiguous())
        out = torch.view_as_real(z * torch.polar(torch.ones_like(a), a)).flatten(-2)
    else:
        cos, sin = torch.cat([a.cos(), a.cos()], -1), torch.cat([a.sin(), a.sin()], -1)
        rotate_half = torch.cat([-xr[..., half:], xr[..., :half]], -1)
        out = xr * cos + rotate_half * sin
    return torch.cat([out.to(x.dtype), rest], -1)
