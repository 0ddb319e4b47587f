"""Where one prefill pass of the real PrefillEngine spends its time, part by part: the model's
ops and linears (as bench/step_profile.py times them), the engine's batch building, the
handoff packing (each layer's KV cut into chunk frames, crc32c and protobuf encoding), and the
commit (first-token sampling, commit frame, prefix-cache insert).

    python -m bench.prefill_pass_profile --model DIR [--prompts 1,8] [--prompt-len 1024]
        [--budgets 0,2048,1024] [--repeats 3] [--torch-threads 1] [--clock thread|wall]

Each setting submits N prompts of --prompt-len tokens (distinct, so the prefix cache is cold)
and runs the engine's own plan/pass loop on this thread until every commit went out, with
each pass budget of --budgets in turn (0: N x len, one pass), the budgets taking turns
within each repeat so that drift in the host's load hits them alike. On a busy host
``--clock thread --torch-threads 1`` counts this thread's CPU seconds: the cost of the work.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench import step_profile
from common.config import ServiceConfig
from common.counters import Counters
from common.handoff.layout import DEFAULT_MAX_CHUNK_BYTES
from common.log import make_logger
from common.sampling import SamplingConfig
from common.server.runtime import build_runtime, warm_up
from prefill_svc.engine import PrefillEngine, PrefillJob
from prefill_svc.send_budget import SendBudget


def _engine(runtime, max_batch_tokens: int, chunk_tokens: int) -> PrefillEngine:
    return PrefillEngine(runtime.model, runtime.pool, runtime.layout, max_batch_tokens,
                         make_logger("prefill", stream=io.StringIO()), Counters(),
                         SendBudget(1 << 40), prefill_chunk_tokens=chunk_tokens)


def run_prompts(runtime, engine: PrefillEngine, prompts: list[list[int]], tag: str) -> dict:
    """Submits prompts to engine (not started: its loop runs here) -> seconds per part."""
    clock = step_profile._Clock()
    step_profile._instrument(runtime.model, clock)
    model_prefill = runtime.model.prefill
    runtime.model.prefill = clock.wrap("other model code", model_prefill)
    engine._forward = clock.wrap("batch building (engine)", engine._forward)
    engine._emit_layer = clock.wrap("handoff packing (frames)", engine._emit_layer)
    engine._commit = clock.wrap("commit (frame, prefix cache)", engine._commit)
    ended = []
    chunk = runtime.layout.chunk_tokens(DEFAULT_MAX_CHUNK_BYTES)

    def emit(frame: bytes | None) -> None:  # the send budget is unbounded: nothing to release
        if frame is None:
            ended.append(1)

    for i, prompt in enumerate(prompts):
        engine._waiting.append(PrefillJob(f"{tag}-{i}", prompt, SamplingConfig(), chunk, emit))
    passes = 0
    t0 = step_profile._now()
    while len(ended) < len(prompts):
        plan = engine._plan_pass()
        if not plan:
            raise RuntimeError("the engine planned nothing: the pool is too small")
        engine._run_pass(plan)
        passes += 1
    total = step_profile._now() - t0
    step_profile._restore(runtime.model)
    del runtime.model.prefill
    del engine._forward, engine._emit_layer, engine._commit
    parts = dict(clock.seconds)
    parts["engine loop (plan, sample, python)"] = total - sum(parts.values())
    parts["total"] = total
    parts["passes"] = passes
    return parts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo", help="'demo' or a checkpoint directory")
    p.add_argument("--kernels", default="auto", help="auto, cpu or torch")
    p.add_argument("--prompts", default="1,8", help="prompts per setting, comma separated")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--budgets", type=lambda t: [int(b) for b in t.split(",") if b.strip()],
                   default=[0], help="pass budgets (--max-batch-tokens) to compare, comma "
                   "separated, taking turns; 0: all prompts in one pass")
    p.add_argument("--chunk-tokens", type=int, default=0, help="0: --prompt-len")
    p.add_argument("--repeats", type=int, default=3, help="timed runs (median reported)")
    p.add_argument("--torch-threads", type=int, default=0, help="0: torch's default")
    p.add_argument("--clock", default="wall", choices=("wall", "thread"))
    args = p.parse_args(argv)
    if args.clock == "thread":
        if args.torch_threads != 1:
            p.error("--clock thread counts one thread's CPU time: add --torch-threads 1")
        step_profile._now = time.thread_time
    counts = [int(c) for c in args.prompts.split(",") if c.strip()]
    n = args.prompt_len
    config = ServiceConfig(model=args.model, kernels=args.kernels, dtype="float32",
                           pool_tokens=max(counts) * (n + 64), torch_threads=args.torch_threads,
                           max_context_tokens=n, allow_context_beyond_pool=True)
    runtime = build_runtime(config, make_logger("prefill", stream=io.StringIO()))
    warm_up(runtime)
    vocab = runtime.loaded.config.vocab_size
    print(f"model {args.model}, {runtime.kernels} ops, {torch.get_num_threads()} torch threads, "
          f"{args.clock} clock; prompts of {n} tokens, median of {args.repeats}")
    for count in counts:
        budgets = [b or count * n for b in args.budgets]
        engines = {b: _engine(runtime, b, min(args.chunk_tokens or n, b)) for b in budgets}
        totals: dict[int, dict[str, list[float]]] = {b: defaultdict(list) for b in budgets}
        for rep in range(args.repeats + 1):  # the budgets take turns within each repeat
            for budget in budgets:
                prompts = [[(7 * t + 13 * i + 101 * rep + budget) % (vocab - 3) + 3
                            for t in range(n)] for i in range(count)]
                parts = run_prompts(runtime, engines[budget], prompts, f"r{rep}-{budget}")
                if rep:  # the first round warms up
                    for name, s in parts.items():
                        totals[budget][name].append(s)
        base = None
        for budget in budgets:
            parts = {name: statistics.median(v) for name, v in totals[budget].items()}
            passes = int(parts.pop("passes"))
            total = parts["total"]
            base = base or total
            step_profile.print_parts(f"{count} x {n} tokens, budget {budget} ({passes} passes)",
                                     parts)
            print(f"  -> {count * n / total:.0f} prompt tokens/s, {base / total:.2f}x the "
                  f"first budget's")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
