"""A fake data plane for tests: a KvReceiver that lands KV a test computed in-process, through
the same engine API and with the same TransferRecord moves as the real receivers.

`kv_for(token_ids)` -> (advisory first token, per-layer KV [2, n, Hkv, D] on the CPU). `fail` (a
HandoffRefused) makes the transfer fail after `fail_after_layers` layers were written, as a plane
whose peer died mid-transfer would.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from common.handoff.reasons import HandoffRefused
from common.handoff.transfer import TransferRecord, TransferState
from decode_svc.engine import DecodeEngine
from decode_svc.kv_receiver import HandoffJob, KvReceiver, LandedKv


class FakeKvReceiver(KvReceiver):
    plane = "fake"

    def __init__(self, engine: DecodeEngine,
                 kv_for: Callable[[list[int]], tuple[int, list[torch.Tensor]]],
                 fail: HandoffRefused | None = None, fail_after_layers: int = 0) -> None:
        self.engine = engine
        self.kv_for = kv_for
        self.fail = fail
        self.fail_after_layers = fail_after_layers
        self.records: list[TransferRecord] = []

    async def receive(self, job: HandoffJob, record: TransferRecord) -> LandedKv:
        self.records.append(record)
        request_id = job.request.request_id
        first, kv = self.kv_for(list(job.request.token_ids))
        nbytes = 0
        for layer, layer_kv in enumerate(kv):
            if self.fail is not None and layer == self.fail_after_layers:
                record.move(TransferState.FAILED, self.fail.reason)
                raise self.fail
            record.move(TransferState.TRANSFERRING)
            self.engine.write(request_id, layer, 0, layer_kv)
            nbytes += layer_kv.numel() * layer_kv.element_size()
        record.move(TransferState.SUCCESS)
        return LandedKv(first, nbytes, bound=True)
