#!/usr/bin/env bash
# Where a backward's time goes, ours against flash-attn-4, in one device call: the per-kernel times
# (scripts/kernel_times.py) and Nsight Compute's per-instruction stall samples of the main kernel
# (SourceCounters, WarpStateStats; as SASS-level CSV, gzipped, plus the details page), the method of
# docs/perf.md's "where the stalls are" section. Each step under its own limit (scripts/device_steps.sh).
#
#   run(command="SHAPE=8,32,2048,64 CAUSAL=1 FA4_TREE=<commit> bash scripts/bwd_profile.sh",
#       carry=[".device", ".device-extras"])
#
# $OUT: ktimes.log, src_<impl>.csv.gz, details_<impl>.csv, summary.txt, setup.log.
set -uo pipefail
cd "$(dirname "$0")/.."
SHAPE="${SHAPE:-8,32,2048,64}"
causal=(); [[ "${CAUSAL:-1}" == 1 ]] && causal=(--causal)
source scripts/device_steps.sh  # OUT, setup, GPU_NAME, step
step ktimes 90 python scripts/kernel_times.py --mode bwd "${causal[@]}" --shape "$SHAPE" --impl ours,fa4-upstream
for impl in ours fa4-upstream; do
  step "ncu_$impl" 120 ncu --clock-control none --profile-from-start off -k regex:FlashAttentionBackwardSm90 \
    --section SourceCounters --section WarpStateStats --section SpeedOfLight -o "$OUT/ncu_$impl" \
    python scripts/ncu_one.py --impl "$impl" --mode bwd --shape "$SHAPE" "${causal[@]}"
  if [[ -f "$OUT/ncu_$impl.ncu-rep" ]]; then
    ncu --import "$OUT/ncu_$impl.ncu-rep" --page source --csv --print-source sass >"$OUT/src_$impl.csv" 2>&1
    ncu --import "$OUT/ncu_$impl.ncu-rep" --page details --csv >"$OUT/details_$impl.csv" 2>&1
    gzip -f "$OUT/src_$impl.csv" && rm -f "$OUT/ncu_$impl.ncu-rep"
  fi
done
cat "$OUT/summary.txt"
