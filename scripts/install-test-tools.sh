#!/usr/bin/env bash
# Installs what the tests use for real, on Debian/Ubuntu as root, and nothing more:
#   redis-server  Debian package (a Redis to test the redis backend against). It is installed
#                 without being started (a temporary /usr/sbin/policy-rc.d refuses service
#                 starts) and disabled at boot afterwards: the tests start their own on a free
#                 loopback port.
#   libibverbs1   Debian package (a library the Mooncake wheel needs even over tcp; no service).
#   promtool      one file, /usr/local/bin/promtool, taken out of Debian's prometheus package
#                 (there is no smaller package with it); the prometheus server is not installed.
# Exits 0 at once when all are present; runs `apt-get update` only when a package is not found.
# Without root or apt-get it says what is missing and exits 1 (the tests that need them skip).
set -euo pipefail
bindir=${PROMTOOL_DIR:-/usr/local/bin}
need=()
command -v redis-server >/dev/null 2>&1 || command -v valkey-server >/dev/null 2>&1 || need+=(redis-server)
ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1' || need+=(libibverbs1)
want_promtool=0
command -v promtool >/dev/null 2>&1 || [ -x "$bindir/promtool" ] || want_promtool=1
[ ${#need[@]} -eq 0 ] && [ $want_promtool = 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  missing="${need[*]}"; [ $want_promtool = 1 ] && missing="$missing promtool"
  echo "install-test-tools: missing$missing; run this script as root on Debian/Ubuntu (those tests skip meanwhile)" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
updated=0
apt_retry() {  # a command that needs the package lists; refreshes them once if it fails
  "$@" >/dev/null 2>&1 && return 0
  [ $updated = 1 ] && return 1
  apt-get update -q >/dev/null && updated=1 && "$@" >/dev/null 2>&1
}

install_packages() {
  local policy=/usr/sbin/policy-rc.d ours=0
  if [ ! -e $policy ]; then  # refuse every service start while we install (exit 101: "not allowed")
    printf '#!/bin/sh\nexit 101\n' > $policy && chmod 755 $policy && ours=1
  fi
  echo "install-test-tools: apt-get install ${need[*]} (services not started)" >&2
  local rc=0
  apt_retry apt-get install -y -q --no-install-recommends "${need[@]}" || rc=$?
  [ $ours = 1 ] && rm -f $policy
  if [ $rc = 0 ] && [[ " ${need[*]} " == *" redis-server "* ]] && command -v systemctl >/dev/null 2>&1; then
    systemctl disable --quiet redis-server.service 2>/dev/null || true
  fi
  return $rc
}

install_promtool() {
  local work rc=0
  work=$(mktemp -d)
  echo "install-test-tools: promtool from Debian's prometheus package into $bindir" >&2
  if (cd "$work" && apt_retry apt-get download prometheus); then
    dpkg-deb --fsys-tarfile "$work"/prometheus_*.deb | tar -x -C "$work" ./usr/bin/promtool &&
      install -D -m 755 "$work/usr/bin/promtool" "$bindir/promtool" || rc=$?
  else
    rc=1
  fi
  rm -rf "$work"
  return $rc
}

[ ${#need[@]} -eq 0 ] || install_packages
[ $want_promtool = 0 ] || install_promtool
