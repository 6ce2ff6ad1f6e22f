"""Compile-time configuration of the attention kernels.

Everything that changes the generated code lives in one frozen dataclass; the compile key is derived
from it (``ForwardConfig.key``), never assembled by hand, so a new field can never be forgotten in the
key. Problem sizes (batch, sequence lengths, head counts) are *not* here: they stay runtime values so
that a new length never triggers a recompile.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .arch import KERNELS, Arch

DTYPES = ("bfloat16", "float16")
HEAD_DIMS = tuple(range(8, 257, 8))


def parse_overrides(text: str) -> dict:
    """'field=value,field=value' -> {field: value} for Config.replace: true/false, a float when the
    value has a '.', else an int (tuning runs and tools name configuration changes this way)."""
    overrides = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, _, value = item.partition("=")
        parsed = {"true": True, "false": False}.get(value.lower())
        overrides[name] = parsed if parsed is not None else float(value) if "." in value else int(value)
    return overrides


@dataclass(frozen=True)
class _Config:
    """What every configuration has: the compile key and copies with changes."""

    def key(self) -> tuple:
        """Hashable compile key: the class name and every field, in declaration order."""
        return (type(self).__name__,) + tuple(
            f.name + "=" + str(getattr(self, f.name)) for f in dataclasses.fields(self)
        )

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    def _check_dtype(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")

    def _check_head_dims(self, *names: str) -> None:
        """The named head-dim fields are multiples of 8 in [8, 256] (16-byte vectors of 16-bit values)."""
        for name in names:
            if getattr(self, name) not in HEAD_DIMS:
                raise ValueError(f"{name} must be a multiple of 8 in [8, 256], got {getattr(self, name)}")

    def _check_arch(self, check: str) -> None:
        """The arch's own rules for this kind of kernel (``check`` in its tiles.py, if it has one):
        tile shapes and switches its kernel supports. An arch without kernels has no rules: compile
        refuses it."""
        entry = KERNELS.get(self.arch)
        rule = getattr(entry.rules(), check, None) if entry is not None else None
        if rule is not None:
            rule(self)


@dataclass(frozen=True)
class _KernelConfig(_Config):
    """Shared by the attention kernel configurations: the problem-class fields every kernel has and
    their validation."""

    arch: Arch
    dtype: str
    head_dim: int
    head_dim_v: int
    causal: bool = False
    local: bool = False

    def _check_common(self) -> None:
        self._check_dtype()
        self._check_head_dims("head_dim", "head_dim_v")
        if self.causal and self.local:
            raise ValueError("causal and local are exclusive: express causal as local with window_right=0")

    def _check_eighths(self, *names: str) -> None:
        """Fields counting eighths of a thread's score columns (0 to 8)."""
        for name in names:
            value = getattr(self, name)
            if not 0 <= value <= 8:
                raise ValueError(f"{name} must be in [0, 8], got {value}")


