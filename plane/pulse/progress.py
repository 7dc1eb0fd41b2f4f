"""The progress bar of a pulse run (rich, on stderr, so `--json` keeps stdout clean)."""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

if TYPE_CHECKING:
    from plane.pulse.runner import Live


class ProgressBar:
    def __init__(self, total: int) -> None:
        self._progress = Progress(
            TextColumn("[bold]pulse"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[counts]}"),
            console=Console(stderr=True),
            transient=False,
        )
        self._task = self._progress.add_task("pulse", total=total, counts="")

    def update(self, live: Live) -> None:
        counts = (f"in flight {live.in_flight}  ok {live.ok}  429 {live.refused}  "
                  f"dropped {live.dropped}")
        self._progress.update(self._task, completed=live.done + live.dropped, counts=counts)

    def __enter__(self) -> ProgressBar:
        self._progress.start()
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._progress.stop()
