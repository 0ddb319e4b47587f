"""Starting a service process and stopping it: the one launcher that `kvhandoff up`, the
benchmarks and the tests use.

Contract with the process: it takes `--port-file FILE` and writes the port it bound there once it
listens (the `kvhandoff prefill|decode` commands do). `launch` returns once that file names a
port and, unless asked not to, once the server reports SERVING (`common.server.wait`). A process
that exits first, or gets nowhere within the timeout, is killed, and the error carries the tail
of its log.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from common.server.wait import ServerExited, wait_serving

POLL_SECONDS = 0.05
STOP_SECONDS = 20.0
LOG_TAIL_CHARS = 3000


class ServiceStartError(RuntimeError):
    """A launched service did not come up; the message says why and ends with its log's tail."""


@dataclass
class ServiceProcess:
    """A running service: its process, the address it bound, the file it logs to (if any)."""

    role: str
    proc: subprocess.Popen
    address: str
    log_path: Path | None = None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = STOP_SECONDS) -> None:
        stop_processes([self.proc], sig, timeout)


def wait_port_file(path: Path, proc: subprocess.Popen, timeout: float) -> int:
    """The port the process wrote to path; ServerExited if it exits first, TimeoutError."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerExited(f"process exited with {proc.returncode} before serving")
        if path.exists() and (text := path.read_text().strip()):
            return int(text)
        time.sleep(POLL_SECONDS)
    raise TimeoutError(f"no port in {path} after {timeout:g}s")


def launch(role: str, argv: Sequence[str], port_file: Path, timeout: float, *,
           host: str = "127.0.0.1", wait_until_serving: bool = True,
           log_path: Path | None = None, cwd: Path | None = None,
           env: dict[str, str] | None = None, capture_stderr: bool = False,
           on_start: Callable[[subprocess.Popen], None] | None = None) -> ServiceProcess:
    """Runs `argv --port-file port_file` and returns once the service listens (and serves,
    when wait_until_serving); `host` is how to reach it. Output goes to log_path (stdout and
    stderr together), or is inherited when None. Raises ServiceStartError after killing the
    process; the timeout covers the whole start. capture_stderr pipes stderr (text) for
    on_start(proc), which runs right after the process starts, e.g. to read what it says."""
    deadline = time.monotonic() + timeout
    port_file.unlink(missing_ok=True)
    log = log_path.open("w") if log_path is not None else None
    try:
        stderr = subprocess.PIPE if capture_stderr else subprocess.STDOUT if log else None
        proc = subprocess.Popen([*argv, "--port-file", str(port_file)], cwd=cwd, env=env,
                                stdout=log, stderr=stderr, text=capture_stderr or None)
    finally:
        if log is not None:
            log.close()  # the child holds its own descriptor
    service = ServiceProcess(role, proc, "", log_path)
    if on_start is not None:
        on_start(proc)
    try:
        service.address = f"{host}:{wait_port_file(port_file, proc, timeout)}"
        if wait_until_serving:
            wait_serving(service.address, max(0.0, deadline - time.monotonic()), proc=proc)
        return service
    except Exception as err:
        proc.kill()
        proc.wait()
        tail = service.log_text()[-LOG_TAIL_CHARS:]
        raise ServiceStartError(f"{role} did not start: {err}" + (f"\n{tail}" if tail else "")
                                ) from err


def stop_processes(procs: Sequence[subprocess.Popen], sig: int = signal.SIGTERM,
                   timeout: float = STOP_SECONDS) -> None:
    """Signals every process still running (in the order given), then waits for each; one
    that outlives timeout seconds is killed."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(sig)
    for proc in procs:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
