"""Prometheus metrics on localhost (``metrics.listen``, default 127.0.0.1:9477).

Components register their own collectors on ``agent.metrics`` (a CollectorRegistry of the
agent's, not the process-global default, so tests can run several agents in one process).
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

log = logging.getLogger("laminar.metrics")


def make_registry() -> CollectorRegistry:
    return CollectorRegistry(auto_describe=True)


class CoreMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.events = Counter("laminar_events_total", "Events emitted, by kind", ["kind"], registry=registry)
        self.up = Gauge("laminar_agent_start_time_seconds", "When this agent process started", registry=registry)
        self.api_requests = Gauge("laminar_api_requests", "Control API requests served", registry=registry)
        self.api_refused = Gauge("laminar_api_refused", "Privileged API calls refused by SO_PEERCRED check",
                                 registry=registry)


def serve(listen: str, registry: CollectorRegistry) -> Any:
    """Starts the HTTP exporter in a daemon thread; returns the server (or None when disabled)."""
    if not listen:
        return None
    host, _, port = listen.rpartition(":")
    server, _thread = start_http_server(int(port), addr=host.strip("[]"), registry=registry)
    log.info("metrics on http://%s/metrics", listen)
    return server
