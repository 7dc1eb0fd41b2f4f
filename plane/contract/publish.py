"""Publishing a message with headers, for the plane's hot path, at a tenth of nats-py's cost.

nats-py's `publish(headers=...)` checks and encodes each header on its own (the key against a
regular expression, both sides stripped and translated, each encoded): ~20 µs for the 6–9
headers of a slot message or an answer, against ~3 µs for a message without headers, and the
router and the node each publish one or two such messages per request
(`benchmarks/publish_headers.py`). Here the header block is made in one pass, with the one
rule that matters for the protocol kept as nats-py keeps it (a CR or LF in a value becomes a
space: keys are the plane's own constants, values its own or read off the wire, where they
cannot hold either, so this never fires in practice, and an answer is never lost to it), and
the command goes to nats-py's own pending buffer and flusher, as `publish` does.

That last step uses three of nats-py's internals (`_send_command`, `_flush_queue`,
`_flush_pending`; nats-py is pinned in pyproject.toml), checked by tests/test_publish.py
against what nats-py itself sends. While the connection is not up (or drains), `publish`
falls back to nats-py's own path, which knows its reconnect buffer's rules.
"""

from __future__ import annotations

from collections.abc import Mapping

from nats.aio.client import Client
from nats.errors import BadSubjectError, MaxPayloadError

from plane.contract.header_lines import parse_header_lines

_BAD_IN_SUBJECT = frozenset(" \t\r\n")
_NEWLINES_TO_SPACES = str.maketrans({"\r": " ", "\n": " "})


def one_value(v: str) -> str:
    """A header value as it goes on the wire: a CR or LF in it becomes a space."""
    return v.translate(_NEWLINES_TO_SPACES) if "\r" in v or "\n" in v else v


def header_block(headers: Mapping[str, str]) -> bytes:
    """`NATS/1.0`, then `Name: value` each, as the protocol wants them."""
    parts = ["NATS/1.0\r\n"]
    parts.extend(f"{k}: {one_value(v)}\r\n" for k, v in headers.items())
    parts.append("\r\n")
    return "".join(parts).encode()


def _check_subject(subject: str) -> None:
    if not subject or not _BAD_IN_SUBJECT.isdisjoint(subject):
        raise BadSubjectError(f"nats: invalid subject {subject!r}")


def command(nc: Client, subject: str, payload: bytes,
            headers: Mapping[str, str] | bytes | None, reply: str = "") -> bytes:
    """The protocol command that publishes `payload` (with `headers`, a mapping or a block
    `header_block` made) to `subject`, checked as nats-py checks a publish (subjects, the
    server's payload limit). Raises as nats-py's `publish` would."""
    _check_subject(subject)
    if reply:
        _check_subject(reply)
    if len(payload) > nc.max_payload:
        raise MaxPayloadError
    if headers is None:
        return b"".join((f"PUB {subject} {reply} {len(payload)}\r\n".encode(), payload, b"\r\n"))
    hdr = headers if isinstance(headers, bytes) else header_block(headers)
    return b"".join((f"HPUB {subject} {reply} {len(hdr)} {len(hdr) + len(payload)}\r\n".encode(),
                     hdr, payload, b"\r\n"))


def append(nc: Client, cmd: bytes) -> bool:
    """`cmd` (from `command`) into the connection's buffer now, with no await: for a hook
    that runs just before the buffer is written (`SoonFlush.before_write`). nats-py's rules
    for a publish that finds the connection closed, or reconnecting with its buffer full,
    drop it (nats-py's `publish` would raise): False then."""
    if nc.is_closed or (not nc.is_connected and (
            nc._max_pending_size <= 0
            or nc._pending_data_size + len(cmd) > nc._max_pending_size)):
        return False
    nc._pending.append(cmd)
    nc._pending_data_size += len(cmd)
    nc.stats["out_msgs"] += 1
    nc.stats["out_bytes"] += len(cmd)
    return True


async def publish(nc: Client, subject: str, payload: bytes,
                  headers: Mapping[str, str] | bytes, reply: str = "") -> None:
    """`nc.publish(subject, payload, reply=reply, headers=headers)`, cheaper. `headers` may
    also come as the block `header_block` makes (or `replies.error_block`)."""
    if not nc.is_connected or nc.is_draining:  # closed, reconnecting: nats-py's rules apply
        await nc.publish(subject, payload, reply=reply, headers=(
            parse_header_lines(headers) if isinstance(headers, bytes) else dict(headers)))
        return
    cmd = command(nc, subject, payload, headers, reply)
    nc.stats["out_msgs"] += 1
    nc.stats["out_bytes"] += len(payload)
    await nc._send_command(cmd)
    if nc._flush_queue is not None and nc._flush_queue.empty():
        await nc._flush_pending()
