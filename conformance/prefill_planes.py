"""Prefill cases of the data-plane negotiation (SPEC.md P-60, P-61): what GetPrefillInfo offers,
and the requests naming a plane that this prefill must not serve them on. The suite never asks
for an out-of-band handoff it would have to read: every request here must be rejected before
anything is computed (no region is made, nothing to release)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.pb.kvhandoff.v1 import handoff_pb2
from conformance.prefill_checks import check_rejection
from conformance.runner import NotApplicable
from conformance.wire import read_handoff

if TYPE_CHECKING:
    from conformance.prefill_suite import PrefillTarget

INLINE = handoff_pb2.DATA_PLANE_INLINE
SHARED_MEMORY = handoff_pb2.DATA_PLANE_SHARED_MEMORY
NIXL = handoff_pb2.DATA_PLANE_NIXL
UNAVAILABLE = "DATA_PLANE_UNAVAILABLE"


def _offers(t: PrefillTarget) -> dict[int, handoff_pb2.DataPlaneOffer]:
    """plane -> offer; an info without data_planes offers INLINE (SPEC.md section 10)."""
    offers = {o.plane: o for o in t.info.data_planes}
    return offers or {INLINE: handoff_pb2.DataPlaneOffer(plane=INLINE)}


async def data_planes_offered(t: PrefillTarget) -> list[str]:
    planes = [o.plane for o in t.info.data_planes]
    problems = []
    if planes and INLINE not in planes:
        problems.append(f"[P-60] data_planes {planes} do not list INLINE")
    if len(set(planes)) != len(planes):
        problems.append(f"[P-60] data_planes {planes} list a plane twice")
    shm = _offers(t).get(SHARED_MEMORY)
    if shm is not None and not shm.host_id:
        problems.append("[P-60] the SHARED_MEMORY offer carries no host_id")
    return problems


async def _rejected_on_plane(t: PrefillTarget, case_id: str, plane: int,
                             host_id: str = "") -> list[str]:
    request = t.request(case_id, t.prompt(5, 60 + plane), data_plane=plane,
                        data_plane_host_id=host_id)
    return check_rejection(request, await read_handoff(t.channel, request, t.timeout),
                           UNAVAILABLE)


async def plane_not_offered(t: PrefillTarget) -> list[str]:
    """A plane of the protocol it does not offer, else one of a later minor version (a value
    DataPlane does not name yet): served by no prefill of this one."""
    known = [p for p in (NIXL, SHARED_MEMORY) if p not in _offers(t)]
    plane = known[0] if known else max(handoff_pb2.DataPlane.values()) + 1
    return await _rejected_on_plane(t, "plane_not_offered", plane)


def _shared_memory_offer(t: PrefillTarget) -> handoff_pb2.DataPlaneOffer:
    offer = _offers(t).get(SHARED_MEMORY)
    if offer is None:
        raise NotApplicable("the prefill does not offer SHARED_MEMORY")
    return offer


async def plane_shm_no_host_id(t: PrefillTarget) -> list[str]:
    _shared_memory_offer(t)
    return await _rejected_on_plane(t, "plane_shm_no_host_id", SHARED_MEMORY)


async def plane_shm_other_host(t: PrefillTarget) -> list[str]:
    other = f"{_shared_memory_offer(t).host_id}-elsewhere"
    return await _rejected_on_plane(t, "plane_shm_other_host", SHARED_MEMORY, other)
