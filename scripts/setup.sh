#!/usr/bin/env bash
# Create or reuse .venv at the repo root and install the plane into it (editable, with every
# extra and the dev tools: `.[dev]` brings `[all]` = `[node,bridge,plots]`). Idempotent and
# quick when nothing changed: the install is redone only when pyproject.toml changes. torch is
# pinned to 2.13.0, which on these CPU machines is a CPU build on local disk; on a GPU machine
# the same pin from PyPI is the CUDA build.
#
# It also keeps the wheels of the base install (the SDK's dependencies) in .venv/wheelhouse:
# tests/test_packaging.py installs the package into a fresh venv from there, offline.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip
fi
stamp=.venv/.plane-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || [ ! -x .venv/bin/plane ]; then
    # torch first and alone, pinned: never let a resolver pick a multi-GB CUDA build here.
    .venv/bin/python -m pip install -q "torch==2.13.0"
    .venv/bin/python -m pip install -q -e '.[dev]'
    rm -rf .venv/wheelhouse
    echo "$want" > "$stamp"
fi
if [ ! -d .venv/wheelhouse ]; then
    .venv/bin/python -c 'import tomllib; print("\n".join(
        tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' \
        > .venv/base-requirements.txt
    .venv/bin/python -m pip wheel -q --wheel-dir .venv/wheelhouse.tmp \
        -r .venv/base-requirements.txt
    mv .venv/wheelhouse.tmp .venv/wheelhouse
fi
test -x .venv/bin/plane && test -x .venv/bin/nats-server
echo "setup: .venv ready ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
