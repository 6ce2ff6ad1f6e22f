#!/usr/bin/env bash
# Wheels the device machine lacks and the GPU test run wants: pytest-xdist (and its execnet), so
# that the suite's kernel compiles, which are most of its wall time, run in parallel processes.
# Pure-Python, about 90 KB; written to .device-extras/ (git-ignored), which a device call carries:
#
#   run(command="source .device/setup.sh && source scripts/use_device_extras.sh &&
#                python -u -m pytest tests/gpu -n 8 -q -rf 2>&1 | tee $OUT/gpu.log",
#       carry=[".device", ".device-extras"])
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .device-extras
python -m pip download --no-deps -q -d .device-extras "pytest-xdist==3.8.0" "execnet==2.1.2"
ls .device-extras
