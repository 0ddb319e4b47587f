"""Prefill cases of the prefix cache's scopes (SPEC.md P-80, P-81) beyond
`kv_cached_prefix_consistent`: a prompt of whole pages seen again (the page holding its last
token must be computed, its logits give the first token), and requests without a scope, which
must neither read nor fill the cache: their KV would be right either way, so the case reads the
prefill's GetStats counters (P-83)."""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

from conformance.kv_content import compare_to_reference, handoff_kv, tolerance_for
from conformance.prefill_checks import check_handoff
from conformance.runner import NotApplicable
from conformance.wire import read_handoff

if TYPE_CHECKING:
    from conformance.prefill_suite import PrefillTarget

WHOLE_PAGES = 4
# a prompt of four pages takes well under a second; a prefill with nothing left to compute
# never answers, and the case should not wait the suite's whole deadline for it
CACHE_CASE_TIMEOUT_S = 30.0
TOKENS_COMPUTED = "prefill_tokens_computed"
PAGES_INSERTED = "prefix_cache_pages_inserted"


async def _served(t: PrefillTarget, case_id: str, prompt: list[int], scope: bytes):
    """(problems, kv) of one handoff under cache_scope `scope` (b"": none)."""
    request = t.request(case_id, prompt, cache_scope=scope)
    received = await read_handoff(t.channel, request, min(t.timeout, CACHE_CASE_TIMEOUT_S))
    found = [f"{case_id}: {p}" for p in check_handoff(request, t.info, received)]
    return found, None if found else handoff_kv(received, t.info.layout, len(prompt))


async def kv_cached_whole_pages(t: PrefillTarget) -> list[str]:
    """P-81: a prompt of exactly four pages under one fresh scope, the same prompt again (a
    cache can lend at most the pages before the one holding the last token), then under a
    scope nobody used: every handoff well formed within 30 s, the repeat's KV equal to the
    fresh one's within the tolerance."""
    page = max(1, int(t.info.page_size))
    pages = min(WHOLE_PAGES, int(t.info.max_prompt_tokens) // page)
    if pages < 2:
        raise NotApplicable("the prompt limit is under two pages")
    prompt = t.prompt(pages * page, 45)
    scope = secrets.token_bytes(16)
    kvs = []
    for case_id, cache_scope in (("kv_whole_first", scope), ("kv_whole_again", scope),
                                 ("kv_whole_fresh", secrets.token_bytes(16))):
        found, kv = await _served(t, case_id, prompt, cache_scope)
        if found:
            return found
        kvs.append(kv)
    return [f"kv_whole_again: {p}" for p in compare_to_reference(
        kvs[1], kvs[2], tolerance_for(t.info.layout.dtype, t.kv_tolerance),
        f"the same {pages}-page prompt's KV computed without a cache hit")]


async def _counters(t: PrefillTarget) -> dict[str, int]:
    return dict((await t.pool.read()).counters)


async def cache_unscoped_untouched(t: PrefillTarget) -> list[str]:
    """P-80 through GetStats counters (P-83): a prompt of two pages and a bit without a scope,
    the same again, then under a fresh scope, then unscoped once more; every unscoped one must
    compute all its tokens (prefill_tokens_computed grows by at least its length) and add no
    page to the cache (prefix_cache_pages_inserted unchanged)."""
    page = max(1, int(t.info.page_size))
    n = min(2 * page + 3, int(t.info.max_prompt_tokens))
    if n <= page:
        raise NotApplicable("the prompt limit is one page")
    prompt = t.prompt(n, 46)
    problems: list[str] = []
    for case_id, scope in (("unscoped_first", b""), ("unscoped_again", b""),
                           ("scoped_fill", secrets.token_bytes(16)), ("unscoped_after", b"")):
        before = await _counters(t)
        found, _ = await _served(t, case_id, prompt, scope)
        if found:
            return found
        leak = await t.pool.settled(CACHE_CASE_TIMEOUT_S)  # the request is done: its pages
        if leak:  # went back or to the cache, its counters are final
            return [f"[G-07] {case_id}: {leak}"]
        after = await _counters(t)
        if TOKENS_COMPUTED not in after:
            raise NotApplicable(f"GetStats counters lack {TOKENS_COMPUTED} (P-83)")
        if scope:
            continue
        computed = after[TOKENS_COMPUTED] - before.get(TOKENS_COMPUTED, 0)
        if computed < n:
            problems.append(f"[P-80] {case_id}: an unscoped prompt of {n} tokens computed "
                            f"{computed}: it read the prefix cache")
        inserted = after.get(PAGES_INSERTED, 0) - before.get(PAGES_INSERTED, 0)
        if inserted:
            problems.append(f"[P-80] {case_id}: an unscoped prompt added {inserted} page(s) "
                            f"to the prefix cache")
    return problems
