"""Audit sampling (`--verify-full-fraction`, SPEC.md D-49): a fault confined to one position of
the last layer, which the sampled checks of D-46/D-47 miss unless they draw that position, is
refused by every audited handoff; an honest handoff gives the same tokens audited or not; bad
values of the flag are one-line refusals.

Two real decodes, each behind its own in-process fake prefill proxying one reference prefill:
one audits every handoff (F = 1), one none (F = 0, the default). Both run with
`--verify-depth-positions 0`, so the depth check recomputes only the last position and the
F = 0 decode accepts the fault every time: that is what shows the test can fail.
"""

from __future__ import annotations

import random
import urllib.request

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from common.counters import Counters
from common.handoff.reasons import HandoffRefused
from common.pb.kvhandoff.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from conformance.decode_script import DecodeCase, ScriptInput, refused, tokens
from conformance.decode_suite import check_run, open_target, play
from conformance.fake_prefill import FakePrefill
from conformance.handoff_edit import Handoff
from decode_svc.full_audit import AUDITS, AUDITS_REFUSED, FullAudit
from kvhandoff_cli.main import main
from kvhandoff_cli.up import up
from tests.fail_closed.harness import DECODE_FLAGS, DecodeHarness
from tests.helpers.cluster import start_service

ONLY_LAST_POSITION = ("--verify-depth-positions", "0")
ELEMENT_BYTES = {common_pb2.KV_DTYPE_FLOAT32: 4, common_pb2.KV_DTYPE_FLOAT16: 2,
                 common_pb2.KV_DTYPE_BFLOAT16: 2}
PROMPT_TOKENS = 40


