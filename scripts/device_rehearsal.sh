#!/usr/bin/env bash
# The device check rehearsed on a CPU: a virtualenv with torch and nothing else, the carried wheel set
# (downloaded from requirements/device.txt, budget checked), and the device command's dry mode on tiny
# shapes. A missing wheel, a missing import or a broken path fails here, not on the GPU machine.
#
#   scripts/device_rehearsal.sh        (needs .venv from scripts/setup_env.sh and the package index)
set -euo pipefail
cd "$(dirname "$0")/.."
work=build/rehearsal
rm -rf "$work"
mkdir -p "$work"
.venv/bin/python scripts/torch_only_venv.py "$work/venv"
bash scripts/device_wheels.sh "$work/whl"
status=0
MBX_WHEELS="$work/whl" PYTHON="$work/venv/bin/python" MBX_DEVICE_SITE="$PWD/$work/site" OUT="$work/out" \
  bash scripts/device_check.sh --dry-run || status=$?
echo "device_rehearsal: device_check.sh --dry-run exited $status; report in $work/out/device_check.json"
exit "$status"
