"""`kvhandoff bench decode`: decode tokens/s of the in-process engine at several batch sizes.

    kvhandoff bench decode [--batches 1,8,32] [--prompt-len 128] [--new-tokens 64]
                           [--dtype auto|float32|bfloat16] [--json OUT]

For each batch size B: B prompts are prefilled (the local-prefill engine, into the pool), then
all join the running batch at once and decode --new-tokens each; tokens/s counts the tokens of
decode steps (the first token of each comes from its prefill) over the time from joining to the
last one finishing. The model, pool and engine are the services' own (`build_runtime`,
`DecodeEngine` stepping), only without gRPC. "CPU ms/step" is this process's CPU time over the
same span per step: on a shared, busy host wall time mostly measures the neighbours, CPU time
(with --torch-threads 1) the work itself.
"""

from __future__ import annotations

import argparse
import io
import json
import threading
import time
from concurrent.futures import Future
from pathlib import Path


from common.capacity import CapacityError
from common.config import ServiceConfig
from common.counters import Counters
from common.log import make_logger
from common.sampling import SamplingConfig
from common.server.core_borrowing import CoreBorrowing
from common.server.runtime import build_service_runtime, warm_up
from common.server.torch_threads import in_passing_thread
from decode_svc.local_prefill import LocalPrefillEngine
from decode_svc.sequence import FailedEvent, FinishedEvent, Sequence


class _Finish:
    """Counts finished sequences of one batch (emit runs on the engine thread)."""

    def __init__(self, expected: int) -> None:
        self.left = expected
        self.done = threading.Event()
        self.errors: list[str] = []
        self.lock = threading.Lock()

    def emit(self, event) -> None:
        if isinstance(event, (FinishedEvent, FailedEvent)):
            if isinstance(event, FailedEvent):
                self.errors.append(str(event.error))
            with self.lock:
                self.left -= 1
                if self.left == 0:
                    self.done.set()


def _answer(call) -> object:
    future: Future = Future()
    call(future.set_result)
    return future.result(timeout=600)


def run_batch(engine: LocalPrefillEngine, batch: int, prompt_len: int, new_tokens: int,
              tag: str) -> tuple[float, float]:
    """-> (wall, process CPU) seconds from the batch joining to its last sequence finishing."""
    greedy = SamplingConfig()
    finish = _Finish(batch)
    sequences = []
    for i in range(batch):
        rid = f"{tag}-{i}"
        ids = [(13 * i + 7 * t) % 90 + 3 for t in range(prompt_len)]
        pages = _answer(lambda done, r=rid: engine.reserve(r, prompt_len + new_tokens - 1, done))
        if not isinstance(pages, list):
            raise RuntimeError(f"reservation refused: {pages}")
        first = _answer(lambda done, r=rid, ids=ids: engine.prefill(r, ids, greedy, done))
        sequences.append(Sequence(rid, prompt_len, ids + [first], new_tokens, greedy,
                                  frozenset(), finish.emit))
    started, cpu_started = time.perf_counter(), time.process_time()
    for seq in sequences:
        engine.begin(seq)
    if not finish.done.wait(timeout=3600):
        raise RuntimeError("the batch did not finish")
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    for seq in sequences:
        engine.release(seq.request_id)
    if finish.errors:
        raise RuntimeError(f"decode failed: {finish.errors[0]}")
    return elapsed, cpu


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvhandoff bench decode", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--batches", default="1,8,32", help="batch sizes, comma separated")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per sequence")
    p.add_argument("--model", default="demo", help="'demo' or a checkpoint directory")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--kernels", default="auto", help="auto, triton, cpu or torch")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"),
                   help="auto: bfloat16 on CUDA, float32 on the CPU (the services' default)")
    p.add_argument("--torch-threads", type=int, default=0, help="0: torch's default")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    per_seq = args.prompt_len + args.new_tokens
    config = ServiceConfig(model=args.model, device=args.device, kernels=args.kernels,
                           dtype=args.dtype,
                           pool_tokens=max(batches) * (per_seq + 16) + 64,
                           max_context_tokens=per_seq, allow_context_beyond_pool=True,
                           torch_threads=args.torch_threads)
    log = make_logger("decode", stream=io.StringIO())
    try:
        runtime = build_service_runtime(config, log)  # the engine's team is the only one
    except CapacityError as err:  # the window comes from this bench's flags: name them
        raise CapacityError(f"--prompt-len {args.prompt_len} + --new-tokens {args.new_tokens} "
                            f"= {per_seq} tokens a sequence: {err}") from None
    in_passing_thread(warm_up, runtime)
    engine = LocalPrefillEngine(runtime.model, runtime.pool, max_batch=max(batches),
                                max_waiting=max(batches), log=log, counters=Counters(),
                                cores=CoreBorrowing(runtime.cores))
    engine.start()
    rows = []
    try:
        run_batch(engine, 1, args.prompt_len, 4, "warmup")
        for batch in batches:
            seconds, cpu = run_batch(engine, batch, args.prompt_len, args.new_tokens,
                                     f"b{batch}")
            steps = args.new_tokens - 1
            rows.append({"batch": batch, "seconds": seconds, "tokens": batch * steps,
                         "tokens_per_s": batch * steps / seconds,
                         "ms_per_step": seconds / steps * 1e3,
                         "cpu_ms_per_step": cpu / steps * 1e3})
    finally:
        engine.stop()
    base = rows[0]["tokens_per_s"]
    print(f"model {args.model} on {runtime.model.device} ({runtime.kernels} kernels, "
          f"{str(runtime.model.dtype).removeprefix('torch.')}, "
          f"{runtime.cores.own_threads} torch threads); prompt {args.prompt_len} tokens, "
          f"{args.new_tokens} new tokens per sequence")
    print(f"{'batch':>6} {'tokens/s':>10} {'ms/step':>9} {'CPU ms/step':>12} "
          f"{'vs batch ' + str(rows[0]['batch']):>11}")
    for r in rows:
        print(f"{r['batch']:>6} {r['tokens_per_s']:>10.1f} {r['ms_per_step']:>9.2f} "
              f"{r['cpu_ms_per_step']:>12.2f} {r['tokens_per_s'] / base:>10.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "decode_throughput", "model": args.model,
                                         "dtype": str(runtime.model.dtype).removeprefix("torch."),
                                         "prompt_len": args.prompt_len,
                                         "new_tokens": args.new_tokens, "rows": rows}, indent=2))
    return 0
