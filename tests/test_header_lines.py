"""`plane.contract.header_lines`: the same headers as nats-py's own reader, for any input, and
on the connections the plane makes."""

from __future__ import annotations

import random

from nats.aio.client import Client
from nats.aio.msg import Msg

from plane.contract.config import ConnectOptions
from plane.contract.embedded import EmbeddedNats
from plane.contract.header_lines import REPEATED, parse_header_lines
from plane.contract.natsconn import close, connect
from plane.contract.publish import publish
from tests.plane_fixtures import wait_until

CASES = [
    b"",
    b"\r\n",
    b"Plane-Request-Id: r1\r\nPlane-Deadline-Ms: 1000\r\n\r\n",
    b"A:b\r\nC:\tD \r\n",  # no space after the colon, a tab, a trailing space
    b"no colon here\r\nOk: yes\r\n",
    b": empty name\r\n",
    b"Bad Name: x\r\nBad\tTab: y\r\nSep\x1cName: z\r\n\x1cLead: w\r\n",
    b"Caf\xc3\xa9: x\r\nKey: caf\xc3\xa9\r\nRaw: \xff\xfe\r\n",
    b"Dup: 1\r\nDup: 2\r\n",
    b"  Padded  :  both sides  \r\n",
    b"Colons: a:b:c\r\n",
]


def nats_py_s(raw: bytes) -> dict[str, str]:
    """What nats-py reads, and the names it read more than once (the one thing it drops)."""
    out = Client._parse_header_lines(raw)
    seen: set[str] = set()
    repeated = []
    for line in raw.split(b"\r\n"):  # the names nats-py kept, in their order, counted
        name = line.partition(b":")[0].strip().decode("ascii", "replace")
        if name in out and line.count(b":"):
            if name in seen:
                repeated.append(name)
            seen.add(name)
    return {**out, REPEATED: ", ".join(repeated)} if repeated else out


def test_the_same_as_nats_py_on_known_cases() -> None:
    for raw in CASES:
        assert parse_header_lines(raw) == nats_py_s(raw), raw


def test_names_given_more_than_once_are_named() -> None:
    raw = b"A: 1\r\nPlane-Deadline-Ms: 5\r\nA: 2\r\nPlane-Deadline-Ms: 9000\r\nA: 3\r\n"
    assert parse_header_lines(raw) == {"A": "3", "Plane-Deadline-Ms": "9000",
                                       REPEATED: "A, Plane-Deadline-Ms, A"}
    assert REPEATED not in parse_header_lines(b"Plane Repeated: x\r\n")  # no line makes it


def test_the_same_as_nats_py_on_random_blocks(rng: random.Random) -> None:
    alphabet = [b"a", b"Z", b"-", b":", b" ", b"\t", b"\r", b"\n", b"\r\n", b"\x1c", b"\x0b",
                b"\xc3\xa9", b"\xff", b"0", b"\x00", b"\x85"]
    for _ in range(3000):
        raw = b"".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 40)))
        assert parse_header_lines(raw) == nats_py_s(raw), raw


async def test_the_plane_s_connections_read_headers_with_it() -> None:
    async with EmbeddedNats() as srv:
        nc = await connect(ConnectOptions(url=srv.url, name="headers"))
        try:
            assert nc._parse_header_lines is parse_header_lines  # natsconn.once_up
            got: list[Msg] = []

            async def keep(msg: Msg) -> None:
                got.append(msg)

            await nc.subscribe("h", cb=keep)
            # nats-py would refuse to send a name with a space; the plane's publish does not.
            await publish(nc, "h", b"", {"Plane-Request-Id": "r1", "Bad Name": "x"})
            inbox = nc.new_inbox()
            await nc.subscribe(inbox, cb=keep)
            # A status line and headers: the no-responders answer to a request with headers.
            await nc.publish("nobody.here", b"", reply=inbox, headers={"K": "v"})
            await wait_until(lambda: len(got) == 2, 5, "both messages")
            assert got[0].headers == {"Plane-Request-Id": "r1"}
            assert (got[1].headers or {})["Status"] == "503"
        finally:
            await close(nc)
