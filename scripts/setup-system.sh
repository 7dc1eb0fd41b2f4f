#!/usr/bin/env bash
# System packages the plane's tests and demos need. Idempotent; run as root.
#   hey: HTTP load against the gateway; redis-server: the Celery side-by-side;
#   prometheus: promtool checks the /metrics exposition; nodejs/npm: the Node.js client test.
# Installs, with --no-install-recommends, only the packages that are missing.
set -euo pipefail

# (No kcat: Debian's, librdkafka 2.0.2, cannot talk to tansu 0.6 without rewriting the
# protocol; the tests produce with confluent-kafka from PyPI, see tests/kafka_fixtures.py.)
PACKAGES=(hey redis-server prometheus)

missing=()
for pkg in "${PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$pkg")
    fi
done

# Node.js may come from elsewhere than Debian (the machine image has its own): only when no
# `npm` is on PATH do we take Debian's.
command -v npm >/dev/null 2>&1 || missing+=(nodejs npm)

if [ "${#missing[@]}" -eq 0 ]; then
    echo "setup-system: all present (${PACKAGES[*]})"
    exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
    echo "setup-system: missing ${missing[*]}; run this script as root (or with sudo)" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
apt-get -o DPkg::Lock::Timeout=600 update -qq
apt-get -o DPkg::Lock::Timeout=600 install -y --no-install-recommends "${missing[@]}"
echo "setup-system: installed ${missing[*]}"
