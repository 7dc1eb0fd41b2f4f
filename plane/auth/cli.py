"""`plane auth init DIR`, `add-tenant DIR NAME` and `remove-tenant DIR NAME`: a secured
server's config and each role's and tenant's credentials (`plane.auth.store`)."""

from __future__ import annotations

import asyncio
import json

import click

from plane.auth.roles import ROLES
from plane.auth.store import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_SUBSCRIPTIONS,
    NO_RATE_LIMIT,
    STATE_FILE,
    AuthDir,
    AuthState,
    check_tenant,
)
from plane.contract.errors import ConfigError, PlaneError


def options_json(d: AuthDir, state: AuthState, *who: str) -> str:
    """`{"router": {"user": ..., "password": ...}, ...}`: what `--user/--password` take."""
    out = {}
    for w in who:
        opts = d.options(w, state=state)
        out[w] = {"user": opts.user, "password": opts.password}
    return json.dumps(out)


@click.group()
def auth() -> None:
    """Secure the plane's NATS server: roles, and tenants as accounts.

    \b
    Examples:
      plane auth init ./auth --json      # DIR/nats.conf, and each role's options as JSON
      plane auth add-tenant ./auth acme --share 2 --max-rate 500 --json
      plane auth add-tenant ./auth acme --new-password --json   # rotate a leaked password
      plane auth remove-tenant ./auth acme                      # revoke: out at once
      plane up --auth ./auth             # the embedded server with it, each part its role
      nats-server -c ./auth/nats.conf -P ./auth/nats.pid -sd /var/lib/nats   # yourself
    """


@auth.command()
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--prefix", default="plane", show_default=True, help="Subject prefix.")
@click.option("--json", "as_json", is_flag=True,
              help="Print each role's connection options as one JSON object.")
@click.option("--include-conf", default=None, metavar="PATH",
              help="Build on this nats-server config: a cluster's routes and JetStream "
                   "store, as compose/ does. Its path relative to DIR as the server sees it "
                   "(nats-server resolves an include from the including file's folder).")
def init(directory: str, prefix: str, as_json: bool, include_conf: str | None) -> None:
    """Write DIR/nats.conf (the plane's account PLANE, users router, node, bridge, gateway,
    admin, each allowed only what it needs) and DIR/auth.json (their passwords, mode 0600).
    Run again on the same DIR: the passwords stay, nats.conf is written afresh."""
    d = AuthDir(directory)
    state = d.init(prefix, include=include_conf)
    if as_json:
        click.echo(options_json(d, state, *ROLES))
        return
    click.echo(f"wrote {d.conf} and {d.path / 'auth.json'} (the passwords: keep it private)")
    click.echo(f"run it: plane up --auth {d.path}   or   nats-server -c {d.conf} -sd STORE "
               f"-P {d.pid_file}")


@auth.command("add-tenant")
@click.argument("directory", type=click.Path(file_okay=False, exists=True))
@click.argument("name")
@click.option("--share", type=int, default=None,
              help="Weight in the fair share of slot time (1..1000; default 1).")
@click.option("--max-rate", type=int, default=None,
              help="Requests per second the tenant may send, per router (1..1000000; "
                   f"{NO_RATE_LIMIT}: no limit, the default; {NO_RATE_LIMIT} again lifts a "
                   "limit set before).")
@click.option("--max-connections", type=int, default=None,
              help="Connections the tenant's account may hold at once "
                   f"(default {DEFAULT_MAX_CONNECTIONS}).")
@click.option("--max-subscriptions", type=int, default=None,
              help=f"Subscriptions over all of them (default {DEFAULT_MAX_SUBSCRIPTIONS}).")
@click.option("--nats", "nats_url", default=None,
              help="A running plane's URL: also put the settings into its PLANE_CONFIG now "
                   "(as the admin role); nothing is written unless it answers.")
@click.option("--new-password", is_flag=True,
              help="Give an existing tenant a new password (a leaked one): the running "
                   "server drops the connections made with the old one at its reload.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the tenant's connection options as one JSON object.")
