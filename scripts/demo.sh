#!/usr/bin/env bash
# The README's main job: set up ./.venv and run the end-to-end demo on the embedded
# defaults (cpu backend, directory storage). Extra arguments go to `cachexferd demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/cachexferd demo "$@"
