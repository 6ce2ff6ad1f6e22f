#!/usr/bin/env bash
# Issue 25's H200 timings in one device call (docs/perf.md's summary table): the backward, then the
# forward, against flash-attn-4 and cuDNN on the grid (d 64/128/256, 4k-16k tokens, causal and not),
# interleaved rounds in one process each. The backward's bitwise-determinism and forced self-check
# tests are in the GPU suite, which decode_evidence.sh runs first on the same machine. Each step's
# limit is cut to what is left of STEP_BUDGET_S seconds (default 570); logs and a tarball of the
# benchmark files land in $OUT (setup.log names the tree and the GPU; summary.txt each step's exit
# status and time).
#
#   run(command="FA4_TREE=<commit> bash scripts/train_evidence.sh", carry=[".device", ".device-extras"],
#       kind="nvidia-h200", timeout_s=600)
#
# after ../shared/device/stage.sh (with the anchors: flash-attn-4) and scripts/stage_device_extras.sh
# here. Off an H200 it runs nothing unless OFF_H200=all: the performance claims are the H200's.
set -uo pipefail
cd "$(dirname "$0")/.."
STEP_BUDGET_S="${STEP_BUDGET_S:-570}"
OFF_H200="${OFF_H200:-none}"
case "$OFF_H200" in all|none) ;; *) echo "OFF_H200 must be all or none, not '$OFF_H200'" >&2; exit 2;; esac
source scripts/device_steps.sh  # OUT, setup, GPU_NAME, step
if [[ $GPU_NAME != *H200* && $OFF_H200 == none ]]; then
  echo "nothing run on $GPU_NAME"
  exit 0
fi
RES=/tmp/fa4_bench; mkdir -p "$RES"
GRID=(--cases grid --headdims 64,128,256 --seqlens 4k,8k,16k --only ours,cudnn,fa4-upstream --rounds 3)
step bwd 260 python benchmarks/bench.py --mode bwd "${GRID[@]}" --out "$RES/bwd"
step fwd 200 python benchmarks/bench.py "${GRID[@]}" --out "$RES/fwd"
(cd "$RES" && tar czf "$OUT/bench.tgz" .)
cat "$OUT/summary.txt"
