#!/usr/bin/env bash
# The README's test command: set up ./.venv (with the test extras), install the storage test
# servers and promtool when possible (as root on Debian/Ubuntu: scripts/install-test-tools.sh,
# docs/operations.md "Test tools" says what it changes), and run the whole suite. Then the
# vLLM plug-in's tests with the real engine, in their own venv (scripts/setup-vllm.sh: about
# 5-7 minutes and 3.5 GB the first time; CACHEXFERD_SKIP_VLLM=1 skips them). Extra arguments
# go to pytest and run only the main suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
if ! scripts/install-test-tools.sh; then
  if [ "${CI:-}" = "true" ]; then
    echo "test: CI needs redis-server, libibverbs1 and promtool" >&2
    exit 1
  fi
fi
# Every CACHEXFERD_* variable is a daemon setting (docs/operations.md, "Configuration"), and
# the daemons the tests start inherit the environment: this script's own switch must not reach them.
skip_vllm=${CACHEXFERD_SKIP_VLLM:-}
unset CACHEXFERD_SKIP_VLLM
.venv/bin/python -m pytest -p no:cacheprovider "$@"
[ $# -eq 0 ] && [ "$skip_vllm" != "1" ] || exit 0
if ! scripts/setup-vllm.sh; then
  if [ "${CI:-}" = "true" ]; then
    echo "test: CI needs the vLLM venv (scripts/setup-vllm.sh)" >&2
    exit 1
  fi
  echo "test: vLLM could not be installed; the vLLM plug-in tests were not run" >&2
  exit 0
fi
exec .venv-vllm/bin/python -m pytest -p no:cacheprovider tests/vllm
