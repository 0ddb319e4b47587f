"""A real decode process pointed at the conformance suite's fake prefill, which runs in this
test process on a background event loop (the loop that made a grpc object is the only loop that
uses it). The fake proxies a real reference prefill; cases are played one at a time."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from conformance.decode_script import DecodeCase
from conformance.decode_suite import CaseRun, DecodeTarget, open_target, play
from conformance.fake_prefill import FakePrefill
from tests.helpers.cluster import Service, start_service

DECODE_FLAGS = ["--model", "demo", "--pool-tokens", "1024", "--max-context-tokens", "512",
                "--max-chunk-bytes", "16384", "--metrics-port", "0", "--handoff-timeout-s", "5"]
PREFILL_FLAGS = ["--model", "demo", "--pool-tokens", "1024", "--max-context-tokens", "512"]


class BackgroundLoop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fake-prefill",
                                        daemon=True)
        self._thread.start()

    def run(self, coro, timeout: float = 180.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


class DecodeHarness:
    def __init__(self, workdir: Path, decode_flags: tuple[str, ...] = (),
                 prefill_flags: tuple[str, ...] = ()) -> None:
        self.bg = BackgroundLoop()
        self.prefill: Service | None = None
        self.decode: Service | None = None
        self.target: DecodeTarget | None = None
        try:
            self.prefill = start_service("prefill", workdir / "prefill",
                                         [*PREFILL_FLAGS, *prefill_flags])
            self.fake = FakePrefill(self.prefill.address)
            fake_port = self.bg.run(self.fake.start("127.0.0.1:0"))
            self.decode = start_service("decode", workdir / "decode", [
                *DECODE_FLAGS, *decode_flags, "--prefill", f"127.0.0.1:{fake_port}"])
            self.target = self.bg.run(open_target(self.decode.address, self.fake, timeout=60,
                                                  settle_timeout=15, wait=60))
            self.metrics_url = f"http://127.0.0.1:{self._metrics_port()}/metrics"
        except Exception:
            self.close()
            raise

    def play(self, case: DecodeCase) -> CaseRun:
        return self.bg.run(play(self.target, case))

    def pool_problem(self) -> str | None:
        """None when decode's pool is back at its idle reading (pages_free == pages_total)."""
        problem = self.bg.run(self.target.pool.settled(15))
        base = self.target.pool.baseline
        if problem is None and base.pages_free != base.pages_total:
            return f"idle reading was not a free pool: {base}"
        return problem

    def log_events(self, event: str, request_id: str) -> list[dict]:
        lines = []
        for line in self.decode.log_text().splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                if record.get("event") == event and record.get("request_id") == request_id:
                    lines.append(record)
        return lines

    def stats_counters(self) -> dict[str, int]:
        """decode's StatsService counters."""
        from common.pb.kvhandoff.v1 import stats_pb2, stats_pb2_grpc

        async def read():
            stub = stats_pb2_grpc.StatsServiceStub(self.target.channel)
            return await stub.GetStats(stats_pb2.GetStatsRequest(), timeout=10)

        return dict(self.bg.run(read()).counters)

    def refused_counts(self) -> dict[str, float]:
        """kvhandoff_refused_total{role="decode"} by reason, scraped from /metrics."""
        with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
            text = response.read().decode()
        counts = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if (sample.name == "kvhandoff_refused_total"
                        and sample.labels.get("role") == "decode"):
                    counts[sample.labels["reason"]] = sample.value
        return counts

    def _metrics_port(self) -> int:
        for line in self.decode.log_text().splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                if record.get("event") == "listening":
                    return int(record["metrics_port"])
        raise AssertionError("decode logged no 'listening' line with its metrics_port")

    def close(self) -> None:
        if self.target is not None:
            self.bg.run(self.target.channel.close())
        if getattr(self, "fake", None) is not None:
            self.bg.run(self.fake.stop())
        for service in (self.decode, self.prefill):
            if service is not None:
                service.stop()
        self.bg.close()
