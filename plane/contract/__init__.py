"""The plane's contract, at the bottom of every import: the names of subjects and headers,
the messages on the wire, errors, configuration and live settings, the shared rules (who
answers a placed request: `ownership`; the service-time model: `budget`) and the small
shared machinery (connections, lifecycle, logs, metrics). It imports nothing of the router,
the node, the freshness path, the tools or the commands (`tests/test_layers.py`)."""
