"""`kvhandoff bench serve --backend openai`: the requests it sends to an OpenAI-compatible server
(standard fields, token-id prompts, greedy, EOS ignored), how it times a streamed completion,
what it refuses, and the side-by-side table of two runs (`--compare`). The server is a small
aiohttp fake on a loopback port 0."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
import threading

import pytest
from aiohttp import web

from bench import serve
from bench.openai_client import OpenAiBackend, token_times
from bench.serve_client import LengthRange, make_requests, run_load


@contextlib.contextmanager
def closed_port_url():
    """A loopback URL whose port is bound but never listens: connections are refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"


class FakeOpenAi:
    """Streams one chunk per token; `behaviour` bends it: 'stop_early' ends at 3 tokens with
    finish_reason stop, 'closing_chunk' adds an empty choice with finish_reason after the last
    token, 'bad_request' answers 400."""

    def __init__(self, behaviour: str = "") -> None:
        self.behaviour = behaviour
        self.bodies: list[dict] = []

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny-llama"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.behaviour == "bad_request":
            return web.json_response({"error": {"message": "prompt too long"}}, status=400)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        count = 3 if self.behaviour == "stop_early" else body["max_tokens"]
        for i in range(count):
            last = i == count - 1
            finish = ("stop" if self.behaviour == "stop_early" else "length") if last else None
            if last and self.behaviour == "closing_chunk":
                finish = None
            await asyncio.sleep(0.002)
            await response.write(self._event({"choices": [
                {"index": 0, "text": f"t{i}", "finish_reason": finish}]}))
        if self.behaviour == "closing_chunk":
            await response.write(self._event({"choices": [
                {"index": 0, "text": "", "finish_reason": "length"}]}))
        await response.write(self._event({"choices": [], "usage": {
            "prompt_tokens": len(body["prompt"]), "completion_tokens": count}}))
        await response.write(b"data: [DONE]\n\n")
        return response

    @staticmethod
    def _event(chunk: dict) -> bytes:
        return f"data: {json.dumps(chunk)}\n\n".encode()


class Served:
    """A FakeOpenAi on its own loop and thread, so that the code under test can run its own."""

    def __init__(self, fake: FakeOpenAi) -> None:
        self.fake = fake
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_get("/v1/models", self.fake.models)
        app.router.add_post("/v1/completions", self.fake.completions)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1"
        self.ready.set()
        self.loop.run_forever()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def served(request):
    server = Served(FakeOpenAi(getattr(request, "param", "")))
    yield server
    server.stop()


def _load(url: str, count: int = 4, max_tokens: int = 5, concurrency: int = 2):
    specs = make_requests(count, LengthRange(7, 7), LengthRange(max_tokens, max_tokens), 100, 0)
    results, duration = asyncio.run(run_load(OpenAiBackend(url), specs, math.inf, concurrency,
                                             0, 30.0, lambda done, total: None))
    return specs, results, duration


def test_sends_the_same_requests_as_standard_streaming_completions(served):
    specs, results, duration = _load(served.url)
    assert [r.error for r in results] == [""] * 4 and duration > 0
    for body in served.fake.bodies:
        assert body["model"] == "tiny-llama"  # the first model GET /v1/models lists
        assert body["max_tokens"] == 5 and body["temperature"] == 0.0
        assert body["stream"] is True and body["ignore_eos"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert all(isinstance(t, int) for t in body["prompt"]) and len(body["prompt"]) == 7
    assert sorted(map(tuple, (b["prompt"] for b in served.fake.bodies))) == sorted(
        tuple(s.token_ids) for s in specs)
    for result in results:
        assert result.output_len == 5 and result.prompt_len == 7
        assert result.token_times == sorted(result.token_times) and result.ttft > 0
        assert result.latency >= result.token_times[-1]


@pytest.mark.parametrize("served", ["closing_chunk"], indirect=True)
def test_an_empty_closing_choice_is_not_a_token(served):
    _specs, results, _ = _load(served.url, count=1)
    assert results[0].error == "" and results[0].output_len == 5


@pytest.mark.parametrize("served", ["stop_early"], indirect=True)
def test_a_server_that_stops_at_eos_is_an_error_not_a_short_run(served):
    _specs, results, _ = _load(served.url, count=1)
    assert "3 of 5 tokens" in results[0].error and "ignore_eos" in results[0].error


@pytest.mark.parametrize("served", ["bad_request"], indirect=True)
def test_an_http_error_is_recorded_with_its_status(served):
    _specs, results, _ = _load(served.url, count=1)
    assert results[0].error.startswith("HTTP 400") and "prompt too long" in results[0].error
    assert not results[0].ok


def test_usage_decides_how_many_tokens_the_chunks_carried():
    arrivals = [(0.1, "a", None), (0.2, "bc", None), (0.3, "", "length")]
    assert token_times(arrivals, 2) == [0.1, 0.2]
    assert token_times(arrivals, 4) == [0.1, 0.2, 0.3, 0.3]
    assert token_times(arrivals, None) == [0.1, 0.2, 0.3]


def test_a_closed_port_is_one_line_not_a_traceback(capsys):
    with closed_port_url() as url:
        code = serve.main(["--backend", "openai", "--url", url, "--vocab-size", "100",
                           "--num-prompts", "1", "--warmup-requests", "1"])
    err = capsys.readouterr().err
    assert code == 1 and "cannot list the models" in err and "Traceback" not in err


def test_openai_backend_refuses_a_missing_url_or_vocabulary(capsys):
    with pytest.raises(SystemExit):
        serve.main(["--backend", "openai"])
    assert "--url http://HOST:PORT/v1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve.main(["--backend", "openai", "--url", "http://127.0.0.1:1/v1"])
    assert "--model DIR" in capsys.readouterr().err


def test_a_run_and_the_compare_of_two_runs_print_the_ratios(served, tmp_path, capsys):
    args = ["--backend", "openai", "--url", served.url, "--vocab-size", "100",
            "--num-prompts", "3", "--warmup-requests", "1", "--input-len", "9",
            "--output-len", "4", "--max-concurrency", "1,2"]
    assert serve.main([*args, "--label", "theirs", "--json", str(tmp_path / "a.json")]) == 0
    first = [tuple(body["prompt"]) for body in served.fake.bodies]
    assert serve.main([*args, "--label", "ours", "--json", str(tmp_path / "b.json")]) == 0
    second = [tuple(body["prompt"]) for body in served.fake.bodies[len(first):]]
    assert sorted(first) == sorted(second)  # the same requests for both systems
    assert len(set(first)) == 1 + 3 + 3  # the warm-up's, then each load its own prompts
    capsys.readouterr()
    assert serve.main(["--compare", str(tmp_path / "b.json"), str(tmp_path / "a.json")]) == 0
    table = capsys.readouterr().out
    assert "ratios: each system over theirs" in table
    rows = [line for line in table.splitlines() if line.startswith("in 9, out 4")]
    assert len(rows) == 4  # two loads, two systems
    ours = [row for row in rows if " ours " in row]
    assert len(ours) == 2 and all(row.count("x") >= 3 for row in ours)
    data = json.loads((tmp_path / "a.json").read_text())
    assert [run["summary"]["completed"] for run in data["runs"]] == [3, 3]
    assert serve.main(["--compare", str(tmp_path / "a.json"), "--ratio-base", "nobody"]) == 2
