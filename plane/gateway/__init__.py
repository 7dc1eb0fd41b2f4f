"""`plane gateway`: HTTP in front of the plane, statuses and headers mapped one to one."""

from plane.gateway.app import build_app, http_headers
from plane.gateway.config import GatewayConfig
from plane.gateway.metrics import GatewayMetrics
from plane.gateway.server import Gateway

__all__ = ["Gateway", "GatewayConfig", "GatewayMetrics", "build_app", "http_headers"]
