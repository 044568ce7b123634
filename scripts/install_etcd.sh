#!/usr/bin/env bash
# Installs an etcd server (Debian's etcd-server package) for the membership-in-etcd tests
# (tests/e2e/test_etcd_membership_e2e.py) and for running a cluster whose members are in etcd
# (docs/deploy.md). apt-get as root, else through sudo where it asks no password; without
# either it says so and exits non-zero: the caller decides whether that is fatal.
set -euo pipefail
if command -v etcd >/dev/null 2>&1; then
  echo "etcd: $(command -v etcd) ($(etcd --version 2>/dev/null | head -n 1))"
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "error: no etcd on the PATH and no apt-get to install etcd-server with;" \
    "install etcd 3.4 or later yourself" >&2
  exit 1
fi
if [ "$(id -u)" -eq 0 ]; then
  as_root=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  as_root=(sudo -n)
else
  echo "error: installing etcd-server needs root (or sudo without a password)" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get update -q
"${as_root[@]}" apt-get install -y -q --no-install-recommends etcd-server
command -v etcd >/dev/null 2>&1 || { echo "error: etcd-server installed no etcd" >&2; exit 1; }
echo "etcd: $(command -v etcd) ($(etcd --version 2>/dev/null | head -n 1))"
