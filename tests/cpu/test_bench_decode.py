"""The decode benchmark's pure parts (benchmarks/bench_decode.py, `bench.py --mode decode`): the
problem table against issue 21's list, the byte formula, the report (ratios, goal column), the plot
on fake results, the command line, and the model-level harness on a tiny CPU model.

Run: python -m pytest tests/cpu/test_bench_decode.py -q
"""

from __future__ import annotations

import json

import pytest

from benchmarks import bench, bench_decode as bd  # tests/conftest.py puts the repository root on sys.path

# issue 21 item 8, verbatim: (b, s_q, s_cache, h, h_kv, d)
ISSUE_SET = [(1, 1, 65536, 32, 8, 128), (2, 1, 131072, 64, 8, 128), (8, 1, 16384, 32, 8, 128),
             (32, 1, 8192, 28, 4, 128), (1, 4, 32768, 32, 8, 128), (4, 1, 32768, 8, 4, 256),
             (16, 64, 8192, 32, 8, 128)]


def test_problem_table_is_the_issue_set():
    assert [(p.b, p.s_q, p.s_cache, p.h, p.h_kv, p.d) for p in bd.PROBLEMS] == ISSUE_SET
    assert all(p.d_v == p.d for p in bd.PROBLEMS)
    # non-causal for one query (SDPA's is_causal would be top-left), bottom-right causal otherwise
    assert [p.causal for p in bd.PROBLEMS] == [p.s_q > 1 for p in bd.PROBLEMS]
    assert len({p.name for p in bd.PROBLEMS}) == len(bd.PROBLEMS)


def test_byte_formula():
    p = bd.Problem(1, 1, 65536, 32, 8, 128)
    assert p.kv_bytes() == 1 * 65536 * 8 * (128 + 128) * 2 == 256 * 2**20
    assert p.qo_bytes() == 1 * 1 * 32 * 256 * 2
    assert p.bytes() == p.kv_bytes() + p.qo_bytes()
    big = bd.Problem(2, 1, 131072, 64, 8, 128)
    assert big.kv_bytes() == 2**30
    assert bd.Problem(1, 2, 10, 4, 2, 64, dv=32).kv_bytes() == 10 * 2 * 96 * 2
    # the issue's HBM floor for 16 x 8k (same bytes as 8 x 16k): 112 us at 4.8 TB/s
    assert bd.floor_us(bd.Problem(8, 1, 16384, 32, 8, 128), 4.8) == pytest.approx(111.9, abs=0.1)
    assert bd.gbps(4.8e9, 1e6) == pytest.approx(4.8)  # 4.8 GB in one second
    assert bd.hbm_fraction(3840.0, 4.8) == pytest.approx(0.8)


def _fake_rows(us_by_impl: dict[str, list[float | None]]) -> list[dict]:
    rows = []
    for i, p in enumerate(bd.PROBLEMS):
        for impl, times in us_by_impl.items():
            t = times[i]
            rows.append(dict(problem=p.name, b=p.b, s_q=p.s_q, s_cache=p.s_cache, h=p.h, h_kv=p.h_kv, d=p.d,
                             causal=p.causal, impl=impl, status="ok" if t else "n/a", note="" if t else "absent",
                             kv_bytes=p.kv_bytes(), bytes=p.bytes(), us=None, gbps=None, hbm_frac=None,
                             round_us=[t * 1.01, t, t * 0.98] if t else [], max_diff_vs_ours=None))
    return rows


FAKE = {
    "ours": [65.0, 260.0, 130.0, 125.0, 40.0, 120.0, 150.0],
    "ours-nosplit": [1339.0, 2600.0, 140.0, 130.0, 300.0, 125.0, 150.0],
    "cudnn": [80.0, 250.0, 133.0, 130.0, 45.0, 125.0, 140.0],
    "sdpa-flash": [90.0, 280.0, 142.0, 140.0, 50.0, 130.0, 160.0],
    "fa4-upstream": [None] * 7,
}


def test_finish_rows_medians_ratios_and_split_gain():
    rows = bd.finish_rows(_fake_rows(FAKE), 4.8)
    by = {(r["problem"], r["impl"]): r for r in rows}
    first = bd.PROBLEMS[0].name
    ours = by[(first, "ours")]
    assert ours["us"] == 65.0  # the median of the rounds
    assert ours["gbps"] == pytest.approx(bd.PROBLEMS[0].bytes() / 65e-6 / 1e9)
    assert ours["hbm_frac"] == pytest.approx(ours["gbps"] / 4800)
    assert ours["vs_cudnn"] == pytest.approx(80 / 65)
    assert ours["split_gain"] == pytest.approx(1339 / 65)
    assert by[(first, "cudnn")]["vs_cudnn"] == pytest.approx(1.0)
    assert by[(first, "fa4-upstream")]["us"] is None and by[(first, "fa4-upstream")]["vs_cudnn"] is None