@dataclass(frozen=True)
class ForwardConfig(_KernelConfig):
    """What a forward kernel is specialised on.

    Kernel call convention (the compiled function, called with torch tensors through TVM-FFI on the
    current CUDA stream):

        fn(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table, learnable_sink,
           softmax_scale, softcap, window_left, window_right, max_seqlen_q)

    batched (``varlen=False``): q (b, sq, hq, d), k (b, sk, hk, d), v (b, sk, hk, dv),
        out (b, sq, hq, dv), lse (b, hq, sq) float32; cu_seqlens_* are None.
    varlen (``varlen=True``): q (total_q, hq, d), k (total_k, hk, d), v (total_k, hk, dv),
        out (total_q, hq, dv), lse (hq, total_q); cu_seqlens_q/k int32 (b + 1,).
    seqused_k: int32 (b,) or None (``has_seqused_k``); seqused_q: int32 (b,) or None (``has_seqused_q``):
        sequence b uses its first seqused_q[b] queries (batched: of sq; varlen: of its cu_seqlens_q
        slot), and the output and LSE rows past them are not written; learnable_sink: float32 (hq,)
        or None.
    paged (``page_size`` > 0): k (num_pages, page_size, hk, d), v (num_pages, page_size, hk, dv),
        page_table int32 (b, max_pages), cu_seqlens_k None, seqused_k the key lengths (batch entry or
        sequence b's keys are its first seqused_k[b] tokens, wherever the table puts their pages:
        fa4_kernels/paged_kv.py); q, out and lse batched or varlen as above. page_table is None
        otherwise.
    softmax_scale, softcap: float (softcap used only when ``has_softcap``);
    window_left/right: int (used only when ``local``; -1 means unbounded on that side);
    max_seqlen_q: int (grid size; for batched inputs it is sq).
    hq must be a multiple of hk (GQA/MQA: query head h reads KV head h // (hq // hk)).

    Which fields an arch reads: every forward reads the problem class (dtype through has_sink,
    pack_gqa; pack_gqa_heads where its rules allow it), its tiles (tile_m, tile_n, num_stages: what
    they mean in warps and stages is the arch's), rescale_threshold, exp2_emulated_eighths,
    persistent_ctas and the tile order (longest_first, longest_first_min_blocks). pingpong,
    tma_store_o, rescale_o_before_pv and whole_k_gemms are sm90 schedule switches (sm90/tiles.py);
    another arch leaves them at their defaults. The arch's check_forward (registry in arch.py)
    rejects what its kernel cannot build, when the config is constructed.
    """

    has_softcap: bool = False
    varlen: bool = False
    has_seqused_k: bool = False
    has_seqused_q: bool = False
    has_sink: bool = False
    # Tuning knobs: dispatch takes them from the arch's tile rules (tiles.py); tests and A/B runs
    # may pin them.
    tile_m: int = 128
    tile_n: int = 128
    num_stages: int = 2
    # Ping-pong: the consumer warpgroups take turns issuing GEMMs (named barriers), so that one's
    # softmax overlaps another's GEMMs.
    pingpong: bool = True
    # Conditional rescaling threshold in log2 units (FA4 uses 8.0 for 16-bit inputs); 0 = always
    # rescale. Off by default: on Hopper it measured 1-5% slower (docs/perf.md).
    rescale_threshold: float = 0.0
    # How many of every 8 softmax exponentials run as a polynomial on the FMA pipe (0 = all MUFU).
    # Off by default: it measured slower on Hopper at d=64..256 (docs/perf.md).
    exp2_emulated_eighths: int = 0
    # O leaves through shared memory (stmatrix) and one TMA store per consumer warpgroup instead of
    # 32-bit global stores from the accumulator layout. Batched queries only, over contiguous or
    # paged keys (a TMA box would write past a packed sequence's end). Where the slabs do not fit
    # beside Q, K and V (d = 192, 256) they reuse Q's buffer, which persistent CTAs cannot lend.
    # tiles.forward_schedule turns it on for batched inputs with d_v a multiple of 16 (measured
    # faster at every head dim, docs/perf.md).
    tma_store_o: bool = False
    # 0: one CTA per output tile. N > 0: a persistent grid of at most N CTAs (the SM count), each
    # walking tiles first, first + grid, ... in the scheduler's order, so that the launch, barrier
    # set-up and pipeline fill are paid once per SM instead of once per tile. Off: on the H200 a few %
    # faster at 1k tokens, up to 1.6x slower at 16k causal (the static stride; docs/perf.md).
    persistent_ctas: int = 0
    # Where O *= row_scale runs: False, after the step's P @ V has retired (then the next GEMMs wait
    # for the multiplies); True, in the next step between issuing S = Q K^T and O += P V, under the
    # QK^T GEMM. Worth it with two consumer warpgroups (d_v = 128 and 256), not with three.
    rescale_o_before_pv: bool = False
    # GQA packing: the query heads that share a KV head, this many (hq // hk, fixed per model), fill
    # one tile's rows together, token by token (row r = token r // g, head r % g of the group), so
    # that short query sequences (decoding, chunked prefill) fill 128-row tiles and read each K/V
    # block once for the whole group; a varlen sequence's rows start at g x its first token.
    # 1: off, one head per tile. Which g an arch packs is its rule (sm90: g divides 64).
    pack_gqa: int = 1
    # GQA packing of a ratio r the arch cannot pack (Qwen2.5's 7): 0, every one of a group's pack_gqa
    # rows is a query head (r = pack_gqa). 0 < r < pack_gqa: r real query heads per KV head, packed as
    # groups of pack_gqa rows (row = token * pack_gqa + head in group, the masks' and tiles' rule
    # unchanged) whose rows with head in group >= r are dummies: loaded as zeros (a TMA dimension of
    # extent r with a box of pack_gqa), never stored, so that q, out and LSE are the caller's real
    # tensors. Query head h reads KV head h // r. Only for an arch whose rules say so
    # (``FORWARD_PADDED_PACK`` in its tiles.py).
    pack_gqa_heads: int = 0
    # The GEMMs outside the steady-state loop's hot path issued as one cute.gemm over their k slices
    # (the DSL's k loop) instead of one call per slice, for a smaller IR (sm90/wgmma.py): Q K^T of
    # the prologue's block and of the causal diagonal's, and the last block's P @ V, a few per
    # tile. Their descriptors then take a per-thread detour (R2UR) before each WGMMA, which the
    # loop's own GEMMs should not pay: its P @ V that way ran 1-2% slower at d = 192 and 256.
    whole_k_gemms: bool = False
    # Split-KV: the KV blocks of every output tile are shared out among num_splits CTAs (a runtime
    # count: the leading extent of ``out``), each writing a float32 partial output, normalised over
    # its own keys, and that partial's LSE; the combine kernel (fa4_kernels/combine.py) merges them.
    # Call convention as above, with out (num_splits, b, sq, hq, dv) / (num_splits, total_q, hq, dv)
    # float32 and lse (num_splits, b, hq, sq) / (num_splits, hq, total_q). Split s of a tile whose
    # visible KV blocks are [n_min, n_max) takes [n_min + s * per, min(n_min + (s + 1) * per, n_max)),
    # per = ceil((n_max - n_min) / num_splits); an empty split writes O = 0 and LSE = -inf. Only for
    # an arch whose rules say it has split-KV (``FORWARD_SPLIT_KV`` in its tiles.py). The torch
    # layer runs it with its combine as one host function (SplitKVConfig, fa4_kernels/split_kv.py).
    split_kv: bool = False
    # Paged KV cache (fa4_kernels/paged_kv.py): 0, K and V are contiguous; N > 0, they are pages of N
    # keys read through a page table, for batched queries (flash_attn_with_kvcache: O leaves by TMA)
    # or varlen ones. A compile-time size: it shapes the TMA boxes of a K/V tile.
    page_size: int = 0
    # CTAs that share one MMA along M: 1, each CTA issues its own; 2, a cluster of two CTAs (a pair)
    # runs the M = 256 tcgen05 MMAs of cta_group::2, each CTA holding its own query rows and half
    # of every K and V tile. Only for an arch whose rules say it has pairs (``FORWARD_CLUSTER_M``
    # in its tiles.py), which also say for which problem classes (its check_forward).
    cluster_m: int = 1
    # Causal/local, batched, not split: query tiles in longest-first order within L2 groups of
    # heads (scheduler.py) instead of the launch order (query block fastest, head by head). Heads of
    # fewer than longest_first_min_blocks query tiles keep the launch order (a runtime choice of
    # the same kernel).
    longest_first: bool = True
    longest_first_min_blocks: int = 1

    def __post_init__(self):
        self._check_common()
        if self.split_kv:
            self._check_split_kv()
        if self.cluster_m != 1:
            self._check_cluster()
        if self.page_size:
            self._check_paged()
        if self.pack_gqa < 1:
            raise ValueError(f"pack_gqa must be >= 1 (1: off), got {self.pack_gqa}")
        if self.pack_gqa_heads:
            self._check_padded_pack()
        self._check_eighths("exp2_emulated_eighths")
        if self.persistent_ctas < 0:
            raise ValueError(f"persistent_ctas must be >= 0 (0: one CTA per tile), got {self.persistent_ctas}")
        self._check_arch("check_forward")

    @property
    def query_heads_per_group(self) -> int:
        """The real query heads of a KV head the kernel packs (1: no packing)."""
        return self.pack_gqa_heads or self.pack_gqa

    def _check_padded_pack(self) -> None:
        if not 1 <= self.pack_gqa_heads < self.pack_gqa:
            raise ValueError(f"pack_gqa_heads must be 0 (every packed row a query head) or in [1, pack_gqa): "
                             f"r real heads padded to groups of pack_gqa={self.pack_gqa} rows, got "
                             f"{self.pack_gqa_heads}")
        entry = KERNELS.get(self.arch)
        if entry is None or not getattr(entry.rules(), "FORWARD_PADDED_PACK", False):
            raise NotImplementedError(f"pack_gqa_heads={self.pack_gqa_heads}: the {self.arch} forward does not pack "
                                      f"padded GQA groups; run the heads unpacked (pack_gqa_heads=0)")

    def _check_paged(self) -> None:
        if self.page_size < 0 or self.page_size % 16:
            # A TMA box of a K/V tile is gcd(tile_n, page_size) rows, whole 16-row MMA steps.
            raise ValueError(f"page_size must be a positive multiple of 16, got {self.page_size}")
        if not self.has_seqused_k:
            # The cache's extent says nothing about a sequence's length: its pages are anywhere.
            raise ValueError("a paged KV cache takes its key lengths as seqused_k: page_size > 0 needs "
                             "has_seqused_k=True (queries batched or varlen)")
        if self.persistent_ctas:
            raise ValueError("a paged KV cache runs one CTA per tile: persistent_ctas must be 0")

    def _check_split_kv(self) -> None:
        entry = KERNELS.get(self.arch)
        if entry is None or not getattr(entry.rules(), "FORWARD_SPLIT_KV", False):
            raise ValueError(f"split_kv: the {self.arch} forward has no split-KV kernel")
        if self.has_sink:
            # The sink logit belongs in the denominator once, not in every split's: the combine
            # kernel adds it (CombineConfig.has_sink).
            raise ValueError("split_kv kernels take no learnable sink: the combine kernel adds it")
        if self.persistent_ctas:
            raise ValueError("split_kv needs one CTA per (tile, split): persistent_ctas must be 0")

    def _check_cluster(self) -> None:
        entry = KERNELS.get(self.arch)
        if entry is None or self.cluster_m not in getattr(entry.rules(), "FORWARD_CLUSTER_M", (1,)):
            raise ValueError(f"cluster_m={self.cluster_m}: the {self.arch} forward has no kernel with "
                             f"{self.cluster_m} CTAs per MMA")
        if self.persistent_ctas % self.cluster_m:
            raise ValueError(f"persistent_ctas ({self.persistent_ctas}) must be a multiple of cluster_m "
                             f"({self.cluster_m}): a persistent grid launches whole clusters")


