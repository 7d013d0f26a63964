#!/usr/bin/env bash
# Create (or bring up to date) the project's virtualenv for one supported Megatron Bridge release.
#
#   scripts/setup_env.sh [--bridge 0.6.2|0.5.1] [--force]
#
# .venv for Bridge 0.6.2 (the default), .venv-bridge<version> for the others. Installs torch, then
# requirements/common.txt, requirements/docs.txt (mkdocs) and the per-release pins, then Megatron Core and Megatron Bridge with
# --no-deps (their declared dependencies drag in Transformer Engine, trackers and GPU kernels that the
# local-spec path never imports), then this package in editable mode. A stamp inside the venv holds
# a hash of the requirement files and pyproject.toml: when nothing changed, a rerun returns at once.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
reqs=$root/requirements
bridge=0.6.2
force=0

supported() { local f names=(); for f in "$reqs"/bridge-*.txt; do f=${f##*/bridge-}; names+=("${f%.txt}"); done; echo "${names[*]}"; }
usage() { echo "usage: $0 [--bridge VERSION] [--force]   (VERSION: $(supported))" >&2; exit 2; }
say() { echo "setup_env: $*"; }
die() { echo "setup_env: error: $*" >&2; exit 1; }

while (($#)); do
    case $1 in
        --bridge) (($# >= 2)) || usage; bridge=$2; shift 2 ;;
        --bridge=*) bridge=${1#*=}; shift ;;
        --force) force=1; shift ;;
        *) usage ;;
    esac
done

bridge_reqs=$reqs/bridge-$bridge.txt
[[ -f $bridge_reqs ]] || die "no requirements/bridge-$bridge.txt; supported: $(supported)"
if [[ $bridge == 0.6.2 ]]; then venv=$root/.venv; else venv=$root/.venv-bridge$bridge; fi
stamp=$venv/.setup-env-stamp
log=$venv/setup-env.log

want=$(cat "$reqs/torch.txt" "$reqs/common.txt" "$reqs/docs.txt" "$bridge_reqs" "$root/pyproject.toml" | sha256sum | cut -d' ' -f1)
if ((!force)) && [[ -x $venv/bin/python && -f $stamp && $(<"$stamp") == "$want" ]]; then
    say "environment up to date (${venv#"$root"/}, Bridge $bridge)"
    exit 0
fi

is_py312() { [[ -x $1 ]] && "$1" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; }

# A Python 3.12 that really runs: a pyenv shim named python3.12 exists even when no 3.12 is selected.
find_python() {
    local candidate version
    candidate=$(command -v python3.12 || true)
    if [[ -n $candidate ]] && is_py312 "$candidate"; then echo "$candidate"; return; fi
    if command -v pyenv >/dev/null; then
        for version in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.[0-9]+)?$' | sort -rV); do
            candidate=$(PYENV_VERSION=$version pyenv which python3.12 2>/dev/null || true)
            if [[ -n $candidate ]] && is_py312 "$candidate"; then echo "$candidate"; return; fi
        done
    fi
    for candidate in $(compgen -G "${PYENV_ROOT:-$HOME/.pyenv}/versions/3.12*/bin/python3.12"; \
                       compgen -G "/root/.pyenv/versions/3.12*/bin/python3.12") ; do
        if is_py312 "$candidate"; then echo "$candidate"; return; fi
    done
    return 1
}

if [[ -e $venv ]]; then
    is_py312 "$venv/bin/python" || die "${venv#"$root"/} exists but its python is not a working Python 3.12; remove it and rerun"
    say "updating ${venv#"$root"/} (Bridge $bridge)"
else
    python=$(find_python) || die "no Python 3.12 found (tried python3.12 on PATH, pyenv 3.12.x, ~/.pyenv/versions/3.12*)"
    say "creating ${venv#"$root"/} with $("$python" -V) ($python)"
    "$python" -m venv "$venv"
fi
rm -f "$stamp"  # a failed run must not leave the environment marked up to date
: >"$log"

# pip's output goes to the log; it is shown only when a step fails. --no-deps installs make pip list
# Bridge's undeclared optional dependencies as "conflicts" on later runs: that noise stays in the log.
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_WARN_SCRIPT_LOCATION=1 PIP_NO_INPUT=1
pip_install() {
    if ! "$venv/bin/python" -m pip install "$@" >>"$log" 2>&1; then
        tail -n 40 "$log" >&2
        die "pip install $* failed (full log: $log)"
    fi
}

pinned=$(mktemp)
trap 'rm -f "$pinned"' EXIT
grep -Ev '^[[:space:]]*(#|$)|^megatron-(core|bridge)==' "$bridge_reqs" >"$pinned" || true
megatron=$(grep -Eo '^megatron-(core|bridge)==[^[:space:]#]+' "$bridge_reqs" | tr '\n' ' ')
[[ $megatron == *megatron-core==*megatron-bridge==* ]] || die "$bridge_reqs must pin megatron-core and megatron-bridge"

say "installing $(grep -Eo '^torch==[^[:space:]]+' "$reqs/torch.txt") (CUDA build from the package index; large on first run)"
pip_install -r "$reqs/torch.txt"
say "installing requirements/common.txt, requirements/docs.txt and the Bridge $bridge pins"
pip_install -r "$reqs/common.txt" -r "$reqs/docs.txt" -r "$pinned"
say "installing ${megatron% } (--no-deps)"
pip_install --no-deps $megatron
say "installing megatron-bridge-ext (editable, --no-deps)"
pip_install --no-deps --no-build-isolation -e "$root"

say "checking that Bridge's LoRA and ours import"
if ! (cd "$root" && "$venv/bin/python" -c '
from megatron_bridge_ext.peft import LoRA
import megatron_bridge_ext.patches as p
bad = [s for s in p.status_all() if s.reason.startswith("cannot inspect")]
assert not bad, bad[0].reason
' >>"$log" 2>&1); then
    tail -n 20 "$log" >&2
    die "import check failed (full log: $log)"
fi

echo "$want" >"$stamp"
say "ready: ${venv#"$root"/} ($(du -sh "$venv" | cut -f1)); activate with: source ${venv#"$root"/}/bin/activate"
