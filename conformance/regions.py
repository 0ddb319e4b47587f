"""Shared-memory regions as the fake prefill handles them (SPEC.md P-62, P-64), written from the
spec for the suite alone: reading the bytes a reference names, and writing regions of its own.

On a SHARED_MEMORY handoff the fake takes the reference prefill's frames apart with their bytes
read back from its regions (`inline_copy`), lets the case's script build its frames as on INLINE,
then moves every chunk's K and V into one region of its own and sends references to it
(`FakeRegions.out_of_band`): the same frames, the same checksums, the bytes out of band. Cases
of the plane itself then break one thing about a reference or a region.

Invariants: every region the fake writes is created exclusively in the decode's directory with
a name of P-64's form unless a case asks for another, mode 0600 unless a case asks for another,
and is removed by `remove_all` (decode removes those it opened, D-65; the rest are the fake's).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field

from common.pb.kvhandoff.v1 import handoff_pb2

Frame = handoff_pb2.PrefillResponse
REGION_PREFIX = "kvh-"


def region_name() -> str:
    """A fresh name of P-64's form: kvh- and 32 lowercase hex digits."""
    return REGION_PREFIX + secrets.token_hex(16)


def read_reference(directory: str, ref: handoff_pb2.KvRegionRef) -> tuple[bytes, bytes]:
    """The K and V bytes a shared-memory reference names. Raises OSError when they are not all
    there."""
    name = os.path.basename(ref.region)
    try:
        fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        raise OSError(f"cannot read the reference prefill's region {name} in {directory} "
                      f"({err.strerror}): is --shm-dir the decode's and the reference's "
                      "shared-memory directory?") from err
    try:
        k = os.pread(fd, ref.length, ref.k_offset)
        v = os.pread(fd, ref.length, ref.v_offset)
    finally:
        os.close(fd)
    if len(k) != ref.length or len(v) != ref.length:
        raise OSError(f"region {ref.region} is shorter than its reference")
    return k, v


def inline_copy(frames: list[Frame], directory: str) -> list[Frame]:
    """frames with every referenced chunk's bytes read back inline and its reference dropped
    (the form conformance.handoff_edit takes apart); other frames as they are."""
    out = []
    for frame in frames:
        if frame.HasField("chunk") and frame.chunk.HasField("ref"):
            copy = Frame()
            copy.CopyFrom(frame)
            copy.chunk.k, copy.chunk.v = read_reference(directory, frame.chunk.ref)
            copy.chunk.ClearField("ref")
            frame = copy
        out.append(frame)
    return out


def with_reference(frame: Frame, region: str, k_offset: int, v_offset: int,
                   keep_bytes: bool = False) -> Frame:
    """A copy of chunk frame referring to K and V (each as long as its K) at the offsets of
    region, its inline bytes dropped unless keep_bytes; checksums untouched."""
    out = Frame()
    out.CopyFrom(frame)
    length = len(frame.chunk.k)
    if not keep_bytes:
        out.chunk.k, out.chunk.v = b"", b""
    out.chunk.ref.CopyFrom(handoff_pb2.KvRegionRef(region=region, k_offset=k_offset,
                                                   v_offset=v_offset, length=length))
    return out


def _movable(step) -> bool:
    """An inline chunk frame whose K and V one reference can name (equal, non-zero sizes)."""
    return (isinstance(step, Frame) and step.HasField("chunk") and not step.chunk.HasField("ref")
            and len(step.chunk.k) == len(step.chunk.v) > 0)


@dataclass
class FakeRegions:
    """The regions the fake wrote into the decode's shared-memory directory."""

    directory: str
    names: list[str] = field(default_factory=list)

    def write(self, data: bytes, mode: int = 0o600, name: str | None = None) -> str:
        """A new region holding data, created exclusively with `mode` (umask not applied)."""
        name = name or region_name()
        path = os.path.join(self.directory, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        self.names.append(name)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        return name

    def out_of_band(self, steps: list) -> list:
        """steps with every movable chunk's K and V moved into one new region and referenced
        from there (checksums untouched: they are over the same bytes); other steps as they
        are."""
        payload = bytearray()
        placed: dict[int, tuple[int, int]] = {}  # step index -> (K offset, V offset)
        for at, step in enumerate(steps):
            if _movable(step):
                k, v = step.chunk.k, step.chunk.v
                placed[at] = (len(payload), len(payload) + len(k))
                payload += k
                payload += v
        if not placed:
            return list(steps)
        name = self.write(bytes(payload))
        out = list(steps)
        for at, (k_offset, v_offset) in placed.items():
            out[at] = with_reference(steps[at], name, k_offset, v_offset)
        return out

    def link(self, target: str) -> str:
        """A new symbolic link of a well-formed name to the region named target."""
        name = region_name()
        os.symlink(target, os.path.join(self.directory, name))
        self.names.append(name)
        return name

    def remove_all(self) -> None:
        for name in self.names:
            try:
                os.unlink(os.path.join(self.directory, name))
            except FileNotFoundError:
                pass  # decode removed it after reading (D-65)
        self.names.clear()
