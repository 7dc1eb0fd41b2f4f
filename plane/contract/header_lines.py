"""Reading the header lines of a message nats-py receives, at under half its cost.

nats-py's `Client._parse_header_lines` checks every character of every header name for white
space with a generator (`any(c.isspace() for c in key)`): for the nine headers of a slot
message, which a node reads per request, it costs about twice what this does
(`.venv/bin/python benchmarks/header_lines.py`: 12.7 against 5.3 µs in a quiet minute, 17-19
against 9-10 in a busy one), with the same result for any input (`str.split()` splits on
exactly what `str.isspace` calls space; tests/test_header_lines.py checks both against each
other).
A name given twice keeps its last value, as in nats-py, and is named under `REPEATED` (a key
no header line can make: a name with white space inside is skipped), so that a reader can
refuse what it cannot read one way (`plane.contract.headers.read_caller`); nats-py's dict
would have kept only the last.
`use_fast_header_lines(nc)` puts it on one connection (an instance attribute: nats-py's
`_process_headers` reads it through `self`; nats-py is pinned in pyproject.toml).
"""

from __future__ import annotations

from nats.aio.client import Client

_CRLF = b"\r\n"
REPEATED = "Plane Repeated"  # the names given more than once, ", "-joined


def parse_header_lines(raw: bytes) -> dict[str, str]:
    """`Name: value` lines into a dict, as nats-py reads them: a line without a colon, a
    name not ASCII or with white space inside is skipped; values decoded with replacement."""
    out: dict[str, str] = {}
    for line in raw.split(_CRLF):
        name, sep, value = line.partition(b":")
        if not sep:
            continue
        try:
            key = name.strip().decode("ascii")
        except UnicodeDecodeError:
            continue
        if key and key.split() != [key]:  # white space inside the name
            continue
        if key in out:
            out[REPEATED] = f"{out[REPEATED]}, {key}" if REPEATED in out else key
        out[key] = value.strip().decode("utf-8", "replace")
    return out


def use_fast_header_lines(nc: Client) -> Client:
    """Make `nc` read header lines with `parse_header_lines`."""
    nc._parse_header_lines = parse_header_lines  # type: ignore[method-assign]
    return nc
