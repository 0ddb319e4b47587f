"""A prefill-side NIXL peer in its own process, for the decode refusal tests: it builds a
handoff's chunk frames with the real NixlSender (its own agent and progress thread) and then
does what a test asks: corrupt a byte of its buffer, stall (hold its agent so nothing
progresses), resume, release, or die (the test kills it).

Commands over a multiprocessing pipe: ("frames", request_id, nonce, [kv per layer], tokens per
chunk) -> [frame bytes]; ("flip", offset) -> True; ("stall",) / ("resume",) / ("release",) ->
True; ("pinned",) -> buffers registered; ("exit",).
"""

from __future__ import annotations

import multiprocessing as mp

from tests.planes.nixl_env import use_loopback_ucx


def _serve(conn, layout) -> None:
    use_loopback_ucx()
    from common.handoff.nixl_agent import open_agent
    from prefill_svc.nixl_sender import NixlPlane, NixlSender

    agent, why = open_agent("prefill")
    conn.send(why)
    if agent is None:
        return
    plane = NixlPlane(agent)
    sender = None
    while True:
        command, *args = conn.recv()
        if command == "frames":
            request_id, nonce, kv, step = args
            sender = NixlSender(request_id, layout, kv[0].shape[1], plane)
            frames, seq = [], 0
            for layer, layer_kv in enumerate(kv):
                for start in range(0, layer_kv.shape[1], step):
                    part = layer_kv[:, start:start + step].contiguous()
                    frames.append(sender.chunk(request_id, seq, layer, start, part, nonce))
                    seq += 1
            conn.send(frames)
        elif command == "flip":
            sender._pinned[args[0]] ^= 0x10
            conn.send(True)
        elif command == "stall":
            agent._lock.acquire()  # the progress thread blocks: no READ against us completes
            conn.send(True)
        elif command == "resume":
            agent._lock.release()
            conn.send(True)
        elif command == "release":
            sender.release(False)
            conn.send(True)
        elif command == "pinned":
            conn.send(plane._pinned)
        else:
            plane.close()
            return


class NixlPeer:
    def __init__(self, layout) -> None:
        self._conn, child = mp.Pipe()
        self.proc = mp.get_context("spawn").Process(target=_serve, args=(child, layout),
                                                     daemon=True)
        self.proc.start()
        self.why = self._conn.recv()

    def ask(self, *command):
        self._conn.send(command)
        return self._conn.recv()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            self._conn.send(("exit",))
            self.proc.join(10)
        if self.proc.is_alive():
            self.kill()
