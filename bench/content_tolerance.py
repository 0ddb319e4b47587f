"""The largest legitimate differences decode's content checks see, per dtype, on a backend.

Prefill computes a prompt's KV as its engine does (whole, in chunks of `--prefill-chunk-tokens`
attending over paged context, or in one pass with other prompts, or both), the KV travels as it
does on the wire (per layer, in the pool's dtype) into shuffled decode pages, and decode's own
checks measure it: layer 0 recomputed for every token (D-46) and the last position plus
`--depth-positions` random ones recomputed through every layer (D-47), and with `--audit` the
full audit's whole-prompt recompute (D-49, judged by the depth tolerance), with the functions
the checks themselves run (decode_svc/content_check.py, decode_svc/full_audit.py). Both sides
run the same backend (`--backend`, default cpu: the oneDNN prepacked bfloat16 projections), in
one process, one thread. The table gives the largest error of each model, dtype and mode, and
the summary the margin to decode_svc.content_check.TOLERANCES (tolerance / largest; a margin
below 1 means a legitimate handoff would be refused).

    python -m bench.content_tolerance --dtypes bfloat16,float16 --seeds 3 --audit

Models: the test checkpoints (tests/helpers/checkpoints.py SPECS and FAMILY_SPECS, made here in
a temporary folder), the demo model, and the bench checkpoint (`--bench-checkpoint`, made with
bench/make_bench_checkpoint.py; skipped when absent). Prompts never exceed a model's window.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.full_audit_margin import _batch
from bench.verify_margin import PAGE_SIZE, _pool
from common.model.llama import LlamaModel
from common.model.loaded import LoadedModel
from common.model.loader import load_model
from common.ops.select import make_ops
from common.sampling import SamplingConfig, sample_batch
from decode_svc.content_check import TOLERANCES, _depth_error, _layer0_error
from decode_svc.full_audit import recompute_and_compare

LENGTHS = (1, 3, 17, 31, 63, 127, 255, 511, 1023, 2047)  # odd, across page boundaries
MODES = ("whole", "chunked-23", "chunked-256", "batched", "batched-100")


@dataclass(frozen=True)
class Handoff:
    """One legitimate handoff as decode's checks measured it."""

    model: str
    dtype: str
    mode: str
    tokens: int
    seed: int
    layer0: float
    depth: float
    depth_layer: int
    first_token_agrees: bool
    audit: float | None  # None: not measured (no --audit)


def checkpoints(root: Path, bench_checkpoint: Path | None) -> Iterator[tuple[str, LoadedModel]]:
    """(name, loaded model) of every test family, the demo model and the bench checkpoint."""
    from tests.helpers.checkpoints import FAMILY_SPECS, SPECS, make_checkpoint

    for spec in [*SPECS, *FAMILY_SPECS]:
        path, _ = make_checkpoint(spec, root)
        yield spec.name, load_model(str(path))
    yield "demo", load_model("demo")
    if bench_checkpoint is not None and (bench_checkpoint / "config.json").is_file():
        yield "bench", load_model(str(bench_checkpoint))


def parse_mode(mode: str) -> tuple[bool, int | None]:
    """'whole' | 'chunked-C' | 'batched' | 'batched-C' -> (with other prompts, chunk tokens or
    None for the whole prompt in one pass)."""
    kind, _, chunk = mode.partition("-")
    valid = {"whole": not chunk, "chunked": chunk.isdigit(),
             "batched": not chunk or chunk.isdigit()}
    if not valid.get(kind, False) or chunk == "0":
        raise ValueError(f"unknown mode {mode!r}: whole, chunked-C, batched or batched-C")
    return kind == "batched", int(chunk) if chunk else None


