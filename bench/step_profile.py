"""Where a decode step and a prefill pass spend their time, part by part, on this machine.

    python bench/step_profile.py --model DIR [--kernels torch] [--batches 1,8] [--context 1088]
                                 [--prompt-len 1024] [--repeats 5] [--json OUT]

Each op of the ops backend and every linear layer of the model are timed by a wrapper around
them (the CPU runs them synchronously, so wall time per call is their cost); what the model's
forward spends outside them is "other model code". A decode step is also timed the way the
engine runs it: building the batch tensors from the sequences (bookkeeping), the forward, and
sampling. Prints one table per setting with each part's milliseconds and share.

On a shared, busy host wall time mostly measures the neighbours: ``--clock thread`` with
``--torch-threads 1`` counts the CPU seconds of this thread instead (torch then runs every op on
it), which is the cost of the work itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from common.model.loader import load_model
from common.model.protocol import DecodeBatch, PrefillBatch
from common.model.registry import build_model
from common.ops.select import make_ops
from common.sampling import SamplingConfig, sample_batch

PAGE_SIZE = 16
OP_NAMES = ("rmsnorm", "rope", "store_kv", "prefill_attention", "paged_prefill_attention",
            "decode_attention")


_now = time.perf_counter  # or time.thread_time (--clock thread)


class _Clock:
    """Accumulates exclusive seconds per part name (a timed call inside another timed call
    counts for itself only)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._inner: list[float] = []  # per open call: seconds of the timed calls inside it

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            start = _now()
            self._inner.append(0.0)
            try:
                return fn(*args, **kwargs)
            finally:
                spent = _now() - start
                self.seconds[name] += spent - self._inner.pop()
                if self._inner:
                    self._inner[-1] += spent
        return timed


class _TimedOps:
    """The backend's ops, each call timed under its own name."""

    def __init__(self, ops, clock: _Clock) -> None:
        self.name = ops.name
        self._ops = ops
        for op in OP_NAMES + ("pack_kv", "unpack_kv"):
            setattr(self, op, clock.wrap(op, getattr(ops, op)))


def _instrument(model, clock: _Clock) -> None:
    model.ops = _TimedOps(model.ops, clock)
    model._linear = clock.wrap("linear (q/k/v/o, mlp)", model._linear)
    model._logits = clock.wrap("final norm + lm_head", model._logits)


def _random_pool(config, dtype, num_pages):
    shape = (config.num_layers, num_pages, PAGE_SIZE, config.num_kv_heads, config.head_dim)
    return torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)


