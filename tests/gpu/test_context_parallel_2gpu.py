"""Context parallelism on two GPUs: PyTorch's ``context_parallel`` ring attention through our provider,
forward and backward, against a float32 reference (scripts/cp_run.py does the work under torchrun).
Skipped unless two GPUs are visible; tests/gpu/test_context_parallel.py emulates the ring on one."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.backward
@pytest.mark.slow
@pytest.mark.parametrize("seqlen", [65536, 4096 + 8])  # the 64k, and chunks that are not whole tiles
def test_ring_attention_on_two_gpus(seqlen):
    if not hasattr(torch.nn.attention, "activate_flash_attention_impl"):
        pytest.skip(f"torch {torch.__version__} has no flash-attention provider registry")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (the device tool's nvidia-h200-x2)")
    torchrun = [shutil.which("torchrun")] if shutil.which("torchrun") else [sys.executable, "-m", "torch.distributed.run"]
    done = subprocess.run(torchrun + ["--nproc-per-node", "2", str(REPO / "scripts" / "cp_run.py"),
                                      "--seqlen", str(seqlen), "--no-bench"],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    assert {r["causal"] for r in lines} == {False, True}, done.stdout
    for r in lines:
        assert r["ok"] and r["served_by_ours"]["forward"] > 0 and r["served_by_ours"]["backward"] > 0, r
