"""scripts/compose_chaos.py's judgement, without Docker: a fake cluster and fake client streams
go through the real phase functions, so a lost request, a pool off its baseline, a region left
in the volume, a kill that hit no handoff, or a decode's client that got no UNAVAILABLE each
fail the phase (the real cluster run is tests/ops/test_compose_smoke.py)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

import pytest

from tests.helpers.cluster import REPO

sys.path.insert(0, str(REPO / "scripts"))
import compose_chaos  # noqa: E402
from compose_chaos_cluster import ClusterError, Replica, Stats  # noqa: E402
from compose_smoke_client import Stream  # noqa: E402

POOL = {"pages_total": 64, "pages_free": 64, "running_requests": 0, "waiting_requests": 0}


@dataclass
class FakeCluster:
    """Two prefills and two decodes; stats[name] is what GetStats answers, in order."""

    stats_by_name: dict = field(default_factory=dict)
    events_by_name: dict = field(default_factory=dict)
    killed: list = field(default_factory=list)

    def replicas(self, service: str) -> list[Replica]:
        return [Replica(service, n, f"{service}{n}", f"127.0.0.1:{5000 + n}"
                        if service == "decode" else "") for n in (1, 2)]

    def running(self, container: str) -> bool:
        return True

    def stats(self, replica: Replica) -> Stats:
        answers = self.stats_by_name.get(replica.name, [])
        return answers.pop(0) if len(answers) > 1 else (answers or [Stats(POOL, {}, [])])[0]

    def kill(self, replica: Replica) -> None:
        self.killed.append(replica.name)

    def ensure_running(self, replica: Replica, timeout: float = 0) -> str:
        return "docker start"

    def events(self, replica: Replica, since: float) -> list[dict]:
        return self.events_by_name.get(replica.name, [])


def args(**overrides) -> argparse.Namespace:
    values = {"timeout": 5.0, "streams": 4, "kill_after": 1, "kill_tokens": 16,
              "decode_kill_streams": 2, "decode_kill_tokens": 200, "victim_tokens": 3000,
              "serve_requests": 1}
    return argparse.Namespace(**{**values, **overrides})


def finished(tokens: int) -> Stream:
    stream = Stream(tokens=tokens, finish_reason="FINISH_REASON_LENGTH",
                    completion_tokens=tokens)
    stream.first.set()
    return stream


def cut(tokens: int, error: str) -> Stream:
    stream = Stream(tokens=tokens, error=error)
    stream.first.set()
    return stream


@pytest.fixture(autouse=True)
def fast_baselines(monkeypatch):
    monkeypatch.setattr(compose_chaos, "wait_for", _wait_once)


def _wait_once(what, check, timeout, interval=1.0):
    result = check()
    if not result:
        raise ClusterError(f"{what}: not after {timeout:.0f} s")
    return result


def test_baselines_name_a_busy_pool_and_a_region_left():
    busy = Stats({**POOL, "pages_free": 60, "running_requests": 1}, {}, [])
    left = Stats(POOL, {}, ["kvh-" + "0" * 32])
    with pytest.raises(ClusterError, match=r'prefill#2.*"pages_free": 60') as err:
        compose_chaos.baselines(FakeCluster({"prefill#2": [busy, busy]}))
    assert "decode#1" in str(err.value)
    with pytest.raises(ClusterError, match=r'decode#1[^}]*}, "regions": 1'):
        compose_chaos.baselines(FakeCluster({"decode#1": [left, left]}))
    summary = compose_chaos.baselines(FakeCluster())
    assert summary["prefill#1"] == "64/64 free, 0 regions" and len(summary) == 4


def test_prefill_kill_fails_on_a_lost_request_and_on_a_kill_that_hit_nothing(monkeypatch):
    streams = [finished(16), finished(16), cut(3, "UNAVAILABLE: Socket closed"), finished(16)]
    monkeypatch.setattr(compose_chaos, "launch", lambda *a: (streams, []))
    cluster = FakeCluster()
    result = compose_chaos.phase_prefill_kill(cluster, args())
    assert cluster.killed == ["prefill#2"]
    assert result["failed"] == 1 and result["requests"] == 4
    assert any("request 2: UNAVAILABLE: Socket closed" in p for p in result["problems"])
    assert any("no handoff was retried" in p for p in result["problems"])


def test_prefill_kill_passes_when_every_request_finished_after_a_retry(monkeypatch):
    streams = [finished(16) for _ in range(4)]
    monkeypatch.setattr(compose_chaos, "launch", lambda *a: (streams, []))
    before, after = Stats(POOL, {}, []), Stats(POOL, {"handoff_retried_transport": 2}, [])
    retried = {"event": "handoff_retried", "refusal": "PEER_UNAVAILABLE"}
    cluster = FakeCluster({"decode#1": [before, after, after]}, {"decode#1": [retried]})
    result = compose_chaos.phase_prefill_kill(cluster, args())
    assert result["problems"] == [] and result["failed"] == 0
    assert result["retried"] == {"decode#1": 2, "decode#2": 0}
    assert result["retried_refusals"] == {"PEER_UNAVAILABLE": 1}


@pytest.mark.parametrize(("victim_error", "other", "expected"), [
    ("UNAVAILABLE: Socket closed", finished(200), []),
    ("", finished(200), ["decode#1 request 0: no error after 40 tokens"]),
    ("UNAVAILABLE: ", finished(200), ["decode#1 request 0: UNAVAILABLE:  after 40 tokens"]),
    ("UNAVAILABLE: Socket closed", cut(50, "UNAVAILABLE: Socket closed"),
     ["decode#2 request 0: UNAVAILABLE: Socket closed"]),
], ids=["as-promised", "no-error", "no-reason", "other-decode-hurt"])
def test_decode_kill_wants_unavailable_with_a_reason_and_the_other_decode_untouched(
        monkeypatch, victim_error, other, expected):
    groups = {"127.0.0.1:5001": [cut(40, victim_error), cut(41, "UNAVAILABLE: Socket closed")],
              "127.0.0.1:5002": [other, finished(200)]}
    monkeypatch.setattr(compose_chaos, "launch", lambda targets, *a: (groups[targets[0]], []))
    cluster = FakeCluster()
    result = compose_chaos.phase_decode_kill(cluster, args())
    assert cluster.killed == ["decode#1"]
    for want in expected:
        assert any(p.startswith(want) for p in result["problems"]), result["problems"]
    if not expected:
        assert result["problems"] == []
        assert result["victim_clients_printed"] == {"UNAVAILABLE: Socket closed": 2}
        assert result["others_completed"] == 2


def test_main_stops_at_the_first_failed_phase(monkeypatch, capsys):
    ran = []
    phases = {"a": lambda c, a: ran.append("a") or {"problems": []},
              "b": lambda c, a: ran.append("b") or {"problems": ["lost one"]},
              "c": lambda c, a: ran.append("c") or {"problems": []}}
    monkeypatch.setattr(compose_chaos, "PHASES", phases)
    status = compose_chaos.main(["--project", "p", "--compose", "docker compose -p p",
                                 "--phases", "a,b,c"])
    assert status == 1 and ran == ["a", "b"]
    assert '"check": "chaos", "ok": false' in capsys.readouterr().out
