"""A decode step of one model with two sets of ops taking turns in one run, part by part.

    python bench/step_ab.py --model DIR --kernels cpu --dtype bfloat16 --torch-threads 1 \\
        --swap rmsnorm=torch [--swap decode_attention=/tmp/old.py:decode_attention_sdpa] \\
        [--batches 1,8] [--context 192] [--shuffle-pages] [--rounds 4] [--repeats 5]

Side A is the backend as it is; side B is the same backend with each ``--swap OP=...`` op
replaced: ``torch`` takes the torch reference's op, ``PATH:FUNCTION`` a function with the op's
signature loaded from a file (e.g. the previous commit's kernel, ``git show
HEAD~:common/kernels/decode_attention_sdpa.py > /tmp/old.py``). The model, its weights and the
KV pool are built once; A and B alternate ``--rounds`` times per batch, each round timing
``--repeats`` steps exactly as bench/step_profile.py does (thread CPU time, one torch thread),
and the table gives each part's median over the rounds and B / A. On a shared host only ratios
of one run mean anything.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench import step_profile
from common.model.loader import load_model
from common.model.registry import build_model
from common.ops.select import make_ops
from common.ops.torch_ops import TorchOps

SWAPPABLE = step_profile.OP_NAMES + ("pack_kv", "unpack_kv")


class _SwappedOps:
    """ops with some of its methods replaced by plain functions of the same signature."""

    def __init__(self, ops, swaps: dict) -> None:
        self.name = ops.name
        for op in SWAPPABLE:
            setattr(self, op, swaps.get(op, getattr(ops, op)))


def _load_swap(spec: str):
    """'OP=torch' or 'OP=PATH:FUNCTION' -> (op name, function)."""
    op, _, source = spec.partition("=")
    if op not in SWAPPABLE or not source:
        raise SystemExit(f"--swap {spec!r}: want OP=torch or OP=PATH:FUNCTION, OP one of "
                         f"{', '.join(SWAPPABLE)}")
    if source == "torch":
        return op, getattr(TorchOps(), op)
    path, _, name = source.rpartition(":")
    if not path or not Path(path).is_file():
        raise SystemExit(f"--swap {spec!r}: no file {path!r}")
    module_spec = importlib.util.spec_from_file_location(f"_swap_{op}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not callable(getattr(module, name, None)):
        raise SystemExit(f"--swap {spec!r}: {path} has no function {name!r}")
    return op, getattr(module, name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo", help="'demo' or a checkpoint directory")
    p.add_argument("--kernels", default="cpu", help="the ops backend of side A")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--swap", action="append", default=[], help="OP=torch or OP=PATH:FUNCTION")
    p.add_argument("--batches", default="1,8", help="decode batch sizes, comma separated")
    p.add_argument("--context", type=int, default=192, help="tokens each sequence holds")
    p.add_argument("--shuffle-pages", action="store_true", help="scatter each sequence's pages")
    p.add_argument("--rounds", type=int, default=4, help="A, B turns per batch")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per turn (median)")
    p.add_argument("--torch-threads", type=int, default=1, choices=(1,),
                   help="one thread: the thread clock counts all of torch's work")
    args = p.parse_args(argv)
    swaps = dict(_load_swap(s) for s in args.swap)
    if not swaps:
        p.error("name at least one --swap")
    torch.set_num_threads(args.torch_threads)
    step_profile._now = time.thread_time
    loaded = load_model(args.model)
    device = torch.device("cpu")
    model = build_model(loaded.config, loaded.weights, make_ops(args.kernels, device), device,
                        getattr(torch, args.dtype))
    sides = {"A": model.ops, "B": _SwappedOps(model.ops, swaps)}
    print(f"model {args.model}, {args.kernels} ops, {args.dtype}, 1 torch thread, thread clock; "
          f"B swaps {', '.join(args.swap)}; {args.rounds} rounds of {args.repeats} steps")
    for batch in (int(b) for b in args.batches.split(",") if b.strip()):
        runs: dict[str, list[dict]] = {"A": [], "B": []}
        for _ in range(args.rounds):
            for side, ops in sides.items():
                model.ops = ops
                runs[side].append(step_profile.profile_decode(model, batch, args.context,
                                                              args.repeats, args.shuffle_pages))
        model.ops = sides["A"]
        med = {side: {part: statistics.median(r[part] for r in rs) for part in rs[0]}
               for side, rs in runs.items()}
        print(f"\ndecode step, batch {batch}, context {args.context}"
              f"{', shuffled pages' if args.shuffle_pages else ''}: ms, A | B | B / A")
        for part in sorted(med["A"], key=lambda k: -med["A"][k]):
            a, b = med["A"][part] * 1e3, med["B"][part] * 1e3
            print(f"  {part:<30} {a:8.3f} {b:8.3f}  {b / a if a > 0 else float('nan'):6.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
