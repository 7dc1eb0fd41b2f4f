"""The work of `plane breathe` (its parsing is in `plane.cli`): read the samples, diagnose each
device, print, plot. Exit 0 with a verdict, 1 when no sample could be read."""

from __future__ import annotations

from pathlib import Path

import click

from plane.observe.breathe import diagnose
from plane.observe.breathe_io import (
    SamplesError,
    Trace,
    metrics_reader,
    parse_nvidia_smi_csv,
    plot,
    render,
    sample,
    to_json,
)

EXIT_OK, EXIT_NO_SAMPLES = 0, 1


def read_traces(*, path: str | None, metrics_url: str | None, nvml: bool, device: str | None,
                seconds: float) -> dict[str, Trace]:
    if path is not None:
        traces = parse_nvidia_smi_csv(Path(path).read_text())
        return {d: t for d, t in traces.items() if device is None or d == device}
    if metrics_url is not None:
        return sample(metrics_reader(metrics_url, device), seconds=seconds)
    from gpu_node.telemetry import open_nvml  # pynvml, lazily, only here

    index = int(device or 0)
    reader = open_nvml(index)
    if isinstance(reader, str):
        raise SamplesError(f"no NVML: {reader}")
    try:
        def read() -> dict[str, float]:
            pct = reader.read().utilization_pct
            return {} if pct is None else {str(index): pct}
        return sample(read, seconds=seconds)
    finally:
        reader.close()


def run_breathe(*, path: str | None, metrics_url: str | None, nvml: bool, device: str | None,
                seconds: float, as_json: bool, out: str | None) -> int:
    try:
        traces = read_traces(path=path, metrics_url=metrics_url, nvml=nvml, device=device,
                             seconds=seconds)
    except SamplesError as exc:
        click.echo(f"error: {exc}", err=True)
        return EXIT_NO_SAMPLES
    if not traces:
        click.echo("error: no utilisation samples read"
                   + (" (is the node on CUDA, with --gpu-sample-ms?)" if metrics_url else ""),
                   err=True)
        return EXIT_NO_SAMPLES
    results = [(t, diagnose(t.times_s, t.util_pct, device=d)) for d, t in sorted(traces.items())]
    if as_json:
        click.echo(to_json([b for _, b in results]))
    else:
        click.echo("\n\n".join(render(b) for _, b in results))
    if out is not None:
        plot(Path(out), results)
        click.echo(f"wrote {out}", err=True)
    return EXIT_OK