def add_tenant(directory: str, name: str, share: int | None, max_rate: int | None,
               max_connections: int | None, max_subscriptions: int | None,
               nats_url: str | None, new_password: bool, as_json: bool) -> None:
    """Add tenant NAME: an account that can only call the plane (`<prefix>.infer.>`, the
    imported service) and read its own replies. A server running DIR/nats.conf reloads it
    at once, with no restart (with --nats URL, checked: the tenant is let in). Again for an
    existing tenant: changes the settings given, keeps the others and its password
    (--max-rate 0 lifts a rate limit; --new-password replaces the password). --share and
    --max-rate go into PLANE_CONFIG (`share.NAME`, `max_rate.NAME`, deleted when lifted)
    with --nats URL, and whenever `plane up --auth DIR` starts. --max-connections and
    --max-subscriptions are the account's limits in nats.conf: the server refuses a
    connection or a subscription past them.

    \b
    Outcome, never half-known:
      exit 2   nothing written: a bad setting, or with --nats a server that does not let
               DIR's admin in or has no plane (PLANE_CONFIG) yet
      exit 0   written, and with --nats taken by the running plane
      exit 1   written (the tenant and, with --json, its password are printed first), but
               the running plane did not take it: the error says why; run the command
               again once fixed (the password stays)
    """
    d = AuthDir(directory)
    settings = {"share": share, "max_rate": max_rate, "max_connections": max_connections,
                "max_subscriptions": max_subscriptions}
    check_tenant(name, **settings)
    if nats_url is not None:
        from plane.auth.live import check_plane

        try:  # before writing: an unreachable plane must not leave a tenant half-added
            asyncio.run(check_plane(d, nats_url))
        except PlaneError as exc:
            raise ConfigError(f"{exc}. Nothing was written: check --nats (a running plane's "
                              "URL), or leave it out to write DIR only") from None
    d.add_tenant(name, **settings, new_password=new_password)
    reloaded = d.reload()
    # Printed before the running plane is asked: whatever it says, the tenant is written and
    # its credentials are known (a JSON caller never saw the password of a tenant that a
    # later failure left in the files).
    if as_json:
        click.echo(options_json(d, d.load(), name))
    else:
        click.echo(f"tenant {name} written to {d.conf} (its login in "
                   f"{d.path / STATE_FILE}); "
                   + ("the running server reloaded it" if reloaded
                      else "no running server to reload"))
    if nats_url is not None and (problem := asyncio.run(go_live(
            d, name, nats_url, reloaded, lifted=max_rate == NO_RATE_LIMIT))):
        raise click.ClickException(
            f"tenant {name} IS written to {d.conf} and {d.path / STATE_FILE}, but {problem}")


async def go_live(d: AuthDir, name: str, url: str, reloaded: bool, *,
                  lifted: bool = False) -> str | None:
    """The running plane at `url` takes tenant `name`: its server lets it in (after our
    reload) and PLANE_CONFIG holds the tenants' settings. Why not, with what to do; None
    when it did. `lifted`: its rate limit was lifted (`--max-rate 0`)."""
    from plane.auth.live import put_tenant_settings, tenant_let_in

    if reloaded and not await tenant_let_in(d, name, url):
        return (f"the server at {url} did not take it on reload (nats-server cannot reload "
                "some changes, such as the system account a config written before 2026-12-01 "
                "lacks; its log says which): restart the server (one at a time in a "
                "cluster), then run this again")
    try:
        await put_tenant_settings(d, url, lifted=name if lifted else None)
    except PlaneError as exc:
        return (f"its settings did not reach PLANE_CONFIG at {url} ({exc}): run this again "
                "once the plane answers (the password stays), or restart `plane up --auth`")
    return None


@auth.command("remove-tenant")
@click.argument("directory", type=click.Path(file_okay=False, exists=True))
@click.argument("name")
def remove_tenant(directory: str, name: str) -> None:
    """Revoke tenant NAME: remove its account from DIR/nats.conf and its login from
    DIR/auth.json. A server running DIR/nats.conf reloads it at once: the tenant's
    connections are dropped and every new one refused (its SDK clients close, their calls
    raising ConnectionClosed that names the authorization violation). To replace a leaked
    password instead: `plane auth add-tenant DIR NAME --new-password`.

    \b
    Example:
      plane auth remove-tenant ./auth acme
    """
    d = AuthDir(directory)
    d.remove_tenant(name)
    reloaded = d.reload()
    click.echo(f"tenant {name} removed from {d.conf} and {d.path / STATE_FILE}; "
               + ("the running server reloaded it" if reloaded
                  else "no running server to reload (restart yours with the new config)"))
