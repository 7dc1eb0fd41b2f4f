"""The README's newcomer path, as written: `plane up --port PORT > log` shows the URL in the
log at once (line-buffered), and every ```python block of the README runs against it. The
README says port 4222; this test takes a free port and puts it in the blocks' URL, nothing
else. A second `plane up` on the same port fails in one line saying so."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from plane.contract.processes import free_port

REPO = Path(__file__).resolve().parent.parent
PLANE = str(Path(sys.executable).parent / "plane")
README_URL = "nats://127.0.0.1:4222"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)



def python_blocks() -> list[str]:
    return BLOCK.findall((REPO / "README.md").read_text())


def _wait_for_line(log: Path, proc: subprocess.Popen[bytes], timeout_s: float) -> str:
    t_end = time.monotonic() + timeout_s
    while time.monotonic() < t_end:
        text = log.read_text()
        if "\n" in text:
            return text.splitlines()[0]
        assert proc.poll() is None, f"plane up exited {proc.returncode}: {text}"
        time.sleep(0.05)
    raise AssertionError(f"plane up printed no line in {timeout_s} s")


def _plane_up_on_a_free_port(log: Path, err: Path,
                             tries: int = 3) -> tuple[int, subprocess.Popen[bytes], str]:
    """`plane up --port P` on a port free a moment before, and its log's first line:
    again on another port when P was taken meanwhile (plane up says "in use" and exits)."""
    for attempt in range(tries):
        port = free_port()
        with log.open("wb") as out, err.open("wb") as errs:
            proc = subprocess.Popen([PLANE, "up", "--port", str(port), "--models",
                                     "risk,tinylm", "--log-level", "warning"],
                                    stdout=out, stderr=errs)
        try:
            # Redirected to a file, still the first line at once (not at exit).
            return port, proc, _wait_for_line(log, proc, 90)
        except AssertionError:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if attempt == tries - 1 or "in use" not in err.read_text():
                raise
    raise AssertionError("unreachable")


def test_readme_python_blocks_run_against_plane_up_on_a_fixed_port(tmp_path: Path) -> None:
    blocks = python_blocks()
    assert len(blocks) >= 2 and all(README_URL in b for b in blocks), blocks
    log, err = tmp_path / "up.log", tmp_path / "up.err"
    port, proc, first = _plane_up_on_a_free_port(log, err)
    try:
        url = f"nats://127.0.0.1:{port}"
        assert first == f"plane is up: NATS {url}", first
        for i, block in enumerate(blocks):
            script = tmp_path / f"readme_{i}.py"
            script.write_text(block.replace(README_URL, url))
            done = subprocess.run([sys.executable, str(script)], cwd=tmp_path,
                                  capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, f"README block {i}:\n{block}\n{done.stderr[-2000:]}"
            if '"tinylm"' in block:  # a stream: its text, then how it finished and its usage
                assert re.search(r"\b(length|stop) Usage\(prompt_tokens=16, completion_tokens=",
                                 done.stdout), done.stdout
            else:
                assert re.search(r"'score': 0\.\d+", done.stdout), done.stdout
        # The port is taken now: a second plane says so in one line and exits 2.
        again = subprocess.run([PLANE, "up", "--port", str(port), "--models", "risk",
                                "--log-level", "warning"], capture_output=True, text=True,
                               timeout=90)
        assert again.returncode == 2, again.stderr
        lines = again.stderr.strip().splitlines()
        assert len(lines) == 1 and "in use" in lines[0] and str(port) in lines[0], lines
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0, err.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_port_and_nats_do_not_go_together() -> None:
    done = subprocess.run([PLANE, "up", "--port", "4222", "--nats", "nats://127.0.0.1:4222"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--port or --nats" in done.stderr, done.stderr


def test_version() -> None:
    done = subprocess.run([PLANE, "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and re.fullmatch(r"plane, version \S+\n", done.stdout)


def test_readme_says_what_plane_up_prints_and_serves() -> None:
    """The README said `plane up` "prints the URL first" (its start-up log comes first, then
    the URL: `tests/test_up.py`) and gives "one /metrics" (only with --metrics-port)."""
    readme = (REPO / "README.md").read_text()
    [bare] = [line for line in readme.splitlines() if line.startswith(".venv/bin/plane up  ")]
    assert "after its start-up log" in bare and "URL first" not in bare, bare
    [row] = [line for line in readme.splitlines() if line.startswith("| `plane up` |")]
    assert "with `--metrics-port`, one /metrics" in row and "no /metrics without it" in row, row
