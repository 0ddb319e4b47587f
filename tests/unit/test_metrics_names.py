"""The metrics registry of each role, without a service: `promtool check metrics` finds nothing
to complain about, and the series dashboards built for vLLM expect exist and move."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from common.counters import Counters
from common.metrics import FINISH_REASONS, ServiceMetrics


def _counters(**values: int) -> Counters:
    counters = Counters()
    for name, value in values.items():
        counters.add(name, value)
    return counters


def build(role: str) -> ServiceMetrics:
    """Ten pages, three in use; one of every event the role records."""
    metrics = ServiceMetrics(role, lambda: 10, lambda: 7, lambda: 1, lambda: 2,
                             model_name="demo", counters=_counters(forward_passes=4),
                             limits={"pool_tokens": lambda: 160})
    metrics.refused("TOKEN_OUT_OF_VOCAB")
    metrics.handoff(0.01, 4096, 0.001)
    if role == "decode":
        metrics.admitted(5)
        metrics.token(0.2, first=True)
        for _ in range(3):
            metrics.token(0.05, first=False)
        metrics.finished(0.5, "length", 5, 4, 0.15)
        metrics.ended("cancelled")
        metrics.decode_step(0.007, 8, 1)
        metrics.decode_step(0.005, 8, 2)
        metrics.decode_step(0.004, 1, 1)
    else:
        metrics.queued(0.002)
        metrics.prefill(0.03, 5)
    return metrics


def samples(metrics: ServiceMetrics) -> dict[tuple[str, tuple], float]:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_promtool_check_metrics_is_clean(role):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    text = generate_latest(build(role).registry)
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                            timeout=60, check=False)
    assert result.returncode == 0, (result.stdout + result.stderr).decode()


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_every_series_names_role_and_model(role):
    got = samples(build(role))
    assert got
    for name, labels in got:
        assert ("role", role) in labels and ("model_name", "demo") in labels, (name, labels)


def test_decode_exports_the_vllm_style_series():
    got = samples(build("decode"))

    def value(name: str, **extra) -> float:
        labels = tuple(sorted({"role": "decode", "model_name": "demo", **extra}.items()))
        assert (name, labels) in got, (name, sorted(n for n, _ in got))
        return got[(name, labels)]

    assert value("kvhandoff_kv_cache_usage_ratio") == pytest.approx(0.3)
    assert value("kvhandoff_pool_pages") == 10
    assert value("kvhandoff_prompt_tokens_total") == 5
    assert value("kvhandoff_generation_tokens_total") == 4
    assert value("kvhandoff_request_prompt_tokens_count") == 1
    assert value("kvhandoff_request_prompt_tokens_sum") == 5
    assert value("kvhandoff_request_generation_tokens_sum") == 4
    assert value("kvhandoff_time_per_output_token_seconds_count") == 1
    assert value("kvhandoff_time_per_output_token_seconds_sum") == pytest.approx(0.05)
    assert value("kvhandoff_requests_finished_total", finished_reason="length") == 1
    assert value("kvhandoff_requests_finished_total", finished_reason="cancelled") == 1
    for reason in FINISH_REASONS:
        value("kvhandoff_requests_finished_total", finished_reason=reason)
    assert value("kvhandoff_decode_step_seconds_count", threads="1") == 2
    assert value("kvhandoff_decode_step_seconds_sum", threads="1") == pytest.approx(0.011)
    assert value("kvhandoff_decode_step_seconds_count", threads="2") == 1
    assert value("kvhandoff_decode_step_seconds_bucket", threads="2", le="0.006") == 1
    assert value("kvhandoff_decode_step_seconds_bucket", threads="2", le="0.004") == 0
    assert value("kvhandoff_decode_step_rows_sum") == 17
    assert value("kvhandoff_decode_step_rows_bucket", le="4.0") == 1


def test_usage_of_an_empty_pool_is_zero():
    metrics = ServiceMetrics("prefill", lambda: 0, lambda: 0, lambda: 0, lambda: 0,
                             model_name="demo")
    key = ("kvhandoff_kv_cache_usage_ratio", (("model_name", "demo"), ("role", "prefill")))
    assert samples(metrics)[key] == 0


def test_docs_list_every_metric():
    """docs/operations.md names every series either role exports (limits as the services
    register them)."""
    from common.metrics import capacity_gauges
    from tests.helpers.cluster import REPO

    docs = (REPO / "docs" / "operations.md").read_text()
    limits = capacity_gauges(type("Capacity", (), {"pool_tokens": 1, "context_window": 1})(),
                             lambda: 1)
    missing = []
    for role in ("prefill", "decode"):
        metrics = ServiceMetrics(role, lambda: 1, lambda: 1, lambda: 0, lambda: 0,
                                 counters=_counters(x=1), limits=limits)
        for family in metrics.registry.collect():
            name = family.name + ("_total" if family.type == "counter" else "")
            if f"`{name}" not in docs:
                missing.append(name)
    assert missing == []
