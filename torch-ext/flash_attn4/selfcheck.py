"""First-use self-check of compiled kernels on architectures we have not run ourselves.

Why: the sm_100 family (B200/GB200, B300/GB300) kernels are compiled and statically checked here, but
no Blackwell GPU has ever run them for us. So the first time a process uses a kernel configuration on
such a GPU, that kernel computes a small problem with the same configuration and its result is
compared with a PyTorch reference *before* the caller's call gets a result. A wrong kernel then
fails loudly at its first call instead of returning wrong numbers.

When: ``ops._checked_forward`` calls :func:`ensure_checked` after it has the compiled forward kernel
for a (device, ForwardConfig), or split-KV pipeline for a (device, SplitKVConfig), before the
caller's launch; ``ops.bwd`` likewise with the compiled backward kernel for a (device,
BackwardConfig), whose check runs the whole backward (the preprocessing, that kernel and the
postprocessing its configuration derives; "The backward" section below). Which configurations are
checked:

* ``FLASH_ATTN4_SELF_CHECK`` unset (or ``auto``): configurations whose ``arch`` is in
  :data:`UNVERIFIED_ARCHS` (today sm_100a and sm_103a: the registry's ``run_by_us``, the one place
  to edit once a GPU of that family has run the test suite);
* ``1``/``true``/``yes``/``on``: every configuration on every architecture (how the H200 tests the
  check itself, on sm90);
* ``0``/``false``/``no``/``off``: none, at the user's own risk.

The variable is read (through ``settings``) when a configuration is first used on a device; the
decision - passed, not required, or off - is then kept per (device index, configuration) and the
kernel object it was made for, so every later call costs one dict lookup (keyed by the device
index and the kernel object's id, about 0.1 us). A failed configuration is
not kept: each later call raises again (without relaunching), unless the variable has been turned
off meanwhile. :func:`clear` forgets everything.

What the check runs (:func:`build_forward_problem`): the configuration's dtype and head dims; for a
persistent kernel (``persistent_ctas``) a batch large enough for more tiles than CTAs, so that some
CTAs run a second tile on the pipeline states their first left behind (:func:`batch_size`); GQA
with the query heads per KV head the kernel packs (pack_gqa, or pack_gqa_heads in padded groups; 3
where the kernel does not pack: any ratio runs there);
ragged lengths that leave partial tiles (about 300 queries, 333 keys); varlen with four sequences
(one with no queries, one not a multiple of 128 long, one whose queries see no keys, one with more
queries than keys); seqused_k below the stored length and 0 for one sequence, the stored keys past
it NaN and their values +inf (docs/CONTRACTS.md: they must reach no result; a kernel that reads
them unzeroed fails); causal or a local
window with both sides bounded, aligned bottom-right, and with more queries than keys so that the
first rows see no key; softcap; a learnable sink; a non-default softmax_scale; seqused_q below the
stored query length (a full sequence, an empty one, a single query), where rows past it are
unspecified and take the reference's values. The launch goes through ``ops._launch_forward``, the
function every forward call launches through, into outputs filled with NaN (out) and +inf (lse) so
that anything left unwritten fails. A split-KV kernel writes SPLITS float32 partials (short sequences
leave some splits empty); they are merged in float64 by :func:`merge_partials` (the combine kernel's
rule, which leaves an empty split's partial unread) and the merge is compared. A split-KV pipeline
(SplitKVConfig: the split kernel and the combine in one call, what ops runs) splits the same way
into a workspace filled with NaN, and its own combine's out and lse are compared (a learnable sink
where its combine adds one). A paged kernel reads the same
keys from a paged copy of the cache (pages shuffled, spare pages and the tables' unused entries
holding other data).

The comparison (:func:`compare_forward`) is the GPU test suite's rule, against a reference computed
on the kernel's device with float64 GEMMs (so no TF32 or reduced-precision setting can loosen it;
:func:`reference_forward`) and the same computation with the input dtype's roundings:
``max|out - ref| <= 2 * max|out_lowp - ref| + atol`` with ``atol`` twice the rounding of the exact
result to the input dtype plus :data:`ATOL`; every output finite; ``|lse - ref| <= LSE_ATOL`` (plus
``softcap * 1e-3`` with softcap: the kernels' approximate tanh) where the reference is finite; lse
-inf exactly where the reference is; out exactly 0 in rows that see no key.

Policy on a mismatch: never return wrong numbers. :class:`SelfCheckError` (a RuntimeError) is raised,
naming the configuration (all its fields), the errors measured against what is allowed and where,
the GPU and the versions, asking for a report at :data:`ISSUE_TRACKER`, and saying how to switch the
check off (``FLASH_ATTN4_SELF_CHECK=0``) for whoever accepts the risk. Raising rather than falling
back to a PyTorch path silently: a fallback would be orders of magnitude slower without anyone
noticing, and a kernel that fails its check is a bug we want to hear about. One exception: a
configuration for which dispatch names a fallback kernel of ours (``dispatch.self_check_fallback``:
CTA pairs, cluster_m = 2, fall back to single CTAs, which compute the same problem class with the
kernel the rules pick when pairs are off; padded GQA groups, pack_gqa_heads, to the heads unpacked
on single CTAs) is replaced by it on that device for the rest of the
process, with a one-line warning naming both and asking for a report (the full failure report goes
to the log at INFO level); the fallback is checked on its first use like any configuration, and
raises if it fails too. An exception raised by the launch itself (a missing feature, a CUDA error)
propagates as it is.

CUDA graphs and torch.compile: a kernel cannot be run and waited for while a CUDA graph is being
captured, so a configuration whose first use falls inside a capture raises a RuntimeError asking for
one eager call first (the usual warm-up; torch.compile's mode="reduce-overhead" and
torch.cuda.make_graphed_callables run eagerly before capturing). Skipping the check there instead
would bake an unchecked kernel into a graph that may replay forever. torch.compile's tracing runs the
op's fake implementation, which launches nothing; the compiled graph's real calls are eager.

Cost: once per (device, configuration) per process, building the problem on the CPU (2-10 ms of
one core on the development machine), one launch of the kernel on it, and the references' few dozen
small kernels on the same device (float64 GEMMs of about 0.5 GFLOP); ``scripts/selfcheck_cost.py``
times the CPU side, tests/gpu/test_selfcheck_gpu.py the whole check on a GPU, and each check's
:class:`CheckReport` (:func:`report`) holds its own times. The reference runs on the GPU rather than
the CPU because, on the CPU, it took 30-150 ms of one core but 0.3-0.9 s with two threads on a
contended machine, as a node whose ranks all start at once would be.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from . import settings
from .fa4_kernels.arch import NOT_RUN_BY_US
from .fa4_kernels.config import BackwardConfig, ForwardConfig, SplitKVConfig

# Architectures whose kernels have never been run by us: checked by default (FLASH_ATTN4_SELF_CHECK
# unset). The registry says which (fa4_kernels/arch.py, ArchKernels.run_by_us).
UNVERIFIED_ARCHS = NOT_RUN_BY_US

ISSUE_TRACKER = "https://huggingface.co/flash-attn4-org/flash-attn4/discussions"

SEED = 20  # the check's inputs: fixed, so that a failure is the same on every run (and reproducible)
ATOL = 1e-3  # added to the output tolerance, beyond twice the rounding to the input dtype
LSE_ATOL = 2e-3
SOFTCAP = 3.0  # scores of the problem are about N(0, 1.25^2): tanh bends them noticeably
SINK_MEAN = 3.0  # sink logits about as large as a row's largest scores, so the sink weighs in
WINDOW = (70, 5)  # local: narrower than a key block, so whole blocks are skipped on both sides
UNPACKED_HEAD_RATIO = 3  # q heads per KV head where the kernel does not pack (any ratio runs there)
# (seqlen_q, seqlen_k stored, seqlen_k used) per varlen sequence; the third one's keys are 0 long
# without seqused_k, so that its rows see no key either way. 333 (290 used) and 40 / 61 keys are odd
# numbers of 128-key blocks, and 290, 40 and 61 odd numbers of the d = 256 pair's 64-key blocks (5, 1,
# 1; 333 and 256 have 6 and 4): a backward CTA pair's odd block there lies past the keys, its packed
# rows the next sequences' (the pair must neither read them unzeroed nor store its dK / dV there).
VARLEN_LENGTHS = ((300, 333, 290), (0, 40, 40), (129, 256, 0), (100, 61, 61))
BATCHED_LENGTHS = (300, 333)  # (sq, sk); swapped for causal/local, so the first rows see no key
BATCH = 2
# seqused_q: queries cut off the stored length, per varlen sequence (300, 0, 129 and 100 stored:
# 263, 0, 129 and 1 used) and per batch element (the stored length less 37, and 1).
SEQUSED_Q_CUT = (37, 0, 0, 99)
SPLITS = 3  # split-KV: KV blocks shared among 3 CTAs per tile (the 333-key sequences: one block each)
SPARE_PAGES = 2  # paged: pages no sequence owns, in the shuffled pool


class SelfCheckError(RuntimeError):
    """A kernel configuration failed its first-use self-check (wrong results, or none in time:
    ``hung``, after which the GPU's context may not recover, so nothing falls back)."""

    def __init__(self, message: str, hung: bool = False):
        super().__init__(message)
        self.hung = hung


# ---- the problem ----


@dataclass
class ForwardProblem:
    """A small forward problem on the CPU in the kernel's call convention (ForwardConfig's
    docstring), with the canonical mask arguments ops passes (causal: window (-1, 0))."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens_q: Optional[torch.Tensor]
    cu_seqlens_k: Optional[torch.Tensor]
    seqused_k: Optional[torch.Tensor]
    learnable_sink: Optional[torch.Tensor]
    softmax_scale: float
    softcap: float
    causal: bool
    window_left: int
    window_right: int
    max_seqlen_q: int
    seed: int
    # per varlen sequence or batch element: (seqlen_q, seqlen_k stored, seqlen_k used)
    lengths: tuple = ()
    seqused_q: Optional[torch.Tensor] = None  # int32 per sequence: queries used (rows past it unspecified)
    num_splits: int = 1  # > 1: a split-KV kernel's partials, merged before the comparison
    # paged: the kernel reads k and v from these (num_pages, page_size, hk, d) pages through
    # page_table (batch, max_pages); the reference reads k, v and cu_seqlens_k
    k_pages: Optional[torch.Tensor] = None
    v_pages: Optional[torch.Tensor] = None
    page_table: Optional[torch.Tensor] = None

    def used_q(self, b: int) -> int:
        return self.lengths[b][0] if self.seqused_q is None else int(self.seqused_q[b])

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    def launch_args(self, device) -> tuple:
        """(q, k, v), then (cu_seqlens_q, cu_seqlens_k, seqused_k, learnable_sink, softmax_scale,
        softcap, window_left, window_right, max_seqlen_q) on ``device``: the arguments around out and
        lse in the kernel's (and ops._launch_forward's) order."""
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        tensors = (self.q, self.k, self.v)
        rest = (self.cu_seqlens_q, self.cu_seqlens_k, self.seqused_k, self.learnable_sink)
        if self.page_table is not None:
            tensors = (self.q, self.k_pages, self.v_pages)
            rest = (self.cu_seqlens_q, None, self.seqused_k, self.learnable_sink)
        return (tuple(move(t) for t in tensors),
                tuple(move(t) for t in rest) + (self.softmax_scale, self.softcap, self.window_left,
                                                self.window_right, self.max_seqlen_q))

    def output_shapes(self) -> tuple[tuple, tuple]:
        hq, dv = self.q.shape[-2], self.v.shape[-1]
        if self.varlen:
            return (self.q.shape[0], hq, dv), (hq, self.q.shape[0])
        b, sq = self.q.shape[:2]
        return (b, sq, hq, dv), (b, hq, sq)

    def describe(self) -> str:
        hq, hk = self.q.shape[-2], self.k.shape[-2]
        layout = (f"varlen, {len(self.lengths)} sequences" if self.varlen
                  else f"batched, batch {self.q.shape[0]}")
        mask = ("causal" if self.causal else
                f"local window ({self.window_left}, {self.window_right})" if self.window_left >= 0
                or self.window_right >= 0 else "no mask")
        parts = [layout, "(seqlen_q, seqlen_k, seqused_k) = " + ", ".join(map(str, self.lengths))]
        if self.seqused_q is not None:
            parts.append(f"seqused_q {self.seqused_q.tolist()}")
        if self.num_splits > 1:
            parts.append(f"{self.num_splits} KV splits (float32 partials, merged)")
        if self.page_table is not None:
            parts.append(f"paged: {self.k_pages.shape[0]} pages of {self.k_pages.shape[1]} keys, shuffled")
        parts += [f"heads q/kv {hq}/{hk}", f"head_dim {self.q.shape[-1]}/{self.v.shape[-1]}", str(self.q.dtype),
                  mask, f"softmax_scale {self.softmax_scale:.6g}"]
        if self.softcap:
            parts.append(f"softcap {self.softcap}")
        if self.learnable_sink is not None:
            parts.append("learnable sink")
        parts.append(f"seed {self.seed}")
        return ", ".join(parts)


_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def build_forward_problem(cfg: ForwardConfig | SplitKVConfig, seed: Optional[int] = None) -> ForwardProblem:
    """A problem on the CPU that takes ``cfg``'s paths (the module docstring lists them; a split-KV
    pipeline's are its forward's, with a sink where its combine adds one); random inputs from
    ``seed`` (default: SEED) drawn from a private generator, so the caller's RNG state is left alone."""
    forward, has_sink = (cfg.forward, cfg.combine.has_sink) if isinstance(cfg, SplitKVConfig) else (cfg, cfg.has_sink)
    ratio = forward.query_heads_per_group if forward.pack_gqa > 1 else UNPACKED_HEAD_RATIO
    return _build_problem(forward, ratio, has_sink, torch.Generator().manual_seed(SEED if seed is None else seed))


