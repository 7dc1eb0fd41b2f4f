"""Score one transaction with the plane's Python SDK, the way a fraud service would.

    .venv/bin/python examples/score_transaction.py nats://127.0.0.1:4222

Retries a refusal as the server asks (Retry-After, ticket), never past the deadline, and says
what happened. `tests/test_examples.py` runs this file against a real plane.
"""

from __future__ import annotations

import asyncio
import sys

from plane.client import Client, DeadlineExceeded, Rejected, Unavailable


async def main(url: str) -> int:
    features = [0.1 * (i % 7) for i in range(32)]
    async with Client.connect(url) as plane:
        try:
            result = await plane.invoke("risk", {"features": features}, deadline_ms=50)
        except Rejected as exc:
            print(f"refused ({exc.reason}): come back in {exc.retry_after_ms} ms")
            return 1
        except (DeadlineExceeded, Unavailable) as exc:
            print(f"no score: {exc}")
            return 1
    score = result.json()["score"]
    print(f"score {score:.4f} from {result.node} slot {result.slot} "
          f"in {result.attempts} attempt(s)")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1])))
