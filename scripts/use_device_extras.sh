# Sourced on the device machine after .device/setup.sh: unpacks the wheels that
# scripts/stage_device_extras.sh staged (no pip or network needed) and puts them on PYTHONPATH.
_extras=/tmp/device-extras
mkdir -p "$_extras"
for _whl in .device-extras/*.whl; do python -m zipfile -e "$_whl" "$_extras"; done
export PYTHONPATH="$_extras${PYTHONPATH:+:$PYTHONPATH}"
unset _extras _whl
