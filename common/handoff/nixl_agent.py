"""A NIXL agent as the NIXL data plane uses it: UCX backend, host memory only, no progress
thread (NIXL's default one spins a whole core per agent), progress driven by the caller.

`open_agent` answers (agent, '') or (None, why) and never raises: where the `nixl-cu12` wheel is
missing or its UCX backend cannot start, prefill simply does not offer the plane and decode
never chooses it. The UCX settings (UCX_TLS, UCX_NET_DEVICES) come from the environment, as UCX
reads them; docs/operations.md says which to set.

Invariants: every call goes through one lock (NIXL's own thread sync is off: the event loop,
the engine thread and the progress thread of prefill all use the agent); a transfer handle is
released only once it is known to be over (DONE or ERR) or, when still in flight, `release`
says it could not be and the caller must keep the destination memory away from any other use.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import uuid
from dataclasses import dataclass

import numpy as np

# UCX confined to this host: its TCP transport only on the loopback interface (connection
# setup), the bytes over shared memory. What `kvhandoff up`, the benchmarks and the tests use
# unless the environment already sets these variables (docs/operations.md).
LOOPBACK_UCX = {"UCX_NET_DEVICES": "lo", "UCX_TLS": "sm,tcp,self"}

DONE = "DONE"
IN_FLIGHT = "PROC"
FAILED = "ERR"


@dataclass(frozen=True)
class Registration:
    """One host buffer registered with the agent; metadata is the partial agent metadata a peer
    loads to read it (empty on decode, which never lets a peer read or write its memory)."""

    address: int
    size: int
    descs: object
    metadata: bytes = b""


def _nixl_api():
    api = importlib.import_module("nixl_cu12._api")
    if not os.environ.get("NIXL_LOG_LEVEL"):  # its INFO lines go to stdout, among our logs
        logging.getLogger("nixl").setLevel(logging.WARNING)
    return api


def nixl_available() -> tuple[bool, str]:
    """(True, '') when the nixl-cu12 wheel imports; else (False, why)."""
    try:
        _nixl_api()
    except Exception as err:  # ImportError, or a shared library that does not load
        return False, f"nixl is not usable here: {type(err).__name__}: {err}"
    return True, ""


def open_agent(role: str, loopback: bool = False) -> tuple[NixlAgent | None, str]:
    """A fresh agent named '<role>-<random>' with the UCX backend, or (None, why).
    loopback: the peer is on this host (the service listens on, or dials, loopback only), so
    UCX is confined to it (LOOPBACK_UCX) unless the environment already says otherwise; without
    it, UCX listens on every interface it finds."""
    if loopback:
        for key, value in LOOPBACK_UCX.items():
            os.environ.setdefault(key, value)
    ok, why = nixl_available()
    if not ok:
        return None, why
    try:
        return NixlAgent(f"{role}-{uuid.uuid4().hex}"), ""
    except Exception as err:  # the UCX backend did not start (no usable transport, ...)
        return None, f"the NIXL UCX backend did not start: {type(err).__name__}: {err}"


class NixlAgent:
    def __init__(self, name: str) -> None:
        api = _nixl_api()
        config = api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                       backends=["UCX"])
        self._agent = api.nixl_agent(name, config)
        if "UCX" not in self._agent.backends:
            raise RuntimeError("the UCX plugin is missing")
        self.name = name
        self._lock = threading.Lock()

    def metadata(self) -> bytes:
        """What a peer loads (add_remote) to reach this agent: its name and UCX address."""
        with self._lock:
            return bytes(self._agent.get_agent_metadata())

    def register(self, buf: np.ndarray, share: bool) -> Registration:
        """buf: a C-contiguous uint8 array that outlives the registration. share: also return
        the partial metadata a peer needs to READ it (with this agent's connection info, so
        it alone lets a peer reach the buffer, whichever replica the peer's handshake saw)."""
        address, size = buf.ctypes.data, buf.nbytes
        with self._lock:
            descs = self._agent.register_memory([(address, size, 0, "")], "DRAM")
            meta = (bytes(self._agent.get_partial_agent_metadata(descs, True, ["UCX"]))
                    if share else b"")
        return Registration(address, size, descs, meta)

    def deregister(self, reg: Registration) -> None:
        with self._lock:
            self._agent.deregister_memory(reg.descs)

    def add_remote(self, metadata: bytes) -> str:
        """Loads a peer's (full or partial) metadata -> the peer agent's name."""
        with self._lock:
            name = self._agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_remote(self, name: str) -> None:
        with self._lock:
            self._agent.remove_remote_agent(name)

    def register_memory(self, address: int, size: int, mem_type: str = "DRAM", device: int = 0,
                        share: bool = False) -> Registration:
        """Registers [address, +size) of memory that outlives the registration (host memory:
        DRAM; a GPU's: VRAM with its device index). share: also return the partial metadata a
        peer needs to READ it (decode's own pool never shares)."""
        with self._lock:
            descs = self._agent.register_memory([(address, size, device, "")], mem_type)
            meta = (bytes(self._agent.get_partial_agent_metadata(descs, True, ["UCX"]))
                    if share else b"")
        return Registration(address, size, descs, meta)

    def register_regions(self, regions: list[tuple[int, int]], share: bool) -> Registration:
        """Registers host memory regions (address, length) that outlive the registration, as
        one registration (one deregister drops them all); share: with the partial metadata a
        peer needs to READ them. The Registration's address and size are the first region's."""
        with self._lock:
            descs = self._agent.register_memory([(a, n, 0, "") for a, n in regions], "DRAM")
            meta = (bytes(self._agent.get_partial_agent_metadata(descs, True, ["UCX"]))
                    if share else b"")
        return Registration(regions[0][0], regions[0][1], descs, meta)

    def read(self, local: np.ndarray, remote: list[tuple[int, int]], peer: str):
        """Posts one READ of the remote (address, length) pieces into local, back to back ->
        (handle, state). Raises when NIXL refuses it (for example a range the peer never
        registered: NIXL checks remote descriptors against the peer's registrations)."""
        base, pieces, at = local.ctypes.data, [], 0
        for _, length in remote:
            pieces.append((base + at, length))
            at += length
        if at > local.nbytes:
            raise ValueError(f"{at} bytes do not fit a {local.nbytes}-byte buffer")
        return self.read_pieces(pieces, remote, peer)

    def read_pieces(self, local: list[tuple[int, int]], remote: list[tuple[int, int]],
                    peer: str, local_type: str = "DRAM", remote_type: str = "DRAM",
                    device: int = 0):
        """Posts one READ: remote piece i (address, length) into local piece i (address of
        registered memory of this agent, same length) -> (handle, state); VRAM pieces are on
        GPU `device` (on either side). Raises when NIXL refuses it; nothing is in flight then."""
        if len(local) != len(remote) or any(a[1] != b[1] for a, b in zip(local, remote)):
            raise ValueError("local and remote pieces differ in number or length")
        with self._lock:
            mine = self._agent.get_xfer_descs([(a, n, device) for a, n in local], local_type)
            theirs = self._agent.get_xfer_descs([(a, n, device) for a, n in remote], remote_type)
            handle = self._agent.initialize_xfer("READ", mine, theirs, peer)
            try:
                return handle, self._agent.transfer(handle)
            except BaseException:  # not posted (the peer is gone): nothing is in flight
                self._agent.release_xfer_handle(handle)
                raise

    def state(self, handle) -> str:
        """DONE, PROC (in flight) or ERR; each call also progresses the agent's worker."""
        with self._lock:
            return self._agent.check_xfer_state(handle)

    def release(self, handle) -> bool:
        """Frees the handle (NIXL cancels a transfer still in flight). False: NIXL could not,
        so bytes may still land in the destination."""
        try:
            with self._lock:
                self._agent.release_xfer_handle(handle)
        except Exception:
            return False
        return True

    def progress(self) -> None:
        """Progresses the worker (a READ a peer posted against this agent's memory needs the
        target to progress on UCX's TCP and shared-memory transports)."""
        with self._lock:
            self._agent.get_new_notifs()
