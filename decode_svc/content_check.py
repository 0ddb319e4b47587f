"""Decode's check of a handoff's KV *content* (SPEC.md D-45..D-48): after the commit verified
the form, and before the sequence joins the batch, decode proves that the KV in its pages is the
KV of the prompt it sent.

1. finite: every received value (checked as each chunk lands, `FiniteTracker`);
2. layer 0: decode computes layer 0's K and V of its own prompt (embedding, norm, projections,
   RoPE depend only on each token and its position) and compares them, every token, with what
   arrived;
3. depth: decode recomputes the last prompt position and `depth_positions` positions it draws at
   random (unguessable, never sent) once layer 0 landed, through every layer over the received
   KV (one batched decode step), and compares each recomputed position's K and V, in every
   layer, with what prefill sent for it;
4. the first token is sampled from decode's own logits of the last position.

With `full_fraction` F > 0, a fraction F of handoffs is also audited between checks 2 and 3
(while the pages still hold exactly what arrived): decode recomputes the whole prompt and
compares every layer at every position (decode_svc/full_audit.py, SPEC.md D-49).

Differences are measured as max |received - recomputed| / rms(recomputed), per layer; the
tolerances per dtype are in SPEC.md section 7.4, with the measurements that justify them.
Checks 2 and 3 normally run layer by layer while the KV lands (decode_svc/content_pipeline.py,
the same computation, measured as each layer arrives); `check_content` then only judges what
they measured, in the order above, or runs them here in full when they did not see every layer.

Invariants: reads and writes only the request's own pages, and only slots its handoff covered;
the depth step run here overwrites the sampled slots with decode's own values (equal within
tolerance); run as the KV lands, it puts prefill's values back.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from common.handoff.reasons import HandoffRefused, refuse
from common.kvpool.kv_cache import KvPool
from common.model.llama import DecodeBatch, LlamaModel
from common.sampling import SamplingConfig, sample_batch
from decode_svc.full_audit import FullAudit
from decode_svc.kv_difference import relative_error

if TYPE_CHECKING:  # content_pipeline calls this module's measures
    from decode_svc.content_pipeline import ContentPipeline


@dataclass(frozen=True)
class ContentTolerance:
    """Largest accepted max |received - recomputed| / rms(recomputed) of one layer."""

    layer0: float
    depth: float


# Measured in SPEC.md section 7.4 (largest legitimate difference seen, then a margin).
TOLERANCES: dict[torch.dtype, ContentTolerance] = {
    torch.float32: ContentTolerance(layer0=1e-3, depth=5e-3),
    torch.float16: ContentTolerance(layer0=2e-2, depth=5e-2),
    torch.bfloat16: ContentTolerance(layer0=1e-1, depth=2.5e-1),
}


@dataclass(frozen=True)
class ContentCheckConfig:
    enabled: bool = True
    depth_positions: int = 4  # random prompt positions recomputed besides the last one
    full_fraction: float = 0.0  # share of handoffs audited in full (D-49); 0: none


@dataclass(frozen=True)
class ContentVerdict:
    """What the checks measured; first_token_id is decode's own."""

    first_token_id: int
    layer0_error: float
    depth_error: float
    positions: tuple[int, ...]
    seconds: float  # after the commit (the whole checks, unless they ran as the KV landed)
    landed_seconds: float = 0.0  # the engine time of the checks run as the KV landed


class FiniteTracker:
    """Per request: were all KV values written so far finite? Accumulates on the device without
    a host sync per chunk; read once, by `all_finite`."""

    def __init__(self) -> None:
        self._flags: dict[str, torch.Tensor] = {}

    def observe(self, request_id: str, kv: torch.Tensor) -> None:
        ok = torch.isfinite(kv).all()
        seen = self._flags.get(request_id)
        self._flags[request_id] = ok if seen is None else seen & ok

    def observe_result(self, request_id: str, ok: bool) -> None:
        """A chunk whose finiteness was already computed (decode_svc.finite_bits)."""
        seen = self._flags.get(request_id)
        flag = torch.tensor(ok)
        self._flags[request_id] = flag if seen is None else seen & flag

    def all_finite(self, request_id: str) -> bool:
        flag = self._flags.get(request_id)
        return flag is None or bool(flag.item())

    def forget(self, request_id: str) -> None:
        self._flags.pop(request_id, None)


def check_content(model: LlamaModel, pool: KvPool, request_id: str, token_ids: list[int],
                  sampling: SamplingConfig, config: ContentCheckConfig,
                  rng: random.Random, audit: FullAudit | None = None,
                  prepared: ContentPipeline | None = None) -> ContentVerdict:
    """Runs checks 2-4 on a request whose handoff is fully written into its pages, and the
    full audit when audit draws it; returns the verdict or raises HandoffRefused
    (KV_LAYER0_MISMATCH, KV_DEPTH_MISMATCH). prepared: the same checks already run layer by
    layer as the KV landed (decode_svc.content_pipeline); used only when it is this request's
    and complete, else the checks run here in full."""
    if (prepared is not None and prepared.complete and prepared.request_id == request_id
            and prepared.token_ids == token_ids):
        return _judge_prepared(model, pool, request_id, sampling, prepared, audit)
    started = time.perf_counter()
    tolerance = TOLERANCES[pool.k.dtype]
    device = model.device
    n = len(token_ids)
    pages = pool.allocator.page_table(request_id)
    table = torch.tensor(pages, dtype=torch.int32, device=device)
    ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
    layer0 = _layer0_error(model, pool, table, ids)
    _judge_layer0(layer0, tolerance)
    if audit is not None and audit.drawn():
        audit.check(model, pool, request_id, table, ids, tolerance.depth)
    others = rng.sample(range(n - 1), min(config.depth_positions, n - 1))
    positions = [n - 1, *sorted(others)]
    depth, layer, logits = _depth_error(model, pool, pages, table, ids, positions)
    _judge_depth(depth, layer, positions, tolerance)
    first = sample_batch(logits[:1], [sampling], [0])[0]
    return ContentVerdict(first, layer0, depth, tuple(positions),
                          time.perf_counter() - started)


