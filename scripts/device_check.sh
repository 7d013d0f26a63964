#!/usr/bin/env bash
# The device check in one command (see scripts/device_check.py for the parts and verdicts):
#
#   scripts/device_check.sh [--dry-run] [--layers N]
#
# On a GPU machine that has Python 3.12 and torch but no Megatron and no network, the wheels in .whl/
# (or in $MBX_WHEELS; made by scripts/device_wheels.sh where the package index is reachable, then
# carried along) are installed into a private folder first ($MBX_DEVICE_SITE, default
# /tmp/mbx-device-site); nothing is installed into the system. Without carried wheels the check uses
# what $PYTHON (default python3) already has, and says so. Results go to
# ${OUT:-build/device}/device_check.json; the exit status is non-zero when a check failed or did not run.
set -u -o pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
site=${MBX_DEVICE_SITE:-/tmp/mbx-device-site}
export PYTHONUNBUFFERED=1
wheels=${MBX_WHEELS:-.whl}
if [ -d "$wheels" ] && ls "$wheels"/*.whl >/dev/null 2>&1; then
  rm -rf "$site"
  if ! "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl; then
    echo "device_check: installing the carried wheels from $wheels/ failed; rebuild them with scripts/device_wheels.sh" >&2
    exit 2
  fi
  echo "device_check: installed $(ls "$wheels"/*.whl | wc -l) carried wheels from $wheels/ into $site"
  export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "device_check: no carried wheels in $wheels/; using the packages $python already has"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
exec "$python" scripts/device_check.py "$@"