def test_markdown_table_and_goal_column():
    rows = bd.finish_rows(_fake_rows(FAKE), 4.8)
    table = bd.markdown_table(rows, 4.8)
    lines = table.splitlines()
    first = bd.PROBLEMS[0].name
    line = next(ln for ln in lines if ln.startswith(f"| {first} | 256 | ours |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    gb = bd.PROBLEMS[0].bytes() / 65e-6 / 1e9
    assert cells[3:7] == ["65.0", f"{gb:.0f}", f"{100 * gb / 4800:.0f}%", f"{80 / 65:.2f}"]
    assert any("| fa4-upstream | n/a | - | - | - | absent |" in ln for ln in lines)
    summary = {s["problem"]: s for s in bd.summary_rows(rows, 4.8)}
    assert summary[first]["goal"] == "peak ok, cuDNN ok"  # 256 MiB at 80% of peak, faster than cuDNN
    b2 = bd.PROBLEMS[1].name
    assert summary[b2]["goal"] == "peak ok, cuDNN MISSED"  # 1 GiB in 260 us = 4.1 TB/s, cuDNN 250 us
    small = bd.PROBLEMS[4].name  # 128 MiB: the peak goal does not apply
    assert summary[small]["goal"] == "cuDNN ok"
    assert "Bytes = 2 * (b*s_cache*h_kv*(d+dv) + b*s_q*h*(d+dv))" in table
    assert "top-left" in table  # why s_q = 1 runs non-causal


def test_plot_on_fake_results(tmp_path):
    pytest.importorskip("matplotlib")
    rows = bd.finish_rows(_fake_rows(FAKE), 4.8)
    path = tmp_path / "decode.png"
    assert bd.write_plot(rows, path, 4.8) is None
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_so(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    note = bd.write_plot(bd.finish_rows(_fake_rows(FAKE), 4.8), tmp_path / "x.png", 4.8)
    assert "matplotlib" in note and not (tmp_path / "x.png").exists()


def test_bottom_right_mask():
    import torch

    m = bd.bottom_right_mask(3, 5)
    assert m.tolist() == [[True, True, True, False, False], [True, True, True, True, False], [True] * 5]
    assert bd.bottom_right_mask(1, 4).all()


def test_sdpa_preparer_with_bottom_right_mask_matches_reference_on_cpu():
    """The SDPA preparer's call (explicit mask, GQA, (b, h, s, d) copies) on the CPU against the
    reference; sdpa_kernel(MATH) stands in for the CUDA backends."""
    import torch

    from tests.reference import attention_ref

    p = bd.Problem(2, 3, 17, 4, 2, 16)
    g = torch.Generator().manual_seed(0)
    x = {n: torch.randn(p.b, s, hh, p.d, generator=g) for n, s, hh in (("q", p.s_q, p.h), ("k", p.s_cache, p.h_kv),
                                                                          ("v", p.s_cache, p.h_kv))}
    notes = {}
    out = bd._sdpa("MATH")(p, x, notes)()
    ref, _ = attention_ref(x["q"], x["k"], x["v"], causal=True)
    assert out.shape == (p.b, p.s_q, p.h, p.d)
    torch.testing.assert_close(out, ref.to(out.dtype), atol=1e-4, rtol=1e-4)
    assert notes["note"] == "explicit bottom-right mask" and notes.get("comparable", True)
    notes = {}
    one = bd.Problem(1, 1, 9, 4, 4, 16)
    x1 = dict(q=torch.randn(1, 1, 4, 16, generator=g), k=torch.randn(1, 9, 4, 16, generator=g),
              v=torch.randn(1, 9, 4, 16, generator=g))
    out = bd._sdpa("MATH")(one, x1, notes)()
    torch.testing.assert_close(out, attention_ref(x1["q"], x1["k"], x1["v"])[0], atol=1e-4, rtol=1e-4)
    assert notes["note"] == ""  # one query: no mask, no GQA


def test_command_line_delegation_and_dry_run(capsys):
    assert bench._delegated_mode(["--mode", "decode"]) == "decode"
    assert bench._delegated_mode(["--quick", "--mode=decode-model"]) == "decode-model"
    assert bench._delegated_mode(["--mode", "fwd"]) is None
    assert bench.main(["--mode", "decode", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert all(p.name in out for p in bd.PROBLEMS)
    assert ", ".join(bd.DECODE_IMPLS) in out and {"ours-paged16", "ours-paged256", "ours-varlen", "ours-kvcache"} <= set(bd.DECODE_IMPLS)
    assert bench.main(["--mode", "decode-model", "--dry-run"]) == 0
    args = bd.parse_args(["--mode", "decode", "--only", "ours,cudnn", "--hbm-tbps", "3.35"])
    assert args.only == ("ours", "cudnn") and args.hbm_tbps == 3.35 and args.rounds == 5
    assert str(args.out).endswith("benchmarks/results/decode.json")
    with pytest.raises(SystemExit):
        bd.parse_args(["--mode", "decode", "--only", "nope"])


def test_model_harness_on_a_tiny_cpu_model():
    """The decode-model loop (warm-up, interleaved rounds, per-token clock, token comparison) on a
    2-layer model with sdpa and eager on the CPU; ms per token comes from the steps after the first."""
    pytest.importorskip("transformers")
    args = bd.parse_args(["--mode", "decode-model", "--prompt-len", "12", "--new-tokens", "4", "--attn", "sdpa,eager",
                          "--model-rounds", "2"])
    tiny = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8)
    results = bd.run_model_decode(args, tiny, device="cpu")
    assert set(results) == {"sdpa/dynamic", "eager/dynamic"}
    for r in results.values():
        assert r["status"] == "ok", r["note"]
        assert len(r["step_ms"]) == 2 * (4 - 1)  # two rounds, every token after the first
        assert r["ms_per_token"] > 0
        assert len(r["tokens"]) == 4
    table = bd.model_table(results, 4)
    assert "| sdpa | dynamic |" in table and "/4 |" in table
    json.dumps(results, default=str)


def test_token_clock_intervals():
    clock = bd.TokenClock(lambda: None)
    clock.stamps = [1.0, 1.010, 1.030]
    assert clock.per_token_ms() == pytest.approx([10.0, 20.0])


def test_goal_counts_k_and_v_bytes_only():
    """b16 sq64: 142 us is >= 80% of peak with q and out counted (553.6 MB) but not with K and V alone
    (536.9 MB), which is what the issue's goal counts."""
    fake = {name: list(times) for name, times in FAKE.items()}
    fake["ours"][6] = 142.0
    rows = bd.finish_rows(_fake_rows(fake), 4.8)
    ours = next(r for r in rows if r["impl"] == "ours" and r["problem"] == bd.PROBLEMS[6].name)
    assert ours["hbm_frac"] >= 0.8 > ours["kv_hbm_frac"]
    summary = {s["problem"]: s for s in bd.summary_rows(rows, 4.8)}
    assert summary[bd.PROBLEMS[6].name]["goal"].startswith("peak MISSED")


def _cpu_impls(ref_fn):
    """Stand-ins: "ours" / "ours-nosplit" = the reference (recording num_splits), "cudnn" = SDPA's math
    backend through the real SDPA preparer, "fa4-upstream" unavailable, "sdpa-flash" failing."""
    def ours(num_splits):
        def prepare(p, x, notes):
            return lambda: ref_fn(x["q"], x["k"], x["v"], causal=p.causal, num_splits=num_splits)
        return prepare

    def broken(p, x, notes):
        def run():
            raise RuntimeError("no kernel for this")
        return run

    return {"ours": (lambda: None, ours(0)), "ours-nosplit": (lambda: None, ours(1)),
            "cudnn": (lambda: None, bd._sdpa("MATH")), "sdpa-flash": (lambda: None, broken),
            "fa4-upstream": (lambda: "flash_attn.cute not importable", None),
            **{name: (lambda: "a GPU-only layout (not a CPU stand-in)", None)
               for name in ("ours-varlen", "ours-kvcache", "ours-paged256", "ours-paged16")}}


def test_run_decode_end_to_end_on_cpu(tmp_path, monkeypatch, capsys):
    """run_decode with CPU stand-ins on two tiny problems: interleaved rounds, correctness column,
    a failing and an absent implementation, the JSON/markdown/plot files and the exit status."""
    from tests.reference import attention_ref

    calls = []

    def ref_fn(q, k, v, causal, num_splits):
        calls.append(num_splits)
        return attention_ref(q, k, v, causal=causal)[0].to(q.dtype)

    timed = []

    def timer(fn):
        timed.append(fn)
        fn()
        return 0.010  # ms

    monkeypatch.setattr(bd, "DEVICE", "cpu")
    monkeypatch.setattr(bd, "decode_impls", lambda: _cpu_impls(ref_fn))
    monkeypatch.setattr(bench, "make_timer", lambda rep_ms: (timer, "fake timer"))
    monkeypatch.setattr(bench, "environment", lambda: dict(gpu="cpu", torch="x", git=None))
    problems = (bd.Problem(1, 1, 40, 4, 2, 16), bd.Problem(2, 3, 24, 4, 1, 16))
    out = tmp_path / "decode.json"
    args = bd.parse_args(["--mode", "decode", "--rounds", "3", "--out", str(out)])
    assert bd.run_decode(args, problems) == 0
    assert set(calls) == {0, 1}
    assert len(timed) == 3 * 3 * len(problems)  # ours, ours-nosplit, cudnn; 3 rounds; 2 problems
    data = json.loads(out.read_text())
    rows = {(r["problem"], r["impl"]): r for r in data["results"]}
    for p in problems:
        assert rows[(p.name, "ours")]["us"] == pytest.approx(10.0)
        assert rows[(p.name, "ours")]["round_us"] == pytest.approx([10.0] * 3)
        assert rows[(p.name, "cudnn")]["max_diff_vs_ours"] < 0.05  # bf16, bottom-right mask where s_q > 1
        assert rows[(p.name, "sdpa-flash")]["status"] == "error"
        assert (p.name, "fa4-upstream") not in rows
    assert data["meta"]["skipped"] == {"fa4-upstream": "flash_attn.cute not importable",
                                       **{name: "a GPU-only layout (not a CPU stand-in)"
                                          for name in ("ours-varlen", "ours-kvcache", "ours-paged256", "ours-paged16")}}
    assert data["meta"]["bytes"] == bd.BYTES_FORMULA
    assert out.with_suffix(".md").read_text().count("| ours |") == len(problems)
    printed = capsys.readouterr().out
    assert "ours/cuDNN" in printed
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "no plot written" in printed
    else:
        assert out.with_suffix(".png").exists()


def test_model_harness_runs_fa4_through_the_adapter_on_cpu(monkeypatch):
    """attn_implementation="fa4" in the model loop, with the reference behind flash_attn4's public
    functions (the adapter looks them up per call): generate() runs and its greedy tokens equal sdpa's."""
    pytest.importorskip("transformers")
    import flash_attn4
    from flash_attn4 import transformers_adapter

    from tests.reference import attention_ref

    used = []

    def dense(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, learnable_sink=None,
              **kwargs):
        used.append(q.shape[1])
        return attention_ref(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                             softcap=softcap, learnable_sink=learnable_sink)[0].to(q.dtype)

    monkeypatch.setattr(flash_attn4, "flash_attn_func", dense)
    transformers_adapter.register()
    args = bd.parse_args(["--mode", "decode-model", "--prompt-len", "10", "--new-tokens", "3", "--attn", "fa4,sdpa",
                          "--model-rounds", "1"])
    tiny = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8)
    results = bd.run_model_decode(args, tiny, device="cpu")
    assert results["fa4/dynamic"]["status"] == "ok", results["fa4/dynamic"]["note"]
    assert results["fa4/dynamic"]["tokens_equal_to_sdpa"] == 3
    assert 10 in used and 1 in used  # the prompt, then single-token decode steps
    assert results["fa4/dynamic"]["num_splits_passed"]  # recorded in the warm-up run
    assert flash_attn4.flash_attn_func is dense  # and unwrapped again


def test_auto_num_splits_is_the_dispatch_heuristic():
    """What ours runs with num_splits=0, worked out on the CPU from dispatch (shown by --dry-run and
    the summary): a split count for each problem, 1 where the KV range is short."""
    counts = [bd.auto_num_splits(p) for p in bd.PROBLEMS]
    assert all(isinstance(n, int) and n >= 1 for n in counts), counts
    assert bd.auto_num_splits(bd.Problem(1, 1, 128, 32, 8, 128)) == 1  # one KV block: nothing to split
    assert bd.auto_num_splits(bd.PROBLEMS[0]) > 1  # b1 64k: 8 (batch x KV head) tiles on 132 SMs
    assert "auto splits" in bd.dry_run_table(bd.PROBLEMS, 4.8)


def test_hbm_peak_follows_the_gpu_name():
    """Without --hbm-tbps the goal is a fraction of the card's own peak (an H100's 3.35 TB/s, not the
    H200's 4.8); an unknown name keeps the H200's."""
    assert bd.hbm_tbps_of("NVIDIA H100 80GB HBM3") == 3.35
    assert bd.hbm_tbps_of("NVIDIA H200") == 4.8
    assert bd.hbm_tbps_of("some other GPU") == bd.H200_HBM_TBPS
    assert bd.parse_args(["--mode", "decode"]).hbm_tbps is None
