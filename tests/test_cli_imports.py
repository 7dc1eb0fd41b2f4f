"""The commands that do not compute start without torch and triton (importing them takes
seconds): `plane --help`, and the router, gateway, pulse, status and bridge commands. Only
`plane up` and `plane node` import the node, inside themselves (see `plane.cli`).

The SDK and the light commands (client, gateway, pulse, router, status) are the base install:
they also leave out what the extras bring (matplotlib, the Kafka clients, numpy, pynvml), so
that they work where only the base is installed (`tests/test_packaging.py`).

Each check runs in a fresh interpreter, since this one may have imported torch already."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "triton")
# Everything an extra brings (`plane.contract.extras`): none of it on the base install's paths.
EXTRAS = (*HEAVY, "numpy", "pynvml", "matplotlib", "aiokafka", "confluent_kafka", "kafka")

# Runs the command through click's CliRunner (in-process, so sys.modules can be read after),
# then prints what it came to as one JSON line.
CLI_PROBE = """
import json, sys
from click.testing import CliRunner
from plane.app import main
result = CliRunner().invoke(main, sys.argv[1:])
heavy = sorted(m for m in {heavy!r} if m in sys.modules)
print(json.dumps({{"exit_code": result.exit_code, "output": result.output, "heavy": heavy}}))
"""

# What the commands that do not compute import when they run (beyond `plane.app`).
IMPORT_PROBE = """
import json, sys
import plane.app, plane.serve, plane.gateway.server, plane.pulse.api, freshness.run
print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))
"""

# The base install's modules: the SDK and the light commands.
BASE_PROBE = """
import json, sys
import plane, plane.client, plane.app, plane.serve, plane.gateway.server, plane.pulse.api
import plane.pulse.cli, freshness.features_cli
print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))
"""


def _python(code: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          cwd=REPO, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("args", [
    ["--help"],
    ["router", "--help"],
    ["gateway", "--help"],
    ["pulse", "--help"],
    ["status", "--help"],
    ["bridge", "--help"],
], ids=" ".join)
def test_help_does_not_import_torch_or_triton(args: list[str]) -> None:
    result = json.loads(_python(CLI_PROBE.format(heavy=HEAVY), *args))
    assert result["exit_code"] == 0, result["output"]
    assert "Usage:" in result["output"]
    assert result["heavy"] == [], f"plane {' '.join(args)} imported {result['heavy']}"


def test_modules_of_the_commands_that_do_not_compute_leave_torch_and_triton_out() -> None:
    assert json.loads(_python(IMPORT_PROBE.format(heavy=HEAVY))) == []


@pytest.mark.parametrize("args", [
    ["--help"],
    ["--version"],
    ["router", "--help"],
    ["gateway", "--help"],
    ["pulse", "--help"],
    ["status", "--help"],
], ids=" ".join)
def test_light_commands_import_no_extra(args: list[str]) -> None:
    result = json.loads(_python(CLI_PROBE.format(heavy=EXTRAS), *args))
    assert result["exit_code"] == 0, result["output"]
    assert result["heavy"] == [], f"plane {' '.join(args)} imported {result['heavy']}"


def test_sdk_and_light_modules_import_no_extra() -> None:
    assert json.loads(_python(BASE_PROBE.format(heavy=EXTRAS))) == []
