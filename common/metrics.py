"""Prometheus metrics, one registry per service (no module-global state), names kvhandoff_*."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ServiceMetrics:
    def __init__(self, role: str, pages_total: Callable[[], int], pages_free: Callable[[], int],
                 running: Callable[[], int], waiting: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        labels = {"role": role}
        self._refused = Counter("kvhandoff_refused_total", "Requests and handoffs refused, by reason",
                                ["role", "reason"], registry=r)
        self.role = role
        self._ttft = Histogram("kvhandoff_time_to_first_token_seconds", "Time to first token",
                               buckets=LATENCY_BUCKETS, registry=r)
        self._itl = Histogram("kvhandoff_inter_token_latency_seconds", "Gap between tokens",
                              buckets=LATENCY_BUCKETS, registry=r)
        self._e2e = Histogram("kvhandoff_request_latency_seconds", "End-to-end request latency",
                              buckets=LATENCY_BUCKETS, registry=r)
        self._queue = Histogram("kvhandoff_queue_time_seconds", "Wait for KV pages",
                                buckets=LATENCY_BUCKETS, registry=r)
        self._handoff = Histogram("kvhandoff_handoff_seconds", "Prefill plus KV transfer time",
                                  buckets=LATENCY_BUCKETS, registry=r)
        self._handoff_bytes = Counter("kvhandoff_handoff_bytes_total", "KV payload bytes received",
                                      registry=r)
        for name, doc, fn in [
            ("kvhandoff_pages_total", "Pages in the KV pool", pages_total),
            ("kvhandoff_pages_in_use", "Pages owned by requests",
             lambda: pages_total() - pages_free()),
            ("kvhandoff_running_requests", "Requests in the running batch", running),
            ("kvhandoff_waiting_requests", "Requests waiting for pages", waiting),
        ]:
            Gauge(name, doc, ["role"], registry=r).labels(**labels).set_function(fn)

    def refused(self, reason: str) -> None:
        self._refused.labels(role=self.role, reason=reason).inc()

    def handoff(self, seconds: float, nbytes: int, queue_seconds: float) -> None:
        self._handoff.observe(seconds)
        self._handoff_bytes.inc(nbytes)
        self._queue.observe(queue_seconds)

    def token(self, gap: float, first: bool) -> None:
        (self._ttft if first else self._itl).observe(gap)

    def finished(self, seconds: float) -> None:
        self._e2e.observe(seconds)

    def serve_http(self, host: str, port: int) -> int:
        """Starts the /metrics endpoint; port 0 picks a free one. Returns the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port
