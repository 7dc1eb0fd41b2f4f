"""The floor: a bare core-NATS responder with nats-py (echo), the least any plane can cost."""

from __future__ import annotations

import asyncio
import sys

import nats
from nats.aio.msg import Msg


async def main(url: str, subject: str) -> None:
    nc = await nats.connect(url)

    async def echo(msg: Msg) -> None:
        await msg.respond(msg.data)

    await nc.subscribe(subject, cb=echo)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
