"""Scripts of the shared-memory cases: the good handoff with one middle chunk's bytes placed in
a region of the fake's own that breaks exactly one rule of SPEC.md 10.2 (its name, its mode, its
kind, its size, or its bytes), every id and checksum of the frame right."""

from __future__ import annotations

import os

from conformance.decode_edits import replace_frame
from conformance.decode_script import ScriptInput, Step, middle
from conformance.regions import FakeRegions, region_name, with_reference


def _regions(i: ScriptInput) -> FakeRegions:
    if i.regions is None:
        raise ValueError("the case needs a SHARED_MEMORY handoff")
    return i.regions


def middle_in_region(i: ScriptInput, flip_byte: bool = False, drop_last_byte: bool = False,
                     mode: int = 0o600, name: str | None = None, refer_as=None,
                     keep_bytes: bool = False, gap: int = 0, v_first: bool = False
                     ) -> list[Step]:
    """The good handoff whose middle chunk refers to a region of the fake's own holding its K
    then V (V then K when v_first), `gap` bytes that are neither between them: with one K byte
    flipped, or the region's last byte missing, written with `mode` under `name`; refer_as(name)
    is the region string the reference carries (default: the name); keep_bytes leaves the
    inline bytes in the frame too."""
    regions = _regions(i)
    frames = i.good()
    at = middle(frames)
    k, v = frames[at].chunk.k, frames[at].chunk.v
    filler = bytes([0xA5]) * gap
    data = bytearray(v + filler + k if v_first else k + filler + v)
    k_offset, v_offset = (len(v) + gap, 0) if v_first else (0, len(k) + gap)
    if flip_byte:
        data[k_offset + len(k) // 2] ^= 0x01
    if drop_last_byte:
        del data[-1]
    written = regions.write(bytes(data), mode=mode, name=name)
    region = refer_as(written) if refer_as else written
    return replace_frame(frames, at, with_reference(frames[at], region, k_offset, v_offset,
                                                 keep_bytes))


def middle_in_missing_region(i: ScriptInput) -> list[Step]:
    """The middle chunk refers to a well-formed region name that does not exist."""
    _regions(i)
    frames = i.good()
    at = middle(frames)
    return replace_frame(frames, at, with_reference(frames[at], region_name(), 0,
                                                 len(frames[at].chunk.k)))


def middle_through_symlink(i: ScriptInput) -> list[Step]:
    """The middle chunk refers to a well-formed name that is a symbolic link to a good region
    (right bytes, mode 0600)."""
    regions = _regions(i)
    frames = i.good()
    at = middle(frames)
    k, v = frames[at].chunk.k, frames[at].chunk.v
    link = regions.link(regions.write(k + v))
    return replace_frame(frames, at, with_reference(frames[at], link, 0, len(k)))


def path_back_into(directory: str):
    """A reference naming the region by a path that leads back into the same directory."""
    return lambda name: f"../{os.path.basename(os.path.normpath(directory))}/{name}"
