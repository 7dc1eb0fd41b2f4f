"""The `plane` console command: the core commands of `plane.cli` plus those each package owns
(gateway, pulse, bridge, risk-demo). Kept apart from `plane.cli` so that those packages can
import the shared options from it without an import cycle."""

from __future__ import annotations

from freshness.cli import bridge, risk_demo
from plane.cli import main
from plane.gateway.cli import gateway
from plane.pulse.cli import pulse

for command in (gateway, pulse, bridge, risk_demo):
    main.add_command(command)

__all__ = ["main"]
