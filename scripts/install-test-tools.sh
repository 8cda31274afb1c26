#!/usr/bin/env bash
# Installs the system packages the tests use for real: redis-server (Redis), libibverbs1
# (needed by the Mooncake wheel even over tcp) and promtool (package prometheus, to lint the
# metrics exposition). Needs root and Debian/Ubuntu. Exits 0 when all are present already.
set -euo pipefail
need=()
command -v redis-server >/dev/null 2>&1 || command -v valkey-server >/dev/null 2>&1 || need+=(redis-server)
ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1' || need+=(libibverbs1)
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "install-test-tools: missing ${need[*]}; install them as root with apt-get (storage tests will skip)" >&2
  exit 1
fi
echo "install-test-tools: apt-get install ${need[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
install() { apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null 2>&1; }
install || { apt-get update -q >/dev/null && install; }
