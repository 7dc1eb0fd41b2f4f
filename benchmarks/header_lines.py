"""What reading a message's header lines costs: nats-py's `Client._parse_header_lines`
against `plane.contract.header_lines.parse_header_lines`, on the headers of a slot message.

    .venv/bin/python benchmarks/header_lines.py [--messages 100000] [--rounds 3]

Pure CPU, no server: each reader parses the same header block (the nine headers a router
puts on a slot message, which a node reads per request) `--messages` times per round, in
turn. Prints µs per message (process time).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import click
from nats.aio.client import Client

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from plane.contract.header_lines import parse_header_lines

BLOCK = (b"Plane-Reply-To: _INBOX.4CXDPkS4rtQlr9h57auJqo.12345\r\n"
         b"Plane-Request-Id: 01JDXYZABCDEFGHJKMNPQRSTVW\r\nPlane-Deadline-At: 1764612345678\r\n"
         b"Plane-Deadline-Ms: 1000\r\nPlane-Work-Us: 0\r\nPlane-Router: router-1\r\n"
         b"Plane-Attempt: 1\r\nNats-TTL: 11s\r\nPlane-Tenant: acme\r\n\r\n")


def _per_message(messages: int, parse: Callable[[bytes], dict[str, str]]) -> float:
    cpu0 = time.process_time()
    for _ in range(messages):
        parse(BLOCK)
    return (time.process_time() - cpu0) / messages * 1e6


@click.command()
@click.option("--messages", default=100_000, show_default=True)
@click.option("--rounds", default=3, show_default=True)
def main(messages: int, rounds: int) -> None:
    """nats-py's header reader against the plane's."""
    readers: dict[str, Callable[[bytes], dict[str, str]]] = {
        "nats-py Client._parse_header_lines": Client._parse_header_lines,
        "plane.contract.header_lines": parse_header_lines,
    }
    assert len({str(parse(BLOCK)) for parse in readers.values()}) == 1
    print(f"{messages} header blocks of 9 headers per reader and round, Python "
          f"{sys.version.split()[0]}")
    print("| reader | round | CPU µs per message |\n| --- | --- | --- |")
    for r in range(rounds):
        for name, parse in readers.items():
            print(f"| {name} | {r + 1} | {_per_message(messages, parse):.2f} |")


if __name__ == "__main__":
    main()
