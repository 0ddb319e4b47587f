"""Prometheus metrics, one registry per service (no module-global state), names kvhandoff_*.

Every series carries a `role` label (prefill or decode) and a `model_name` label (the --model
setting), so dashboards can aggregate scrapes of both services, and of several models, without
relabelling. Units are in the names (_seconds, _bytes, _tokens, _ratio); counters, and only
counters, end in _total, so `promtool check metrics` is clean. The decode metrics follow vLLM's
(time to first token, time per output token, inter-token latency, end-to-end latency, KV-cache
usage, prompt and generation tokens, their per-request histograms, requests by finish reason),
so dashboards built for vLLM map one to one; docs/operations.md lists every series.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily

from common.server.ports import check_port_free, port_error
from common.counters import Counters

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# A decode step's wall time: from under a millisecond (a small model on a GPU) to a long batch.
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1,
                0.25, 0.5, 1)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                 100000, 200000)
# Why a request that was admitted ended: the proto's finish reasons, a client that went away or
# hit its deadline, or an error after admission (refusals before it are kvhandoff_refused_total).
FINISH_REASONS = ("stop", "length", "cancelled", "error")
# Why decode asked for a handoff again on another prefill replica (decode_svc/handoff_retry.py).
RETRY_REASONS = ("transport", "refused")


class _CountersCollector:
    """Exports a service's StatsService counters (written by its engine thread) at scrape
    time as kvhandoff_engine_events_total{role, model_name, event}; every scrape sees every
    counter."""

    def __init__(self, labels: tuple[str, str], counters: Counters) -> None:
        self.labels = labels  # (role, model_name)
        self.counters = counters

    def collect(self):
        family = CounterMetricFamily("kvhandoff_engine_events", "Engine events by kind "
                                     "(the StatsService counters)",
                                     labels=["role", "model_name", "event"])
        for event, value in sorted(self.counters.snapshot().items()):
            family.add_metric([*self.labels, event], value)
        yield family


class ServiceMetrics:
    """One service's metrics. The callables are read at scrape time on the HTTP thread, so
    they must be safe to call from any thread (they read counters, never the GPU)."""

    def __init__(self, role: str, pages_total: Callable[[], int], pages_free: Callable[[], int],
                 running: Callable[[], int], waiting: Callable[[], int], *,
                 model_name: str = "", counters: Counters | None = None,
                 limits: Mapping[str, Callable[[], int]] | None = None,
                 gauges: Mapping[str, tuple[str, Callable[[], int]]] | None = None) -> None:
        """limits: gauges named kvhandoff_<key> (e.g. max_prompt_tokens, pool_tokens);
        gauges: more gauges, kvhandoff_<key> -> (help text, value), e.g. the prefix cache's.
        pages_free counts what a new request can get (on prefill: free pages and cached pages
        no request reads)."""
        self.role = role
        self.registry = r = CollectorRegistry()
        names = ["role", "model_name"]
        own = (role, model_name)

        def histogram(name: str, doc: str, buckets=LATENCY_BUCKETS) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=r).labels(*own)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=r).labels(*own)

        def usage() -> float:
            total = pages_total()
            return (total - pages_free()) / total if total else 0.0

        for name, doc, fn in [
            ("kvhandoff_pool_pages", "Pages in the KV pool", pages_total),
            ("kvhandoff_pages_in_use", "Pages held by requests (on prefill including the "
             "cached pages they read)",
             lambda: pages_total() - pages_free()),
            ("kvhandoff_kv_cache_usage_ratio", "Fraction of the KV pool's pages owned by "
             "requests, 0 to 1 (vLLM: kv_cache_usage_perc)", usage),
            ("kvhandoff_running_requests", "Requests being computed (decode: in the running "
             "batch)", running),
            ("kvhandoff_waiting_requests", "Requests waiting for KV pages or a batch", waiting),
        ]:
            Gauge(name, doc, names, registry=r).labels(*own).set_function(fn)
        self._refused = Counter("kvhandoff_refused_total", "Requests and handoffs refused, by "
                                "reason (the ErrorInfo reason the client sees)",
                                [*names, "reason"], registry=r)
        self._own = own
        self._handoff = histogram("kvhandoff_handoff_seconds", "KV handoff time: on decode from "
                                  "the reservation to the verified commit, on prefill from the "
                                  "header to the commit sent")
        self._handoff_bytes = counter("kvhandoff_handoff_bytes_total", "KV payload bytes handed "
                                      "off (received on decode, sent on prefill)")
        self._queue = histogram("kvhandoff_queue_time_seconds", "Wait before compute: on decode "
                                "for KV pages, on prefill for a batch with room")
        if role == "decode":
            self._ttft = histogram("kvhandoff_time_to_first_token_seconds",
                                   "From request received to the first token sent")
            self._itl = histogram("kvhandoff_inter_token_latency_seconds",
                                  "Gap between consecutive tokens of a request")
            self._tpot = histogram("kvhandoff_time_per_output_token_seconds",
                                   "Per finished request with two or more tokens: time from "
                                   "its first token to its last over the tokens after the first")
            self._e2e = histogram("kvhandoff_e2e_request_latency_seconds",
                                  "From request received to the final message sent")
            self._prompt_tokens = counter("kvhandoff_prompt_tokens_total", "Prompt tokens of "
                                          "the requests admitted (their KV received)")
            self._generation_tokens = counter("kvhandoff_generation_tokens_total",
                                              "Tokens generated and sent")
            self._prompt_len = histogram("kvhandoff_request_prompt_tokens", "Prompt length of "
                                         "each finished request", TOKEN_BUCKETS)
            self._generation_len = histogram("kvhandoff_request_generation_tokens", "Tokens "
                                             "generated by each finished request", TOKEN_BUCKETS)
            self._finished = Counter("kvhandoff_requests_finished_total", "Admitted requests "
                                     "by how they ended: stop, length, cancelled (client gone "
                                     "or deadline), error", [*names, "finished_reason"],
                                     registry=r)
            for reason in FINISH_REASONS:  # every reason exported from the start, at 0
                self._finished.labels(*own, reason)
            self._retried = Counter("kvhandoff_handoff_retried_total", "Handoffs asked again "
                                    "on another prefill replica before any token was sent, by "
                                    "why: transport or refused", [*names, "reason"], registry=r)
            for reason in RETRY_REASONS:
                self._retried.labels(*own, reason)
            self._step = Histogram("kvhandoff_decode_step_seconds", "Wall time of one decode "
                                   "step of the running batch, by the torch threads it ran "
                                   "on (more than the service's own while it borrows its "
                                   "peer's cores)", [*names, "threads"], buckets=STEP_BUCKETS,
                                   registry=r)
            self._step_rows = histogram("kvhandoff_decode_step_rows", "Sequences in the running "
                                        "batch of each decode step", ROW_BUCKETS)
            self._ejected = counter("kvhandoff_prefill_ejected_total", "Prefill replicas "
                                    "ejected from the choice by their circuit breaker")
        else:
            self._prefill = histogram("kvhandoff_prefill_seconds",
                                      "Forward pass time of the batch that held the request")
            self._prefill_tokens = counter("kvhandoff_prefill_tokens_total", "Prompt tokens "
                                           "prefilled")
        if counters is not None:
            r.register(_CountersCollector(own, counters))
        for key, fn in (limits or {}).items():
            Gauge(f"kvhandoff_{key}", f"Effective limit: {key.replace('_', ' ')}", names,
                  registry=r).labels(*own).set_function(fn)
        for key, (doc, fn) in (gauges or {}).items():
            Gauge(f"kvhandoff_{key}", doc, names, registry=r).labels(*own).set_function(fn)

    def refused(self, reason: str) -> None:
        self._refused.labels(*self._own, reason).inc()

    def handoff(self, seconds: float, nbytes: int, queue_seconds: float | None = None) -> None:
        """One completed handoff; decode passes its page wait as queue_seconds, prefill
        records its queue time separately with `queued`."""
        self._handoff.observe(seconds)
        self._handoff_bytes.inc(nbytes)
        if queue_seconds is not None:
            self._queue.observe(queue_seconds)

    def queued(self, seconds: float) -> None:
        self._queue.observe(seconds)

    def admitted(self, prompt_tokens: int) -> None:
        """Decode: a request's KV arrived and was verified; it joins the batch."""
        self._prompt_tokens.inc(prompt_tokens)

    def token(self, gap: float, first: bool) -> None:
        """Decode: one token sent; gap since the request arrived (first token) or since the
        previous token."""
        (self._ttft if first else self._itl).observe(gap)
        self._generation_tokens.inc()

    def finished(self, seconds: float, reason: str = "stop", prompt_tokens: int = 0,
                 completion_tokens: int = 0, decode_seconds: float = 0.0) -> None:
        """Decode: a request that completed with finish reason stop or length, after
        `seconds` end to end, of which decode_seconds from its first token to its last."""
        self._e2e.observe(seconds)
        self._finished.labels(*self._own, reason).inc()
        self._prompt_len.observe(prompt_tokens)
        self._generation_len.observe(completion_tokens)
        if completion_tokens > 1:
            self._tpot.observe(decode_seconds / (completion_tokens - 1))

    def ended(self, reason: str) -> None:
        """Decode: an admitted request that did not complete: cancelled or error."""
        self._finished.labels(*self._own, reason).inc()

    def retried(self, reason: str) -> None:
        """Decode: a handoff asked again on another prefill replica (reason: RETRY_REASONS)."""
        self._retried.labels(*self._own, reason).inc()

    def decode_step(self, seconds: float, rows: int, threads: int) -> None:
        """Decode: one step of the running batch (rows sequences) took seconds on threads torch
        threads. Called on the engine thread."""
        self._step.labels(*self._own, str(threads)).observe(seconds)
        self._step_rows.observe(rows)

    def ejected(self) -> None:
        """Decode: a prefill replica's circuit breaker opened."""
        self._ejected.inc()

    def prefill(self, seconds: float, tokens: int, requests: int = 1) -> None:
        """Prefill: one forward pass over `requests` prompts totalling `tokens` tokens."""
        for _ in range(requests):
            self._prefill.observe(seconds)
        self._prefill_tokens.inc(tokens)

    def serve_http(self, host: str, port: int) -> int:
        """Starts the /metrics endpoint; port 0 picks a free one. Returns the bound port; a
        taken port raises PortUnavailable naming it."""
        check_port_free(host, port, "--metrics-port")
        try:
            server, _thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as err:
            raise port_error(host, port, "--metrics-port", err) from err
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

    def admitted(self, prompt_tokens: int) -> None:
        pass

    def token(self, gap: float, first: bool) -> None:
        pass

    def finished(self, seconds: float, reason: str = "stop", prompt_tokens: int = 0,
                 completion_tokens: int = 0, decode_seconds: float = 0.0) -> None:
        pass

    def ended(self, reason: str) -> None:
        pass

    def retried(self, reason: str) -> None:
        pass

    def ejected(self) -> None:
        pass


def capacity_gauges(capacity, max_prompt_tokens: Callable[[], int]) -> dict[str, Callable[[], int]]:
    """The limits a service enforces, as gauges: pool size, context window, prompt limit."""
    return {"pool_tokens": lambda: capacity.pool_tokens,
            "context_window_tokens": lambda: capacity.context_window,
            "max_prompt_tokens": max_prompt_tokens}
