#!/usr/bin/env bash
# One device call that verifies a tree on the H200 (docs/VERIFICATION.md records what it printed):
#   1. the shipped sm_90a set (scripts/build_aot.py) and the cold-start test on a quiet machine;
#   2. then, side by side (correctness only, no timing): the GPU suite, the bounded GPU fuzz and the
#      four compute-sanitizer tools.
# Device time is scarce, so every step has its own time limit (seconds, from the environment) and
# the batch goes on after a failure; the summary at the end gives each step's exit status
# (124: its limit ran out; pytest stopped by the limit exits 2 after its summary).
#
#   run(command="FA4_TREE=<commit> bash scripts/gpu_batch.sh", carry=[".device", ".device-extras"], timeout_s=600)
#
# after ../shared/device/stage.sh --no-anchors and scripts/stage_device_extras.sh here.
set -uo pipefail
cd "$(dirname "$0")/.."
AOT_S="${AOT_S:-120}" COLD_S="${COLD_S:-90}" SUITE_S="${SUITE_S:-330}" FUZZ_S="${FUZZ_S:-240}"
SANITIZE_S="${SANITIZE_S:-300}" WORKERS="${WORKERS:-10}"
source scripts/device_steps.sh  # OUT, setup, step

AOT_DIR=/tmp/fa4_aot
step aot "$AOT_S" python scripts/build_aot.py --arch sm_90a --out "$AOT_DIR" -j 16
step cold "$COLD_S" env FLASH_ATTN4_AOT_DIR="$AOT_DIR" python -m pytest tests/gpu/test_cold_start.py -q -s -rA

step suite "$SUITE_S" python -u -m pytest tests/gpu -n "$WORKERS" -q -rfEx --durations=15 &
step fuzz "$FUZZ_S" make fuzz-gpu FUZZ_TIME=$((FUZZ_S - 30)) &
step sanitize "$SANITIZE_S" make sanitize SANITIZE_TOOLS="${SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck}" &
wait
cat "$OUT/summary.txt"
