#!/usr/bin/env bash
# Issue 21's H200 evidence in one device call (docs/DECODING.md, "Measured"): the GPU suite first
# (a known ~130 s: a call cut short loses a benchmark, not the suite), then the decode benchmark
# (dense, KV-cache, varlen and paged rows against cuDNN and SDPA-flash; its PNG and JSON), the host
# time per call, back to back and inside the 1.1B model's decoding ("fa4" beside "sdpa"), and the
# model-level decode benchmark (the last steps are the ones cut when time runs out). Each step has a
# limit cut to what is left of STEP_BUDGET_S seconds (default 570); logs and a tarball of the
# benchmark files land in $OUT (setup.log names the tree and the GPU; summary.txt each step's exit
# status and time).
#
#   run(command="FA4_TREE=<commit> bash scripts/decode_evidence.sh", carry=[".device", ".device-extras"],
#       kind="nvidia-h200", timeout_s=600)
#
# after ../shared/device/stage.sh and scripts/stage_device_extras.sh here. On an H200 it runs
# everything; on another GPU what OFF_H200 says: "suite" (the default), "all", or "none" (a try for
# an H200 once the suite has run on the tree on another GPU). Options: TILES_AB=1 adds the 64-row
# decode tile A/B after the suite (docs/perf.md, session 31); BASE_TGZ=<file in the tree> times an
# earlier torch layer (DEVELOPMENT.md: git archive REV ... > base.tgz) beside this one, back to back
# and inside the model, each base run just before this tree's.
set -uo pipefail
cd "$(dirname "$0")/.."
STEP_BUDGET_S="${STEP_BUDGET_S:-570}"
OFF_H200="${OFF_H200:-suite}"
case "$OFF_H200" in suite|all|none) ;; *) echo "OFF_H200 must be suite, all or none, not '$OFF_H200'" >&2; exit 2;; esac
source scripts/device_steps.sh  # OUT, setup, GPU_NAME, step
RES=/tmp/fa4_bench; mkdir -p "$RES"
RUN=$OFF_H200
[[ $GPU_NAME == *H200* ]] && RUN=all

BASE=()  # the command prefix that runs BASE_TGZ's layer over this tree's kernels
if [[ -n ${BASE_TGZ:-} ]]; then
  mkdir -p /tmp/base && tar xzf "$BASE_TGZ" -C /tmp/base \
    && ln -sfn "$PWD/torch-ext/flash_attn4/fa4_kernels" /tmp/base/torch-ext/flash_attn4/fa4_kernels \
    && BASE=(env FLASH_ATTN4_TREE=/tmp/base/torch-ext)
fi

if [[ $RUN != none ]]; then
  step suite 200 python -u -m pytest tests/gpu -n 12 -q -rfEx -p no:cacheprovider
  if [[ -n ${TILES_AB:-} ]]; then
    step tiles 150 python benchmarks/decode_tiles_ab.py --variant t64:tile_m=64,pingpong=false --rounds 5 \
      --max-head-dim 256
  fi
fi
if [[ $RUN == all ]]; then
  step decode 180 python benchmarks/bench.py --mode decode --rounds 3 --out "$RES/decode.json" \
    --only ours,ours-kvcache,ours-varlen,ours-paged256,ours-paged16,cudnn,sdpa-flash
  (( ${#BASE[@]} )) && step host-base 60 "${BASE[@]}" python scripts/host_time.py --calls 1000
  step host 60 python scripts/host_time.py --calls 1000
  (( ${#BASE[@]} )) && step in-model-base 90 "${BASE[@]}" python scripts/host_time.py --in-model --rounds 2 --new-tokens 32
  step in-model 90 python scripts/host_time.py --in-model --rounds 2 --new-tokens 32
  step model 150 python benchmarks/bench.py --mode decode-model --static --out "$RES/decode-model.json"
  (cd "$RES" && tar czf "$OUT/bench.tgz" .)
fi
cat "$OUT/summary.txt" 2>/dev/null || echo "nothing run on $GPU_NAME"
