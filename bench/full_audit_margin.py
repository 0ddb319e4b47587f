"""How close legitimate handoffs come to the full audit's tolerance (SPEC.md D-49, 7.4).

The audit recomputes the whole prompt with one unchunked prefill; the KV it compares against
came from prefill's engine, which may have computed it differently: in chunks attending over
paged context (`--prefill-chunk-tokens`, prefix-cache hits), or batched with other prompts in
one forward pass. Each mode is run here as prefill's engine runs it, in process, on the demo
model, and the largest legitimate audit error (max |received - recomputed| / rms(recomputed) of
a layer, over every layer, K and V, and position) is reported against the tolerance.

    python -m bench.full_audit_margin --handoffs 12 --dtypes float32,bfloat16
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from bench.verify_margin import PAGE_SIZE, _pool, lengths, model_on
from common.model.llama import LlamaModel, PrefillBatch
from decode_svc.content_check import TOLERANCES
from decode_svc.full_audit import recompute_and_compare

MODES = ("whole", "chunked-16", "chunked-23", "batched")


def _batch(pool, items: list[tuple[str, list[int], int, int]], device) -> PrefillBatch:
    """items: (request id, prompt, start, end): one forward pass over those pieces."""
    ids, positions, slots, cu, contexts, tables = [], [], [], [0], [], []
    for rid, prompt, start, end in items:
        pages = pool.allocator.page_table(rid)
        ids += prompt[start:end]
        positions += range(start, end)
        slots += pool.slots_for(pages, start, end)
        cu.append(cu[-1] + end - start)
        contexts.append(start)
        tables.append(pages)
    paged = any(contexts)
    width = max(len(t) for t in tables)
    return PrefillBatch(
        token_ids=torch.tensor(ids, device=device), positions=torch.tensor(positions,
                                                                           device=device),
        slot_mapping=torch.tensor(slots, device=device),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
        max_seqlen=max(e - s for _, _, s, e in items),
        context_lens=torch.tensor(contexts, dtype=torch.int32, device=device) if paged else None,
        page_table=(torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                 dtype=torch.int32, device=device) if paged else None))


def audit_error(model: LlamaModel, prompt: list[int], mode: str, rng: random.Random) -> float:
    """Prefill of prompt as `mode`, then the audit over its pages -> the audit's error."""
    n, device = len(prompt), model.device
    other = [rng.randrange(2, model.config.vocab_size) for _ in range(rng.randint(1, 40))]
    pool = _pool(model, (2 * (n + len(other)) // PAGE_SIZE + 4) * PAGE_SIZE)
    pool.allocator.allocate("other", len(other))
    pool.allocator.allocate("p", n)
    if mode == "batched":
        model.prefill(_batch(pool, [("other", other, 0, len(other)), ("p", prompt, 0, n)],
                             device), pool.k, pool.v)
    else:
        step = n if mode == "whole" else int(mode.split("-")[1])
        for start in range(0, n, step):
            model.prefill(_batch(pool, [("p", prompt, start, min(n, start + step))], device),
                          pool.k, pool.v)
    table = torch.tensor(pool.allocator.page_table("p"), dtype=torch.int32, device=device)
    return recompute_and_compare(model, pool, table, torch.tensor(prompt, device=device)).error


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.full_audit_margin",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--handoffs", type=int, default=12, help="prompts per dtype and mode")
    p.add_argument("--dtypes", default="float32,bfloat16", help="KV dtypes, comma separated")
    p.add_argument("--modes", default=",".join(MODES), help="how prefill computes the KV")
    p.add_argument("--seed", type=int, default=0, help="prompt lengths and tokens")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    rows = []
    print(f"{'dtype':>9} {'prefill as':>11} {'handoffs':>8} {'largest error':>14} "
          f"{'tolerance':>10} {'margin':>8}")
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name.strip())
        model = model_on("torch", dtype)
        tolerance = TOLERANCES[dtype].depth
        for mode in args.modes.split(","):
            rng = random.Random(args.seed)
            worst = 0.0
            for n in lengths(args.handoffs, rng):
                prompt = [rng.randrange(2, model.config.vocab_size) for _ in range(n)]
                worst = max(worst, audit_error(model, prompt, mode.strip(), rng))
            margin = tolerance / worst if worst else None  # None: bit-exact every time
            rows.append({"dtype": name, "mode": mode, "handoffs": args.handoffs,
                         "largest_error": worst, "tolerance": tolerance, "margin": margin})
            shown = "exact" if margin is None else f"{margin:.3g}x"
            print(f"{name:>9} {mode:>11} {args.handoffs:>8} {worst:>14.3g} {tolerance:>10g} "
                  f"{shown:>8}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "full_audit_margin", "rows": rows},
                                        indent=2))


if __name__ == "__main__":
    main()
