"""The console the commands print their tables to (`plane status`, `top`, `pulse`).

rich lays a table out for the terminal's width, and for 80 columns when stdout is not a
terminal (a pipe, a file, a CI log): `plane status > status.txt` cut its columns to
"calibr…" and "1000/1…". Off a terminal the tables get room enough for their widest cells
instead (a line longer than 80 columns in a file is no harm; a value cut short is).
`COLUMNS`, when set, still decides, as rich has it.
"""

from __future__ import annotations

import os
import sys

from rich.console import Console

OFF_TERMINAL_WIDTH = 200


def console() -> Console:
    if sys.stdout.isatty() or os.environ.get("COLUMNS"):
        return Console()
    return Console(width=OFF_TERMINAL_WIDTH)