def _build_problem(cfg, ratio: int, has_sink: bool, gen: torch.Generator) -> ForwardProblem:
    """The problem of a forward or backward configuration (``cfg``: its dtype, head dims, mask,
    softcap, varlen and seqused_k fields; the forward's seqused_q, split_kv and page_size where it
    has them) with ``ratio`` query heads per KV head, from ``gen``."""
    seed = gen.initial_seed()
    dtype = _TORCH_DTYPES[cfg.dtype]
    hk = 2 if ratio <= 8 else 1
    hq = ratio * hk
    d, dv = cfg.head_dim, cfg.head_dim_v
    masked = cfg.causal or cfg.local
    has_seqused_q, split_kv, page_size = (getattr(cfg, name, default) for name, default in
                                          (("has_seqused_q", False), ("split_kv", False), ("page_size", 0)))
    if cfg.varlen:
        lengths = VARLEN_LENGTHS if cfg.has_seqused_k else tuple(
            (sq, sk if used else 0, sk if used else 0) for sq, sk, used in VARLEN_LENGTHS)
        total_q, total_k = sum(x[0] for x in lengths), sum(x[1] for x in lengths)
        q_shape, k_shape, v_shape = (total_q, hq, d), (total_k, hk, d), (total_k, hk, dv)
        cu_q, cu_k = (torch.tensor([0] + [sum(x[i] for x in lengths[:j + 1]) for j in range(len(lengths))],
                                   dtype=torch.int32) for i in (0, 1))
        max_seqlen_q = max(x[0] for x in lengths)
    else:
        sq, sk = BATCHED_LENGTHS[::-1] if masked else BATCHED_LENGTHS
        batch = batch_size(cfg, sq, hq, hk)
        used = (sk - 43, 0) * (batch // 2) + (sk - 43,) * (batch % 2) if cfg.has_seqused_k else (sk,) * batch
        lengths = tuple((sq, sk, u) for u in used)
        q_shape, k_shape, v_shape = (batch, sq, hq, d), (batch, sk, hk, d), (batch, sk, hk, dv)
        cu_q = cu_k = None
        max_seqlen_q = sq
    randn = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float32)  # noqa: E731
    q, k, v = (randn(*s).to(dtype) for s in (q_shape, k_shape, v_shape))
    seqused_k = torch.tensor([x[2] for x in lengths], dtype=torch.int32) if cfg.has_seqused_k else None
    if cfg.has_seqused_k:  # stored keys past the used ones: must reach no result
        start = 0
        for b, (_, stored, used) in enumerate(lengths):
            rows = slice(start + used, start + stored) if cfg.varlen else (b, slice(used, stored))
            k[rows], v[rows] = float("nan"), float("inf")
            start += stored
    seqused_q = None
    if has_seqused_q:
        cuts = SEQUSED_Q_CUT if cfg.varlen else ((37, None) * len(lengths))[:len(lengths)]
        seqused_q = torch.tensor([max(x[0] - cut, 0) if cut is not None else 1 for x, cut in zip(lengths, cuts)],
                                 dtype=torch.int32)
    sink = randn(hq) + SINK_MEAN if has_sink else None
    if cfg.causal:
        left, right = -1, 0
    elif cfg.local:
        left, right = WINDOW
    else:
        left, right = -1, -1
    pages = (None, None, None)
    if page_size:  # batched keys as packed ones: entry b's sk stored keys after entry b - 1's
        pages = _paged(*((k, v) if cfg.varlen else (k.flatten(0, 1), v.flatten(0, 1))), lengths, page_size, gen)
    return ForwardProblem(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=seqused_k,
                          learnable_sink=sink, softmax_scale=1.25 / math.sqrt(d),
                          softcap=SOFTCAP if cfg.has_softcap else 0.0, causal=cfg.causal, window_left=left,
                          window_right=right, max_seqlen_q=max_seqlen_q, seed=seed, lengths=lengths,
                          seqused_q=seqused_q, num_splits=SPLITS if split_kv else 1,
                          k_pages=pages[0], v_pages=pages[1], page_table=pages[2])


