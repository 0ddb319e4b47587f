"""What the P-68a scrub adds to a real prefill pass: the real PrefillEngine and model prefill one
prompt per run, its chunks going out inline; in one arm the sender zeroes the handoff's slots
not written yet at its first `spans` call (prefill_svc.page_scrub, where NixlPagesSender does
before it registers the pages), in the other it does not. The arms take turns in every repeat,
so drift in the host's load hits them alike; the pool does not poison or scrub freed pages
(else the scrub is skipped).

    python -m bench.nixl_scrub_pass [--model demo|DIR] [--prompt-len 512,2048] [--repeats 5]
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.prefill_pass_profile import _engine  # noqa: E402
from common.config import ServiceConfig  # noqa: E402
from common.handoff.layout import DEFAULT_MAX_CHUNK_BYTES  # noqa: E402
from common.log import make_logger  # noqa: E402
from common.sampling import SamplingConfig  # noqa: E402
from common.server.runtime import build_runtime, warm_up  # noqa: E402
from prefill_svc.engine import PrefillJob  # noqa: E402
from prefill_svc.kv_sender import InlineSender  # noqa: E402
from prefill_svc.page_scrub import scrub_unwritten  # noqa: E402


class ScrubbingInline(InlineSender):
    """The inline sender, plus the pages sender's scrub at its first spans call."""

    def __init__(self, request_id: str, pool, num_tokens: int) -> None:
        super().__init__(request_id)
        self.pool, self.num_tokens, self.zeroed, self.seconds = pool, num_tokens, -1, 0.0

    def spans(self, page_table, token_start, token_end, chunk_tokens):
        if self.zeroed < 0:
            started = time.perf_counter()
            self.zeroed = scrub_unwritten(self.pool, self.record.request_id,
                                          page_table.tolist(), self.num_tokens, token_end)
            self.seconds = time.perf_counter() - started
        return super().spans(page_table, token_start, token_end, chunk_tokens)


def _one(runtime, engine, prompt: list[int], request_id: str, scrub: bool
         ) -> tuple[float, float]:
    """One prompt prefilled -> (seconds of its passes, seconds of its scrub)."""
    ended: list[int] = []
    chunk = runtime.layout.chunk_tokens(DEFAULT_MAX_CHUNK_BYTES)
    sender = (ScrubbingInline(request_id, runtime.pool, len(prompt)) if scrub
              else InlineSender(request_id))
    engine._waiting.append(PrefillJob(request_id, prompt, SamplingConfig(), chunk,
                                      lambda f: ended.append(1) if f is None else None,
                                      sender=sender))
    started = time.perf_counter()
    while not ended:
        plan = engine._plan_pass()
        if not plan:
            raise RuntimeError("the engine planned nothing: the pool is too small")
        engine._run_pass(plan)
    return time.perf_counter() - started, sender.seconds if scrub else 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo", help="'demo' or a checkpoint directory")
    p.add_argument("--prompt-len", default="512,2048")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    lengths = [int(n) for n in args.prompt_len.split(",")]
    top = max(lengths)
    config = ServiceConfig(model=args.model, dtype="float32", pool_tokens=4 * (top + 64),
                           max_context_tokens=top, allow_context_beyond_pool=True)
    runtime = build_runtime(config, make_logger("prefill", stream=io.StringIO()))
    warm_up(runtime)
    vocab = runtime.loaded.config.vocab_size
    print(f"model {args.model}; median of {args.repeats}, arms interleaved; "
          f"KV {runtime.layout.kv_bytes_per_token} B/token")
    for n in lengths:
        engine = _engine(runtime, n, n)
        times: dict[bool, list[float]] = {False: [], True: []}
        scrubs: list[float] = []
        for rep in range(args.repeats + 1):  # the first round warms up
            for scrub in (False, True):
                prompt = [(7 * t + 101 * rep + 13 * scrub) % (vocab - 3) + 3 for t in range(n)]
                took, scrubbing = _one(runtime, engine, prompt, f"r{rep}-{n}-{int(scrub)}",
                                       scrub)
                if rep:
                    times[scrub].append(took)
                    scrubs += [scrubbing] if scrub else []
        plain, scrubbed = (statistics.median(times[s]) for s in (False, True))
        print(f"{n:>6} tokens: pass {1e3 * plain:8.1f} ms, with the scrub {1e3 * scrubbed:8.1f}"
              f" ms ({scrubbed / plain:.3f}x); the scrub itself "
              f"{1e3 * statistics.median(scrubs):.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