def _judge_prepared(model: LlamaModel, pool: KvPool, request_id: str, sampling: SamplingConfig,
                    prepared: ContentPipeline, audit: FullAudit | None) -> ContentVerdict:
    """The verdict of checks 2-4 measured as the KV landed, in the order check_content gives
    them (layer 0, the audit when drawn, depth, the first token)."""
    started = time.perf_counter()
    tolerance = TOLERANCES[pool.k.dtype]
    layer0 = prepared.layer0_error
    _judge_layer0(layer0, tolerance)
    if audit is not None and audit.drawn():
        table = torch.tensor(pool.allocator.page_table(request_id), dtype=torch.int32,
                             device=model.device)
        ids = torch.tensor(prepared.token_ids, dtype=torch.int64, device=model.device)
        audit.check(model, pool, request_id, table, ids, tolerance.depth)
    errors = prepared.depth_errors  # per layer, measured as each layer landed
    layer = max(range(len(errors)), key=errors.__getitem__)
    depth = errors[layer]
    _judge_depth(depth, layer, prepared.positions, tolerance)
    first = sample_batch(prepared.logits[:1], [sampling], [0])[0]
    return ContentVerdict(first, layer0, depth, tuple(prepared.positions),
                          time.perf_counter() - started, prepared.seconds)


def _judge_layer0(layer0: float, tolerance: ContentTolerance) -> None:
    """Raises KV_LAYER0_MISMATCH unless layer0 is within the tolerance (a NaN is not)."""
    if not layer0 <= tolerance.layer0:
        raise refuse("KV_LAYER0_MISMATCH", f"layer 0 K/V differ from decode's own computation "
                     f"of the prompt by {layer0:.3g} (tolerance {tolerance.layer0:g}): the KV "
                     "is not the KV of the prompt decode sent")


def _judge_depth(depth: float, layer: int, positions, tolerance: ContentTolerance) -> None:
    """Raises KV_DEPTH_MISMATCH unless depth (worst at layer) is within the tolerance."""
    if not depth <= tolerance.depth:
        raise refuse("KV_DEPTH_MISMATCH", f"recomputing prompt positions {list(positions)} "
                     f"through every layer over the received KV gives layer {layer} K/V that "
                     f"differ by {depth:.3g} from what prefill sent (tolerance "
                     f"{tolerance.depth:g})")


def _layer0_error(model: LlamaModel, pool: KvPool, table: torch.Tensor,
                  ids: torch.Tensor) -> float:
    n = ids.shape[0]
    positions = torch.arange(n, dtype=torch.int64, device=ids.device)
    k, v = model.layer0_kv(ids, positions)  # [n, Hkv, D] each
    received = model.ops.pack_kv(pool.k[0], pool.v[0], table, 0, n)  # [2, n, Hkv, D]
    return max(relative_error(received[0], k), relative_error(received[1], v))


def _depth_error(model: LlamaModel, pool: KvPool, pages: list[int], table: torch.Tensor,
                 ids: torch.Tensor, positions: list[int]) -> tuple[float, int, torch.Tensor]:
    """-> (largest per-layer error, its layer, logits [m, vocab] with the last position first)."""
    device = ids.device
    slots = torch.tensor(pool.slots_at(pages, positions), dtype=torch.int64,
                         device=device)  # [m]
    sent = _gather(pool, slots)  # [L, 2, m, Hkv, D], before the step overwrites the slots
    where = torch.tensor(positions, dtype=torch.int64, device=device)
    batch = DecodeBatch(
        token_ids=ids[where], positions=where, slot_mapping=slots,
        page_table=table.unsqueeze(0).expand(len(positions), -1).contiguous(),
        seq_lens=(where + 1).to(torch.int32))
    logits = model.decode(batch, pool.k, pool.v)
    depth, worst = _depth_compare(sent, _gather(pool, slots))
    return depth, worst, logits


def _depth_compare(sent, mine) -> tuple[float, int]:
    """sent, mine: per layer [2, m, Hkv, D] (prefill's K/V at the depth rows' slots, decode's
    own) -> (the largest per-layer max |sent - mine| / rms(mine), its layer)."""
    errors = [relative_error(s, m) for s, m in zip(sent, mine, strict=True)]
    worst = max(range(len(errors)), key=errors.__getitem__)
    return errors[worst], worst


def _gather(pool: KvPool, slots: torch.Tensor) -> torch.Tensor:
    """K and V of the given slots in every layer: [L, 2, m, Hkv, D] (a copy)."""
    k = pool.k.flatten(1, 2)[:, slots]  # [L, m, Hkv, D]
    v = pool.v.flatten(1, 2)[:, slots]
    return torch.stack((k, v), dim=1)


def refusal_if_not_finite(tracker: FiniteTracker, request_id: str) -> HandoffRefused | None:
    if tracker.all_finite(request_id):
        return None
    return refuse("KV_NOT_FINITE", "the received KV holds NaN or infinite values")