def prefill(model: LlamaModel, prompt: list[int], others: list[list[int]],
            chunk: int | None) -> tuple[list[torch.Tensor], int]:
    """Prefill's engine on the prompt (request "p") and others: each pass takes the next chunk
    of every unfinished prompt (prefill_svc/pass_plan.py). -> the prompt's KV per layer
    [2, n, Hkv, D] in the pool's dtype, as sent, and prefill's first token."""
    jobs = [("p", prompt), *((f"o{i}", o) for i, o in enumerate(others))]
    total = sum(len(t) for _, t in jobs)
    pool = _pool(model, (total // PAGE_SIZE + len(jobs) + 1) * PAGE_SIZE)
    for rid, tokens in jobs:
        pool.allocator.allocate(rid, len(tokens))
    done = {rid: 0 for rid, _ in jobs}
    first = -1
    while any(done[rid] < len(t) for rid, t in jobs):
        items = []
        for rid, tokens in jobs:
            if done[rid] < len(tokens):
                end = len(tokens) if chunk is None else min(len(tokens), done[rid] + chunk)
                items.append((rid, tokens, done[rid], end))
        logits = model.prefill(_batch(pool, items, model.device), pool.k, pool.v)  # [B, V]
        for row, (rid, tokens, _, end) in enumerate(items):
            done[rid] = end
            if rid == "p" and end == len(tokens):
                first = sample_batch(logits[row:row + 1], [SamplingConfig()], [0])[0]
    table = torch.tensor(pool.allocator.page_table("p"), dtype=torch.int32, device=model.device)
    n = len(prompt)
    kv = [model.ops.pack_kv(pool.k[layer], pool.v[layer], table, 0, n).cpu()
          for layer in range(model.config.num_layers)]
    return kv, first


def measure_on_decode(model: LlamaModel, prompt: list[int], kv: list[torch.Tensor],
                      rng: random.Random, depth_positions: int,
                      audit: bool) -> tuple[float, float, int, int, float | None]:
    """Lands kv in shuffled decode pages and measures it as check_content does -> (layer-0
    error, depth error, its layer, decode's first token, the full audit's error or None)."""
    n, device = len(prompt), model.device
    pool = _pool(model, (2 * (n // PAGE_SIZE + 1) + 4) * PAGE_SIZE)
    spacers = [f"s{k}" for k in range(pool.allocator.num_pages - pool.allocator.pages_needed(n))]
    for name in spacers:  # scatter the request's pages over the pool
        pool.allocator.allocate(name, 1)
    for name in rng.sample(spacers, len(spacers) // 2):
        pool.allocator.free(name)
    pages = pool.allocator.allocate("d", n)
    table = torch.tensor(pages, dtype=torch.int32, device=device)
    for layer, buffer in enumerate(kv):
        model.ops.unpack_kv(buffer.to(device, model.dtype), pool.k[layer], pool.v[layer],
                            table, 0)
    ids = torch.tensor(prompt, dtype=torch.int64, device=device)
    layer0 = _layer0_error(model, pool, table, ids)
    audited = recompute_and_compare(model, pool, table, ids).error if audit else None
    positions = [n - 1, *sorted(rng.sample(range(n - 1), min(depth_positions, n - 1)))]
    depth, worst_layer, logits = _depth_error(model, pool, pages, table, ids, positions)
    first = sample_batch(logits[:1], [SamplingConfig()], [0])[0]
    return layer0, depth, worst_layer, first, audited


def run(name: str, loaded: LoadedModel, dtype: torch.dtype, backend: str, modes: list[str],
        lengths: list[int], seeds: int, depth_positions: int,
        audit: bool) -> Iterator[Handoff]:
    device = torch.device("cpu")
    prefill_model = LlamaModel(loaded.config, loaded.weights, make_ops(backend, device), device,
                               dtype)
    decode_model = LlamaModel(loaded.config, loaded.weights, make_ops(backend, device), device,
                              dtype)
    window = loaded.config.max_position_embeddings
    vocab = loaded.config.vocab_size
    for mode in modes:
        batched, chunk = parse_mode(mode)
        for n in [n for n in lengths if n <= window]:
            for seed in range(seeds):
                rng = random.Random(f"{name}/{mode}/{n}/{seed}")
                prompt = [rng.randrange(3, vocab) for _ in range(n)]
                others = [[rng.randrange(3, vocab) for _ in range(rng.randint(1, min(window, 300)))]
                          for _ in range(rng.randint(1, 3))] if batched else []
                kv, first = prefill(prefill_model, prompt, others, chunk)
                layer0, depth, layer, mine, audited = measure_on_decode(
                    decode_model, prompt, kv, rng, depth_positions, audit)
                yield Handoff(name, str(dtype).removeprefix("torch."), mode, n, seed, layer0,
                              depth, layer, mine == first, audited)


def report(rows: list[Handoff]) -> None:
    """The table (largest per model, dtype and mode) and the margins to TOLERANCES."""
    groups: dict[tuple[str, str, str], list[Handoff]] = {}
    for r in rows:
        groups.setdefault((r.model, r.dtype, r.mode), []).append(r)
    print(f"{'model':<22} {'dtype':<9} {'mode':<12} {'n':>4} {'layer0 max':>10} "
          f"{'depth max':>10} {'at tokens':>9} {'audit max':>10} {'first-token diff':>16}")
    for (model, dtype, mode), group in groups.items():
        worst = max(group, key=lambda r: r.depth)
        print(f"{model:<22} {dtype:<9} {mode:<12} {len(group):>4} "
              f"{max(r.layer0 for r in group):>10.3g} {worst.depth:>10.3g} {worst.tokens:>9} "
              f"{_audit(group):>10} {sum(not r.first_token_agrees for r in group):>16}")
    print()
    for dtype in sorted({r.dtype for r in rows}):
        mine = [r for r in rows if r.dtype == dtype]
        tol = TOLERANCES[getattr(torch, dtype)]
        l0 = max(mine, key=lambda r: r.layer0)
        dp = max(mine, key=lambda r: r.depth)
        refused = sum(r.layer0 > tol.layer0 or r.depth > tol.depth for r in mine)
        print(f"{dtype}: {len(mine)} handoffs, {refused} would be refused; layer0 largest "
              f"{l0.layer0:.3g} ({l0.model}, {l0.mode}, {l0.tokens} tokens), tolerance "
              f"{tol.layer0:g}, margin {_margin(tol.layer0, l0.layer0)}; depth largest "
              f"{dp.depth:.3g} ({dp.model}, {dp.mode}, {dp.tokens} tokens, layer "
              f"{dp.depth_layer}), tolerance {tol.depth:g}, margin {_margin(tol.depth, dp.depth)}")
        audited = [r.audit for r in mine if r.audit is not None]
        if audited:
            refused = sum(a > tol.depth for a in audited)
            print(f"{dtype}: full audit of {len(audited)} handoffs, {refused} would be refused; "
                  f"largest {max(audited):.3g}, tolerance {tol.depth:g}, margin "
                  f"{_margin(tol.depth, max(audited))}")


def _audit(group: list[Handoff]) -> str:
    audited = [r.audit for r in group if r.audit is not None]
    return f"{max(audited):.3g}" if audited else "-"


def _margin(tolerance: float, worst: float) -> str:
    return "exact" if worst == 0 else f"{tolerance / worst:.3g}x"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.content_tolerance",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dtypes", default="bfloat16", help="KV dtypes, comma separated")
    p.add_argument("--backend", default="cpu", help="ops backend of both sides")
    p.add_argument("--modes", default=",".join(MODES), help="how prefill computes the KV")
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="prompt tokens")
    p.add_argument("--seeds", type=int, default=3, help="prompts per model, mode and length")
    p.add_argument("--depth-positions", type=int, default=4, help="as --verify-depth-positions")
    p.add_argument("--audit", action="store_true", help="also the full audit's recompute")
    p.add_argument("--models", default="", help="only these model names (comma separated)")
    p.add_argument("--bench-checkpoint", type=Path, default=Path("/tmp/kvh-bench-llama"))
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--json", type=Path, help="write every handoff here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    only = {m for m in args.models.split(",") if m}
    modes = [m.strip() for m in args.modes.split(",")]
    for mode in modes:
        try:
            parse_mode(mode)
        except ValueError as exc:
            p.error(str(exc))
    dtypes = [d.strip() for d in args.dtypes.split(",")]
    known = {str(t).removeprefix("torch."): t for t in TOLERANCES}
    if unknown := [d for d in dtypes if d not in known]:
        p.error(f"--dtypes {','.join(unknown)}: choose from {', '.join(known)}")
    lengths = [int(x) for x in args.lengths.split(",")]
    rows: list[Handoff] = []
    with tempfile.TemporaryDirectory(prefix="kvh-content-tolerance-") as tmp:
        for name, loaded in checkpoints(Path(tmp), args.bench_checkpoint):
            if only and name not in only:
                continue
            for dtype_name in dtypes:
                rows += run(name, loaded, known[dtype_name], args.backend, modes, lengths,
                            args.seeds, args.depth_positions, args.audit)
                print(f"# {name} {dtype_name}: done", flush=True)
    report(rows)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))


if __name__ == "__main__":
    main()
