#!/usr/bin/env bash
# The wheels of requirements/device.txt into DIR (default .whl/, git-ignored), budget checked; carry DIR to
# the GPU machine (see megatron_bridge_ext/device_check/wheels.py):
#
#   scripts/device_wheels.sh [DIR]        ($PYTHON, default .venv/bin/python; needs the package index)
cd "$(dirname "$0")/.." || exit 2
exec "${PYTHON:-.venv/bin/python}" -m megatron_bridge_ext.device_check.wheels "$@"
