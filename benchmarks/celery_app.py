"""The Celery side of the side-by-side: one task with the plane's `calibrated` compute (a
sleep of `duration_us`, which holds its worker process as a slot holds its SMs).

The app is deliberately unconfigured here (no environment read at import): the worker gets
its broker and result backend from the command line that benchmarks/celery_side_by_side.py
builds, and the adapter there calls `configure(app, url)`.

    celery -b redis://127.0.0.1:PORT/0 --result-backend redis://127.0.0.1:PORT/1 \
        -A benchmarks.celery_app worker --concurrency 4 --prefetch-multiplier 1
"""

from __future__ import annotations

import time

from celery import Celery

TASK_NAME = "plane_bench.calibrated"

app = Celery("plane_bench")
app.conf.update(
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    # One task at a time per worker process, as one request at a time per slot.
    worker_prefetch_multiplier=1,
    task_acks_late=False,
    result_expires=3600,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)


@app.task(name=TASK_NAME)  # type: ignore[untyped-decorator,unused-ignore]  # celery: untyped
def calibrated(duration_us: int) -> dict[str, int]:
    """The same compute as the plane's `calibrated` model: hold the worker for duration_us."""
    time.sleep(duration_us / 1e6)
    return {"duration_us": duration_us}


def configure(broker_url: str, backend_url: str) -> Celery:
    """Point the app at a broker and a result backend (client side)."""
    app.conf.update(broker_url=broker_url, result_backend=backend_url)
    return app
