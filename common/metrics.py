"""Prometheus metrics, one registry per service (no module-global state), names kvhandoff_*.

Every series carries a `role` label (prefill or decode) so dashboards can aggregate scrapes of
both services without relabelling. Units are in the names (_seconds, _bytes); counters end in
_total. Both roles: pages total and in use, running and waiting requests, refusals by reason,
handoff seconds and bytes, queue time, engine event counters. Decode adds time to first token,
inter-token latency and end-to-end request latency; prefill adds prefill seconds and tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily

from common.counters import Counters

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _CountersCollector:
    """Exports a service's StatsService counters (written by its engine thread) at scrape
    time as kvhandoff_engine_events_total{role, event}; every scrape sees every counter."""

    def __init__(self, role: str, counters: Counters) -> None:
        self.role = role
        self.counters = counters

    def collect(self):
        family = CounterMetricFamily("kvhandoff_engine_events", "Engine events by kind "
                                     "(the StatsService counters)", labels=["role", "event"])
        for event, value in sorted(self.counters.snapshot().items()):
            family.add_metric([self.role, event], value)
        yield family


class ServiceMetrics:
    """One service's metrics. The callables are read at scrape time on the HTTP thread, so
    they must be safe to call from any thread (they read counters, never the GPU)."""

    def __init__(self, role: str, pages_total: Callable[[], int], pages_free: Callable[[], int],
                 running: Callable[[], int], waiting: Callable[[], int], *,
                 counters: Counters | None = None,
                 limits: Mapping[str, Callable[[], int]] | None = None) -> None:
        """limits: gauges named kvhandoff_<key> (e.g. max_prompt_tokens, pool_tokens)."""
        self.role = role
        self.registry = r = CollectorRegistry()

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, ["role"], buckets=LATENCY_BUCKETS,
                             registry=r).labels(role)

        for name, doc, fn in [
            ("kvhandoff_pages_total", "Pages in the KV pool", pages_total),
            ("kvhandoff_pages_in_use", "Pages owned by requests",
             lambda: pages_total() - pages_free()),
            ("kvhandoff_running_requests", "Requests being computed (decode: in the running "
             "batch)", running),
            ("kvhandoff_waiting_requests", "Requests waiting for KV pages or a batch", waiting),
        ]:
            Gauge(name, doc, ["role"], registry=r).labels(role).set_function(fn)
        self._refused = Counter("kvhandoff_refused_total", "Requests and handoffs refused, by "
                                "reason (the ErrorInfo reason the client sees)",
                                ["role", "reason"], registry=r)
        self._handoff = histogram("kvhandoff_handoff_seconds", "KV handoff time: on decode from "
                                  "the reservation to the verified commit, on prefill from the "
                                  "header to the commit sent")
        self._handoff_bytes = Counter("kvhandoff_handoff_bytes_total", "KV payload bytes handed "
                                      "off (received on decode, sent on prefill)", ["role"],
                                      registry=r).labels(role)
        self._queue = histogram("kvhandoff_queue_time_seconds", "Wait before compute: on decode "
                                "for KV pages, on prefill for a batch with room")
        if role == "decode":
            self._ttft = histogram("kvhandoff_time_to_first_token_seconds",
                                   "From request received to the first token sent")
            self._itl = histogram("kvhandoff_inter_token_latency_seconds",
                                  "Gap between consecutive tokens of a request")
            self._e2e = histogram("kvhandoff_e2e_request_latency_seconds",
                                  "From request received to the final message sent")
        else:
            self._prefill = histogram("kvhandoff_prefill_seconds",
                                      "Forward pass time of the batch that held the request")
            self._prefill_tokens = Counter("kvhandoff_prefill_tokens_total", "Prompt tokens "
                                           "prefilled", ["role"], registry=r).labels(role)
        if counters is not None:
            r.register(_CountersCollector(role, counters))
        for key, fn in (limits or {}).items():
            Gauge(f"kvhandoff_{key}", f"Effective limit: {key.replace('_', ' ')}", ["role"],
                  registry=r).labels(role).set_function(fn)

    def refused(self, reason: str) -> None:
        self._refused.labels(role=self.role, reason=reason).inc()

    def handoff(self, seconds: float, nbytes: int, queue_seconds: float | None = None) -> None:
        """One completed handoff; decode passes its page wait as queue_seconds, prefill
        records its queue time separately with `queued`."""
        self._handoff.observe(seconds)
        self._handoff_bytes.inc(nbytes)
        if queue_seconds is not None:
            self._queue.observe(queue_seconds)

    def queued(self, seconds: float) -> None:
        self._queue.observe(seconds)

    def token(self, gap: float, first: bool) -> None:
        """Decode: gap since the request arrived (first token) or since the previous token."""
        (self._ttft if first else self._itl).observe(gap)

    def finished(self, seconds: float) -> None:
        """Decode: end-to-end latency of a request that completed."""
        self._e2e.observe(seconds)

    def prefill(self, seconds: float, tokens: int, requests: int = 1) -> None:
        """Prefill: one forward pass over `requests` prompts totalling `tokens` tokens."""
        for _ in range(requests):
            self._prefill.observe(seconds)
        self._prefill_tokens.inc(tokens)

    def serve_http(self, host: str, port: int) -> int:
        """Starts the /metrics endpoint; port 0 picks a free one. Returns the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port


class NullMetrics:
    """Records nothing: for engines and servicers built outside a service (tests, benches)."""

    def refused(self, reason: str) -> None:
        pass

    def handoff(self, seconds: float, nbytes: int, queue_seconds: float | None = None) -> None:
        pass

    def queued(self, seconds: float) -> None:
        pass

    def prefill(self, seconds: float, tokens: int, requests: int = 1) -> None:
        pass

    def token(self, gap: float, first: bool) -> None:
        pass

    def finished(self, seconds: float) -> None:
        pass


def capacity_gauges(capacity, max_prompt_tokens: Callable[[], int]) -> dict[str, Callable[[], int]]:
    """The limits a service enforces, as gauges: pool size, context window, prompt limit."""
    return {"pool_tokens": lambda: capacity.pool_tokens,
            "context_window_tokens": lambda: capacity.context_window,
            "max_prompt_tokens": max_prompt_tokens}
