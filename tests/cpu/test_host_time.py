"""scripts/host_time.py on the CPU (--noop): every public path it times runs through this tree's layer.

The script prints "n/a" for a path that raises (so that it can time an older checkout), which would
hide a path broken by a change of the layer; this runs each path for a few calls in a subprocess
(the no-op kernels patch the package's modules) and fails on any "n/a".

Run: python -m pytest tests/cpu/test_host_time.py -q
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PATHS = ("flash_attn_func", "flash_attn_func requires_grad", "flash_attn_func forward+backward",
         "flash_attn_func num_splits=0", "flash_attn_varlen_func",
         "flash_attn_varlen_func paged", "kvcache 16k append 1", "kvcache 16k no append", "kvcache 16k num_splits=1",
         "kvcache 4x4k append 1", "adapter decode (dynamic cache)", "adapter decode (padding mask)",
         "adapter decode (left padding)", "sdpa flash op via our provider")


def test_noop_run_times_every_path():
    env = dict(os.environ)
    env.pop("FLASH_ATTN4_TREE", None)
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "host_time.py"), "--noop", "--calls", "3"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line[:40].strip(): line[40:] for line in done.stdout.splitlines()[1:]}
    assert set(rows) == set(PATHS), done.stdout
    for name, rest in rows.items():
        assert re.fullmatch(r"\s+[\d.]+ us/call wall\s+[\d.]+ us/call CPU", rest), (name, rest)


def test_in_model_run_times_the_attention_call():
    """--in-model on the CPU: a narrow model's greedy decoding runs through the adapter, and the
    report counts the decode-step calls only (layers x (new tokens - 1) x rounds)."""
    pytest.importorskip("transformers")
    env = dict(os.environ)
    env.pop("FLASH_ATTN4_TREE", None)
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "host_time.py"), "--noop", "--in-model",
                           "--prompt-len", "64", "--new-tokens", "3", "--rounds", "2"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = [line for line in done.stdout.splitlines() if line.startswith("fa4 ")]
    match = re.fullmatch(r"fa4\s+attention call\s+([\d.]+) us host \(mean ([\d.]+), p90 ([\d.]+), "
                         r"thread CPU ([\d.]+), (\d+) calls\); step ([\d.]+) ms", row)
    assert match, row
    median, mean, p90, cpu, calls, step = (float(x) for x in match.groups())
    assert 0 < median <= p90 and mean > 0 and cpu > 0 and step > 0
    assert calls == 16 * (3 - 1) * 2
