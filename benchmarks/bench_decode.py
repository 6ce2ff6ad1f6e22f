#!/usr/bin/env python3
"""Decode benchmarks (issue 21 items 6 and 8), run through bench.py:

    python benchmarks/bench.py --mode decode            # kernel level: the issue's 7 problems (make bench-decode)
    python benchmarks/bench.py --mode decode --dry-run  # the problems, their bytes and HBM floors (no GPU)
    python benchmarks/bench.py --mode decode-model      # model level: greedy decoding, "fa4" vs "sdpa"

--mode decode: few queries against a long KV cache, bf16, (b, s_q, s_cache, h, h_kv, d) from the issue.
- Masks: non-causal where s_q = 1 (one query sees every key; SDPA's is_causal is aligned top-left and
  would give that query a single key), bottom-right causal where s_q > 1 (ours: causal=True). SDPA
  gets an explicit boolean mask, aligned bottom-right, built once outside timing; a backend that
  refuses it is timed without a mask instead, and its row says so ("non-causal") and is not compared
  for correctness: the mask hides at most s_q - 1 of s_cache keys (< 0.4% of the work here).
- Implementations: ours with num_splits=0 (automatic) and ours-nosplit (num_splits=1, the split-KV
  gain); cuDNN SDPA and SDPA flash (FA2) with enable_gqa=True (a backend without native GQA gets its
  K/V expanded beforehand, noted: it then reads h/h_kv times the bytes counted); flash-attn-4
  upstream (flash_attn.cute.flash_attn_func, num_splits=0 = its heuristic) when importable.
- Layouts: ours and upstream (b, s, h, d), SDPA (b, h, s, d), each contiguous, built once per problem.
- Timing: bench.py's timer (triton do_bench median with the L2 flushed, else CUDA events), every
  implementation warmed up first, then interleaved over --rounds rounds; the median of the rounds.
- Bytes = K and V read + q read + out written = 2 * (b * s_cache * h_kv * (d + dv) + b * s_q * h * (d + dv))
  (2-byte elements); GB/s = bytes / time / 1e9; % HBM = GB/s / (--hbm-tbps * 1000) (H200: 4.8 TB/s).
  "vs cuDNN" = cuDNN time / this time (> 1: faster than cuDNN); "split gain" = nosplit time / ours time.
- Writes --out (default benchmarks/results/decode.json), .md and .png (needs matplotlib) beside it.

--mode decode-model: a Llama-style 1.1B-shaped model (16 layers, hidden 2048, 16 heads / 4 KV heads,
d=128, intermediate 5632, vocab 32000) with random weights, bf16, batch 1, a random --prompt-len
(16k) prompt, greedy generate() of --new-tokens (32) with attn_implementation "fa4" (our transformers
adapter) and "sdpa", dynamic cache (--static adds a static cache, whose decode step generate()
torch.compiles on CUDA). The time of each token is the interval between consecutive logits-processor
calls, with the GPU synchronised; reported: the median over the tokens after the first, over
--model-rounds interleaved runs after a warm-up run each; how many greedy tokens equal SDPA's; and
the num_splits values the adapter passed to our functions (recorded in the warm-up run only).

Dense and paged KV caches (issue items 2, 3 and 8): ours-varlen runs the dense cache through
flash_attn_varlen_func (packed keys, seqused_k); ours-kvcache through flash_attn_with_kvcache
(cache_seqlens: the batched kernel with seqused_k); ours-paged256 and ours-paged16 copy the cache
into shuffled pages of 256 and 16 tokens and call flash_attn_with_kvcache with the page table
(the batched kernel reading pages): the same call as ours-kvcache but for the loads.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

try:  # as a package (tests: the repository root is on sys.path) or from the script's folder
    from benchmarks import bench as _bench
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench as _bench

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "decode.json"
DEFAULT_MODEL_OUT = REPO_ROOT / "benchmarks" / "results" / "decode-model.json"
H200_HBM_TBPS = 4.8
# HBM peaks by GPU name (TB/s), for --hbm-tbps left unset: the goal is a fraction of the card's own peak.
HBM_TBPS_BY_NAME = (("H200", 4.8), ("H100 PCIe", 2.0), ("H100 NVL", 3.9), ("H100", 3.35), ("B200", 8.0),
                    ("B300", 8.0))


def hbm_tbps_of(gpu_name: str) -> float:
    """The HBM peak of a GPU by its name (H100 SXM: 3.35 TB/s), the H200's when the name is unknown."""
    return next((tbps for key, tbps in HBM_TBPS_BY_NAME if key in gpu_name), H200_HBM_TBPS)
