"""Helpers for the operations tests: log lines, /metrics scrapes, a Generate that returns the
request id, and a shared demo cluster with metrics ports."""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from common.pb.kvhandoff.v1 import generate_pb2, generate_pb2_grpc
from tests.helpers.cluster import Cluster, Service, start_cluster


def log_events(service: Service) -> list[dict]:
    """Every JSON line of a service's log (stdout and stderr together)."""
    events = []
    for line in service.log_text().splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return events


def metrics_port(service: Service) -> int:
    """The /metrics port the service logged when it started (it ran with --metrics-port 0)."""
    for event in log_events(service):
        if event.get("event") in ("serving", "listening") and "metrics_port" in event:
            return int(event["metrics_port"])
    raise AssertionError(f"{service.role} logged no metrics port:\n{service.log_text()[-2000:]}")


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one /metrics scrape."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict, name: str, **labels) -> float:
    """The sum over the series of `name` whose labels include `labels` (the others, such as
    model_name, may be anything); 0 when no such series exists yet."""
    wanted = set(labels.items())
    return sum(v for (sample, have), v in samples.items()
               if sample == name and wanted <= set(have))


@dataclass(frozen=True)
class Reply:
    request_id: str
    token_ids: list[int]
    completion_tokens: int


def generate_reply(address: str, token_ids: list[int], max_tokens: int,
                   timeout: float = 120, cache_salt: str = "") -> Reply:
    request = generate_pb2.GenerateRequest(max_tokens=max_tokens, ignore_eos=True,
                                           cache_salt=cache_salt)
    request.token_ids.ids.extend(token_ids)
    tokens: list[int] = []
    reply = None
    with grpc.insecure_channel(address) as channel:
        # read to the end of the stream: leaving after the finished message would cancel the
        # call while decode still logs the request's last phase (request_finished)
        for response in generate_pb2_grpc.GenerationServiceStub(channel).Generate(
                request, timeout=timeout):
            if response.HasField("token"):
                tokens.append(response.token.token_id)
            else:
                reply = Reply(response.finished.request_id, tokens,
                              response.finished.usage.completion_tokens)
    if reply is None:
        raise AssertionError(f"stream ended without a finished message after {tokens}")
    return reply


def start_demo_cluster(workdir: Path, **kwargs) -> Cluster:
    """Demo model, small pools, /metrics on free ports."""
    return start_cluster(workdir, "demo", common_flags=["--pool-tokens", "4096",
                                                        "--metrics-port", "0"], **kwargs)