@dataclass(frozen=True)
class BackwardConfig(_KernelConfig):
    """What a backward kernel is specialised on.

    Kernel call convention (TVM-FFI, current CUDA stream):

        fn(q, k, v, dout, lse_log2, dpsum, dq_accum, dk, dv, cu_seqlens_q, cu_seqlens_k, seqused_k,
           dq_semaphore, softmax_scale, softcap, window_left, window_right, max_seqlen_k)

    Batched: q (b, sq, hq, d), k (b, sk, hk, d), v (b, sk, hk, dv), dout (b, sq, hq, dv) in ``dtype``;
    lse_log2 and dpsum (b, hq, sq_pad) float32 with sq_pad a multiple of 4 (TMA strides are 16-byte
    aligned): the forward's LSE times log2(e) (+inf for rows that saw no key) and rowsum(dout * out);
    dq_accum float32 (b, hq, rows, row), zeroed by the caller: the kernel adds dQ / softmax_scale into
    it, query block after query block in the arch's order (its dq_accum_layout in the registry,
    arch.py, gives row, rows per block and the order; the postprocessing kernel reads it back);
    dk, dv like k, v in ``dtype``: written whole (dK and dV of a KV head summed over its query heads).
    Varlen: the token axis is packed, q (total_q, hq, d) etc.; lse_log2/dpsum (hq, rows) with sequence
    b's rows from seqlen.packed_row_offset(cu_seqlens_q[b], b) on (16-byte aligned starts; rows =
    packed_row_offset(total_q, batch)); dq_accum (hq, rows, row), sequence b's query blocks from
    the layout's block_offset(cu_seqlens_q[b], b) on; cu_seqlens_q/k (batch + 1,) int32, seqused_k
    (batch,) int32 or None.
    dq_semaphore (batch, hq, ceil(max_seqlen_q / tile_m), 2) int32 zeroed, when ``deterministic``
    (else None): orders the dQ reduce-adds so that repeated runs are bitwise identical.
    max_seqlen_k sizes the grid (the longest key sequence).

    Which fields an arch reads: the problem class (dtype through deterministic) and tile_m, tile_n,
    num_stages everywhere; longest_first wherever the arch's scheduler orders tiles; split_head_dim,
    exp_eighths_under_dp, exp2_emulated_eighths, separate_do_barrier, dq_bulk_reduce, tma_store_dkv,
    one_step_body, ds_store_by_group and query_rows_by_shuffle are sm90 layout and schedule switches
    (sm90/tiles.py). The arch's check_backward (registry in arch.py) rejects tiles its kernel cannot
    build, when the config is constructed.
    """

    has_softcap: bool = False
    varlen: bool = False
    has_seqused_k: bool = False
    deterministic: bool = False
    tile_m: int = 64  # query rows per step (sm90: 128 up to d = 64, 80 at d = 128 unsplit)
    tile_n: int = 128  # keys per CTA (sm90: 64 per consumer warpgroup, or 64 shared with split_head_dim)
    num_stages: int = 2
    # The layout for head dims above 128 and d != dv, whose dK/dV accumulators would not fit in a
    # warpgroup's registers for 64 keys each: both consumer warpgroups work on one 64-key tile, each
    # owning half of the head dim of dK, dV and dQ, with P^T and dS^T exchanged through shared memory.
    split_head_dim: bool = False
    # Causal/local, batched: KV tiles in longest-first order within L2 groups of heads (the first KV
    # blocks see the most queries), the partial group first, instead of the launch order (KV block
    # fastest, head by head), whose last heads' longest tiles start late. Where fewer than
    # longest_first_min_group heads' Q and dO fit the L2 budget (long sequences), or a head has
    # fewer than longest_first_min_blocks KV tiles (short sequences), the kernel keeps the launch
    # order: a runtime choice of the same kernel (groups of one head are the launch order). sm90's
    # rule and its measurements: sm90/tiles.backward_tiles.
    longest_first: bool = False
    longest_first_min_group: int = 1
    longest_first_min_blocks: int = 1
    # How much of P^T is exponentiated while dP^T's GEMM still runs, in eighths of the thread's
    # query columns; the rest is computed after dP^T, column by column with dS^T, so that the
    # MUFU exponentials and the FMA-pipe gradient arithmetic can interleave. 8: all before.
    exp_eighths_under_dp: int = 8
    # How many of every 8 column pairs of P^T run exp2 as a polynomial on the FMA pipe
    # (exp2.exp2_fma) instead of MUFU.EX2, in steps without an element-wise mask (0: all MUFU; a NaN
    # score there gives P ~ 2^-126, not NaN, as in the forward's). Measured no faster (docs/perf.md).
    exp2_emulated_eighths: int = 0
    # Q (with LSE) and dO (with rowsum) behind one mbarrier per stage (False), or each behind its own
    # (True): S^T = K Q^T is then issued as soon as Q has landed, while dO may still be in flight.
    separate_do_barrier: bool = False
    # dQ's reduce-add into dq_accum: one 2-D TMA tensor reduce per consumer warpgroup's part (False),
    # or one 1-D bulk reduce (cp.reduce.async.bulk, no tensor map) of the part's contiguous bytes,
    # which register order (sm90/dq_accum.py) makes possible.
    dq_bulk_reduce: bool = False
    # dK and dV leave through shared memory (stmatrix into K's and V's tiles, free after the last
    # step) and a TMA store each, instead of 32-bit global stores from the accumulators. Batched
    # inputs, unsplit layout.
    tma_store_dkv: bool = False
    # One step body (True): every query block takes the masked step, as flash-attn-4's loop does
    # (a select per score on every step), instead of a second, mask-free copy of the step for blocks
    # inside the mask (False): half the step loop's code, more work per unmasked step. For A/B runs.
    one_step_body: bool = False
    # dS^T leaves the registers for shared memory a stmatrix at a time, as soon as the arithmetic
    # of its query columns is done (True), instead of all stmatrix together after dV's GEMM is
    # issued (False): the stores then drain under the rest of the gradient arithmetic, and the fence
    # before the dS barrier waits for the last one only. Unsplit layout.
    ds_store_by_group: bool = False
    # Where a step reads LSE and rowsum at the thread's query columns, for query blocks of more
    # than 64 rows (64-row blocks hold them in registers): each from shared memory as its column
    # needs it (False: a broadcast load per column pair), or (True) a few values per lane loaded
    # once per step and fetched by warp shuffle per column, off shared memory's bandwidth, which
    # the step's GEMM operands use (sm90/fragments.py QueryRowValues). No effect at 64-row blocks.
    # Off: within noise at d = 64, 1-4% slower at d = 128 causal (H100, docs/perf.md session 23).
    query_rows_by_shuffle: bool = False
    # CTAs that share one MMA along the keys: 1, each CTA issues its own; 2, a cluster of two CTAs
    # (a pair, tile_n keys each) runs the M = 2 * tile_n tcgen05 MMAs of cta_group::2 issued by the
    # even CTA. Only for an arch whose rules say it has backward pairs (``BACKWARD_CLUSTER_M`` in its
    # tiles.py), which also say for which problem classes (its check_backward).
    cluster_m: int = 1

    def __post_init__(self):
        self._check_common()
        if self.has_seqused_k and not self.varlen:
            raise ValueError("has_seqused_k needs varlen")
        self._check_eighths("exp_eighths_under_dp", "exp2_emulated_eighths")
        if self.cluster_m != 1:
            entry = KERNELS.get(self.arch)
            if entry is None or self.cluster_m not in getattr(entry.rules(), "BACKWARD_CLUSTER_M", (1,)):
                raise ValueError(f"cluster_m={self.cluster_m}: the {self.arch} backward has no kernel with "
                                 f"{self.cluster_m} CTAs per MMA")
        self._check_arch("check_backward")

    def postprocess(self) -> "PostprocessConfig":
        """The postprocessing kernel that reads this kernel's dQ accumulator."""
        return PostprocessConfig(arch=self.arch, dtype=self.dtype, head_dim=self.head_dim, tile_m=self.tile_m,
                                 varlen=self.varlen)