def output_tiles(cfg: ForwardConfig, batch: int, seqlen_q: int, hq: int, hk: int) -> int:
    """The tiles a batched launch of ``cfg`` has (the kernels' TileScheduler: query blocks of tile_m
    rows, of tile_m x cluster_m rows for CTA pairs, with pack_gqa the group's heads folded into the
    rows, times heads, times batch)."""
    rows, heads = (seqlen_q * cfg.pack_gqa, hk) if cfg.pack_gqa > 1 else (seqlen_q, hq)
    return -(-rows // (cfg.tile_m * cfg.cluster_m)) * heads * batch


def batch_size(cfg, seqlen_q: int, hq: int, hk: int) -> int:
    """BATCH, or for a persistent kernel (cfg.persistent_ctas: at most that many CTAs, each looping
    over tiles; with CTA pairs, half as many pairs, each looping over pair tiles) the smallest batch
    with more tiles than workers, so that some run a second tile with the pipeline states the first
    left behind: where a persistent kernel's phases go wrong."""
    batch = BATCH
    workers = getattr(cfg, "persistent_ctas", 0) // getattr(cfg, "cluster_m", 1)  # forward configurations only
    while workers and output_tiles(cfg, batch, seqlen_q, hq, hk) <= workers:
        batch += 1
    return batch


def _paged(k: torch.Tensor, v: torch.Tensor, lengths: tuple, page_size: int, gen: torch.Generator):
    """(k_pages, v_pages, page_table): the packed keys and values of ``lengths`` copied into
    pages of ``page_size`` keys, drawn in a shuffled order from a pool with SPARE_PAGES more than
    needed; everything else (page tails, spare pages, unused table entries) holds other data."""
    per_seq = [-(-stored // page_size) for _, stored, _ in lengths]
    num_pages = sum(per_seq) + SPARE_PAGES
    order = torch.randperm(num_pages, generator=gen).tolist()
    k_pages = torch.randn(num_pages, page_size, *k.shape[1:], generator=gen).to(k.dtype)
    v_pages = torch.randn(num_pages, page_size, *v.shape[1:], generator=gen).to(v.dtype)
    table = torch.randint(0, num_pages, (len(lengths), max(max(per_seq), 1)), generator=gen, dtype=torch.int32)
    start = 0
    for b, (_, stored, _) in enumerate(lengths):
        for i in range(per_seq[b]):
            page, n = order.pop(), min(page_size, stored - i * page_size)
            table[b, i] = page
            k_pages[page, :n] = k[start + i * page_size:start + i * page_size + n]
            v_pages[page, :n] = v[start + i * page_size:start + i * page_size + n]
        start += stored
    return k_pages, v_pages, table


# ---- the reference ----


def _visible(sq: int, sk: int, causal: bool, left: int, right: int, device) -> torch.Tensor:
    """(sq, sk) bool: query i sees key j (bottom-right aligned; -1 = that side unbounded)."""
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    diag = i + sk - sq
    visible = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if causal:
        right = 0
    if left >= 0 and not causal:
        visible &= j >= diag - left
    if right >= 0:
        visible &= j <= diag + right
    return visible


def _attend(q, k, v, sink, p: ForwardProblem, exact: bool):
    """One sequence, inputs in float64 holding the input dtype's values: q (sq, hq, d), k (sk, hk, d),
    v (sk, hk, dv) -> out (sq, hq, dv), lse (hq, sq) in float64, empty (sq,) rows that see no key.
    exact: float64 throughout. Else a plain low-precision implementation: GEMM results and P rounded
    to the input dtype (a float64 GEMM rounded once is what a 16-bit GEMM accumulating in float32
    gives, to within its accumulation error) and the softmax in float32. Every GEMM is float64, so
    no TF32 or reduced-precision setting of the caller's can change the reference."""
    sq, hq = q.shape[:2]
    sk, hk = k.shape[:2]
    dtype = p.q.dtype
    k = k.repeat_interleave(hq // hk, dim=1)
    v = v.repeat_interleave(hq // hk, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k)
    if not exact:
        scores = scores.to(dtype)
    scores = scores * p.softmax_scale
    if p.softcap:
        scores = p.softcap * torch.tanh(scores / p.softcap)
    scores = scores.to(torch.float64 if exact else torch.float32)
    visible = _visible(sq, sk, p.causal, p.window_left, p.window_right, q.device)
    scores = scores.masked_fill(~visible, float("-inf"))
    logits = scores
    if sink is not None:
        logits = torch.cat([scores, sink.to(scores.dtype)[:, None, None].expand(hq, sq, 1)], dim=-1)
    if logits.shape[-1]:
        lse = torch.logsumexp(logits, dim=-1)
    else:
        lse = torch.full((hq, sq), float("-inf"), dtype=scores.dtype, device=q.device)
    finite = torch.isfinite(lse)
    probs = torch.exp(scores - torch.where(finite, lse, 0.0)[..., None])
    probs = torch.where(finite[..., None], probs, 0.0)
    if not exact:
        probs = probs.to(dtype)
    out = torch.einsum("hqk,khd->qhd", probs.double(), v)
    if not exact:
        out = out.to(dtype)
    return out.double(), lse.double(), ~visible.any(dim=-1)


@dataclass
class ForwardReference:
    out: torch.Tensor  # float64, the kernel's out layout
    lse: torch.Tensor  # float64, the kernel's lse layout
    out_lowp: torch.Tensor  # float64 values of the input-dtype computation
    empty: torch.Tensor  # bool, the out layout without the last two dims: rows that see no key
    unused: torch.Tensor  # bool, like empty: rows past seqused_q, whose results are unspecified


def reference_forward(p: ForwardProblem, device=None) -> ForwardReference:
    """Exact (float64) and low-precision results of ``p``, in the kernel's layouts, computed on
    ``device`` (default: the CPU; the check uses the kernel's device: a few milliseconds on a GPU,
    and no CPU threads contended by other processes of the node)."""
    device = torch.device("cpu") if device is None else torch.device(device)
    with torch.autocast(device.type, enabled=False):  # a caller's autocast region must not round it
        return _reference_forward(p, device)


def _reference_forward(p: ForwardProblem, device: torch.device) -> ForwardReference:
    out_shape, lse_shape = p.output_shapes()
    q, k, v = (t.to(device=device, dtype=torch.float64) for t in (p.q, p.k, p.v))
    sink = None if p.learnable_sink is None else p.learnable_sink.to(device)
    out = torch.zeros(out_shape, dtype=torch.float64, device=device)
    out_lowp = torch.zeros_like(out)
    lse = torch.full(lse_shape, float("-inf"), dtype=torch.float64, device=device)
    empty = torch.zeros(out_shape[:-2], dtype=torch.bool, device=device)
    unused = torch.zeros_like(empty)
    cq = p.cu_seqlens_q.tolist() if p.varlen else None
    ck = p.cu_seqlens_k.tolist() if p.varlen else None
    for b, (_, _, used) in enumerate(p.lengths):
        # Sequence b's rows (a slice of the packed tokens, or batch entry b), its queries in use
        # (seqused_q: they alone define the causal alignment) and its keys.
        if p.varlen:
            first, keys = cq[b], slice(ck[b], ck[b] + used)
            kb, vb, seq = k[keys], v[keys], slice(cq[b], cq[b + 1])
        else:
            first, kb, vb, seq = 0, k[b, :used], v[b, :used], b
        rows = slice(first, first + p.used_q(b))
        qb = q[rows] if p.varlen else q[b, :p.used_q(b)]
        exact, lowp = _attend(qb, kb, vb, sink, p, exact=True), _attend(qb, kb, vb, sink, p, exact=False)
        if p.varlen:
            out[rows], lse[:, rows], empty[rows] = exact
            out_lowp[rows] = lowp[0]
            unused[first + p.used_q(b):cq[b + 1]] = True
        else:
            out[b, rows], lse[b, :, rows], empty[b, rows] = exact
            out_lowp[b, rows] = lowp[0]
            unused[seq, p.used_q(b):] = True
    return ForwardReference(out=out, lse=lse, out_lowp=out_lowp, empty=empty, unused=unused)


def merge_partials(out_partial: torch.Tensor, lse_partial: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A split-KV kernel's (splits, *out) and (splits, *lse) partials merged in float64 by the
    combine kernel's rule (fa4_kernels/combine.py): weights exp(LSE_s - max); a split with LSE -inf
    adds nothing and its partial output is not read; every split empty gives O = 0, LSE = -inf."""
    out_partial, lse_partial = out_partial.double(), lse_partial.double()
    top = lse_partial.amax(0)
    top = torch.where(torch.isfinite(top), top, 0.0)
    weights = torch.exp(lse_partial - top)  # 0 for an empty split; NaN/inf propagate (unwritten)
    total = weights.sum(0)
    lse = torch.log(total) + top
    w = (weights / torch.where(total > 0, total, 1.0)).transpose(-1, -2)[..., None]  # out's layout
    out = torch.where(w != 0, w * out_partial, 0.0).sum(0)
    return out, lse


# ---- the comparison ----


@dataclass
class CheckReport:
    """What a check measured. ``failures`` empty means passed."""

    failures: list = field(default_factory=list)
    out_err: float = float("nan")
    out_allowed: float = float("nan")
    lse_err: float = float("nan")
    lse_allowed: float = float("nan")
    # the backward's: gradient name ("dq", "dk", "dv", "dsink") -> (max |grad - ref|, allowed)
    grads: dict = field(default_factory=dict)
    problem: str = ""
    hung: bool = False  # the kernel did not finish within HANG_TIMEOUT_S
    # wall seconds: building the problem (CPU) and moving it to the device; computing both references
    # (on a GPU: queueing their kernels); comparing (on a GPU: waiting for the kernel and the
    # references too); the whole check
    build_s: float = 0.0
    reference_s: float = 0.0
    compare_s: float = 0.0
    total_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        if self.grads:
            return "; ".join(f"{name} max|{name} - ref| = {err:.3e} (allowed {allowed:.3e})"
                             for name, (err, allowed) in self.grads.items())
        return (f"out max|out - ref| = {self.out_err:.3e} (allowed {self.out_allowed:.3e}); "
                f"lse max|lse - ref| = {self.lse_err:.3e} (allowed {self.lse_allowed:.3e})")


def _where(p: ForwardProblem, index: tuple, lse_layout: bool = False, keys: bool = False) -> str:
    """Human words for an element index of out or dq (of lse; of dk or dv with ``keys``)."""
    row_name = "key row" if keys else "query row"
    if p.varlen:
        head, token = (index[0], index[1]) if lse_layout else (index[1], index[0])
        cu = (p.cu_seqlens_k if keys else p.cu_seqlens_q).tolist()
        seq = max(b for b in range(len(cu) - 1) if cu[b] <= token) if len(cu) > 1 else 0
        return f"sequence {seq} {row_name} {token - cu[seq]} head {head}"
    if lse_layout:
        b, head, row = index[:3]
    else:
        b, row, head = index[:3]
    return f"batch {b} {row_name} {row} head {head}"


def _first(mask: torch.Tensor) -> tuple:
    return tuple(int(x) for x in mask.nonzero()[0])


def compare_forward(p: ForwardProblem, out: torch.Tensor, lse: torch.Tensor,
                    ref: Optional[ForwardReference] = None) -> CheckReport:
    """The kernel's ``out``/``lse`` against the reference (computed on out's device when not
    given), under the module docstring's rule, on the reference's device: only numbers come back.
    Never raises for a mismatch: the report lists every failed condition."""
    ref = reference_forward(p, out.device) if ref is None else ref
    report = CheckReport(problem=p.describe())
    fail = report.failures.append
    out, lse = (t.detach().to(ref.out.device, torch.float64) for t in (out, lse))
    dtype = p.q.dtype
    if out.shape != ref.out.shape or lse.shape != ref.lse.shape:
        fail(f"output shapes out {tuple(out.shape)} lse {tuple(lse.shape)}, expected {tuple(ref.out.shape)} and "
             f"{tuple(ref.lse.shape)}")
        return report
    if ref.unused.any():  # rows past seqused_q: unspecified, so they compare as the reference
        out = torch.where(ref.unused[..., None, None], ref.out, out)
        lse = torch.where(ref.unused[None, :] if p.varlen else ref.unused[:, None, :], ref.lse, lse)

    bad = ~torch.isfinite(out)
    if bad.any():
        fail(f"out: {int(bad.sum())} of {out.numel()} values are NaN or infinite (first at "
             f"{_where(p, _first(bad))})")
    rounding = float((ref.out.to(dtype).double() - ref.out).abs().max()) if out.numel() else 0.0
    base = float((ref.out_lowp - ref.out).abs().max()) if out.numel() else 0.0
    report.out_allowed = 2 * base + 2 * rounding + ATOL
    diff = torch.nan_to_num((out - ref.out).abs(), nan=math.inf)
    report.out_err = float(diff.max()) if diff.numel() else 0.0
    if report.out_err > report.out_allowed:
        where = _where(p, tuple(int(x) for x in torch.unravel_index(diff.argmax(), diff.shape)))
        fail(f"out: max|out - ref| = {report.out_err:.3e} at {where} exceeds 2 * max|out_{str(dtype)[6:]} - ref| + "
             f"atol = 2 * {base:.3e} + {2 * rounding + ATOL:.3e}")
    nonzero = (out != 0).any(-1) & ref.empty[..., None]  # (.., rows, heads)
    if nonzero.any():
        fail(f"out: {int(nonzero.sum())} rows that see no key are not 0 (first at {_where(p, _first(nonzero))})")

    bad = torch.isnan(lse) | torch.isposinf(lse)
    if bad.any():
        fail(f"lse: {int(bad.sum())} values are NaN or +inf, i.e. wrong or unwritten (first at "
             f"{_where(p, _first(bad), lse_layout=True)})")
    pattern = torch.isneginf(lse) != torch.isneginf(ref.lse)
    if pattern.any():
        fail(f"lse: -inf at {int(pattern.sum())} places where the reference differs (first at "
             f"{_where(p, _first(pattern), lse_layout=True)}: {float(lse[_first(pattern)])} vs "
             f"{float(ref.lse[_first(pattern)])})")
    report.lse_allowed = LSE_ATOL + (p.softcap * 1e-3 if p.softcap else 0.0)
    both = torch.isfinite(ref.lse) & torch.isfinite(lse)
    lse_diff = torch.where(both, (lse - ref.lse).abs(), 0.0)
    report.lse_err = float(lse_diff.max()) if lse_diff.numel() else 0.0
    if report.lse_err > report.lse_allowed:
        where = _where(p, tuple(int(x) for x in torch.unravel_index(lse_diff.argmax(), lse_diff.shape)), True)
        fail(f"lse: max|lse - ref| = {report.lse_err:.3e} at {where} exceeds {report.lse_allowed:.1e}")
    return report


# ---- running a check ----

Launch = Callable[..., None]  # ops._launch_forward's signature: (kernel, q, k, v, out, lse, cu_q, ...)


def check_forward(cfg: ForwardConfig | SplitKVConfig, kernel, launch: Launch, device,
                  seed: Optional[int] = None) -> CheckReport:
    """Run ``kernel`` (``cfg``'s compiled forward, or split-KV pipeline) on the problem of ``cfg``
    through ``launch`` on ``device``'s current stream, compute the reference on the same device and
    compare (the comparison's reductions wait for the kernel). A split-KV kernel's partials are
    merged here; a pipeline's workspace starts as NaN and its own combine writes out and lse."""
    t0 = time.perf_counter()
    p = build_forward_problem(cfg, seed)
    (q, k, v), rest = p.launch_args(device)
    out_shape, lse_shape = p.output_shapes()
    pipeline = isinstance(cfg, SplitKVConfig)
    splits = (p.num_splits,) if p.num_splits > 1 and not pipeline else ()
    out = torch.full(splits + out_shape, float("nan"), dtype=torch.float32 if splits else q.dtype, device=device)
    lse = torch.full(splits + lse_shape, float("inf"), dtype=torch.float32, device=device)
    extra = {} if p.seqused_q is None else {"seqused_q": p.seqused_q.to(device)}
    if pipeline:
        extra["workspace"] = torch.full(cfg.workspace_shape(p.num_splits, math.prod(out_shape[:-1])), float("nan"),
                                        device=device)
    t1 = time.perf_counter()
    if p.page_table is not None:
        extra["page_table"] = p.page_table.to(device)
    launch(kernel, q, k, v, out, lse, *rest, **extra)
    if not await_completion(completion_probe(device)):
        # A problem of a few hundred rows takes milliseconds: the kernel is stuck (a barrier that
        # never completes). Nothing else is queued behind it, and the failure is recorded, so later
        # calls raise instead of launching it again.
        return CheckReport(failures=[f"the kernel did not finish the check's problem within {HANG_TIMEOUT_S:.0f} s "
                                     f"(it hangs; this GPU's context may not recover until the process exits)"],
                           hung=True,
                           problem=p.describe(), build_s=t1 - t0, total_s=time.perf_counter() - t0)
    t2 = time.perf_counter()
    ref = reference_forward(p, device)
    t3 = time.perf_counter()
    if splits:
        out, lse = merge_partials(out, lse)
    report = compare_forward(p, out, lse, ref)
    report.build_s, report.reference_s = t1 - t0, t3 - t2
    report.compare_s = time.perf_counter() - t3
    report.total_s = time.perf_counter() - t0
    return report


# How long the check waits for the kernel before calling it hung.
HANG_TIMEOUT_S = 60.0


def completion_probe(device) -> Optional[Callable[[], bool]]:
    """Whether the work queued so far on ``device``'s current stream has finished, as a callable
    (None on the CPU, where the launch has finished when it returns)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event.query


def await_completion(probe: Optional[Callable[[], bool]], timeout_s: Optional[float] = None,
                     poll_s: float = 1e-3) -> bool:
    """Poll ``probe`` until it says done (True) or ``timeout_s`` (default HANG_TIMEOUT_S) has passed
    (False)."""
    if probe is None:
        return True
    deadline = time.monotonic() + (HANG_TIMEOUT_S if timeout_s is None else timeout_s)
    while not probe():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


# ---- the backward ----
#
# A BackwardConfig's check runs the whole backward as ops.bwd launches it (ops._launch_backward: the
# preprocessing, the main kernel, the postprocessing) on its configuration's problem (the forward's:
# dtype, head dims, mask, softcap, varlen, seqused_k; GQA with UNPACKED_HEAD_RATIO query heads per KV
# head), with the reference forward's out (rounded to the input dtype) and LSE as the forward would
# have left them and a random incoming gradient dout. Deterministic configurations run twice and must
# agree bit for bit. The gradients are compared with autograd through the reference forward (float64,
# on the kernel's device) by the GPU suite's backward rule (tests/gpu/test_bwd.py):
# max|grad - ref| <= 2 * max|grad_lowp - ref| + atol, atol twice the rounding of the exact gradient to
# the input dtype plus GRAD_RTOL of its largest value plus ATOL, with grad_lowp the gradient of the
# reference run with the input dtype's roundings (its GEMM results, P, and in the backward dP, dS and
# the gradients); every gradient finite; dq exactly 0 in rows that see no key, dk and dv exactly 0 for
# keys no query sees (keys past seqused_k included).
#
# A learnable sink only changes the LSE the kernels read (BackwardConfig has no sink field; its
# gradient is torch's, ops._sink_grad, checked here too): the problem has one where the configuration
# asks for one (a future ``has_sink`` field) and otherwise where no mask is set. Masked configurations
# keep their rows without any key (LSE -inf, which the preprocessing turns into +inf), which a sink
# would hide.

GRAD_RTOL = 1e-4  # of the largest exact gradient, as in the GPU suite's rule


@dataclass(frozen=True)
class BackwardLaunch:
    """How the torch layer runs a backward (ops.BACKWARD_LAUNCH): ``gradients(kernel, cfg, dout, q, k,
    v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, softmax_scale, softcap, window_left,
    window_right, max_seqlen_q, max_seqlen_k, poison=True)`` -> (dq, dk, dv) is ops._launch_backward;
    ``sink_gradient(dout, out, lse, learnable_sink, varlen)`` -> dsink is ops._sink_grad."""

    gradients: Callable
    sink_gradient: Callable


@dataclass
class BackwardProblem:
    """A forward problem (inputs, masks) plus what the backward takes beyond it."""

    fwd: ForwardProblem
    dout: torch.Tensor  # out's layout, in the input dtype
    max_seqlen_k: int
    deterministic: bool

    def describe(self) -> str:
        return self.fwd.describe() + (", deterministic (run twice)" if self.deterministic else "")


def backward_has_sink(cfg) -> bool:
    """Whether a backward configuration's problem has a learnable sink (the section comment above)."""
    return getattr(cfg, "has_sink", not (cfg.causal or cfg.local))


def build_backward_problem(cfg, seed: Optional[int] = None) -> BackwardProblem:
    """The problem of a BackwardConfig, on the CPU, from ``seed`` (default: SEED) in a private
    generator."""
    gen = torch.Generator().manual_seed(SEED if seed is None else seed)
    fwd = _build_problem(cfg, UNPACKED_HEAD_RATIO, backward_has_sink(cfg), gen)
    out_shape, _ = fwd.output_shapes()
    dout = torch.randn(*out_shape, generator=gen, dtype=torch.float32).to(fwd.q.dtype)
    return BackwardProblem(fwd=fwd, dout=dout, max_seqlen_k=max(x[1] for x in fwd.lengths),
                           deterministic=cfg.deterministic)


@dataclass
class BackwardReference:
    grads: dict  # name -> float64 exact gradient, in the kernel's layouts ("dsink" with a sink)
    lowp: dict  # the same with the input dtype's roundings
    empty: torch.Tensor  # bool, q's layout without the last two dims: rows that see no key
    unseen: torch.Tensor  # bool, k's layout without the last two dims: keys no query sees
    extra_atol: dict  # name -> tolerance beyond the rule's ("dsink": _dsink_noise)


def reference_backward(p: BackwardProblem, device=None, fwd_ref: Optional[ForwardReference] = None
                       ) -> BackwardReference:
    """Autograd through the reference forward (``_attend``) with incoming gradient p.dout, exact and
    with the input dtype's roundings, on ``device`` (default: the CPU)."""
    device = torch.device("cpu") if device is None else torch.device(device)
    with torch.enable_grad(), torch.autocast(device.type, enabled=False), _autograd_dispatch():
        exact, lowp = (_reference_grads(p, device, exact) for exact in (True, False))
    dtype = p.fwd.q.dtype
    lowp = {name: (g if name == "dsink" else g.to(dtype).double()) for name, g in lowp.items()}
    empty, unseen = _unseen(p.fwd, device)
    extra = {}
    if p.fwd.learnable_sink is not None:
        fwd_ref = reference_forward(p.fwd, device) if fwd_ref is None else fwd_ref
        extra["dsink"] = _dsink_noise(p, fwd_ref, device)
    return BackwardReference(grads=exact, lowp=lowp, empty=empty, unseen=unseen, extra_atol=extra)


def _autograd_dispatch():
    """A context in which autograd records again where the caller runs below it: the check of a
    backward that PyTorch's attention provider reaches (torch_provider.py serves ATen's flash ops as
    their CPU/CUDA kernels, under ATen's autograd kernel, which excludes the autograd dispatch keys).
    There the reference's loss would not require grad and every reference gradient would read 0."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.ADInplaceOrView)
    for name in ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor"):
        keys = keys | torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, name))
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(),
                                           torch._C._dispatch_tls_local_exclude_set() - keys)


def _dsink_noise(p: BackwardProblem, fwd_ref: ForwardReference, device) -> float:
    """Six standard deviations of the sink gradient's error from taking rowsum(dO * O) with O in the
    input dtype, as every FlashAttention backward does (the GPU suite's dsink_rounding):
    dsink_h = -sum_rows exp(sink_h - lse) rowsum(dO * O), each element of O rounded independently,
    uniformly within +-eps/2 of its size."""
    f = p.fwd
    weight = ((p.dout.to(device, torch.float64) * fwd_ref.out) ** 2).sum(-1)  # (b, sq, hq) or (total, hq)
    weight = weight.t() if f.varlen else weight.transpose(1, 2)  # lse's layout
    sink = f.learnable_sink.to(device, torch.float64)
    p_sink = torch.exp((sink[:, None] if f.varlen else sink[None, :, None]) - fwd_ref.lse)
    per_head = (p_sink ** 2 * weight).sum(-1) if f.varlen else (p_sink ** 2 * weight).sum((0, 2))
    return 6 * float(per_head.max().sqrt()) * torch.finfo(f.q.dtype).eps / (2 * 3 ** 0.5)


def _sequences(f: ForwardProblem):
    """Per sequence: (its query rows, its used keys, its stored keys) as indexes into the batched
    (b, s, ...) or packed (total, ...) tensors."""
    cq = f.cu_seqlens_q.tolist() if f.varlen else None
    ck = f.cu_seqlens_k.tolist() if f.varlen else None
    for b, (sq, sk, used) in enumerate(f.lengths):
        if f.varlen:
            yield slice(cq[b], cq[b] + sq), slice(ck[b], ck[b] + used), slice(ck[b], ck[b] + sk)
        else:
            yield (b, slice(0, sq)), (b, slice(0, used)), (b, slice(0, sk))


def _reference_grads(p: BackwardProblem, device, exact: bool) -> dict:
    f = p.fwd
    leaves = {name: t.to(device=device, dtype=torch.float64).requires_grad_()
              for name, t in (("dq", f.q), ("dk", f.k), ("dv", f.v), ("dsink", f.learnable_sink)) if t is not None}
    dout = p.dout.to(device=device, dtype=torch.float64)
    q, k, v, sink = leaves["dq"], leaves["dk"], leaves["dv"], leaves.get("dsink")
    loss = torch.zeros((), dtype=torch.float64, device=device)
    for rows, keys, _ in _sequences(f):
        if q[rows].shape[0] == 0:
            continue
        out, _, _ = _attend(q[rows], k[keys], v[keys], sink, f, exact=exact)
        loss = loss + (out * dout[rows]).sum()
    names = list(leaves)
    grads = (torch.autograd.grad(loss, [leaves[n] for n in names], allow_unused=True) if loss.requires_grad
             else [None] * len(names))
    return {n: (torch.zeros_like(leaves[n]) if g is None else g).detach() for n, g in zip(names, grads)}


def _unseen(f: ForwardProblem, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows that see no key, keys no query sees) in q's and k's layouts without the last two dims."""
    empty = torch.zeros(f.q.shape[:-2], dtype=torch.bool, device=device)
    unseen = torch.ones(f.k.shape[:-2], dtype=torch.bool, device=device)
    for (rows, keys, _), (sq, _, used) in zip(_sequences(f), f.lengths):
        visible = _visible(sq, used, f.causal, f.window_left, f.window_right, device)
        empty[rows] = ~visible.any(dim=1)
        unseen[keys] = ~visible.any(dim=0)
    return empty, unseen


def compare_backward(p: BackwardProblem, runs: list, ref: BackwardReference) -> CheckReport:
    """The gradients of each run (dicts name -> tensor in the kernel's layouts) against the
    reference, under the section comment's rule; several runs (deterministic) must also be bitwise
    equal. Never raises for a mismatch: the report lists every failed condition."""
    f = p.fwd
    report = CheckReport(problem=p.describe())
    fail = report.failures.append
    got = runs[0]
    for i, other in enumerate(runs[1:], 2):
        for name, g in got.items():
            if not torch.equal(torch.nan_to_num(g), torch.nan_to_num(other[name])):
                fail(f"{name}: deterministic mode gave a different result on run {i} (max difference "
                     f"{float((g.double() - other[name].double()).abs().max()):.3e})")
    for name, want in ref.grads.items():
        g = got.get(name)
        if g is None or tuple(g.shape) != tuple(want.shape):
            fail(f"{name}: shape {None if g is None else tuple(g.shape)}, expected {tuple(want.shape)}")
            continue
        g = g.detach().to(want.device, torch.float64)
        keys = name in ("dk", "dv")
        where = (lambda index: f"head {index[0]}") if name == "dsink" else (
            lambda index: _where(f, index, keys=keys))  # noqa: E731
        bad = ~torch.isfinite(g)
        if bad.any():
            fail(f"{name}: {int(bad.sum())} of {g.numel()} values are NaN or infinite, i.e. wrong or unwritten "
                 f"(first at {where(_first(bad))})")
        scale = float(want.abs().max()) if want.numel() else 0.0
        rounding = float((want.to(got[name].dtype).double() - want).abs().max()) if want.numel() else 0.0
        base = float((ref.lowp[name] - want).abs().max()) if want.numel() else 0.0
        atol = 2 * rounding + GRAD_RTOL * scale + ATOL + ref.extra_atol.get(name, 0.0)
        diff = torch.nan_to_num((g - want).abs(), nan=math.inf)
        err = float(diff.max()) if diff.numel() else 0.0
        report.grads[name] = (err, 2 * base + atol)
        if err > 2 * base + atol:
            at = where(tuple(int(x) for x in torch.unravel_index(diff.argmax(), diff.shape)))
            fail(f"{name}: max|{name} - ref| = {err:.3e} at {at} exceeds 2 * max|{name}_{str(f.q.dtype)[6:]} - ref| "
                 f"+ atol = 2 * {base:.3e} + {atol:.3e}")
        if name != "dsink":
            zero = ref.unseen if keys else ref.empty
            nonzero = (g != 0).any(-1) & zero[..., None]  # (.., rows, heads)
            if nonzero.any():
                what = "keys that no query sees" if keys else "query rows that see no key"
                fail(f"{name}: {int(nonzero.sum())} {what} have a gradient that is not 0 (first at "
                     f"{where(_first(nonzero))})")
    return report


def check_backward(cfg, kernel, launch: BackwardLaunch, device, seed: Optional[int] = None) -> CheckReport:
    """Run ``cfg``'s whole backward (``kernel`` its compiled main kernel) on the problem of ``cfg``
    through ``launch`` on ``device``'s current stream (twice if deterministic), compute the reference
    on the same device and compare."""
    t0 = time.perf_counter()
    p = build_backward_problem(cfg, seed)
    f = p.fwd
    fwd_ref = reference_forward(f, device)  # what the forward leaves for the backward: out, lse
    out, lse = fwd_ref.out.to(f.q.dtype), fwd_ref.lse.float()
    (q, k, v), (cu_q, cu_k, used, sink, *scalars) = f.launch_args(device)
    dout = p.dout.to(device)
    args = (kernel, cfg, dout, q, k, v, out, lse, cu_q, cu_k, used, *scalars, p.max_seqlen_k)
    t1 = time.perf_counter()
    runs = []
    for _ in range(2 if p.deterministic else 1):
        dq, dk, dv = launch.gradients(*args, poison=True)
        runs.append({"dq": dq, "dk": dk, "dv": dv})
    if not await_completion(completion_probe(device)):
        return CheckReport(failures=[f"the backward did not finish the check's problem within {HANG_TIMEOUT_S:.0f} s "
                                     f"(it hangs; this GPU's context may not recover until the process exits)"],
                           hung=True,
                           problem=p.describe(), build_s=t1 - t0, total_s=time.perf_counter() - t0)
    if sink is not None:
        dsink = launch.sink_gradient(dout, out, lse, sink, f.varlen)
        for run in runs:
            run["dsink"] = dsink
    t2 = time.perf_counter()
    ref = reference_backward(p, device, fwd_ref)
    t3 = time.perf_counter()
    report = compare_backward(p, runs, ref)
    report.build_s, report.reference_s = t1 - t0, t3 - t2
    report.compare_s = time.perf_counter() - t3
    report.total_s = time.perf_counter() - t0
    return report


_CHECKS = {ForwardConfig: check_forward, SplitKVConfig: check_forward, BackwardConfig: check_backward}

# (device index, id(kernel)) -> kernel, for kernels whose use is decided: the hot path's one lookup
# (a pair of ints hashes faster than a config; the value keeps the kernel, and so its id, alive)
_settled: dict = {}
_verdicts: dict = {}  # (device index, cfg) -> "passed" | "not required" | "off" | "failed"
_reports: dict = {}  # (device index, cfg) -> CheckReport of checks that ran
_failed: dict = {}  # (device index, cfg) -> (kernel, message, hung)
_fallbacks: dict = {}  # (device index, cfg) -> the configuration used in its place after it failed
_lock = threading.RLock()


def required(cfg) -> bool:
    """Whether a configuration's first use is checked now (FLASH_ATTN4_SELF_CHECK, read now)."""
    mode = settings.self_check()
    return cfg.arch in UNVERIFIED_ARCHS if mode is None else mode


def ensure_checked(cfg, device: torch.device, kernel, launch: Launch) -> None:
    """Return once ``kernel`` (compiled for ``cfg``) may run on ``device``; on its first use there,
    run its self-check where it is required, raising SelfCheckError if it fails. After the first
    decision: one dict lookup."""
    if (device.index, id(kernel)) in _settled:
        return
    _first_use(cfg, device, kernel, launch)


def _settle(key, kernel, verdict: str) -> None:
    _settled[(key[0], id(kernel))] = kernel
    _verdicts[key] = verdict


def _first_use(cfg, device, kernel, launch: Launch) -> None:
    log = settings.get_logger()
    key = (device.index, cfg)
    with _lock:  # one check at a time; a second thread waits for the first one's verdict
        if (device.index, id(kernel)) in _settled:
            return
        failed = _failed.get(key)
        failed = failed[1:] if failed is not None and failed[0] is kernel else None  # (message, hung)
        mode = settings.self_check()
        if mode is False:
            if failed is not None:
                log.warning("flash-attn4: FLASH_ATTN4_SELF_CHECK is off: using a kernel configuration that failed "
                            "its self-check (%s)", _describe_cfg(cfg))
            _settle(key, kernel, "off")
            return
        if not (mode or cfg.arch in UNVERIFIED_ARCHS):
            _settle(key, kernel, "not required")
            return
        if failed is not None:
            raise SelfCheckError(*failed)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"flash-attn4: the first use of a kernel configuration on {_describe_device(device)} happens "
                f"during CUDA graph capture, where its self-check (a launch of a small problem and a wait for its "
                f"result) cannot run. Call the function once outside the capture with inputs of the same kind "
                f"(dtype, head dims, mask, varlen, GQA ratio) before capturing, as a warm-up; or set "
                f"FLASH_ATTN4_SELF_CHECK=0 to skip the check at your own risk. Configuration: {_describe_cfg(cfg)}")
        check = _CHECKS.get(type(cfg))
        if check is None:
            raise NotImplementedError(f"flash-attn4: no self-check for {type(cfg).__name__} yet")
        with torch.no_grad():
            report = check(cfg, kernel, launch, device)
        _reports[key] = report
        if report.ok:
            log.info("flash-attn4 self-check passed on %s in %.3f s (problem %.3f s, references %.3f s, comparison "
                     "%.3f s): %s; %s", _describe_device(device), report.total_s, report.build_s, report.reference_s,
                     report.compare_s, _describe_cfg(cfg), report.summary())
            _settle(key, kernel, "passed")
            return
        message = _failure_message(cfg, device, report)
        _failed[key] = (kernel, message, report.hung)
        _verdicts[key] = "failed"
        raise SelfCheckError(message, hung=report.hung)


def _describe_cfg(cfg) -> str:
    return f"{type(cfg).__name__}(" + ", ".join(cfg.key()[1:]) + ")"


def _describe_device(device: torch.device) -> str:
    if device.type != "cuda":
        return str(device)
    from . import device_info

    info = device_info.get_device_info(device)
    return f"{info.name} (cuda:{info.index}, compute capability {info.capability_str})"


def _versions() -> str:
    import importlib.metadata

    from . import __version__

    def version(dist):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "unknown"

    return (f"flash-attn4 {__version__}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
            f"nvidia-cutlass-dsl {version('nvidia-cutlass-dsl')}")


def _failure_message(cfg, device, report: CheckReport) -> str:
    return (
        f"flash-attn4 self-check FAILED: the compiled kernel for this configuration failed its check (wrong "
        f"results, or no result in time) on {_describe_device(device)}, so it was not used (no result was "
        f"returned).\n"
        f"  configuration: {_describe_cfg(cfg)}\n"
        f"  check problem: {report.problem}\n"
        + "".join(f"  error: {f}\n" for f in report.failures)
        + f"  measured: {report.summary()}\n"
        f"  versions: {_versions()}\n"
        + ("This architecture's kernels have not been run by the flash-attn4 developers. " if cfg.arch in
           UNVERIFIED_ARCHS else f"(The check ran because {settings.SELF_CHECK} forces it on.) ")
        + f"Please report this message at {ISSUE_TRACKER}.\n"
        f"To use the kernel anyway, at your own risk (it failed here), set the environment "
        f"variable FLASH_ATTN4_SELF_CHECK=0."
    )


def substitute(cfg, device: torch.device):
    """``cfg``, or the configuration that replaced it on ``device`` after it failed its check
    (fall_back). One dict lookup."""
    return _fallbacks.get((device.index, cfg), cfg)


def fall_back(cfg, fallback, device: torch.device, error: SelfCheckError) -> None:
    """Use ``fallback`` in place of ``cfg`` on ``device`` from now on (``cfg`` failed its check with
    ``error``; dispatch.self_check_fallback chose ``fallback``), saying so in one warning line; the
    failure's full report goes to the log at INFO level."""
    log = settings.get_logger()
    with _lock:
        _fallbacks[(device.index, cfg)] = fallback
    log.warning("flash-attn4: %s failed its first-use self-check on %s; using %s for this problem class "
                "instead (please report at %s)", _describe_cfg(cfg), _describe_device(device),
                ", ".join(_changes(cfg, fallback)), ISSUE_TRACKER)
    log.info("flash-attn4: the failed self-check: %s", error)


def _changes(cfg, other, prefix: str = "") -> list[str]:
    """'field=value' for each field of ``other`` that differs from ``cfg``'s ('forward.pack_gqa=1'
    inside a split-KV pipeline's configuration)."""
    changes = []
    for name in cfg.__dataclass_fields__:
        mine, theirs = getattr(cfg, name), getattr(other, name)
        if mine != theirs:
            nested = hasattr(theirs, "__dataclass_fields__")
            changes += _changes(mine, theirs, f"{prefix}{name}.") if nested else [f"{prefix}{name}={theirs}"]
    return changes


def verdict(cfg, device) -> Optional[str]:
    """"passed", "not required", "off", "failed", or None before the configuration's first use on
    ``device`` (a torch.device or a device index)."""
    index = device if isinstance(device, int) or device is None else torch.device(device).index
    return _verdicts.get((index, cfg))


def report(cfg, device) -> Optional[CheckReport]:
    """The report of the check that ran for (device, cfg), if one ran."""
    index = device if isinstance(device, int) or device is None else torch.device(device).index
    return _reports.get((index, cfg))


def clear() -> None:
    """Forget every verdict: each configuration is decided (and checked where required) again."""
    with _lock:
        for d in (_settled, _verdicts, _reports, _failed, _fallbacks):
            d.clear()
