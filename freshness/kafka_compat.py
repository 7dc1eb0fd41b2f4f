"""A loopback shim that lets librdkafka 2.0 clients (Debian's `kcat`) talk to tansu.

tansu 0.6 answers ApiVersions v3 with every optional tagged field written out (empty
SupportedFeatures, FinalizedFeaturesEpoch -1, ...). That is valid Kafka protocol, but
librdkafka 2.0.2 misreads those tags ("Read underflow ... ApiVersion v3") and gives up on the
broker. The shim forwards bytes both ways and rewrites only that one response, dropping its
trailing tagged fields (all of them optional, all at their defaults). Everything else passes
through untouched; tansu advertises the shim's port so that every connection goes through it.

Used by tests and by `EmbeddedTansu(librdkafka_compat=True)`; aiokafka does not need it.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct

import structlog

from plane.lifecycle import Lifecycle

log = structlog.get_logger("freshness.kafka_compat")

API_VERSIONS = 18
_FRAME = struct.Struct(">i")
_REQ_HEAD = struct.Struct(">hhi")  # api_key, api_version, correlation_id


def _uvarint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7


def strip_api_versions_tags(body: bytes) -> bytes:
    """ApiVersions v3+ response (after the size prefix) without its top-level tagged fields.

    Layout: correlation_id int32, error_code int16, api_keys compact array of (key, min,
    max int16, tagged fields), throttle_time_ms int32, tagged fields.
    """
    i = 4 + 2
    n, i = _uvarint(body, i)
    for _ in range(max(n - 1, 0)):
        i += 6
        tags, i = _uvarint(body, i)
        for _ in range(tags):
            _, i = _uvarint(body, i)
            size, i = _uvarint(body, i)
            i += size
    i += 4
    return body[:i] + b"\x00"


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    (size,) = _FRAME.unpack(await reader.readexactly(4))
    return await reader.readexactly(size)


class ApiVersionsShim(Lifecycle):
    """`async with ApiVersionsShim(upstream_port) as shim:` listens on `shim.port`."""

    def __init__(self, upstream_port: int, *, port: int = 0, host: str = "127.0.0.1") -> None:
        self.upstream_port = upstream_port
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        if self._server is not None:
            return
        self._server = await asyncio.start_server(self._accept, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for task in list(self._conns):
            task.cancel()
        for task in list(self._conns):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if server is not None:
            await server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            await self._serve(reader, writer)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self._conns.discard(task)
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(self.host, self.upstream_port)
        pending: set[int] = set()
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._requests(reader, up_writer, pending))
                tg.create_task(self._responses(up_reader, writer, pending))
        except* (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            up_writer.close()

    @staticmethod
    async def _requests(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pending: set[int]
    ) -> None:
        while True:
            frame = await _read_frame(reader)
            key, version, corr = _REQ_HEAD.unpack_from(frame)
            if key == API_VERSIONS and version >= 3:
                pending.add(corr)
            writer.write(_FRAME.pack(len(frame)) + frame)
            await writer.drain()

    @staticmethod
    async def _responses(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pending: set[int]
    ) -> None:
        while True:
            frame = await _read_frame(reader)
            (corr,) = _FRAME.unpack_from(frame)
            if corr in pending:
                pending.discard(corr)
                frame = strip_api_versions_tags(frame)
            writer.write(_FRAME.pack(len(frame)) + frame)
            await writer.drain()

