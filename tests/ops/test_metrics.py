"""Prometheus /metrics on both services: the documented names exist, and a generation moves
the counters and histograms by exactly what it did."""

from __future__ import annotations

import shutil
import subprocess
import urllib.request

import grpc
import pytest

from common.handoff.layout import KvLayout, torch_dtype
from common.pb.kvhandoff.v1 import handoff_pb2
from tests.helpers.cluster import handoff_stub
from tests.ops.helpers import generate_reply, metrics_port, scrape, value

pytestmark = pytest.mark.slow

COMMON = ["kvhandoff_pool_pages", "kvhandoff_pages_in_use", "kvhandoff_running_requests",
          "kvhandoff_waiting_requests", "kvhandoff_handoff_seconds_count",
          "kvhandoff_handoff_bytes_total", "kvhandoff_queue_time_seconds_count"]
DECODE_ONLY = ["kvhandoff_time_to_first_token_seconds_count",
               "kvhandoff_inter_token_latency_seconds_count",
               "kvhandoff_e2e_request_latency_seconds_count"]
PREFILL_ONLY = ["kvhandoff_prefill_seconds_count", "kvhandoff_prefill_tokens_total"]
PROMPT = list(range(5, 5 + 21))  # 21 tokens: one page plus a remainder at page size 16
NEW_TOKENS = 6


def _kv_bytes(prefill_address: str, tokens: int) -> int:
    """K plus V bytes of `tokens` tokens over all layers, from prefill's advertised layout."""
    with grpc.insecure_channel(prefill_address) as channel:
        info = handoff_stub(channel).GetPrefillInfo(handoff_pb2.GetPrefillInfoRequest(),
                                                    timeout=10)
    p = info.layout
    layout = KvLayout(p.num_layers, p.num_kv_heads, p.head_dim, torch_dtype(p.dtype))
    return tokens * layout.kv_bytes_per_token


def _delta(before: dict, after: dict, name: str, role: str) -> float:
    return value(after, name, role=role) - value(before, name, role=role)


def test_metric_names_are_exposed_with_units(ops_cluster):
    for service, names in ((ops_cluster.decode, COMMON + DECODE_ONLY),
                           (ops_cluster.prefill, COMMON + PREFILL_ONLY)):
        samples = scrape(metrics_port(service))
        present = {name for name, _labels in samples}
        assert set(names) <= present, (service.role, sorted(set(names) - present))
        assert value(samples, "kvhandoff_pool_pages", role=service.role) > 0


def test_decode_metrics_move_with_a_generation(ops_cluster):
    port = metrics_port(ops_cluster.decode)
    before = scrape(port)
    reply = generate_reply(ops_cluster.address, PROMPT, NEW_TOKENS)
    ops_cluster.assert_pools_at_baseline()
    after = scrape(port)
    assert reply.completion_tokens == NEW_TOKENS
    d = lambda name: _delta(before, after, name, "decode")  # noqa: E731
    assert d("kvhandoff_time_to_first_token_seconds_count") == 1
    assert d("kvhandoff_inter_token_latency_seconds_count") == NEW_TOKENS - 1
    assert d("kvhandoff_e2e_request_latency_seconds_count") == 1
    assert d("kvhandoff_queue_time_seconds_count") == 1
    assert d("kvhandoff_handoff_seconds_count") == 1
    assert d("kvhandoff_handoff_bytes_total") == _kv_bytes(ops_cluster.prefill.address,
                                                           len(PROMPT))
    assert d("kvhandoff_e2e_request_latency_seconds_sum") > 0
    assert value(after, "kvhandoff_pages_in_use", role="decode") == 0
    assert d("kvhandoff_prompt_tokens_total") == len(PROMPT)
    assert d("kvhandoff_generation_tokens_total") == NEW_TOKENS
    assert d("kvhandoff_request_prompt_tokens_sum") == len(PROMPT)
    assert d("kvhandoff_request_generation_tokens_sum") == NEW_TOKENS
    assert d("kvhandoff_time_per_output_token_seconds_count") == 1
    # the first token comes from decode's own logits at verification: one step per later token
    steps = sum(v for (name, _), v in after.items() if name == "kvhandoff_decode_step_seconds_count"
                ) - sum(v for (name, _), v in before.items()
                        if name == "kvhandoff_decode_step_seconds_count")
    assert steps == NEW_TOKENS - 1
    assert d("kvhandoff_decode_step_rows_sum") == NEW_TOKENS - 1  # one sequence each step
    assert (value(after, "kvhandoff_requests_finished_total", finished_reason="length")
            - value(before, "kvhandoff_requests_finished_total", finished_reason="length")) == 1
    assert value(after, "kvhandoff_kv_cache_usage_ratio", role="decode") == 0
    assert value(after, "kvhandoff_pool_pages", role="decode", model_name="demo") > 0


