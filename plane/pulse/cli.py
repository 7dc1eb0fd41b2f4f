"""`plane pulse`: parse flags into a target and a load, run it, report. Nothing else here."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from plane.cli import EXIT_UNHEALTHY, connect_options_with, make_connect, require_nats
from plane.client.attempt import with_start_wait
from plane.contract.backoff import NO_RETRY, RetryPolicy
from plane.contract.config import MAX_DEADLINE_MS
from plane.contract.errors import ConfigError
from plane.contract.lifecycle import run as run_on_uvloop
from plane.contract.logs import configure as configure_logs
from plane.pulse.api import pulse as run_pulse
from plane.pulse.bodies import DEFAULT_DURATION_US, DEFAULT_MAX_TOKENS, body_from_option
from plane.pulse.report import print_table, to_json, write_out
from plane.pulse.runner import LoadConfig
from plane.pulse.stream_api import DEFAULT_CAPACITY_S
from plane.pulse.stream_cli import StreamOptions, run_stream_pulse
from plane.pulse.targets import HttpTarget, NatsTarget, Target

NO_DEADLINE_WAIT_MS = 30_000  # the SDK's own wait for a call without a deadline


def _headers(raw: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for h in raw:
        name, sep, value = h.partition(":")
        if not sep:
            raise click.BadParameter(f"{h!r}: use 'Name: value'", param_hint="--header")
        out[name.strip()] = value.strip()
    return out


@click.command("pulse")
@connect_options_with("NATS URL(s) of the plane, comma separated (env PLANE_NATS). Give it "
                      "or --url (required with --stream).")
@click.option("--url", default=None, help="Load this HTTP endpoint instead of the plane.")
@click.option("--model", default="calibrated", show_default=True)
@click.option("--body", default=None, help="Request body as JSON (default: valid for --model).")
@click.option("--duration-us", type=int, default=DEFAULT_DURATION_US, show_default=True,
              help="calibrated: device time per request in the default body.")
@click.option("--rate", type=float, default=100.0, show_default=True, help="Arrivals per second.")
@click.option("--duration", "duration_s", type=float, default=10.0, show_default=True,
              help="Seconds of arrivals.")
@click.option("--arrivals", type=click.Choice(["even", "poisson"]), default=None,
              help="How sends are scheduled: even (one every 1/--rate s, the default) or "
                   "poisson (independent callers: bursts and lulls at the same mean rate; "
                   "--seed fixes them). --stream: always poisson.")
@click.option("--concurrency", type=int, default=512, show_default=True,
              help="Most requests in flight; arrivals beyond are dropped (counted).")
@click.option("--deadline-ms", type=click.IntRange(1, MAX_DEADLINE_MS), default=None,
              help="Send Plane-Deadline-Ms with this budget (default: send none, so the "
                   "router's live deadline_ms.<model> applies).")
@click.option("--timeout-ms", type=click.IntRange(1, 2 * MAX_DEADLINE_MS), default=None,
              help="How long to wait for an answer, retries included (default: deadline + "
                   f"1000, or {NO_DEADLINE_WAIT_MS} without --deadline-ms).")
@click.option("--wait-ms", "start_wait_ms", type=click.IntRange(1, MAX_DEADLINE_MS),
              default=None,
              help="Send Plane-Wait-Ms: each request waits up to this long at the router for "
                   "its start rather than be refused (callers that do not retry).")
@click.option("--retry/--no-retry", default=False, show_default=True,
              help="Retry 429s as the SDK does (Retry-After, ticket, backoff).")
@click.option("--max-attempts", type=int, default=4, show_default=True)
@click.option("-H", "--header", "headers", multiple=True, help="HTTP only: 'Name: value'.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Write latencies.csv, pulse.png (latency over time, by percentile, "
                   "refusal rate, histogram) and summary.json here.")
@click.option("--progress/--no-progress", default=None,
              help="Progress bar on stderr (default: when stderr is a terminal).")
@click.option("--stream", is_flag=True,
              help="Ask for streams (Plane-Stream: 1; models that stream: tinylm): Poisson "
                   "arrivals at --rate, TTFT/TPOT percentiles, tokens/s, the issue's targets. "
                   "--deadline-ms is then the TTFT budget; --timeout-ms the wait for a "
                   "stream's end when no --stream-deadline-ms is sent.")
@click.option("--stream-deadline-ms", type=click.IntRange(1, MAX_DEADLINE_MS), default=None,
              help="--stream: send Plane-Stream-Deadline-Ms, the whole stream's budget "
                   "(default: none, the plane's own).")
@click.option("--max-tokens", type=click.IntRange(1, 255), default=DEFAULT_MAX_TOKENS,
              show_default=True, help="tinylm: tokens asked for in the default body.")
@click.option("--capacity-x", type=click.FloatRange(min=0, min_open=True), default=None,
              help="--stream: measure the capacity first (closed loop, --callers at a time) "
                   "and offer this multiple of it instead of --rate.")
@click.option("--callers", type=int, default=2, show_default=True,
              help="--stream --capacity-x: closed-loop callers (one per slot).")
@click.option("--capacity-s", type=float, default=DEFAULT_CAPACITY_S, show_default=True,
              help="--stream --capacity-x: seconds of closed loop.")
@click.option("--seed", type=int, default=None,
              help="Seed of the Poisson arrivals (and --stream's retry jitter; default: "
                   "random).")
def pulse(nats_url: str | None, user: str | None, password: str | None, token: str | None,
          creds: str | None, tls_ca: str | None, url: str | None, model: str,
          body: str | None, duration_us: int, rate: float, duration_s: float,
          arrivals: str | None, concurrency: int, deadline_ms: int | None,
          timeout_ms: int | None, start_wait_ms: int | None, retry: bool,
          max_attempts: int, headers: tuple[str, ...], as_json: bool, out_dir: Path | None,
          progress: bool | None, stream: bool, stream_deadline_ms: int | None,
          max_tokens: int, capacity_x: float | None, callers: int, capacity_s: float,
          seed: int | None) -> None:
    """Open-loop load: a constant --rate for --duration, latency from each scheduled send.
    With --stream: streams at Poisson arrivals (or --capacity-x times the closed-loop
    capacity), TTFT, TPOT and tokens/s, judged against the streaming targets.

    \b
    Examples:
      plane pulse --nats nats://127.0.0.1:4222 --rate 200 --duration 10 --retry
      plane pulse --nats nats://127.0.0.1:4222 --model risk --deadline-ms 50 --json
      plane pulse --url http://127.0.0.1:8080/v1/infer/calibrated --rate 50 --out out/
      plane pulse --nats nats://127.0.0.1:4222 --model tinylm --stream --rate 20 --retry
      plane pulse --nats nats://127.0.0.1:4222 --model tinylm --stream --capacity-x 2 \\
          --callers 2 --duration 30 --retry --out out/
    """
    # The SDK's warnings (a connection lost and back) to stderr: structlog's default wrote
    # them on stdout, into `--json`'s document.
    configure_logs("warning")
    try:
        deadline = deadline_ms  # None: send none; the plane's own applies
        wait_ms = timeout_ms or (deadline + 1000 if deadline is not None
                                 else NO_DEADLINE_WAIT_MS)
        payload = body_from_option(body, model, duration_us, max_tokens)
        policy = RetryPolicy(max_attempts=max_attempts) if retry else NO_RETRY
        if stream and arrivals == "even":
            raise ConfigError("--stream sends at Poisson arrivals: leave out --arrivals even")
        load = LoadConfig(rate=rate, duration_s=duration_s, concurrency=concurrency,
                          progress=sys.stderr.isatty() if progress is None else progress,
                          arrivals="poisson" if stream or arrivals == "poisson" else "even",
                          seed=seed)
        if stream and url is not None:
            raise ConfigError("--stream reads streams over NATS: give --nats URL (or "
                              "PLANE_NATS) in place of --url (for HTTP streams, load the "
                              "gateway's SSE with another tool)")
        if url is None:  # said as every command says it
            require_nats(nats_url, or_instead="" if stream else "--url URL of an HTTP "
                         "endpoint to load")
        opts = (make_connect(nats_url, user, password, token, creds, tls_ca, name="pulse")
                if nats_url is not None else None)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    if stream:
        assert opts is not None
        run_stream_pulse(
            opts, model=model, body=payload, load=load, deadline_ms=deadline, timeout_ms=timeout_ms,
            retry=retry, max_attempts=max_attempts, as_json=as_json, out_dir=out_dir,
            stream=StreamOptions(stream_deadline_ms=stream_deadline_ms, seed=seed,
                                 capacity_x=capacity_x, callers=callers,
                                 capacity_s=capacity_s))
        return
    try:
        target: Target
        wait = dict(with_start_wait(None, start_wait_ms) or {})  # --wait-ms: Plane-Wait-Ms
        if url is not None:
            target = HttpTarget(url, deadline_ms=deadline, timeout_ms=wait_ms, policy=policy,
                                concurrency=concurrency, headers={
                                    **_headers(headers), **wait})
        else:
            assert opts is not None  # require_nats above
            target = NatsTarget(opts, model=model, deadline_ms=deadline, policy=policy,
                                wait_ms=wait_ms, headers=wait)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    report = run_on_uvloop(run_pulse(target, payload, load, deadline_ms=deadline))
    if as_json:
        click.echo(to_json(report.summary))
    else:
        print_table(report.summary)
    if out_dir is not None:
        for path in write_out(out_dir, report.run.outcomes, report.summary):
            click.echo(f"wrote {path}", err=True)
    if report.summary.answered == 0:
        sys.exit(EXIT_UNHEALTHY)
