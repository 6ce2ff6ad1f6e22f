# Sourced (in the project root) by the scripts that make up one device call, gpu_batch.sh and
# decode_evidence.sh: sets OUT (default /tmp/fa4_out), sets up the CuTe DSL and the extra wheels
# (their output, the tree, the GPU and the versions in $OUT/setup.log), names the GPU in GPU_NAME,
# and defines step.
OUT="${OUT:-/tmp/fa4_out}"
mkdir -p "$OUT"
source .device/setup.sh >"$OUT/setup.log" 2>&1
source scripts/use_device_extras.sh >>"$OUT/setup.log" 2>&1
GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>>"$OUT/setup.log")
{ echo "tree: ${FA4_TREE:-unknown}"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python -c "import torch, cutlass; print(torch.__version__, cutlass.__version__)"; } >>"$OUT/setup.log" 2>&1

_STEPS_T0=$SECONDS

# step NAME LIMIT_S CMD...: runs CMD under its limit, output to $OUT/NAME.log, its exit status and
# time a line of $OUT/summary.txt. With STEP_BUDGET_S set, the limit is cut to what is left of that
# many seconds since this file was sourced, and a step cut below 20 s is skipped. SIGINT
# first: pytest stopped by the limit still prints the summary of what ran (and exits 2).
step() {
  local name=$1 limit=$2; shift 2
  if [[ -n "${STEP_BUDGET_S:-}" ]]; then
    local left=$((STEP_BUDGET_S - (SECONDS - _STEPS_T0)))
    if (( left < limit )); then
      if (( left < 20 )); then echo "$name skipped (no time left)" >>"$OUT/summary.txt"; return; fi
      limit=$left
    fi
  fi
  local t0=$SECONDS
  timeout -s INT --kill-after=15 "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "$name rc=$? ${limit}s-limit took=$((SECONDS - t0))s" >>"$OUT/summary.txt"
}