@dataclass(frozen=True)
class PreprocessConfig(_Config):
    """The backward's preprocessing kernel (fa4_kernels/bwd_preprocess.py, call convention there):
    it depends only on the output's dtype and head dim."""

    arch: Arch
    dtype: str
    head_dim_v: int

    def __post_init__(self):
        self._check_dtype()
        self._check_head_dims("head_dim_v")


@dataclass(frozen=True)
class CombineConfig(_Config):
    """The split-KV combine kernel (fa4_kernels/combine.py, call convention there): it merges float32
    partial outputs and LSEs into the output, for every architecture; it depends on the output's
    dtype (float32 too: users merging partial attention themselves may keep it), its head dim, and
    whether a learnable sink joins the denominator (``has_sink``: the split-KV forward leaves the
    sink to the combine, which counts it once). ``pdl``: launched as a programmatic dependent of the
    kernel before it (early launch, a grid-dependency wait at its start); off for A/B runs.
    ``splits_in_flight``: how many splits' partial rows a lane loads before using any (fewer where a
    lane owns more than one 16-byte vector of a row: at most 16 vectors, 64 registers, in flight);
    decoding merges few rows over many splits, where the kernel's time is these loads' latency."""

    arch: Arch
    dtype: str
    head_dim_v: int
    has_sink: bool = False
    pdl: bool = True
    splits_in_flight: int = 16

    def __post_init__(self):
        if self.dtype not in DTYPES + ("float32",):
            raise ValueError(f"dtype must be one of {DTYPES + ('float32',)}, got {self.dtype!r}")
        self._check_head_dims("head_dim_v")
        if not 1 <= self.splits_in_flight <= 16:
            raise ValueError(f"splits_in_flight must be 1 to 16, got {self.splits_in_flight}")


