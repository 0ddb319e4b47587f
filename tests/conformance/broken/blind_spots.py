"""Broken variants of the suite's former blind spots (issue 22): each is a small change to our
own services that the suite passed before its case existed. Registered in variants.VARIANTS;
the patching helpers are variants' own (imported when a variant is applied)."""

from __future__ import annotations


# ---- decode ---------------------------------------------------------------------------------
def decode_accepts_major_0() -> None:
    """D-06 broken: a header of major 0 with a minor >= 1 reads as version 1 (only 0.0, which
    the minor-version policy refuses anyway, is refused)."""
    from common.handoff.verifier import HandoffVerifier
    from common.pb.kvhandoff.v1 import handoff_pb2
    from tests.conformance.broken.variants import _patch

    def make(original):
        def _on_header(self, header):
            version = header.protocol_version
            if version.major == 0 and version.minor >= 1:
                lifted = handoff_pb2.HandoffHeader()
                lifted.CopyFrom(header)
                lifted.protocol_version.major = 1
                header = lifted
            return original(self, header)
        return _on_header
    _patch(HandoffVerifier, "_on_header", make)


def decode_layer0_k_only() -> None:
    """D-46 broken: layer 0 is recomputed but only its K is compared with what arrived."""
    import torch

    import decode_svc.content_check as content
    from tests.conformance.broken.variants import _patch_module

    def make(original):
        def _layer0_error(model, pool, table, ids):
            n = ids.shape[0]
            k, _ = model.layer0_kv(ids, torch.arange(n, dtype=torch.int64, device=ids.device))
            received = model.ops.pack_kv(pool.k[0], pool.v[0], table, 0, n)  # [2, n, Hkv, D]
            return content.relative_error(received[0], k)
        return _layer0_error
    _patch_module(content, "_layer0_error", make)


def decode_reads_v_after_k() -> None:
    """D-61 broken: on shared memory decode reads a chunk's V right after its K
    (k_offset + length), ignoring the reference's v_offset."""
    import decode_svc.shm_receiver as shm_receiver
    from common.pb.kvhandoff.v1 import handoff_pb2
    from tests.conformance.broken.variants import _patch_module

    def make(original):
        def reference_to_fetch(frame, expect, plane):
            chunk = original(frame, expect, plane)
            if chunk is None:
                return None
            moved = handoff_pb2.KvChunk()
            moved.CopyFrom(chunk)
            moved.ref.v_offset = chunk.ref.k_offset + chunk.ref.length
            return moved
        return reference_to_fetch
    _patch_module(shm_receiver, "reference_to_fetch", make)


# ---- prefill --------------------------------------------------------------------------------
def prefill_rejects_without_nonce() -> None:
    """P-41 broken: a rejection's header carries no nonce (an OK header still echoes it)."""
    import prefill_svc.servicer as servicer
    from common.pb.kvhandoff.v1 import handoff_pb2
    from tests.conformance.broken.variants import _patch_module

    def make(original):
        def header_frame(request_id, token_count, status, *args, **kwargs):
            frame = original(request_id, token_count, status, *args, **kwargs)
            if status == handoff_pb2.HANDOFF_STATUS_REJECTED:
                frame.header.ClearField("nonce")
            return frame
        return header_frame
    _patch_module(servicer, "header_frame", make)


def prefill_shm_without_host_id() -> None:
    """P-61 broken: a SHARED_MEMORY request that names no host id is served (read as naming
    this prefill's host); one naming another host is still rejected."""
    import prefill_svc.servicer as servicer
    from common.pb.kvhandoff.v1 import handoff_pb2
    from tests.conformance.broken.variants import _patch_module

    def make(original):
        def validate_prefill(request, limits):
            if (request.data_plane == handoff_pb2.DATA_PLANE_SHARED_MEMORY
                    and not request.data_plane_host_id):
                assumed = handoff_pb2.PrefillRequest()
                assumed.CopyFrom(request)
                assumed.data_plane_host_id = limits.shm_host_id
                request = assumed
            return original(request, limits)
        return validate_prefill
    _patch_module(servicer, "validate_prefill", make)


UNSCOPED_SHARED_SCOPE = b"unscoped"


def prefill_caches_unscoped() -> None:
    """P-80 broken: requests with an empty cache_scope share one scope of their own, so they
    read and fill the prefix cache (their KV stays right: the fault is invisible in KV)."""
    from prefill_svc.engine import PrefillEngine
    from tests.conformance.broken.variants import _patch

    def make(original):
        def submit(self, job):
            if not job.cache_scope:
                job.cache_scope = UNSCOPED_SHARED_SCOPE
            return original(self, job)
        return submit
    _patch(PrefillEngine, "submit", make)


def prefill_cache_covers_last_token() -> None:
    """P-81 broken: a lookup may borrow the page that holds the prompt's last token (keys over
    the whole prompt, not all but its last token), so a prompt of whole pages seen before has
    nothing left to compute, and no logits for its first token."""
    from prefill_svc.prefix_cache import PrefixCache
    from tests.conformance.broken.variants import _patch

    def make(original):
        def reserve(self, owner, token_ids, scope):
            # the cache looks up all but the last token: one more makes it look up them all
            return original(self, owner, [*token_ids, 0], scope)
        return reserve
    _patch(PrefixCache, "reserve", make)


BLIND_SPOT_VARIANTS = {
    "decode_accepts_major_0": ("decode", decode_accepts_major_0),
    "decode_layer0_k_only": ("decode", decode_layer0_k_only),
    "decode_reads_v_after_k": ("decode", decode_reads_v_after_k),
    "prefill_rejects_without_nonce": ("prefill", prefill_rejects_without_nonce),
    "prefill_shm_without_host_id": ("prefill", prefill_shm_without_host_id),
    "prefill_caches_unscoped": ("prefill", prefill_caches_unscoped),
    "prefill_cache_covers_last_token": ("prefill", prefill_cache_covers_last_token),
}