def test_refusals_are_counted_by_reason(ops_cluster):
    port = metrics_port(ops_cluster.decode)
    before = scrape(port)
    with pytest.raises(grpc.RpcError) as err:
        generate_reply(ops_cluster.address, [10**6], 2)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = scrape(port)
    labels = {"role": "decode", "reason": "TOKEN_OUT_OF_VOCAB"}
    assert (value(after, "kvhandoff_refused_total", **labels)
            - value(before, "kvhandoff_refused_total", **labels)) == 1


def test_prefill_metrics_move_with_a_generation(ops_cluster):
    """Needs prefill's call sites (docs/operations.md, 'Metrics'): prefill time, queue time,
    handoff seconds and bytes sent."""
    port = metrics_port(ops_cluster.prefill)
    before = scrape(port)
    generate_reply(ops_cluster.address, PROMPT, 2)
    ops_cluster.assert_pools_at_baseline()
    after = scrape(port)
    d = lambda name: _delta(before, after, name, "prefill")  # noqa: E731
    assert d("kvhandoff_prefill_seconds_count") == 1
    assert d("kvhandoff_prefill_tokens_total") == len(PROMPT)
    assert d("kvhandoff_queue_time_seconds_count") == 1
    assert d("kvhandoff_handoff_seconds_count") == 1
    assert d("kvhandoff_handoff_bytes_total") == _kv_bytes(ops_cluster.prefill.address,
                                                           len(PROMPT))


def test_engine_counters_are_exported(ops_cluster):
    """The StatsService counters appear as kvhandoff_engine_events_total{role, event}."""
    generate_reply(ops_cluster.address, PROMPT, 3)
    for service, event in ((ops_cluster.prefill, "handoffs_completed"),
                           (ops_cluster.decode, "decode_steps")):
        samples = scrape(metrics_port(service))
        stats = service.stats().counters  # read after the scrape: counters only grow
        exported = value(samples, "kvhandoff_engine_events_total", role=service.role,
                         event=event)
        assert exported > 0 and exported <= stats[event], (service.role, exported, stats)


def test_effective_limits_are_exported(ops_cluster):
    """The limits each service enforces match what its StatsService reports."""
    for service in (ops_cluster.prefill, ops_cluster.decode):
        samples = scrape(metrics_port(service))
        pool = service.stats().pool
        assert value(samples, "kvhandoff_pool_tokens", role=service.role) == pool.tokens_total
        assert value(samples, "kvhandoff_context_window_tokens",
                     role=service.role) == pool.max_context_tokens
        assert value(samples, "kvhandoff_max_prompt_tokens",
                     role=service.role) == pool.max_prompt_tokens > 0


def test_live_scrapes_pass_promtool(ops_cluster):
    """What the services really serve (not only the registry) passes `promtool check metrics`."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    generate_reply(ops_cluster.address, PROMPT, 2)
    for service in (ops_cluster.prefill, ops_cluster.decode):
        url = f"http://127.0.0.1:{metrics_port(service)}/metrics"
        body = urllib.request.urlopen(url, timeout=10).read()
        result = subprocess.run([promtool, "check", "metrics"], input=body,
                                capture_output=True, timeout=60, check=False)
        assert result.returncode == 0, (service.role, (result.stdout + result.stderr).decode())
