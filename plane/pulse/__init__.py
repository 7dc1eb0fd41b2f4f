"""`plane pulse`: an open-loop load tester for the plane (over NATS) and any HTTP endpoint.

    report = await pulse(HttpTarget(url, ...), body, LoadConfig(rate=200, duration_s=10),
                         deadline_ms=1000)
    print(report.summary.verdict)
"""

from plane.pulse.api import Report, pulse
from plane.pulse.bodies import default_body
from plane.pulse.outcome import Attempts, Outcome
from plane.pulse.plateau import Plateau, detect_plateau
from plane.pulse.runner import LoadConfig, arrival_offsets_s, run_load
from plane.pulse.series import Second, per_second, percentile_curve
from plane.pulse.summary import Signals, Summary, summarize, verdict
from plane.pulse.targets import HttpTarget, NatsTarget, Target

__all__ = [
    "Attempts",
    "HttpTarget",
    "LoadConfig",
    "NatsTarget",
    "Outcome",
    "Plateau",
    "Report",
    "Second",
    "Signals",
    "Summary",
    "Target",
    "arrival_offsets_s",
    "default_body",
    "detect_plateau",
    "per_second",
    "percentile_curve",
    "pulse",
    "run_load",
    "summarize",
    "verdict",
]
