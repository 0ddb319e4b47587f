"""A payload that lies in several buffers, in order: a chunk's K (or V) landed straight into the
pages of decode's reservation, one piece per run of contiguous page slots."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScatteredBytes:
    """pieces: C-contiguous uint8 views, in payload order; nbytes: their total length."""

    pieces: tuple
    nbytes: int

    def __len__(self) -> int:
        return self.nbytes