# A split-KV workspace's row (one split's partials) is a multiple of this many float32 elements, so
# that every split's partial outputs start 32-byte aligned (fa4_kernels/split_kv.py).
WORKSPACE_ALIGN = 8


@dataclass(frozen=True)
class SplitKVConfig(_Config):
    """A split-KV forward as one host function (fa4_kernels/split_kv.py, call convention there): the
    arch's split forward (``forward``, split_kv=True) into float32 partials carved from one
    workspace, then the combine (``combine``) into the caller's out and LSE. One TVM-FFI call and one
    allocation for the partials instead of two of each: a decode step pays them once per layer, on
    the host, between the model's other ops. ``has_sink`` lives on the combine (the splits leave the
    sink out; the combine counts it once)."""

    forward: ForwardConfig
    combine: CombineConfig

    def __post_init__(self):
        f, c = self.forward, self.combine
        if not f.split_kv:
            raise ValueError("SplitKVConfig.forward must be a split-KV forward (split_kv=True)")
        if (c.arch, c.dtype, c.head_dim_v) != (f.arch, f.dtype, f.head_dim_v):
            raise ValueError(f"SplitKVConfig: the combine ({c.arch}, {c.dtype}, head_dim_v={c.head_dim_v}) must "
                             f"match the forward ({f.arch}, {f.dtype}, head_dim_v={f.head_dim_v})")

    @property
    def arch(self) -> Arch:
        return self.forward.arch

    def workspace_shape(self, num_splits: int, rows: int, spare: int = 0) -> tuple[int, int]:
        """The float32 workspace of ``num_splits`` splits for ``rows`` output rows (query tokens x
        heads): (num_splits, per_split), per_split holding a split's rows x head_dim_v partial
        outputs, then its rows LSEs, then ``spare`` elements the kernels never touch (a caller's
        scratch: ops puts an LSE that nobody reads there), padded to a multiple of WORKSPACE_ALIGN
        (split_kv.py)."""
        per_split = rows * (self.forward.head_dim_v + 1) + spare
        return num_splits, -(-per_split // WORKSPACE_ALIGN) * WORKSPACE_ALIGN

    def key(self) -> tuple:
        """Both kernels' keys, their fields prefixed with the part they configure."""
        return ((type(self).__name__,) + tuple("forward." + part for part in self.forward.key()[1:])
                + tuple("combine." + part for part in self.combine.key()[1:]))


@dataclass(frozen=True)
class AppendConfig(_Config):
    """The KV-cache append kernel (fa4_kernels/kv_append.py, call convention there), for every
    architecture: it depends on the caches' dtype and head dims, on whether the cache is paged
    (``paged``: a page table maps positions to pages) and whether cache_batch_idx picks each entry's
    cache row (``has_rows``; contiguous-rows caches only)."""

    arch: Arch
    dtype: str
    head_dim: int
    head_dim_v: int
    paged: bool = False
    has_rows: bool = False

    def __post_init__(self):
        self._check_dtype()
        self._check_head_dims("head_dim", "head_dim_v")
        if self.paged and self.has_rows:
            raise ValueError("a paged cache has no cache rows to pick (has_rows needs paged=False)")


@dataclass(frozen=True)
class PostprocessConfig(_Config):
    """The backward's postprocessing kernel (the arch's bwd_postprocess in the registry, arch.py;
    call convention in its module): dQ from the main kernel's float32 accumulator, whose order
    follows that kernel's dQ tiles, so BackwardConfig.postprocess() derives this from it. Which
    head dims and tile_m it takes is the arch's check_postprocess."""

    arch: Arch
    dtype: str
    head_dim: int
    tile_m: int
    varlen: bool = False

    def __post_init__(self):
        self._check_dtype()
        self._check_arch("check_postprocess")
