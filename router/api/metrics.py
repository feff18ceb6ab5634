"""``GET /metrics`` and the HTTP side of the metrics: every request counted and timed by its route. The metrics
themselves: router/core/metrics.py."""

from __future__ import annotations

import time

from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import Response

from router.core.metrics import Metrics


def exposition(metrics: Metrics) -> Response:
    body, media_type = metrics.exposition()
    return Response(body, media_type=media_type)


class RequestMetrics(BaseHTTPMiddleware):
    """Counts and times every HTTP request by its route's path template (``/v1/videos/{video_id}``)."""

    def __init__(self, app, metrics: Metrics):
        super().__init__(app)
        self.metrics = metrics

    async def dispatch(self, request: Request, call_next):
        t0 = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")
        endpoint = getattr(route, "path", None) or "unmatched"
        self.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        self.metrics.request_seconds.labels(endpoint).observe(time.perf_counter() - t0)
        return response