GOAL_FRACTION = 0.8  # issue 21: >= 80% of HBM peak where the cache is >= 256 MiB
GOAL_MIN_CACHE_BYTES = 256 * 2**20
ELEMENT_BYTES = 2  # bf16

DECODE_IMPLS = ("ours", "ours-nosplit", "ours-varlen", "ours-kvcache", "ours-paged256", "ours-paged16", "cudnn",
                "sdpa-flash", "fa4-upstream")


# --------------------------------------------------------------------------------------------
# Problems and bytes (pure: tested on the CPU)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    b: int
    s_q: int
    s_cache: int
    h: int
    h_kv: int
    d: int
    dv: int = 0  # 0: d

    @property
    def d_v(self) -> int:
        return self.dv or self.d

    @property
    def causal(self) -> bool:
        """Bottom-right causal where s_q > 1; one query sees every key (non-causal = bottom-right causal)."""
        return self.s_q > 1

    @property
    def name(self) -> str:
        kv = f"{self.s_cache // 1024}k" if self.s_cache % 1024 == 0 else str(self.s_cache)
        mask = " causal" if self.causal else ""
        return f"b{self.b} sq{self.s_q} sk{kv} h{self.h}/{self.h_kv} d{self.d}{mask}"

    def kv_bytes(self, element_bytes: int = ELEMENT_BYTES) -> int:
        """K and V read once: b * s_cache * h_kv * (d + dv) elements."""
        return self.b * self.s_cache * self.h_kv * (self.d + self.d_v) * element_bytes

    def qo_bytes(self, element_bytes: int = ELEMENT_BYTES) -> int:
        """q read and out written: b * s_q * h * (d + dv) elements."""
        return self.b * self.s_q * self.h * (self.d + self.d_v) * element_bytes

    def bytes(self, element_bytes: int = ELEMENT_BYTES) -> int:
        return self.kv_bytes(element_bytes) + self.qo_bytes(element_bytes)


# issue 21 item 8, in its order: (b, s_q, s_cache, h, h_kv, d)
PROBLEMS = tuple(Problem(*p) for p in (
    (1, 1, 65536, 32, 8, 128),
    (2, 1, 131072, 64, 8, 128),
    (8, 1, 16384, 32, 8, 128),
    (32, 1, 8192, 28, 4, 128),
    (1, 4, 32768, 32, 8, 128),
    (4, 1, 32768, 8, 4, 256),
    (16, 64, 8192, 32, 8, 128),
))

BYTES_FORMULA = "2 * (b*s_cache*h_kv*(d+dv) + b*s_q*h*(d+dv)) bytes (K, V, q, out; bf16)"


def gbps(nbytes: int, us: float) -> float:
    return nbytes / (us * 1e-6) / 1e9


def hbm_fraction(gb_per_s: float, hbm_tbps: float) -> float:
    return gb_per_s / (hbm_tbps * 1000.0)


def floor_us(p: Problem, hbm_tbps: float) -> float:
    """The time to move the problem's bytes at the HBM peak."""
    return p.bytes() / (hbm_tbps * 1e12) * 1e6


H200_SMS = 132


def auto_num_splits(p: Problem, num_sms: int = H200_SMS) -> int | None:
    """The split count ours runs with num_splits=0 on sm90, as ops._num_splits derives it (the dispatch
    config's tiles and GQA packing into dispatch.num_splits_heuristic); None where that cannot be
    worked out here (informational only: the benchmark times whatever the kernel does)."""
    try:
        fa = _bench._import_ours()
        dispatch = __import__(fa.__name__ + ".dispatch", fromlist=["forward_config"])
        arch = __import__(fa.__name__ + ".fa4_kernels.arch", fromlist=["Arch"]).Arch.SM90
        ratio = p.h // p.h_kv  # a ratio 64 does not divide runs in padded groups when the queries are short
        cfg = dispatch.forward_config(arch, "bfloat16", p.d, p.d_v, causal=p.causal, local=False, has_softcap=False,
                                      varlen=False, has_seqused_k=False, has_sink=False, qhead_per_kvhead=ratio,
                                      pack_group=dispatch.padded_pack(arch, p.d, p.d_v, False, ratio, p.s_q))
        return int(dispatch.num_splits_heuristic(batch=p.b, num_heads=p.h, num_heads_kv=p.h_kv, seqlen_q=p.s_q,
                                                 seqlen_k=p.s_cache, tile_m=cfg.tile_m, tile_n=cfg.tile_n,
                                                 pack_gqa=cfg.pack_gqa, num_sms=num_sms))
    except Exception:
        return None


