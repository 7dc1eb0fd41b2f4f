# The two commands a fresh machine needs (see README):
#   make demo   run the plane on the embedded default, make example calls, stop
#   make test   run the whole test suite against real servers
.PHONY: demo up test lint typecheck bench setup system js

setup:
	scripts/setup.sh

system:
	scripts/setup-system.sh

js: system
	cd tests/js && npm ci --no-audit --no-fund --loglevel=error

demo: setup
	.venv/bin/plane up --demo --log-level warning

up: setup
	.venv/bin/plane up --metrics-port 9464

test: setup system js
	.venv/bin/ruff check plane gpu_node kernels freshness tests benchmarks scripts examples
	.venv/bin/mypy
	.venv/bin/python -m pytest -q || { echo "the last test started: $$(cat .pytest_cache/current-test 2>/dev/null)"; exit 1; }

lint: setup
	.venv/bin/ruff check plane gpu_node kernels freshness tests benchmarks scripts examples

typecheck: setup
	.venv/bin/mypy

bench: setup
	.venv/bin/python benchmarks/plane_vs_floor.py
