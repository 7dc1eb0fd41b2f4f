"""`plane pulse --stream`: the options `plane pulse` takes for streams turned into a target
and a load, run, reported. The command itself (its flags) is `plane.pulse.cli`."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import click

from plane.cli import EXIT_UNHEALTHY
from plane.contract.backoff import NO_RETRY, RetryPolicy
from plane.contract.config import ConnectOptions
from plane.contract.errors import ConfigError
from plane.contract.lifecycle import run as run_on_uvloop
from plane.contract.models import MODELS
from plane.pulse.runner import LoadConfig
from plane.pulse.stream_api import pulse_streams
from plane.pulse.stream_report import print_stream_table, to_json, write_stream_out
from plane.pulse.stream_target import DEFAULT_WAIT_MS, StreamSpec, StreamTarget


@dataclass(frozen=True, kw_only=True)
class StreamOptions:
    """The stream-only flags of `plane pulse`."""

    stream_deadline_ms: int | None
    seed: int | None
    capacity_x: float | None
    callers: int
    capacity_s: float


def run_stream_pulse(opts: ConnectOptions, *, model: str, body: bytes, load: LoadConfig,
                     deadline_ms: int | None, timeout_ms: int | None, retry: bool,
                     max_attempts: int, stream: StreamOptions, as_json: bool,
                     out_dir: Path | None) -> None:
    try:
        spec_model = MODELS.get(model)
        if spec_model is not None and not spec_model.streams:
            streaming = ", ".join(m for m, s in MODELS.items() if s.streams)
            raise ConfigError(f"model {model!r} does not stream; --stream works with: "
                              f"{streaming}")
        if stream.callers < 1:
            raise ConfigError("--callers must be at least 1 (one per slot measures capacity)")
        spec = StreamSpec(model=model, deadline_ms=deadline_ms,
                          stream_deadline_ms=stream.stream_deadline_ms,
                          policy=RetryPolicy(max_attempts=max_attempts) if retry else NO_RETRY,
                          wait_ms=timeout_ms or DEFAULT_WAIT_MS)
        target = StreamTarget(opts, spec, seed=stream.seed)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    try:
        report = run_on_uvloop(pulse_streams(
            target, body, load, seed=stream.seed, capacity_x=stream.capacity_x,
            callers=stream.callers, capacity_s=stream.capacity_s))
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(to_json(report.summary, report.capacity))
    else:
        print_stream_table(report.summary, report.capacity)
    if out_dir is not None:
        for path in write_stream_out(out_dir, report.run.outcomes, report.summary,
                                     report.capacity):
            click.echo(f"wrote {path}", err=True)
    if report.summary.started == 0:
        sys.exit(EXIT_UNHEALTHY)
