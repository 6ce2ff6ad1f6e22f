#!/usr/bin/env bash
# Issue 21's H200 evidence in one device call (docs/DECODING.md, "Measured"): the decode benchmark
# (dense, KV-cache, varlen and paged rows against cuDNN and SDPA-flash; its PNG and JSON), the host
# time per call, and the model-level decode benchmark; then, with time left, the GPU suite. Each step
# has a limit cut to what is left of BUDGET seconds; logs and a tarball of the benchmark files land in
# $OUT (summary.txt names the GPU and each step's exit status and time).
#
#   run(command="FA4_TREE=<commit> bash scripts/decode_evidence.sh", carry=[".device", ".device-extras"],
#       kind="nvidia-h200", timeout_s=600)
#
# after ../shared/device/stage.sh and scripts/stage_device_extras.sh here. On a GPU other than an
# H200 it runs only the suite (SUITE_ONLY_OFF_H200=0 runs everything anyway).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/fa4_out}"; RES=/tmp/fa4_bench; mkdir -p "$OUT" "$RES"
T0=$SECONDS; BUDGET="${BUDGET:-570}"
source .device/setup.sh >"$OUT/summary.txt" 2>&1
source scripts/use_device_extras.sh >>"$OUT/summary.txt" 2>&1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader)
{ echo "tree: ${FA4_TREE:-unknown}"; echo "gpu: $GPU"
  python -c "import torch, cutlass; print(torch.__version__, cutlass.__version__)"; } >>"$OUT/summary.txt" 2>&1

step() {  # step NAME LIMIT CMD...: CMD under min(LIMIT, what is left), output to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET - (SECONDS - T0)))
  (( left < limit )) && limit=$left
  if (( limit < 20 )); then echo "$name skipped (no time left)" >>"$OUT/summary.txt"; return; fi
  local t0=$SECONDS
  timeout -s INT --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "$name rc=$? limit=${limit}s took=$((SECONDS - t0))s" >>"$OUT/summary.txt"
}

if [[ $GPU == *H200* || "${SUITE_ONLY_OFF_H200:-1}" == 0 ]]; then
  step decode 180 python benchmarks/bench.py --mode decode --rounds 3 --out "$RES/decode.json" \
    --only ours,ours-kvcache,ours-varlen,ours-paged256,ours-paged16,cudnn,sdpa-flash
  step host 60 python scripts/host_time.py --calls 1000
  step model 150 python benchmarks/bench.py --mode decode-model --static --out "$RES/decode-model.json"
  (cd "$RES" && tar czf "$OUT/bench.tgz" .)
fi
step suite 220 python -u -m pytest tests/gpu -n 12 -q -rfEx -p no:cacheprovider
cat "$OUT/summary.txt"
