#!/usr/bin/env bash
# The device check in one command, from the repository root on the GPU machine (the carried wheels in .whl/
# or $MBX_WHEELS installed first; see megatron_bridge_ext/device_check/__main__.py):
#
#   scripts/device_check.sh [--dry-run] [--layers N]        ($PYTHON, default python3)
cd "$(dirname "$0")/.." || exit 2
exec "${PYTHON:-python3}" -m megatron_bridge_ext.device_check "$@"
