"""The `plane` console command: the core commands of `plane.cli` plus those each package owns
(gateway, pulse, bridge, features, risk-demo). Kept apart from `plane.cli` so that those
packages can import the shared options from it without an import cycle.

The Kafka commands are listed here but imported only when one runs: their module imports a
Kafka client, which the base install leaves out (`pip install 'the-plane[bridge]'`), and
`plane --help` or `plane gateway` must not pay for it (`tests/test_cli_imports.py`).
"""

from __future__ import annotations

import importlib
from typing import Any

import click

from plane.cli import main
from plane.gateway.cli import gateway
from plane.pulse.cli import pulse


class LazyCommand(click.Command):
    """A command whose module is imported when it is run (or asked for its --help), not when
    the group is built. `plane --help` lists it with `short_help`. A module that cannot be
    imported for want of an extra is reported by `plane.cli.PlaneGroup` in one line."""

    def __init__(self, name: str, target: str, short_help: str) -> None:
        super().__init__(name, short_help=short_help, help=short_help)
        self.target = target  # "module:attribute" of the real click command

    def load(self) -> click.Command:
        module, _, attr = self.target.partition(":")
        command = getattr(importlib.import_module(module), attr)
        assert isinstance(command, click.Command), self.target
        return command

    def make_context(self, info_name: str | None, args: list[str],
                     parent: click.Context | None = None, **extra: Any) -> click.Context:
        # click's Group runs `sub_ctx.command.invoke(sub_ctx)`: the real command's context
        # carries the real command, so from here on click sees only that one.
        return self.load().make_context(info_name, args, parent=parent, **extra)


for command in (
    gateway,
    pulse,
    LazyCommand("bridge", "freshness.cli:bridge",
                "Bridge Kafka topics into JetStream (needs the [bridge] extra)."),
    LazyCommand("features", "freshness.features_cli:features",
                "Keep per-card features in PLANE_FEATURES from bridged transactions."),
    LazyCommand("risk-demo", "freshness.cli:risk_demo",
                "A runnable risk pipeline: Kafka -> bridge -> features -> plane."),
):
    main.add_command(command)

__all__ = ["main"]
