"""Audit sampling (`--verify-full-fraction F`, SPEC.md D-49): for a fraction F of handoffs,
decode recomputes the whole prompt itself and compares every layer's K and V, at every position,
with what arrived.

The content checks of D-46/D-47 see layer 0 everywhere but deeper layers only at the last
position and a few random ones; a fault confined to one position of the last layer is read only
by the logits, so they catch it only when they happen to draw that position. An audit catches
it every time it runs: with F per handoff.

- The draw: one `random.SystemRandom().random() < F` per handoff, made on decode's engine
  thread after the commit was verified. It is unguessable on purpose (not seeded): a prefill that
  could tell which handoffs are audited could be honest on those alone. F = 0 never audits and
  F = 1 always does, so both are exact in tests.
- The recompute: the model's own prefill path (`model.prefill`, the code that produced the KV on
  prefill), into a scratch of ONE layer's pages that every layer reuses (the caches passed have
  a stride-0 layer dimension). Each layer is compared as soon as it is stored
  (`on_layer_stored`), before the next layer overwrites the scratch, so the audit needs one
  layer's KV of memory, not the prompt's. The request's own pages are only read.
- The comparison: per layer, for K and for V, max |received - recomputed| / rms(recomputed)
  over every position (the measure of D-46, content_check.relative_error), against the depth
  tolerance of the pool's dtype (content_check.TOLERANCES; margins measured in SPEC.md 7.4 by
  `python -m bench.full_audit_margin`). A mismatch is KV_DEPTH_MISMATCH.

Runs on the engine thread, inside `check_content`, before the first token is sampled: a refusal
happens before any token is streamed, and the servicer's release frees the pages as for any
refusal.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import torch

from common.counters import Counters
from common.handoff.reasons import refuse
from common.kvpool.kv_cache import KvPool
from common.model.llama import LlamaModel, PrefillBatch
from decode_svc.kv_difference import relative_error_by_row

AUDITS = "full_audits"  # GetStats counters (and kvhandoff_engine_events_total{event=...})
AUDITS_REFUSED = "full_audits_refused"


@dataclass(frozen=True)
class AuditResult:
    """The worst difference an audit found: where, and by how much (relative, as D-46)."""

    error: float
    layer: int
    kv: str  # "K" or "V"
    position: int
    seconds: float


class FullAudit:
    """Draws, runs, counts and logs the audits of one decode engine (engine thread only)."""

    def __init__(self, fraction: float, rng: random.Random, counters: Counters, log) -> None:
        if not 0.0 <= fraction <= 1.0:  # the settings refuse this first; never audit by accident
            raise ValueError(f"verify_full_fraction must be in [0, 1], got {fraction!r}")
        self.fraction = fraction
        self._rng = rng
        self.counters = counters
        self.log = log

    def drawn(self) -> bool:
        """Is this handoff audited? One draw per handoff; F = 0 never, F = 1 always."""
        return self.fraction > 0.0 and self._rng.random() < self.fraction

    def check(self, model: LlamaModel, pool: KvPool, request_id: str, table: torch.Tensor,
              ids: torch.Tensor, tolerance: float) -> AuditResult:
        """Audits one handoff whose KV is in its pages; raises HandoffRefused
        (KV_DEPTH_MISMATCH) when any layer differs by more than tolerance."""
        result = recompute_and_compare(model, pool, table, ids)
        refused = not result.error <= tolerance
        self.counters.add(AUDITS)
        if refused:
            self.counters.add(AUDITS_REFUSED)
        self.log.info("full_audit", request_id=request_id, prompt_tokens=int(ids.shape[0]),
                      error=round(result.error, 8) if math.isfinite(result.error) else "inf",
                      layer=result.layer, kv=result.kv, position=result.position,
                      tolerance=tolerance, refused=refused, seconds=round(result.seconds, 5))
        if refused:
            raise refuse("KV_DEPTH_MISMATCH", f"audit (--verify-full-fraction): recomputing the "
                         f"whole prompt gives layer {result.layer} {result.kv} at position "
                         f"{result.position} that differs by {result.error:.3g} from what "
                         f"prefill sent (tolerance {tolerance:g})")
        return result


def recompute_and_compare(model: LlamaModel, pool: KvPool, table: torch.Tensor,
                          ids: torch.Tensor) -> AuditResult:
    """Prefills ids (the prompt, [n]) into a one-layer scratch and compares each layer with the
    request's pages (table: [pages] int32); -> the worst relative difference and where."""
    started = time.perf_counter()
    device = ids.device
    n = ids.shape[0]
    page_size, num_layers = pool.page_size, pool.k.shape[0]
    pages = -(-n // page_size)
    one_layer = (1, pages, page_size, *pool.k.shape[3:])  # [1, P, S, Hkv, D]
    k_scratch = torch.empty(one_layer, dtype=pool.k.dtype, device=device)
    v_scratch = torch.empty(one_layer, dtype=pool.v.dtype, device=device)
    errors: list[torch.Tensor] = []  # per layer: [2, n] (K, V) relative error per position

    def compare(layer: int) -> None:
        mine = torch.stack((k_scratch[0].flatten(0, 1)[:n],
                            v_scratch[0].flatten(0, 1)[:n]))  # [2, n, Hkv, D]
        sent = model.ops.pack_kv(pool.k[layer], pool.v[layer], table, 0, n)  # [2, n, Hkv, D]
        errors.append(torch.stack([relative_error_by_row(sent[i], mine[i])
                                   for i in range(2)]))  # [2, n]: K and V, each its own scale

    batch = PrefillBatch(
        token_ids=ids, positions=torch.arange(n, dtype=torch.int64, device=device),
        slot_mapping=torch.arange(n, dtype=torch.int64, device=device),
        cu_seqlens=torch.tensor([0, n], dtype=torch.int32, device=device), max_seqlen=n)
    model.prefill(batch, k_scratch.expand(num_layers, *one_layer[1:]),
                  v_scratch.expand(num_layers, *one_layer[1:]), on_layer_stored=compare)
    table_of_errors = torch.stack(errors).cpu()  # [L, 2, n]: one device sync for the audit
    worst = int(table_of_errors.argmax())
    layer, kv, position = (worst // (2 * n), (worst // n) % 2, worst % n)
    return AuditResult(float(table_of_errors.flatten()[worst]), layer, "KV"[kv], position,
                       time.perf_counter() - started)
