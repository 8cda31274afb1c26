#!/usr/bin/env bash
# The README's test command: set up ./.venv (with the test extras), install the storage test
# servers and promtool when possible (as root on Debian/Ubuntu: scripts/install-test-tools.sh,
# docs/operations.md "Test tools" says what it changes), and run the whole suite. Extra
# arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
if ! scripts/install-test-tools.sh; then
  if [ "${CI:-}" = "true" ]; then
    echo "test: CI needs redis-server, libibverbs1 and promtool" >&2
    exit 1
  fi
fi
exec .venv/bin/python -m pytest -p no:cacheprovider "$@"
