"""What the commands say when a flag is wrong or a port is taken: one line, `error: ...` or
click's usage error, naming the flag and what to do, exit 2, never a traceback (each case
below was a traceback, found by running the commands from outside).

A value out of range is refused before anything starts (in-process, through click's
CliRunner); a busy port is found by binding it, so those commands run for real against a
real nats-server."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from plane.app import LazyCommand, main
from plane.contract.embedded import EmbeddedNats
from plane.gateway.config import GatewayConfig, tenant_tokens_from

PLANE = str(Path(sys.executable).parent / "plane")
UNREACHABLE = "nats://127.0.0.1:1"


@contextlib.contextmanager
def busy_port() -> Iterator[int]:
    """A loopback port something listens on for the block."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


async def plane(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(subprocess.run, [PLANE, *args], capture_output=True,
                                   text=True, timeout=timeout_s)


def one_error_line(out: subprocess.CompletedProcess[str], *wanted: str) -> None:
    """Exit 2, no traceback, and an `error: ` line that says each of `wanted`."""
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, out.stderr
    assert all(w in errors[0] for w in wanted), errors[0]


# -- --metrics-port, --port ------------------------------------------------------------------
@pytest.mark.parametrize("command", [
    ["up"], ["router", "--nats", UNREACHABLE], ["node", "--nats", UNREACHABLE],
    ["bridge", "--kafka", "127.0.0.1:1", "--topic", "t", "--nats", UNREACHABLE],
], ids=lambda c: c[0])
@pytest.mark.parametrize("port", ["99999", "-5", "65536"])
def test_a_metrics_port_out_of_range_is_refused_before_anything_starts(
        command: list[str], port: str) -> None:
    result = CliRunner().invoke(main, [*command, "--metrics-port", port])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "--metrics-port" in result.output and "0<=x<=65535" in result.output


@pytest.mark.parametrize("command", [
    ["up", "--models", "calibrated"],
    ["router"],
    ["bridge", "--kafka", "127.0.0.1:1", "--topic", "t"],
], ids=lambda c: c[0])
async def test_a_busy_metrics_port_is_one_line_naming_it(
        nats_server: EmbeddedNats, command: list[str]) -> None:
    nats = [] if command[0] == "up" else ["--nats", nats_server.url]
    with busy_port() as port:
        out = await plane(*command, *nats, "--metrics-port", str(port))
    one_error_line(out, f"metrics cannot listen on 127.0.0.1:{port}", "the port is in use",
                   "--metrics-port")


async def test_a_metrics_host_not_of_this_machine_is_one_line(nats_server: EmbeddedNats) -> None:
    out = await plane("router", "--nats", nats_server.url, "--metrics-port", "0",
                      "--metrics-host", "192.0.2.1")  # TEST-NET-1: never this host's
    one_error_line(out, "metrics cannot listen on 192.0.2.1:0", "check --metrics-host")


async def test_a_busy_gateway_port_is_one_line_naming_it(nats_server: EmbeddedNats) -> None:
    with busy_port() as port:
        out = await plane("gateway", "--nats", nats_server.url, "--port", str(port))
    one_error_line(out, f"gateway cannot listen on 127.0.0.1:{port}", "the port is in use",
                   "--port")


def test_a_node_groups_last_metrics_port_must_exist() -> None:
    result = CliRunner().invoke(main, ["node", "--nats", UNREACHABLE, "--model", "calibrated",
                                       "--slots", "2", "--processes", "2",
                                       "--metrics-port", "65535"])
    assert result.exit_code == 2 and "leaves no port for member 1" in result.output


# -- --nats ----------------------------------------------------------------------------------
def nats_help(name: str) -> str:
    """The --help text of a command's --nats option."""
    command = main.commands[name]
    if isinstance(command, LazyCommand):
        command = command.load()
    [option] = [p for p in command.params if p.name == "nats_url"]
    assert isinstance(option, click.Option) and option.help is not None
    return option.help


@pytest.mark.parametrize("name", ["node", "router", "status", "top", "gateway", "bridge",
                                  "features"])
def test_the_nats_help_of_a_command_without_a_server_says_it_is_required(name: str) -> None:
    """Every command's help said `(default: embedded server)`; only `plane up` (and
    `plane risk-demo`) start one: the others stop with exit 2."""
    said = nats_help(name)
    assert "embedded" not in said and "Required" in said and "PLANE_NATS" in said


def test_the_nats_help_says_what_up_pulse_and_risk_demo_do_without_it() -> None:
    assert "Default: an embedded nats-server" in nats_help("up")
    assert "Give it or --url" in nats_help("pulse") and "embedded" not in nats_help("pulse")
    assert "Default: a nats-server of the demo's own" in nats_help("risk-demo")


@pytest.mark.parametrize("name", ["router", "node", "gateway"])
def test_a_router_node_or_gateway_without_nats_says_give_nats_in_one_line(name: str) -> None:
    """Was `cannot connect to NATS at None`, after the start-up log; the gateway's said
    neither PLANE_NATS nor that only `plane up` starts a server."""
    result = CliRunner().invoke(main, [name], env={"PLANE_NATS": None, "PLANE_AUTH": None})
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert errors == ["Error: give --nats URL (or PLANE_NATS) of the plane's NATS server: "
                      "only `plane up` starts one of its own"], result.output


@pytest.mark.parametrize(("args", "said"), [
    ([], "Error: give --nats URL (or PLANE_NATS) of the plane's NATS server, or --url URL of "
         "an HTTP endpoint to load: only `plane up` starts one of its own"),
    (["--stream", "--model", "tinylm"],
     "Error: give --nats URL (or PLANE_NATS) of the plane's NATS server: only `plane up` "
     "starts one of its own"),
    (["--stream", "--model", "tinylm", "--url", "http://127.0.0.1:9/x"],
     "Error: --stream reads streams over NATS: give --nats URL (or PLANE_NATS) in place of "
     "--url (for HTTP streams, load the gateway's SSE with another tool)"),
], ids=["plain", "stream", "stream-url"])
def test_pulse_without_nats_says_give_nats_or_plane_nats_as_the_others_do(
        args: list[str], said: str) -> None:
    """`plane pulse` said `give --nats URL (the plane) or --url URL`, naming no PLANE_NATS;
    --stream said neither. Now the words of the router's, node's and gateway's."""
    result = CliRunner().invoke(main, ["pulse", *args],
                                env={"PLANE_NATS": None, "PLANE_AUTH": None})
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert errors == [said], result.output


# -- --models --------------------------------------------------------------------------------
@pytest.mark.parametrize(("command", "models", "said"), [
    (["up"], "", "plane up serves at least one model"),
    (["up"], " , ", "plane up serves at least one model"),
    (["router", "--nats", UNREACHABLE], "", "a router serves at least one model"),
    (["up"], "risk,risk", "risk named more than once"),
    (["up"], "risk, calibrated,risk", "risk named more than once"),
    (["router", "--nats", UNREACHABLE], "calibrated,calibrated",
     "calibrated named more than once"),
    (["up"], "risk,nonsense", "unknown model(s) nonsense: the plane's models are"),
], ids=lambda v: v[0] if isinstance(v, list) else repr(v))
def test_a_models_list_is_checked_before_anything_starts(
        command: list[str], models: str, said: str) -> None:
    """`plane up --models ''` started the plane, then an IndexError; `risk,risk` started two
    nodes of one model and ended in prometheus's DuplicateTimeseries."""
    result = CliRunner().invoke(main, [*command, "--models", models])
    assert result.exit_code == 2, result.output
    assert said in result.output and "--models" in result.output


# -- --log-level -----------------------------------------------------------------------------
@pytest.mark.parametrize("command", [
    ["up"], ["router", "--nats", UNREACHABLE], ["node", "--nats", UNREACHABLE],
    ["gateway", "--nats", UNREACHABLE],
    ["bridge", "--kafka", "127.0.0.1:1", "--topic", "t", "--nats", UNREACHABLE],
    ["risk-demo"],
], ids=lambda c: c[0])
def test_every_command_takes_the_same_log_levels(command: list[str]) -> None:
    """`plane gateway --log-level nonsense` was a KeyError traceback (so were the bridge's
    and risk-demo's): every command names the levels it takes."""
    result = CliRunner().invoke(main, [*command, "--log-level", "nonsense"])
    assert result.exit_code == 2, result.output
    assert "--log-level" in result.output
    assert "'nonsense' is not one of 'debug', 'info', 'warning', 'error'" in result.output


# -- --replicas against a lone server --------------------------------------------------------
def test_plane_up_refuses_replicas_on_its_embedded_server() -> None:
    result = CliRunner().invoke(main, ["up", "--replicas", "3"])
    assert result.exit_code == 2, result.output
    assert "--replicas above 1 needs a JetStream cluster" in result.output


@pytest.mark.parametrize("command", [["router"], ["up", "--models", "calibrated"]],
                         ids=lambda c: c[0])
async def test_replicas_a_lone_server_cannot_keep_are_one_line(
        nats_server: EmbeddedNats, command: list[str]) -> None:
    """Was nats-py's ServerError (err_code 10074) as a traceback, from `plane up`'s router
    process and again from the command."""
    out = await plane(*command, "--replicas", "3", "--nats", nats_server.url)
    one_error_line(out, "runs JetStream without a cluster", "give --replicas 1")
    assert "Traceback" not in out.stdout


# -- plane gateway's bearer tokens -----------------------------------------------------------
@pytest.mark.parametrize(("tokens", "wanted"), [
    (["--tenant-token", "acme=samesame1", "--tenant-token", "beta=samesame1"],
     ("tenants 'acme' and 'beta' are given the same bearer token", "give each tenant its own")),
    (["--bearer-token", "samesame1", "--tenant-token", "acme=samesame1"],
     ("--bearer-token is also the --tenant-token of tenant 'acme'",
      "give the tenant a token of its own")),
    (["--tenant-token", "samesame1"], ("--tenant-token wants TENANT=TOKEN",
                                        "not shown: it may be a token")),
    (["--tenant-token", "acme="], ("--tenant-token wants TENANT=TOKEN",
                                   "tenant 'acme' with an empty token")),
], ids=["two-tenants", "bearer-and-tenant", "no-equals", "empty-token"])
def test_a_bearer_token_that_names_two_tenants_is_refused_at_start(
        tokens: list[str], wanted: tuple[str, ...]) -> None:
    """One token for two tenants was accepted, and every request with it went on as the last
    named (metered and share-limited as it); the same for the plain --bearer-token and a
    tenant's (found from outside). Refused as a malformed one is, naming the tenants and never
    the token (a malformed one printed 40 characters of itself: the token alone, no `=`)."""
    result = CliRunner().invoke(main, ["gateway", "--nats", UNREACHABLE, *tokens])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert all(w in result.output for w in wanted), result.output
    assert "samesame1" not in result.output


def test_a_tenant_may_have_two_tokens_to_rotate_one() -> None:
    tokens = tenant_tokens_from(["acme=old-token-1", "acme=new-token-2", "beta=beta-token",
                                 "beta=beta-token"])  # the same pair twice: one
    assert tokens == {"old-token-1": "acme", "new-token-2": "acme", "beta-token": "beta"}
    GatewayConfig(bearer_token="plain-token", tenant_tokens=tokens)  # accepted
