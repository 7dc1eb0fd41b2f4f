"""Which mode Triton launches run in, the lock that keeps the interpreter single-threaded, and
the capture of a request's launches as one CUDA graph.

Checked on triton 3.9: `@triton.jit` reads TRITON_INTERPRET when the decorator runs, and
triton's own library (`tl.sum`, `tl.sigmoid`, ...) is decorated when `triton` is imported.
So the CPU interpreter works only in a process where TRITON_INTERPRET=1 was set before
`import triton`: set it in the environment that starts the process (the kernel tests re-run
themselves in a subprocess when they find triton already imported without it).

The interpreter keeps process-wide state while it runs a grid (the current program id, and
`triton.language` patched to numpy), so two slot threads interpreting at once would trip over
each other: interpreted launches are serialised by `launch_lock()`. Compiled launches take no
lock.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from typing import Any

import triton

# Guards the interpreter's process-wide state (see the module docstring).
_INTERPRETER_LOCK = threading.Lock()
_NO_LOCK = contextlib.nullcontext()


def interpreting() -> bool:
    """True when TRITON_INTERPRET asks for the CPU interpreter (read now, not at import)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def interpreter_ready() -> bool:
    """True when triton was imported with TRITON_INTERPRET=1, so kernels can be interpreted."""
    from triton.runtime.interpreter import InterpretedFunction

    return interpreting() and isinstance(triton.language.standard.sum, InterpretedFunction)


def launch_lock() -> contextlib.AbstractContextManager[object]:
    """Hold this around a launch: the interpreter lock when interpreting, else nothing."""
    return _INTERPRETER_LOCK if interpreting() else _NO_LOCK


def capture_graph(launches: Callable[[], object], stream: Any | None) -> Any:
    """`launches` captured as one `torch.cuda.CUDAGraph`, on `stream` (a slot's lane; None or
    the default stream: torch's own side stream), replayed later on any stream with one
    launch from the host. `thread_local`: other slots' threads may use the GPU meanwhile, and
    only this thread's calls are checked. Raises RuntimeError where the capture fails; the
    caller checks a replay against the launches before it keeps the graph."""
    import torch

    graph = torch.cuda.CUDAGraph()
    if stream is not None and stream == torch.cuda.default_stream(stream.device):
        stream = None  # a capture needs a stream other than the default
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        launches()
    return graph