def last_layer_negated(where: str):
    """A script: the honest handoff with K and V of one prompt position of the LAST layer
    negated (every checksum right); where: 'first', 'middle' or 'second_last' position."""

    def script(i: ScriptInput):
        n, layer = i.ref.token_count, i.ref.num_layers - 1
        position = {"first": 0, "middle": n // 2, "second_last": n - 2}[where]
        per, size = i.ref.k_bytes_per_token_per_layer, ELEMENT_BYTES[i.ref.header.layout.dtype]
        k, v = list(i.ref.k), list(i.ref.v)
        for kv in (k, v):
            data = bytearray(kv[layer])
            lo, hi = position * per, (position + 1) * per
            data[lo + size - 1:hi:size] = bytes(b ^ 0x80 for b in data[lo + size - 1:hi:size])
            kv[layer] = bytes(data)
        fake = Handoff(i.ref.original, i.ref.header, i.ref.commit, k, v)
        return i.good(fake.chunks(fake.ranges(fake.tokens_per_chunk(i.max_chunk_bytes))))

    return script


def fault_case(where: str, expect) -> DecodeCase:
    return DecodeCase(f"audit_last_layer_{where}", "D-49", "MUST", f"the {where} position of "
                      "the last layer negated, every checksum right", last_layer_negated(where),
                      expect, prompt_tokens=PROMPT_TOKENS)


class PlainDecode:
    """A second decode (F = 0) behind its own fake, on the audited harness's loop and prefill."""

    def __init__(self, harness: DecodeHarness, workdir) -> None:
        self.bg = harness.bg
        self.fake = FakePrefill(harness.prefill.address)
        self.decode = self.target = None
        try:
            port = self.bg.run(self.fake.start("127.0.0.1:0"))
            self.decode = start_service("decode", workdir, [
                *DECODE_FLAGS, *ONLY_LAST_POSITION, "--prefill", f"127.0.0.1:{port}"])
            self.target = self.bg.run(open_target(self.decode.address, self.fake, timeout=60,
                                                  settle_timeout=15, wait=60))
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        if self.target is not None:
            self.bg.run(self.target.channel.close())
        self.bg.run(self.fake.stop())
        if self.decode is not None:
            self.decode.stop()


@pytest.fixture(scope="module")
def decodes(tmp_path_factory):
    """(audited harness F = 1, plain decode F = 0)."""
    root = tmp_path_factory.mktemp("full_audit")
    audited = DecodeHarness(root / "audited", ("--verify-full-fraction", "1",
                                               *ONLY_LAST_POSITION))
    try:
        plain = PlainDecode(audited, root / "plain")
    except Exception:
        audited.close()
        raise
    yield audited, plain
    plain.close()
    audited.close()


def test_a_last_layer_fault_is_refused_by_every_audit_and_accepted_without(decodes):
    audited, plain = decodes
    before = audited.stats_counters()
    wheres = ("first", "middle", "second_last")
    for where in wheres:
        run = audited.play(fault_case(where, refused("KV_DEPTH_MISMATCH")))
        assert check_run(fault_case(where, refused("KV_DEPTH_MISMATCH")), run) == [], where
        request_id = run.exchanges[0].request.request_id
        [audit] = audited.log_events("full_audit", request_id)
        last = audited.target.fake.info.layout.num_layers - 1
        assert audit["refused"] is True and audit["layer"] == last, audit
        assert audited.pool_problem() is None
        # the same fault without the audit: accepted, tokens streamed (the blind spot)
        accepted = plain.bg.run(play(plain.target, fault_case(where, tokens())))
        assert accepted.outcome.code == grpc.StatusCode.OK and accepted.tokens, where
    after = audited.stats_counters()
    assert after.get(AUDITS, 0) - before.get(AUDITS, 0) == len(wheres)
    assert after.get(AUDITS_REFUSED, 0) - before.get(AUDITS_REFUSED, 0) == len(wheres)
    assert plain.decode.stats().counters.get(AUDITS, 0) == 0
    assert audited.refused_counts().get("KV_DEPTH_MISMATCH", 0) >= len(wheres)
    events = audit_events(audited.metrics_url)
    assert events[AUDITS] >= len(wheres) and events[AUDITS_REFUSED] >= len(wheres), events


def audit_events(url: str) -> dict[str, float]:
    """The audit counters as /metrics exports them (kvhandoff_engine_events_total)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {s.labels["event"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "kvhandoff_engine_events_total"
            and s.labels.get("event") in (AUDITS, AUDITS_REFUSED)}


async def _generate(target, prompt: list[int], sampling: common_pb2.SamplingParams) -> list[int]:
    stub = generate_pb2_grpc.GenerationServiceStub(target.channel)
    out = []
    async for response in stub.Generate(generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=prompt), max_tokens=12, ignore_eos=True,
            sampling=sampling), timeout=120):
        if response.HasField("token"):
            out.append(response.token.token_id)
    return out


def test_b_an_honest_handoff_gives_the_same_tokens_audited_or_not(decodes):
    audited, plain = decodes
    before = audited.stats_counters()
    rng = random.Random(7)
    vocab = audited.target.vocab_size
    samplings = [common_pb2.SamplingParams(temperature=0.0),
                 common_pb2.SamplingParams(temperature=0.9, top_p=0.95, seed=11, has_seed=True)]
    runs = 0
    for n in (1, 16, 17, 45):
        prompt = [rng.randrange(3, vocab) for _ in range(n)]
        for sampling in samplings:
            with_audit = audited.bg.run(_generate(audited.target, prompt, sampling))
            without = plain.bg.run(_generate(plain.target, prompt, sampling))
            assert len(with_audit) == 12 and with_audit == without, (n, sampling)
            runs += 1
    after = audited.stats_counters()
    assert after.get(AUDITS, 0) - before.get(AUDITS, 0) == runs
    assert after.get(AUDITS_REFUSED, 0) == before.get(AUDITS_REFUSED, 0)
    assert audited.pool_problem() is None


@pytest.mark.parametrize("value", ["-0.1", "1.5", "abc", "nan"])
def test_c_bad_fractions_are_one_line_refusals(capsys, value):
    with pytest.raises(SystemExit) as exit_info:
        main(["decode", "--verify-full-fraction", value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--verify-full-fraction" in err, err
    assert up(["--verify-full-fraction", value]) == 2  # before starting anything
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--verify-full-fraction" in err, err


def test_c_an_audit_without_content_checks_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["decode", "--verify-full-fraction", "0.5", "--no-content-checks"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--no-content-checks" in err, err


def test_the_draw_is_never_at_zero_always_at_one_and_unseeded():
    counters = Counters()
    never = FullAudit(0.0, random.SystemRandom(), counters, log=None)
    always = FullAudit(1.0, random.SystemRandom(), counters, log=None)
    half = FullAudit(0.5, random.SystemRandom(), counters, log=None)
    assert not any(never.drawn() for _ in range(1000))
    assert all(always.drawn() for _ in range(1000))
    assert 350 < sum(half.drawn() for _ in range(1000)) < 650  # 10 sigma either side
    with pytest.raises(ValueError):
        FullAudit(1.5, random.SystemRandom(), counters, log=None)


class _Log:
    def __init__(self) -> None:
        self.lines: list[dict] = []

    def info(self, event: str, **fields) -> None:
        self.lines.append({"event": event, **fields})


def test_in_process_audit_compares_every_layer_and_refuses_one_changed_value():
    from bench.verify_margin import _pool, model_on, prefill_kv

    model = model_on("torch", torch.float32)
    rng = random.Random(3)
    prompt = [rng.randrange(2, model.config.vocab_size) for _ in range(21)]
    kv, _ = prefill_kv(model, prompt)
    pool = _pool(model, 8 * 16)
    pool.allocator.allocate("spacer", 20)  # the request's pages are not the first ones
    table = torch.tensor(pool.allocator.allocate("r", len(prompt)), dtype=torch.int32)
    for layer, buffer in enumerate(kv):
        model.ops.unpack_kv(buffer, pool.k[layer], pool.v[layer], table, 0)
    counters, log = Counters(), _Log()
    audit = FullAudit(1.0, random.SystemRandom(), counters, log)
    ids = torch.tensor(prompt)
    sent = (pool.k.clone(), pool.v.clone())
    assert audit.check(model, pool, "r", table, ids, 5e-3).error == 0.0  # same path, same bits
    assert torch.equal(pool.k, sent[0]) and torch.equal(pool.v, sent[1])  # pages only read
    last, position = model.config.num_layers - 1, 9
    slot = int(table[position // 16]) * 16 + position % 16
    pool.v.flatten(1, 2)[last, slot, 0, 0] += 3 * pool.v[last].float().pow(2).mean().sqrt()
    with pytest.raises(HandoffRefused) as refusal:
        audit.check(model, pool, "r", table, ids, 5e-3)
    assert refusal.value.reason == "KV_DEPTH_MISMATCH"
    assert (counters.get(AUDITS), counters.get(AUDITS_REFUSED)) == (2, 1)
    worst = log.lines[-1]
    assert (worst["layer"], worst["kv"], worst["position"], worst["refused"]) == (
        last, "V", position, True)
