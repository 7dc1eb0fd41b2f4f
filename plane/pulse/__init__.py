"""`plane pulse`: an open-loop load tester for the plane (over NATS) and any HTTP endpoint.

    report = await pulse(HttpTarget(url, ...), body, LoadConfig(rate=200, duration_s=10),
                         deadline_ms=1000)
    print(report.summary.verdict)

Streams (`plane pulse --stream`): `pulse_streams(StreamTarget(opts, StreamSpec(...)), body,
LoadConfig(...), capacity_x=2.0, callers=2)`, TTFT/TPOT and issue 14's targets.
"""

from plane.pulse.api import Report, pulse
from plane.pulse.bodies import default_body
from plane.pulse.outcome import Attempts, Outcome
from plane.pulse.plateau import Plateau, detect_plateau
from plane.pulse.runner import LoadConfig, arrival_offsets_s, poisson_offsets_s, run_load
from plane.pulse.series import Second, per_second, percentile_curve
from plane.pulse.stream_api import StreamReport, pulse_streams
from plane.pulse.stream_outcome import StreamOutcome
from plane.pulse.stream_runner import Capacity, closed_loop, run_streams
from plane.pulse.stream_summary import StreamSummary, summarize_streams
from plane.pulse.stream_target import StreamSpec, StreamTarget
from plane.pulse.summary import Signals, Summary, summarize, verdict
from plane.pulse.targets import HttpTarget, NatsTarget, Target

__all__ = [
    "Attempts",
    "Capacity",
    "HttpTarget",
    "LoadConfig",
    "NatsTarget",
    "Outcome",
    "Plateau",
    "Report",
    "Second",
    "Signals",
    "StreamOutcome",
    "StreamReport",
    "StreamSpec",
    "StreamSummary",
    "StreamTarget",
    "Summary",
    "Target",
    "arrival_offsets_s",
    "closed_loop",
    "default_body",
    "detect_plateau",
    "per_second",
    "percentile_curve",
    "poisson_offsets_s",
    "pulse",
    "pulse_streams",
    "run_load",
    "run_streams",
    "summarize",
    "summarize_streams",
    "verdict",
]
