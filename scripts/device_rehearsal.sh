#!/usr/bin/env bash
# The device check rehearsed on a CPU into build/rehearsal/ (see megatron_bridge_ext/device_check/rehearsal.py):
#
#   scripts/device_rehearsal.sh        (needs .venv from scripts/setup_env.sh and the package index)
cd "$(dirname "$0")/.." || exit 2
exec .venv/bin/python -m megatron_bridge_ext.device_check.rehearsal
