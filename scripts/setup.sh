#!/usr/bin/env bash
# Creates ./.venv with cachexferd and what it needs. Usage: scripts/setup.sh [EXTRAS]
#   EXTRAS: comma-separated pip extras of the package (e.g. "test" or "dev"); default none.
# torch is pinned to the CPU build (2.13.0): an unpinned torch pulls several GB of CUDA
# wheels. On a GPU host install a CUDA build of torch into the venv yourself.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
venv=${CACHEXFERD_VENV:-.venv}
extras=${1:-}
spec="."
[ -n "$extras" ] && spec=".[$extras]"

if [ ! -x "$venv/bin/python" ]; then
  echo "setup: creating $venv" >&2
  "$python" -m venv "$venv"
fi
stamp="$venv/.installed-${extras:-base}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup: installing torch==2.13.0 (CPU) and cachexferd${extras:+[$extras]} into $venv" >&2
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check torch==2.13.0
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e "$spec"
  touch "$stamp"
fi
