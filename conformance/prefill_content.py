"""Prefill cases on the KV *content* (SPEC.md P-17): against a trusted reference prefill when
the suite was given one (`--reference-prefill`), and without one, that no layer's K or V is a
copy of another layer's (e.g. layer 0's KV sent for every layer) and that the KV of a prompt's
first tokens are those of that shorter prompt (a causal model's KV at a position depend only on
the tokens up to it: the KV of another prompt breaks this)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from common.pb.kvhandoff.v1 import handoff_pb2
from conformance.kv_content import compare_to_reference, copied_layers, handoff_kv, tolerance_for
from conformance.prefill_checks import check_handoff
from conformance.runner import NotApplicable
from conformance.wire import read_handoff

if TYPE_CHECKING:
    from conformance.prefill_suite import PrefillTarget


@dataclass(frozen=True)
class ReferencePrefill:
    """A prefill the operator trusts (e.g. ours), serving the target's model."""

    channel: grpc.aio.Channel
    info: handoff_pb2.GetPrefillInfoResponse


def content_prompt_lengths(t: PrefillTarget) -> list[int]:
    """1 token, and several pages plus a remainder (within the target's limit)."""
    limit = int(t.info.max_prompt_tokens)
    return sorted({1, min(limit, 4 * t.info.page_size + 3)})


def _tolerance(t: PrefillTarget) -> float:
    return tolerance_for(t.info.layout.dtype, t.kv_tolerance)


async def _served_kv(t: PrefillTarget, channel, info, case_id: str, prompt: list[int]):
    """(problems, kv): the form problems of the handoff, or its KV when it is well formed."""
    request = t.request(case_id, prompt, model_fingerprint=info.model_fingerprint)
    received = await read_handoff(channel, request, t.timeout)
    problems = check_handoff(request, info, received)
    return problems, None if problems else handoff_kv(received, info.layout, len(prompt))


async def kv_matches_reference(t: PrefillTarget) -> list[str]:
    ref = t.reference
    if ref is None:
        raise NotApplicable("no --reference-prefill given")
    if (ref.info.model_fingerprint, ref.info.layout) != (t.info.model_fingerprint, t.info.layout):
        return [(f"[P-17] the reference prefill serves {ref.info.model_fingerprint!r} "
                 f"({ref.info.layout}), the target {t.info.model_fingerprint!r}: not comparable")]
    problems: list[str] = []
    for n in content_prompt_lengths(t):
        prompt = t.prompt(n, 40 + n)
        found, mine = await _served_kv(t, t.channel, t.info, "kv_matches_reference", prompt)
        if found:
            problems += [f"{n} tokens: {p}" for p in found]
            continue
        found, theirs = await _served_kv(t, ref.channel, ref.info, "kv_reference", prompt)
        if found:
            return [f"the reference prefill's handoff is not well formed: {found[0]}"]
        problems += [f"{n} tokens: {p}" for p in compare_to_reference(mine, theirs, _tolerance(t))]
    return problems


async def kv_prefix_consistent(t: PrefillTarget) -> list[str]:
    n = max(content_prompt_lengths(t))
    if n < 2:
        raise NotApplicable("the prompt limit is one token")
    prompt, m = t.prompt(n, 42), n // 2
    found, whole = await _served_kv(t, t.channel, t.info, "kv_prefix_whole", prompt)
    if found:
        return [f"{n} tokens: {p}" for p in found]
    found, head = await _served_kv(t, t.channel, t.info, "kv_prefix_head", prompt[:m])
    if found:
        return [f"{m} tokens: {p}" for p in found]
    return compare_to_reference(whole.head(m), head, _tolerance(t),
                                f"the KV of the prompt's first {m} tokens alone")


async def kv_layers_distinct(t: PrefillTarget) -> list[str]:
    if t.info.layout.num_layers < 2:
        raise NotApplicable("the model has one layer")
    n = max(content_prompt_lengths(t))
    found, kv = await _served_kv(t, t.channel, t.info, "kv_layers_distinct", t.prompt(n, 41))
    return found or copied_layers(kv, _tolerance(t))


async def kv_cached_prefix_consistent(t: PrefillTarget) -> list[str]:
    """P-81: under one (fresh, random) cache scope a prompt, then a sibling sharing only its
    first page, then the prompt again (a prefill with a prefix cache serves the last two partly
    from it); the sibling once more under a scope nobody used (computed fresh). Every handoff
    well formed; the cached ones' KV equal the fresh ones' within the tolerance. A prefill
    without a cache passes trivially."""
    n, page = max(content_prompt_lengths(t)), max(1, int(t.info.page_size))
    if n <= 2 * page:
        raise NotApplicable("the prompt limit is two pages")
    prompt = t.prompt(n, 43)
    sibling = prompt[:page] + t.prompt(n - page, 44)
    scope, fresh = secrets.token_bytes(16), secrets.token_bytes(16)
    runs = [("kv_cache_first", prompt, scope), ("kv_cache_sibling", sibling, scope),
            ("kv_cache_again", prompt, scope), ("kv_cache_sibling_fresh", sibling, fresh)]
    kvs = []
    for case_id, tokens, cache_scope in runs:
        request = t.request(case_id, tokens, cache_scope=cache_scope)
        received = await read_handoff(t.channel, request, t.timeout)
        found = check_handoff(request, t.info, received)
        if found:
            return [f"{case_id}: {p}" for p in found]
        kvs.append(handoff_kv(received, t.info.layout, len(tokens)))
    return [f"{case_id}: {p}" for case_id, (a, b) in (
        ("kv_cache_sibling", (kvs[1], kvs[3])), ("kv_cache_again", (kvs[2], kvs[0])))
        for p in compare_to_reference(a, b, _tolerance(t), "the same prompt's KV computed "
                                      "without a cache hit")]
