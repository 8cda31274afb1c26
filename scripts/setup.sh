#!/usr/bin/env bash
# Creates ./.venv with cachexferd and what it needs. Usage: scripts/setup.sh [EXTRAS]
#   EXTRAS: comma-separated pip extras of the package (e.g. "test" or "dev"); default none.
# torch is the CPU build, pinned: a plain `pip install torch` on Linux pulls several GB of
# CUDA wheels. torch==2.13.0+cpu comes from the indexes pip is configured with when one has
# it (a mirror, a wheel directory), else from PyTorch's CPU index. A torch 2.13.0 already in
# the venv is kept whatever its build (a GPU host installs the CUDA build itself: README).
# Environment: PYTHON (interpreter for the venv), CACHEXFERD_VENV (its path, default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
venv=${CACHEXFERD_VENV:-.venv}
extras=${1:-}
torch_version=2.13.0
torch_cpu_index=https://download.pytorch.org/whl/cpu
spec="."
[ -n "$extras" ] && spec=".[$extras]"
pip() { "$venv/bin/python" -m pip --disable-pip-version-check "$@"; }

install_torch() {
  local have
  have=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)
  [[ "$have" == "$torch_version" || "$have" == "$torch_version"+* ]] && return 0
  echo "setup: installing torch==$torch_version+cpu (the CPU build) into $venv" >&2
  local log
  log=$(mktemp)
  if ! pip install --quiet "torch==$torch_version+cpu" 2>"$log"; then
    pip install --quiet --extra-index-url "$torch_cpu_index" "torch==$torch_version+cpu" || {
      cat "$log" >&2
      rm -f "$log"
      return 1
    }
  fi
  rm -f "$log"
}

if [ ! -x "$venv/bin/python" ]; then
  echo "setup: creating $venv" >&2
  "$python" -m venv "$venv"
fi
stamp="$venv/.installed-${extras:-base}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  install_torch
  echo "setup: installing cachexferd${extras:+[$extras]} into $venv" >&2
  pip install --quiet -e "$spec"
  touch "$stamp"
fi
