"""Which mode Triton launches run in, and the lock that keeps the interpreter single-threaded.

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
