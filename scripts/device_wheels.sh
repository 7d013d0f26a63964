#!/usr/bin/env bash
# Download, where the package index is reachable, the wheels of requirements/device.txt into .whl/
# (git-ignored) for Python 3.12 on x86-64 Linux, build the one sdist-only package into a wheel, and
# check the set against its budget. Carry .whl/ to the GPU machine; scripts/device_check.sh installs it.
#
#   scripts/device_wheels.sh [DIR]        (default .whl)
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl}
py=${PYTHON:-.venv/bin/python}
budget_mib=48
mkdir -p "$dest"
rm -f "$dest"/*.whl
pins=$(grep -Ev '^[[:space:]]*(#|$)' requirements/device.txt | sed 's/[[:space:]]*#.*//')
sdist_only=antlr4-python3-runtime
binary=$(echo "$pins" | grep -v "^$sdist_only==")
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# shellcheck disable=SC2086
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$dest" $binary
"$py" -m pip wheel -q --no-deps -w "$dest" "$(echo "$pins" | grep "^$sdist_only==")"
count=$(ls "$dest"/*.whl | wc -l)
want=$(echo "$pins" | wc -l)
bytes=$(du -cb "$dest"/*.whl | tail -1 | cut -f1)
echo "device_wheels: $count wheels, $((bytes / 1048576)) MiB in $dest (budget $budget_mib MiB)"
if [ "$count" -ne "$want" ]; then
  echo "device_wheels: expected $want wheels (one per line of requirements/device.txt), got $count" >&2
  exit 1
fi
if [ "$bytes" -gt $((budget_mib * 1048576)) ]; then
  echo "device_wheels: the set is over its $budget_mib MiB budget; trim requirements/device.txt" >&2
  exit 1
fi