def finish_rows(rows: list[dict], hbm_tbps: float) -> list[dict]:
    """Fill in us, GB/s, HBM fraction, the ratio to cuDNN and the split gain from round_us."""
    for r in rows:
        if r.get("status") == "ok" and r.get("round_us"):
            r["us"] = statistics.median(r["round_us"])
            r["gbps"] = gbps(r["bytes"], r["us"])
            r["hbm_frac"] = hbm_fraction(r["gbps"], hbm_tbps)
            # the issue's goal counts K and V bytes only
            r["kv_hbm_frac"] = hbm_fraction(gbps(r["kv_bytes"], r["us"]), hbm_tbps)
    by = {(r["problem"], r["impl"]): r for r in rows}
    for r in rows:
        cudnn = by.get((r["problem"], "cudnn"))
        r["vs_cudnn"] = cudnn["us"] / r["us"] if r.get("us") and cudnn and cudnn.get("us") else None
        if r["impl"] == "ours":
            nosplit = by.get((r["problem"], "ours-nosplit"))
            r["split_gain"] = nosplit["us"] / r["us"] if r.get("us") and nosplit and nosplit.get("us") else None
    return rows


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def markdown_table(rows: list[dict], hbm_tbps: float) -> str:
    """One line per (problem, implementation), then a summary per problem (ours against the goal)."""
    lines = [
        f"| problem | cache MiB | impl | us | GB/s | % of {hbm_tbps:g} TB/s | vs cuDNN | note |",
        "|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if r.get("us") is None:
            cells = [r["status"], "-", "-", "-"]
        else:
            cells = [f"{r['us']:.1f}", f"{r['gbps']:.0f}", f"{100 * r['hbm_frac']:.0f}%",
                     _fmt(r.get("vs_cudnn"), ".2f")]
        lines.append(f"| {r['problem']} | {r['kv_bytes'] / 2**20:.0f} | {r['impl']} | " + " | ".join(cells)
                     + f" | {r.get('note') or ''} |")
    summary = summary_rows(rows, hbm_tbps)
    if summary:
        lines += ["", f"| problem | ours us | ours K+V % of peak | ours/cuDNN | splits | split gain | goal (K+V "
                  f"bytes >= {GOAL_FRACTION:.0%} of peak where cache >= 256 MiB; no slower than cuDNN) |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        for s in summary:
            lines.append(f"| {s['problem']} | {_fmt(s['us'], '.1f')} | "
                         f"{_fmt(None if s['hbm_frac'] is None else 100 * s['hbm_frac'], '.0f')}% | "
                         f"{_fmt(s['vs_cudnn'], '.2f')} | {_fmt(s['splits'], 'd', '?')} | "
                         f"{_fmt(s['split_gain'], '.2f')} | {s['goal']} |")
    lines += ["", f"Bytes = {BYTES_FORMULA}; GB/s = bytes / time; vs cuDNN = cuDNN time / this time (> 1 is "
              "faster); splits = the count ours chose with num_splits=0; split gain = ours-nosplit time / ours "
              "time; the goal counts K and V bytes only. s_q = 1 runs non-causal (SDPA's is_causal is aligned "
              "top-left: one query would see one key); s_q > 1 runs bottom-right causal (SDPA: an explicit boolean "
              "mask)."]
    return "\n".join(lines)


def summary_rows(rows: list[dict], hbm_tbps: float) -> list[dict]:
    out = []
    for r in rows:
        if r["impl"] != "ours":
            continue
        goals = []
        if r.get("us") is None:
            goal = "ours did not run"
        else:
            if r["kv_bytes"] >= GOAL_MIN_CACHE_BYTES:
                goals.append("peak ok" if r["kv_hbm_frac"] >= GOAL_FRACTION else "peak MISSED")
            if r.get("vs_cudnn") is not None:
                goals.append("cuDNN ok" if r["vs_cudnn"] >= 1.0 else "cuDNN MISSED")
            goal = ", ".join(goals) or "-"
        out.append(dict(problem=r["problem"], us=r.get("us"), hbm_frac=r.get("kv_hbm_frac"), vs_cudnn=r.get("vs_cudnn"),
                        split_gain=r.get("split_gain"), splits=r.get("auto_splits"), goal=goal))
    return out


def write_plot(rows: list[dict], path: Path, hbm_tbps: float) -> str | None:
    """GB/s against the problems ordered by cache length, one line per implementation, the HBM peak
    and the 80% goal as horizontal lines. Returns None when written, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot written"
    problems = {}
    for r in rows:
        problems.setdefault(r["problem"], r)
    order = sorted(problems, key=lambda n: (problems[n]["s_cache"], problems[n]["kv_bytes"], n))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    by = {(r["problem"], r["impl"]): r for r in rows}
    fig, ax = plt.subplots(figsize=(max(8, 1.4 * len(order)), 5.5))
    xs = list(range(len(order)))
    for name in impls:
        ys = [(by.get((p, name)) or {}).get("gbps") for p in order]
        label = name if any(y is not None for y in ys) else f"{name} (not run)"
        ax.plot(xs, [float("nan") if y is None else y for y in ys], marker="o", label=label)
    ax.axhline(hbm_tbps * 1000, color="k", linestyle="--", linewidth=1, label=f"HBM peak {hbm_tbps:g} TB/s")
    ax.axhline(GOAL_FRACTION * hbm_tbps * 1000, color="gray", linestyle=":", linewidth=1,
               label=f"{GOAL_FRACTION:.0%} of peak")
    ax.set_xticks(xs)
    ax.set_xticklabels([n.replace(" h", "\nh") for n in order], fontsize=7)
    ax.set_xlabel("problem (ordered by cache length)")
    ax.set_ylabel("GB/s (K, V, q, out bytes / time)")
    ax.set_ylim(bottom=0)
    ax.set_title("decode attention bandwidth, bf16")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def dry_run_table(problems, hbm_tbps: float) -> str:
    lines = [f"{'problem':38s} {'mask':12s} {'KV MiB':>8s} {'bytes':>12s} {'floor us':>9s} {'auto splits':>11s}"]
    for p in problems:
        mask = "bottom-right" if p.causal else "none"
        lines.append(f"{p.name:38s} {mask:12s} {p.kv_bytes() / 2**20:8.0f} {p.bytes():12d} "
                     f"{floor_us(p, hbm_tbps):9.1f} {_fmt(auto_num_splits(p), 'd', '?'):>11s}")
    lines.append(f"bytes = {BYTES_FORMULA}; floor = bytes / {hbm_tbps:g} TB/s; auto splits = what ours runs with "
                 f"num_splits=0 on an sm90 GPU of {H200_SMS} SMs")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Implementations: (problem, inputs) -> zero-argument callable returning out (b, s_q, h, dv)
# --------------------------------------------------------------------------------------------


class Unsupported(Exception):
    pass


DEVICE = "cuda"  # the CPU tests run the harness with "cpu"


def _sync():
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def make_inputs(p: Problem, dtype, seed: int) -> dict:
    """q (b, s_q, h, d), k (b, s_cache, h_kv, d), v (b, s_cache, h_kv, dv), contiguous."""
    import torch

    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(p.b, p.s_q, p.h, p.d, device=DEVICE, dtype=dtype, generator=gen)
    k = torch.randn(p.b, p.s_cache, p.h_kv, p.d, device=DEVICE, dtype=dtype, generator=gen)
    v = torch.randn(p.b, p.s_cache, p.h_kv, p.d_v, device=DEVICE, dtype=dtype, generator=gen)
    return dict(q=q, k=k, v=v)


def bottom_right_mask(s_q: int, s_k: int, device=None):
    """Boolean (s_q, s_k), True = attend: query i sees keys j <= i + s_k - s_q (bottom-right alignment)."""
    import torch

    i = torch.arange(s_q, device=device).unsqueeze(1)
    j = torch.arange(s_k, device=device).unsqueeze(0)
    return j <= i + (s_k - s_q)


def _ours(num_splits: int):
    def prepare(p: Problem, x: dict, notes: dict):
        fa = _bench._import_ours()
        q, k, v = x["q"], x["k"], x["v"]
        return lambda: fa.flash_attn_func(q, k, v, causal=p.causal, num_splits=num_splits)
    return prepare


def _varlen_inputs(p: Problem, x: dict):
    """q packed (b * s_q, h, d) with cu_seqlens_q, and every sequence's key count (seqused_k)."""
    import torch

    cu_q = torch.arange(p.b + 1, dtype=torch.int32, device=DEVICE) * p.s_q
    return x["q"].reshape(p.b * p.s_q, p.h, p.d), cu_q, _full_cache_lengths(p)


def _full_cache_lengths(p: Problem):
    """Every sequence's key count, int32 (b,): the whole cache (seqused_k, cache_seqlens)."""
    import torch

    return torch.full((p.b,), p.s_cache, dtype=torch.int32, device=DEVICE)


def _ours_varlen(p: Problem, x: dict, notes: dict):
    """The dense cache through the varlen kernel (packed keys, seqused_k)."""
    fa = _bench._import_ours()
    q, cu_q, used = _varlen_inputs(p, x)
    k, v = (t.reshape(p.b * p.s_cache, p.h_kv, -1) for t in (x["k"], x["v"]))
    cu_k = torch_arange_i32(p.b + 1) * p.s_cache
    return lambda: fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_seqlen_q=p.s_q, max_seqlen_k=p.s_cache,
                                             seqused_k=used, causal=p.causal, num_splits=0).view(x["q"].shape[:3] + (-1,))


def torch_arange_i32(n: int):
    import torch

    return torch.arange(n, dtype=torch.int32, device=DEVICE)


def _ours_kvcache(p: Problem, x: dict, notes: dict):
    """The dense cache through flash_attn_with_kvcache (every entry filled to s_cache, no append): the
    paged rows' baseline, the same kernel but for the loads."""
    fa = _bench._import_ours()
    used = _full_cache_lengths(p)
    return lambda: fa.flash_attn_with_kvcache(x["q"], x["k"], x["v"], cache_seqlens=used, causal=p.causal,
                                              num_splits=0)


def _ours_paged(page_size: int):
    """The cache copied into shuffled pages of ``page_size`` tokens, read through a page table by
    flash_attn_with_kvcache (the API paged decoding calls)."""
    def prepare(p: Problem, x: dict, notes: dict):
        import torch

        fa = _bench._import_ours()
        used = _full_cache_lengths(p)
        per_seq = -(-p.s_cache // page_size)
        order = torch.randperm(p.b * per_seq, device=DEVICE)
        table = order.view(p.b, per_seq).to(torch.int32)

        def paged(t):
            padded = torch.zeros(p.b, per_seq * page_size, *t.shape[2:], dtype=t.dtype, device=DEVICE)
            padded[:, :p.s_cache] = t
            pages = torch.empty(p.b * per_seq, page_size, *t.shape[2:], dtype=t.dtype, device=DEVICE)
            pages[order] = padded.view(p.b * per_seq, page_size, *t.shape[2:])
            return pages

        k, v = paged(x["k"]), paged(x["v"])
        notes["note"] = f"pages of {page_size} in shuffled order"
        return lambda: fa.flash_attn_with_kvcache(x["q"], k, v, cache_seqlens=used, page_table=table,
                                                  causal=p.causal, num_splits=0)
    return prepare


def _sdpa(backend_name: str):
    def prepare(p: Problem, x: dict, notes: dict):
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)
        q, k, v = (t.transpose(1, 2).contiguous() for t in (x["q"], x["k"], x["v"]))  # (b, h, s, d)
        mask = bottom_right_mask(p.s_q, p.s_cache, q.device) if p.causal else None
        gqa = p.h != p.h_kv

        def call(k, v, mask, gqa):
            def run():
                with sdpa_kernel(backend):
                    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
                return out.transpose(1, 2)
            return run

        errors = []
        for expand in ((False, True) if gqa else (False,)):
            kk, vv = (k, v) if not expand else (t.repeat_interleave(p.h // p.h_kv, dim=1) for t in (k, v))
            for m in ((mask, None) if mask is not None else (None,)):
                fn = call(kk, vv, m, gqa and not expand)
                try:
                    fn()
                except RuntimeError as exc:
                    errors.append(_bench._short(exc))
                    continue
                said = []
                if expand:
                    said.append(f"kv expanded (reads {p.h // p.h_kv}x the bytes counted)")
                if m is not None:
                    said.append("explicit bottom-right mask")
                if mask is not None and m is None:
                    said.append("non-causal: the backend refused the explicit bottom-right mask")
                    notes["comparable"] = False
                notes["note"] = "; ".join(said)
                return fn
        raise Unsupported(errors[-1] if errors else "no variant ran")
    return prepare


def _upstream(p: Problem, x: dict, notes: dict):
    from flash_attn.cute import flash_attn_func

    q, k, v = x["q"], x["k"], x["v"]

    def run():
        out = flash_attn_func(q, k, v, causal=p.causal, num_splits=0)
        return out[0] if isinstance(out, tuple) else out
    return run


def decode_impls() -> dict:
    """name -> (availability check returning None or why not, preparer)."""
    return {
        "ours": (_bench._ours_available, _ours(0)),
        "ours-nosplit": (_bench._ours_available, _ours(1)),
        "ours-varlen": (_bench._ours_available, _ours_varlen),
        "ours-kvcache": (_bench._ours_available, _ours_kvcache),
        "ours-paged256": (_bench._ours_available, _ours_paged(256)),
        "ours-paged16": (_bench._ours_available, _ours_paged(16)),
        "cudnn": (_bench._sdpa_available("CUDNN_ATTENTION"), _sdpa("CUDNN_ATTENTION")),
        "sdpa-flash": (_bench._sdpa_available("FLASH_ATTENTION"), _sdpa("FLASH_ATTENTION")),
        "fa4-upstream": (_bench._upstream_available, _upstream),
    }


def run_problem(p: Problem, impls: dict, args, timer) -> list[dict]:
    import torch

    x = make_inputs(p, torch.bfloat16, args.seed)
    rows, runners, outputs = [], {}, {}
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count if DEVICE == "cuda" else H200_SMS
    for name, (_, prepare) in impls.items():
        row = dict(problem=p.name, **asdict(p), dv_eff=p.d_v, causal=p.causal, impl=name, status="ok", note="",
                   kv_bytes=p.kv_bytes(), bytes=p.bytes(), us=None, gbps=None, hbm_frac=None, vs_cudnn=None,
                   round_us=[], max_diff_vs_ours=None)
        if name == "ours":
            row["auto_splits"] = auto_num_splits(p, num_sms)
        rows.append(row)
        notes = {}
        try:
            fn = prepare(p, x, notes)
            out = fn()  # warm-up: compiles where anything compiles
            _sync()
            fn()
            _sync()
            runners[name] = fn
            if notes.get("comparable", True):
                outputs[name] = out
            row["note"] = notes.get("note", "")
        except Unsupported as exc:
            row.update(status="n/a", note=str(exc))
        except Exception as exc:
            row.update(status="error", note=_bench._short(exc))
            if args.verbose:
                traceback.print_exc()
        _sync()
    ref = outputs.get("ours")
    for row in rows:
        out = outputs.get(row["impl"])
        if ref is not None and out is not None and out.shape == ref.shape:
            row["max_diff_vs_ours"] = (out.float() - ref.float()).abs().max().item()
    outputs.clear()
    for _ in range(args.rounds):  # interleaved: A B C, A B C, ...
        for row in rows:
            fn = runners.get(row["impl"])
            if fn is None:
                continue
            try:
                row["round_us"].append(1000.0 * timer(fn))
            except Exception as exc:
                runners.pop(row["impl"])
                row.update(status="error", note=_bench._short(exc))
    del x, runners
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return rows


def run_decode(args, problems=PROBLEMS) -> int:
    if args.dry_run:
        print(dry_run_table(problems, args.hbm_tbps or H200_HBM_TBPS))
        print(f"\nimplementations: {', '.join(args.only or DECODE_IMPLS)}; {args.rounds} interleaved rounds; "
              f"writes {args.out} and {args.out.with_suffix('.png')}")
        return 0
    import torch

    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("bench decode: needs a CUDA GPU; --dry-run lists the problems", file=sys.stderr)
        return 2
    all_impls = decode_impls()
    impls, skipped = {}, {}
    for name in args.only or DECODE_IMPLS:
        available, prepare = all_impls[name]
        why = available()
        if why is None:
            impls[name] = (available, prepare)
        else:
            skipped[name] = why
            print(f"bench decode: skipping {name}: {why}", file=sys.stderr)
    if not impls:
        print("bench decode: no implementation is available", file=sys.stderr)
        return 2
    timer, timer_name = _bench.make_timer(args.rep_ms)
    env = _bench.environment()
    if args.hbm_tbps is None:
        args.hbm_tbps = hbm_tbps_of(env["gpu"])
        print(f"bench decode: HBM peak {args.hbm_tbps:g} TB/s for {env['gpu']} (--hbm-tbps to set it)", flush=True)
    print(f"bench decode: {len(problems)} problems x {len(impls)} implementations, {args.rounds} interleaved rounds, "
          f"bf16, {timer_name}; {env['gpu']}, torch {env['torch']}", flush=True)
    rows = []
    for i, p in enumerate(problems, 1):
        prows = finish_rows(run_problem(p, impls, args, timer), args.hbm_tbps)
        rows.extend(prows)
        print(f"[{i}/{len(problems)}] {p.name}: " + "  ".join(
            f"{r['impl']}={r['us']:.1f}us" if r.get("us") else f"{r['impl']}={r['status']}" for r in prows), flush=True)
    rows = finish_rows(rows, args.hbm_tbps)
    table = markdown_table(rows, args.hbm_tbps)
    print()
    print(table)
    if skipped:
        print("\nskipped: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(env, mode="decode", dtype="bf16", rounds=args.rounds, rep_ms=args.rep_ms, timer=timer_name,
                seed=args.seed, hbm_tbps=args.hbm_tbps, bytes=BYTES_FORMULA, skipped=skipped)
    out.write_text(json.dumps(dict(meta=meta, results=rows), indent=1, default=str) + "\n")
    out.with_suffix(".md").write_text(
        f"{env['gpu']}, torch {env['torch']}, bf16, {timer_name}, median of {args.rounds} interleaved rounds, "
        f"git {env.get('git')}\n\n{table}\n")
    note = write_plot(rows, out.with_suffix(".png"), args.hbm_tbps)
    print(f"\nbench decode: wrote {out}, {out.with_suffix('.md').name}"
          + (f", {out.with_suffix('.png').name}" if note is None else f" ({note})"))
    failed = [r["problem"] for r in rows if r["impl"] == "ours" and r["status"] != "ok"]
    if failed or "ours" in skipped:
        print(f"bench decode: ours did not run {failed or 'at all'}", file=sys.stderr)
        return 1
    return 0


# --------------------------------------------------------------------------------------------
# Model level (item 6): greedy decoding of a random-weight Llama-style model
# --------------------------------------------------------------------------------------------

LLAMA_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                num_attention_heads=16, num_key_value_heads=4, head_dim=128)


class TokenClock:
    """A logits processor that only records when it is called (once per generated token, after the
    forward that produced the token's logits), with the device synchronised first."""

    def __init__(self, sync):
        self.sync = sync
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores):
        self.sync()
        self.stamps.append(time.perf_counter())
        return scores

    def per_token_ms(self) -> list[float]:
        """Decode-step times: intervals between consecutive tokens (the first token is the prefill's)."""
        return [1000.0 * (b - a) for a, b in zip(self.stamps, self.stamps[1:])]


def build_model(config_kwargs: dict, device: str, dtype, seed: int, max_positions: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**config_kwargs, max_position_embeddings=max_positions, bos_token_id=None,
                         eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def generate_once(model, attn: str, input_ids, new_tokens: int, cache: str, sync) -> tuple[list[float], list[int]]:
    import torch
    from transformers import LogitsProcessorList

    model.set_attn_implementation(attn)
    clock = TokenClock(sync)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  logits_processor=LogitsProcessorList([clock]), pad_token_id=0, eos_token_id=None)
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
    return clock.per_token_ms(), out[0, input_ids.shape[1]:].tolist()


@contextlib.contextmanager
def recording_num_splits(seen: set):
    """Wrap flash_attn4's public functions (the adapter looks them up per call) to record the
    num_splits each call passes ("default" when none). Used in the warm-up run only: the wrapper
    is host time that the timed runs must not pay."""
    fa = _bench._import_ours()
    saved = {name: getattr(fa, name) for name in ("flash_attn_func", "flash_attn_varlen_func")}

    def wrap(fn):
        def call(*a, **kw):
            seen.add(kw.get("num_splits", "default"))
            return fn(*a, **kw)
        return call

    for name, fn in saved.items():
        setattr(fa, name, wrap(fn))
    try:
        yield seen
    finally:
        for name, fn in saved.items():
            setattr(fa, name, fn)


def run_model_decode(args, config_kwargs: dict = LLAMA_1B, device: str = "cuda") -> dict:
    """Warm-up run per (implementation, cache), then --model-rounds interleaved timed runs; returns
    {key: dict(ms_per_token (median over all steps after the first, all rounds), ...)}."""
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    model = build_model(config_kwargs, device, dtype, args.seed, args.prompt_len + args.new_tokens + 8)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    input_ids = torch.randint(0, config_kwargs["vocab_size"], (1, args.prompt_len), device=device, generator=gen)
    variants = [(attn, cache) for cache in args.caches for attn in args.attn]
    results = {f"{a}/{c}": dict(attn=a, cache=c, step_ms=[], tokens=None, status="ok", note="") for a, c in variants}
    for a, c in variants:  # warm-up: kernel compiles, torch.compile of the static-cache step
        r = results[f"{a}/{c}"]
        try:
            t0 = time.perf_counter()
            if a == "fa4":
                seen = set()
                with recording_num_splits(seen):
                    _, r["tokens"] = generate_once(model, a, input_ids, args.new_tokens, c, sync)
                r["num_splits_passed"] = sorted(map(str, seen))  # by the adapter; "default" = the function's
            else:
                _, r["tokens"] = generate_once(model, a, input_ids, args.new_tokens, c, sync)
            r["warmup_s"] = time.perf_counter() - t0
        except Exception as exc:
            r.update(status="error", note=_bench._short(exc))
            if args.verbose:
                traceback.print_exc()
    for _ in range(args.model_rounds):
        for a, c in variants:
            r = results[f"{a}/{c}"]
            if r["status"] != "ok":
                continue
            try:
                steps, tokens = generate_once(model, a, input_ids, args.new_tokens, c, sync)
            except Exception as exc:  # keep the other implementation's numbers
                r.update(status="error", note=_bench._short(exc))
                continue
            r["step_ms"].extend(steps)
            if tokens != r["tokens"]:
                r["note"] = "tokens differ between runs"
    for r in results.values():
        r["ms_per_token"] = statistics.median(r["step_ms"]) if r["step_ms"] else None
    ref = results.get(f"sdpa/{args.caches[0]}", {}).get("tokens")
    for r in results.values():
        if ref is not None and r.get("tokens") is not None:
            r["tokens_equal_to_sdpa"] = sum(x == y for x, y in zip(r["tokens"], ref))
    return results


def model_table(results: dict, new_tokens: int) -> str:
    lines = ["| attn | cache | ms per token | tokens equal to sdpa's | num_splits passed | note |",
             "|---|---|---:|---:|---|---|"]
    for r in results.values():
        eq = r.get("tokens_equal_to_sdpa")
        splits = ",".join(r.get("num_splits_passed", [])) or "-"
        lines.append(f"| {r['attn']} | {r['cache']} | {_fmt(r.get('ms_per_token'), '.2f', r['status'])} | "
                     f"{'-' if eq is None else f'{eq}/{new_tokens}'} | {splits} | {r.get('note', '')} |")
    return "\n".join(lines)


def run_decode_model(args) -> int:
    if args.dry_run:
        print(f"decode-model: Llama-style {LLAMA_1B}, random weights, bf16, batch 1, prompt {args.prompt_len}, "
              f"{args.new_tokens} new tokens, attn {args.attn}, caches {args.caches}, {args.model_rounds} rounds")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("bench decode-model: needs a CUDA GPU", file=sys.stderr)
        return 2
    if "fa4" in args.attn:
        import transformers  # noqa: F401  (so that importing flash_attn4 registers "fa4")

        fa = _bench._import_ours()
        __import__(fa.__name__ + ".transformers_adapter", fromlist=["register"]).register()
    t0 = time.perf_counter()
    results = run_model_decode(args)
    table = model_table(results, args.new_tokens)
    print(table)
    print(f"\nms per token: median of the decode steps after the first token over {args.model_rounds} round(s) "
          f"after a warm-up; total {time.perf_counter() - t0:.0f} s")
    out = args.out if args.out != DEFAULT_OUT else DEFAULT_MODEL_OUT
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(_bench.environment(), mode="decode-model", model=LLAMA_1B, prompt_len=args.prompt_len,
                new_tokens=args.new_tokens, rounds=args.model_rounds)
    out.write_text(json.dumps(dict(meta=meta, results=results), indent=1, default=str) + "\n")
    print(f"bench decode-model: wrote {out}")
    return 0 if all(r["status"] == "ok" for r in results.values()) else 1


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="bench.py --mode decode|decode-model", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--mode", choices=("decode", "decode-model"), required=True)
    p.add_argument("--dry-run", action="store_true", help="print what would run (no GPU needed)")
    p.add_argument("--only", type=_names, help=f"decode: implementations, from {','.join(DECODE_IMPLS)}")
    p.add_argument("--rounds", type=int, default=5, help="decode: interleaved rounds (default 5)")
    p.add_argument("--rep-ms", type=float, default=50.0, help="decode: timing budget per measurement (ms)")
    p.add_argument("--hbm-tbps", type=float, default=None,
                   help="HBM peak in TB/s (default: the GPU's, by name: H200 4.8, H100 3.35; 4.8 when unknown)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help="JSON file (default benchmarks/results/decode.json, decode-model.json for decode-model); "
                        ".md and .png beside it")
    p.add_argument("--prompt-len", type=int, default=16384, help="decode-model: prompt tokens (default 16384)")
    p.add_argument("--new-tokens", type=int, default=32, help="decode-model: generated tokens (default 32)")
    p.add_argument("--model-rounds", type=int, default=2, help="decode-model: interleaved timed runs (default 2)")
    p.add_argument("--attn", type=_names, default=("fa4", "sdpa"), help="decode-model: attn_implementations")
    p.add_argument("--static", action="store_true",
                   help="decode-model: also a static cache (generate() torch.compiles its step on CUDA: "
                        "a slower warm-up)")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failing implementations")
    args = p.parse_args(argv)
    if args.only:
        unknown = set(args.only) - set(DECODE_IMPLS)
        if unknown:
            p.error(f"unknown implementation(s) {sorted(unknown)}; choose from {', '.join(DECODE_IMPLS)}")
    if args.rounds < 1 or args.model_rounds < 1 or args.new_tokens < 2:
        p.error("--rounds and --model-rounds must be >= 1, --new-tokens >= 2")
    args.caches = ("dynamic", "static") if args.static else ("dynamic",)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_decode(args) if args.mode == "decode" else run_decode_model(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] if "--mode" in sys.argv else ["--mode", "decode"] + sys.argv[1:]))