def profile_decode(model, batch: int, context: int, repeats: int, shuffle: bool) -> dict:
    """One decode step of `batch` sequences that each hold `context` tokens, each in one
    ascending run of pages (as a fresh pool hands them out), or in shuffled pages."""
    c = model.config
    pages_each = (context + 1 + PAGE_SIZE - 1) // PAGE_SIZE
    k_cache, v_cache = _random_pool(c, model.dtype, batch * pages_each + 1)
    order = torch.randperm(batch * pages_each) if shuffle else torch.arange(batch * pages_each)
    perm = (1 + order).tolist()
    seq_pages = [perm[b * pages_each:(b + 1) * pages_each] for b in range(batch)]
    tokens = [[(7 * b + t) % c.vocab_size for t in range(context + 1)] for b in range(batch)]
    greedy = [SamplingConfig()] * batch
    totals: dict[str, list[float]] = defaultdict(list)
    for rep in range(repeats + 1):
        clock = _Clock()
        _instrument(model, clock)
        t0 = _now()
        table = torch.zeros(batch, pages_each, dtype=torch.int32)
        positions, slots = [], []
        for row, pages in enumerate(seq_pages):  # what DecodeEngine._step builds
            table[row, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
            pos = context
            positions.append(pos)
            slots.append(pages[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE)
        step = DecodeBatch(
            token_ids=torch.tensor([t[-1] for t in tokens], dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64), page_table=table,
            seq_lens=torch.tensor([p + 1 for p in positions], dtype=torch.int32))
        t1 = _now()
        logits = model.decode(step, k_cache, v_cache)
        t2 = _now()
        sample_batch(logits, greedy, [1] * batch)
        t3 = _now()
        _restore(model)
        if rep == 0:
            continue  # warm-up
        parts = dict(clock.seconds)
        parts["other model code"] = (t2 - t1) - sum(parts.values())
        parts["batch tensors (bookkeeping)"] = t1 - t0
        parts["sampling"] = t3 - t2
        parts["total"] = t3 - t0
        for name, s in parts.items():
            totals[name].append(s)
    return {name: statistics.median(v) for name, v in totals.items()}


def profile_prefill(model, prompt_len: int, repeats: int) -> dict:
    """One prefill pass of one prompt of `prompt_len` tokens into fresh pages."""
    c = model.config
    num_pages = (prompt_len + PAGE_SIZE - 1) // PAGE_SIZE
    k_cache, v_cache = _random_pool(c, model.dtype, num_pages + 1)
    batch = PrefillBatch(
        token_ids=torch.tensor([(5 * t) % c.vocab_size for t in range(prompt_len)]),
        positions=torch.arange(prompt_len), slot_mapping=torch.arange(prompt_len) + PAGE_SIZE,
        cu_seqlens=torch.tensor([0, prompt_len], dtype=torch.int32), max_seqlen=prompt_len)
    totals: dict[str, list[float]] = defaultdict(list)
    for rep in range(repeats + 1):
        clock = _Clock()
        _instrument(model, clock)
        t0 = _now()
        model.prefill(batch, k_cache, v_cache)
        t1 = _now()
        _restore(model)
        if rep == 0:
            continue
        parts = dict(clock.seconds)
        parts["other model code"] = (t1 - t0) - sum(parts.values())
        parts["total"] = t1 - t0
        for name, s in parts.items():
            totals[name].append(s)
    return {name: statistics.median(v) for name, v in totals.items()}


def _restore(model) -> None:
    model.ops = model.ops._ops
    del model._linear, model._logits  # back to the class's methods


def print_parts(title: str, parts: dict) -> None:
    total = parts["total"]
    print(f"\n{title}: {total * 1e3:.2f} ms")
    for name, s in sorted(parts.items(), key=lambda kv: -kv[1]):
        if name != "total" and s > 0:
            print(f"  {name:<30} {s * 1e3:9.2f} ms {100 * s / total:6.1f} %")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo", help="'demo' or a checkpoint directory")
    p.add_argument("--kernels", default="torch", help="the ops backend on the CPU")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--batches", default="1,8", help="decode batch sizes, comma separated")
    p.add_argument("--context", type=int, default=1088, help="tokens each sequence holds")
    p.add_argument("--shuffle-pages", action="store_true",
                   help="scatter each sequence's pages (a fragmented pool), not one run each")
    p.add_argument("--prompt-len", type=int, default=1024, help="prefill prompt tokens")
    p.add_argument("--repeats", type=int, default=5, help="timed runs (median reported)")
    p.add_argument("--torch-threads", type=int, default=0, help="0: torch's default")
    p.add_argument("--clock", default="wall", choices=("wall", "thread"),
                   help="wall time, or this thread's CPU time (needs --torch-threads 1)")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    if args.clock == "thread":
        if args.torch_threads != 1:
            p.error("--clock thread counts one thread's CPU time: add --torch-threads 1")
        global _now
        _now = time.thread_time
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    loaded = load_model(args.model)
    device = torch.device("cpu")
    dtype = getattr(torch, args.dtype)
    model = build_model(loaded.config, loaded.weights, make_ops(args.kernels, device), device,
                        dtype)
    print(f"model {args.model}, {args.kernels} ops, {args.dtype}, "
          f"{torch.get_num_threads()} torch threads, {args.clock} clock, "
          f"{'shuffled' if args.shuffle_pages else 'one run of'} pages per sequence")
    results = {}
    for batch in (int(b) for b in args.batches.split(",") if b.strip()):
        parts = profile_decode(model, batch, args.context, args.repeats, args.shuffle_pages)
        print_parts(f"decode step, batch {batch}, context {args.context}", parts)
        results[f"decode_b{batch}"] = parts
    if args.prompt_len > 0:
        parts = profile_prefill(model, args.prompt_len, args.repeats)
        print_parts(f"prefill, one {args.prompt_len}-token prompt", parts)
        results[f"prefill_{args.prompt_len}"] = parts
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "step_profile", "model": args.model,
                                         "kernels": args.kernels, "dtype": args.dtype,
                                         "clock": args.clock,
                                         "shuffle_pages": args.shuffle_pages,
                                         "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
