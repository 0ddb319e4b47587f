"""The data planes a handoff's KV bytes may travel by, and how the two sides agree on one.

Names as the SPEC, the flags and the logs say them: "inline" (bytes inside the gRPC chunk
frames; every peer speaks it) and "shared-memory" (a region on the same host; the frames carry
references) and "nixl" (prefill's NIXL agent holds the bytes in a registered buffer, decode
READs them; the frames carry references). Faster planes first in PREFERENCE: `choose_plane`
picks the first one that both prefill offers and decode may use.

Host identity (shared memory): the kernel's boot id plus the device and inode of the
shared-memory directory, so two processes agree only when they run on one host (one boot) and
see the same directory (one mount namespace, e.g. a shared /dev/shm volume between containers).
"""

from __future__ import annotations

import os
from pathlib import Path

from common.pb.kvhandoff.v1 import handoff_pb2

INLINE = "inline"
SHARED_MEMORY = "shared-memory"
NIXL = "nixl"
# auto's order. On one host shared memory comes first: in both `kvhandoff bench transfer` runs
# after stop 12's page-order fix it moved 1.11 and 1.01 GB/s at 64 MiB, 1.29 and 1.41 at 1 GiB,
# against NIXL's 0.99 and 0.91, 1.26 and 1.33 (docs/benchmarks.md), with no pinned buffers and
# no agent; NIXL serves where shared memory cannot (another host).
PREFERENCE = (SHARED_MEMORY, NIXL, INLINE)
TO_PROTO = {INLINE: handoff_pb2.DATA_PLANE_INLINE,
            SHARED_MEMORY: handoff_pb2.DATA_PLANE_SHARED_MEMORY,
            NIXL: handoff_pb2.DATA_PLANE_NIXL}
FROM_PROTO = {v: k for k, v in TO_PROTO.items()} | {handoff_pb2.DATA_PLANE_UNSPECIFIED: INLINE}
DEFAULT_SHM_DIR = "/dev/shm"
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def host_identity(shm_dir: str) -> str:
    """'' when shared memory cannot be used here (no directory, or not writable)."""
    try:
        st = os.stat(shm_dir)
        boot = BOOT_ID.read_text().strip() if BOOT_ID.exists() else os.uname().nodename
    except OSError:
        return ""
    if not os.access(shm_dir, os.W_OK | os.X_OK):
        return ""
    return f"{boot}:{st.st_dev}:{st.st_ino}"


def plane_name(value: int) -> str:
    """A PrefillRequest/DataPlaneOffer enum value -> its name; unknown values as 'plane-N'."""
    return FROM_PROTO.get(value, f"plane-{value}")


def offered(info: handoff_pb2.GetPrefillInfoResponse) -> dict[str, str]:
    """plane name -> host id from GetPrefillInfo; an info without data_planes offers inline."""
    planes = {plane_name(o.plane): o.host_id for o in info.data_planes}
    planes.setdefault(INLINE, "")
    return planes


def nixl_metadata(info: handoff_pb2.GetPrefillInfoResponse) -> bytes:
    """prefill's NIXL agent metadata from its offer; b'' when it does not offer the plane."""
    for offer in info.data_planes:
        if offer.plane == handoff_pb2.DATA_PLANE_NIXL:
            return bytes(offer.nixl_agent_metadata)
    return b""


def choose_plane(info: handoff_pb2.GetPrefillInfoResponse, wanted: str, shm_dir: str,
                 allow_shared_memory: bool, nixl: bool = False) -> str:
    """The plane decode uses with this prefill. wanted: 'auto' (the fastest both sides can use),
    or one plane's name, which is used only when prefill offers it and decode may (else inline:
    the caller logs why). Shared memory needs prefill's host id to equal decode's own; NIXL
    needs prefill's agent metadata and decode's own agent (nixl: decode has one and may use
    planes that bypass TLS)."""
    offers = offered(info)
    mine = host_identity(shm_dir) if allow_shared_memory else ""
    usable = [p for p in PREFERENCE if p in offers
              and (p != SHARED_MEMORY or (mine and offers[p] == mine))
              and (p != NIXL or (nixl and nixl_metadata(info)))]
    if wanted == "auto":
        return usable[0]
    return wanted if wanted in usable else INLINE
