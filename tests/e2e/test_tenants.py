"""Tenants by identity through real services (decode with --api-tokens FILE, prefill with its
prefix cache): with no salt, tenant A's cached prompt is a hit for A (through either of A's
tokens) and never for B, who computes it all; an unknown token is UNAUTHENTICATED and reaches
nothing; SIGHUP reloads the file (a token added works, one removed is refused, a bad file keeps
the table); decode's log lines carry the tenant and never a token, and its metrics are labelled
only by tenant names. Hits are read from prefill's StatsService counters, never timed."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest

from common.pb.kvhandoff.v1 import generate_pb2, generate_pb2_grpc, stats_pb2, stats_pb2_grpc
from tests.helpers.checkpoints import SPECS, make_checkpoint
from tests.helpers.cluster import REPO, start_cluster
from tests.helpers.polling import wait_until

pytestmark = pytest.mark.slow

PAGE = 4
VOCAB = SPECS[0].vocab
PROMPT = [3 + (7 * i) % (VOCAB - 3) for i in range(26)]  # 6 whole pages and 2 tokens
FLAGS = ["--page-size", str(PAGE), "--poison-freed-pages", "--check-page-owners"]
A1, A2, B, C = "tok-a-one", "tok-a-two", "tok-b", "tok-c"
TOKENS = f"# tenant token\nteam-a {A1}\nteam-b {B}\nteam-a {A2}\n"


def _bearer(token: str):
    return (("authorization", f"Bearer {token}"),)


def _generate(address: str, token: str, prompt: list[int] = PROMPT, salt: str = "") -> list[int]:
    request = generate_pb2.GenerateRequest(max_tokens=4, ignore_eos=True, cache_salt=salt)
    request.token_ids.ids.extend(prompt)
    with grpc.insecure_channel(address) as channel:
        return [r.token.token_id for r in generate_pb2_grpc.GenerationServiceStub(channel)
                .Generate(request, timeout=120, metadata=_bearer(token)) if r.HasField("token")]


def _refused(address: str, token: str) -> grpc.StatusCode | None:
    try:
        _generate(address, token)
    except grpc.RpcError as err:
        return err.code()
    return None


def _hits(cluster) -> tuple[int, int]:
    counters = cluster.prefill.stats().counters
    return counters.get("prefix_cache_hits", 0), counters.get("prefill_tokens_computed", 0)


def _log_lines(cluster) -> list[dict]:
    lines = []
    for line in cluster.decode.log_text().splitlines():
        if line.startswith("{"):
            lines.append(json.loads(line))
    return lines


def _events(cluster, event: str) -> list[dict]:
    return [line for line in _log_lines(cluster) if line.get("event") == event]


@pytest.fixture(scope="module")
def tenants(tmp_path_factory):
    root = tmp_path_factory.mktemp("tenants")
    path, _ = make_checkpoint(SPECS[0], root)
    tokens = root / "tokens"
    tokens.write_text(TOKENS)
    tokens.chmod(0o600)
    c = start_cluster(root / "run", str(path), prefill_flags=["--pool-tokens", "256"],
                      decode_flags=["--pool-tokens", "256", "--api-tokens", str(tokens),
                                    "--metrics-port", "0"], common_flags=FLAGS)
    yield c, tokens
    c.stop()


def test_a_tenants_cached_prompt_is_a_hit_for_it_and_never_for_another(tenants):
    cluster, _ = tenants
    hits0, computed0 = _hits(cluster)
    first = _generate(cluster.address, A1)  # team-a caches the prompt
    hits1, computed1 = _hits(cluster)
    assert (hits1 - hits0, computed1 - computed0) == (0, len(PROMPT))
    assert _generate(cluster.address, B) == first  # team-b, no salt: computes it all
    hits2, computed2 = _hits(cluster)
    assert (hits2 - hits1, computed2 - computed1) == (0, len(PROMPT))
    assert _generate(cluster.address, A2) == first  # team-a's other token: team-a's cache
    hits3, computed3 = _hits(cluster)
    assert (hits3 - hits2, computed3 - computed2) == (1, len(PROMPT) - 24)
    assert _generate(cluster.address, B) == first  # now team-b's own cached copy
    hits4, _ = _hits(cluster)
    assert hits4 - hits3 == 1
    assert _generate(cluster.address, A1, salt="s") == first  # a salt separates within a tenant
    assert _hits(cluster)[0] == hits4
    before = _hits(cluster)
    assert _refused(cluster.address, "tok-nobody") == grpc.StatusCode.UNAUTHENTICATED
    assert _hits(cluster) == before  # a refused call reached nothing
    pool = cluster.prefill.stats().pool
    assert pool.pages_free == pool.pages_total


def test_sighup_reloads_the_file_and_a_bad_file_keeps_the_table(tenants):
    cluster, tokens = tenants
    pid = cluster.decode.proc.pid
    try:
        tokens.write_text(f"team-a {A1}\nteam-c {C}\n")  # team-b leaves, team-c joins
        cluster.decode.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: len(_events(cluster, "api_tokens_reloaded")) == 1, 30,
                   "decode logged api_tokens_reloaded")
        reloaded = _events(cluster, "api_tokens_reloaded")[0]
        assert (reloaded["added"], reloaded["removed"]) == (["team-c"], ["team-b"])
        assert _refused(cluster.address, C) is None
        assert _refused(cluster.address, B) == grpc.StatusCode.UNAUTHENTICATED
        assert _refused(cluster.address, A2) == grpc.StatusCode.UNAUTHENTICATED
        tokens.write_text(f"team-a {A1}\nteam-c {C}\nteam-d\n")
        cluster.decode.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: len(_events(cluster, "api_tokens_reload_failed")) == 1, 30,
                   "decode logged api_tokens_reload_failed")
        failed = _events(cluster, "api_tokens_reload_failed")[0]
        assert "line 3" in failed["message"] and "keeping the previous table" in failed["message"]
        assert _refused(cluster.address, C) is None  # the previous table is still in force
        assert cluster.decode.proc.poll() is None and cluster.decode.proc.pid == pid
    finally:
        tokens.write_text(TOKENS)
        cluster.decode.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: len(_events(cluster, "api_tokens_reloaded")) == 2, 30,
                   "decode reloaded the original file")


def test_logs_carry_the_tenant_and_metrics_only_tenant_names(tenants):
    cluster, _ = tenants
    _generate(cluster.address, B, prompt=PROMPT[:9])
    with grpc.insecure_channel(cluster.address) as channel:  # the stats are behind a token too
        stats_pb2_grpc.StatsServiceStub(channel).GetStats(
            stats_pb2.GetStatsRequest(), timeout=10, metadata=_bearer(A1))
    text = cluster.decode.log_text()
    for token in (A1, A2, B, C):
        assert token not in text
    finished = _events(cluster, "request_finished")
    assert finished and {line.get("tenant") for line in finished} == {"team-a", "team-b", "team-c"}
    assert finished[-1]["tenant"] == "team-b"
    verified = {line["request_id"]: line["tenant"] for line in _events(cluster, "handoff_verified")}
    assert verified and set(verified.values()) == {"team-a", "team-b", "team-c"}
    port = next(line["metrics_port"] for line in _events(cluster, "listening"))
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    labels = {line.split('tenant="')[1].split('"')[0] for line in body.splitlines()
              if line.startswith("kvhandoff_api_calls_total{")}
    assert labels == {"team-a", "team-b", "team-c", "unauthenticated"}
    assert 'kvhandoff_api_tenants{model_name=' in body


def test_a_malformed_file_refuses_to_start_in_one_line(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"team-a {A1}\nteam-b {A1}\n")
    for argv in (["decode", "--model", "demo", "--api-tokens", str(tokens)],
                 ["up", "--api-tokens", str(tokens)]):
        done = subprocess.run([sys.executable, "-m", "kvhandoff_cli.main", *argv], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 2, done.stderr
        assert len(lines) == 1 and "line 2" in lines[0] and str(tokens) in lines[0], lines
        assert A1 not in done.stderr + done.stdout and "Traceback" not in done.stderr


def _cli_generate(address: str, token: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvhandoff_cli.main", "generate", "--target",
                           address, "--token-ids", "3,4,5", "--max-tokens", "2", "--token",
                           token], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_up_passes_the_file_to_decode_and_forwards_sighup(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"team-a {A1}\n")
    tokens.chmod(0o600)
    errors = (tmp_path / "up.err").open("w")
    up = subprocess.Popen([sys.executable, "-m", "kvhandoff_cli.main", "up", "--port", "0",
                           "--pool-tokens", "8192", "--api-tokens", str(tokens)], cwd=REPO,
                          stdout=subprocess.PIPE, stderr=errors, text=True)
    try:
        deadline = time.monotonic() + 180
        line = ""
        while "ready" not in line:  # up's own GetStats on decode carried a token of the file
            assert time.monotonic() < deadline and up.poll() is None, "no ready line"
            line = up.stdout.readline()
        address = re.search(r"serving at (\S+)", line).group(1)
        assert _cli_generate(address, A1).returncode == 0
        refused = _cli_generate(address, C)
        assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stderr
        tokens.write_text(f"team-a {A1}\nteam-c {C}\n")
        up.send_signal(signal.SIGHUP)
        wait_until(lambda: "api_tokens_reloaded" in (tmp_path / "up.err").read_text(), 30,
                   "decode reloaded the file on up's SIGHUP")
        assert _cli_generate(address, C).returncode == 0 and up.poll() is None
    finally:
        up.send_signal(signal.SIGTERM)
        status = up.wait(timeout=60)
        errors.close()
    assert status == 0
    assert A1 not in (tmp_path / "up.err").read_text() and C not in line
