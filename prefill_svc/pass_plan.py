"""Which prompt tokens one prefill forward pass computes (chunked prefill).

A pass carries at most ``pass_tokens`` tokens (``--max-batch-tokens``); each job in it
contributes one chunk of at most ``chunk_tokens`` (``--prefill-chunk-tokens``) of its next
uncomputed tokens. Jobs already running go first, in admission order, so a prompt once started
keeps moving; what is left of the budget goes to newly admitted jobs.

Invariants of a plan: the slices' tokens sum to <= pass_tokens; a job appears at most once;
each slice starts at its job's ``computed_tokens`` and holds >= 1 token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class ChunkedJob(Protocol):
    token_ids: list[int]
    computed_tokens: int  # prompt tokens whose KV is already in the job's pages


@dataclass(frozen=True)
class ChunkSlice:
    """Tokens [start, end) of job's prompt, computed in this pass over the job's pages, which
    already hold tokens [0, start)."""

    job: ChunkedJob
    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def is_last(self) -> bool:
        """The prompt's last token is in this slice: its logits give the first token."""
        return self.end == len(self.job.token_ids)


def next_slice(job: ChunkedJob, budget_left: int, chunk_tokens: int) -> ChunkSlice | None:
    """job's next chunk within budget_left tokens, or None when nothing fits (or is left)."""
    take = min(chunk_tokens, len(job.token_ids) - job.computed_tokens, budget_left)
    if take <= 0:
        return None
    return ChunkSlice(job, job.computed_tokens, job.computed_tokens + take)


def plan_running(jobs: Sequence[ChunkedJob], pass_tokens: int,
                 chunk_tokens: int) -> list[ChunkSlice]:
    """One chunk for each running job, in order, until the pass budget is spent."""
    plan: list[ChunkSlice] = []
    left = pass_tokens
    for job in jobs:
        piece = next_slice(job, left, chunk_tokens)
        if piece is None:
            if left <= 0:
                break
            continue
        plan.append(piece)
        left -= piece.num_tokens
    return plan
