"""Services for a benchmark: the disaggregated pair (prefill + decode) or one decode with
--local-prefill, each service its own process on 127.0.0.1 (as `kvhandoff up` starts them),
stopped with SIGTERM. Logs go to files in the run's work directory."""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from common.server.cpu_placement import allowed_cpus, format_cpu_list, split_cores
from common.server.launch import ServiceProcess, launch, stop_processes

REPO = Path(__file__).resolve().parents[1]
MODES = ("disaggregated", "local", "cache-off", "cache-on", "borrowing")
DEFAULT_MODES = MODES[:4]
# disaggregated modes whose prefill runs with these flags (the prefix cache off and on;
# borrowing: the pair with core borrowing, whatever --core-borrowing says)
PREFILL_FLAGS = {"disaggregated": [], "cache-off": ["--no-prefix-cache"],
                 "cache-on": ["--prefix-cache"], "borrowing": []}


@dataclass(frozen=True)
class Variant:
    """A disaggregated pair under its own name whose services get extra flags after their
    placement flags (so a variant's --torch-threads or --cpu-affinity overrides the split):
    the A and B of one setting, run side by side by `kvhandoff bench serve --variant`."""

    name: str
    prefill_flags: tuple[str, ...] = ()
    decode_flags: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> Variant:
        """'NAME=PREFILL FLAGS[;DECODE FLAGS]', e.g. 'b1024=--max-batch-tokens 1024'."""
        name, sep, flags = text.partition("=")
        name = name.strip()
        if not sep or not name or name in MODES or not name.replace("-", "").isalnum():
            raise ValueError(f"--variant {text!r}: write NAME=PREFILL FLAGS[;DECODE FLAGS], "
                             f"NAME letters, digits and '-', not one of {', '.join(MODES)}")
        prefill, _, decode = flags.partition(";")
        return cls(name, tuple(shlex.split(prefill)), tuple(shlex.split(decode)))


@dataclass
class Deployment:
    """Running services of one mode; `address` is decode's, the client-facing one."""

    mode: str
    address: str
    services: list[ServiceProcess] = field(default_factory=list)

    @property
    def pids(self) -> list[int]:
        return [service.proc.pid for service in self.services]

    def stop(self) -> None:
        stop_processes([service.proc for service in reversed(self.services)])


def placement_flags(role: str, mode: str, torch_threads: int, cpu_split: bool,
                    busy_file: Path | None = None) -> list[str]:
    """--cpu-affinity and --torch-threads of one service, as `kvhandoff up` places them: with
    cpu_split, a prefill and its decode each get their own share of this process's CPUs (a
    local-prefill decode all of them), and torch_threads 0 means one per CPU of the share;
    with a busy_file too, each also borrows the other's share while the other idles
    (--borrow-cpus, common/server/core_borrowing.py), as up's --core-borrowing does;
    without cpu_split, only torch_threads > 0 is passed on (on a small shared machine, more
    threads than free cores make every parallel op wait for a timeslice)."""
    if not cpu_split:
        return ["--torch-threads", str(torch_threads)] if torch_threads > 0 else []
    cpus = allowed_cpus()
    borrow: tuple[int, ...] = ()
    if mode in PREFILL_FLAGS:
        shares = split_cores(cpus)
        cpus, peer = (shares if role == "prefill" else shares[::-1])
        borrow = tuple(c for c in peer if c not in cpus) if busy_file is not None else ()
    flags = ["--cpu-affinity", format_cpu_list(cpus), "--torch-threads",
             str(torch_threads or len(cpus))]
    if borrow:
        flags += ["--borrow-cpus", format_cpu_list(borrow), "--busy-file", str(busy_file)]
    return flags


def _start(role: str, flags: list[str], workdir: Path, env: dict, timeout: float
           ) -> ServiceProcess:
    return launch(role, [sys.executable, "-m", "kvhandoff_cli.main", role, "--port", "0", *flags],
                  workdir / f"{role}.port", timeout, log_path=workdir / f"{role}.log", cwd=REPO,
                  env=env)


def start_deployment(mode: str, service_flags: list[str], workdir: Path, torch_threads: int,
                     decode_flags: list[str] = (), timeout: float = 300.0,
                     cpu_split: bool = True, variant: Variant | None = None,
                     core_borrowing: bool = False) -> Deployment:
    """Starts `mode` (one of MODES: 'local' is decode --local-prefill, the others a prefill
    and a decode), placed on the CPUs by placement_flags, and waits until decode reports
    SERVING. With a variant, mode is 'disaggregated' and each service gets the variant's
    flags last."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: choose one of {', '.join(MODES)}")
    extra_prefill = list(variant.prefill_flags) if variant else []
    decode_flags = [*decode_flags, *(variant.decode_flags if variant else ())]
    workdir = workdir / (variant.name if variant else mode)
    workdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    deployment = Deployment(mode, "")
    busy_file = workdir / "decode.busy" if core_borrowing or mode == "borrowing" else None
    try:
        decode_extra = list(decode_flags)
        if mode in PREFILL_FLAGS:
            prefill = _start("prefill", [*service_flags, *PREFILL_FLAGS[mode],
                                         *placement_flags("prefill", mode, torch_threads,
                                                          cpu_split, busy_file), *extra_prefill],
                             workdir, env, timeout)
            deployment.services.append(prefill)
            decode_extra += ["--prefill", prefill.address]
        else:
            decode_extra += ["--local-prefill"]
        decode = _start("decode", [*service_flags,
                                   *placement_flags("decode", mode, torch_threads, cpu_split,
                                                    busy_file),
                                   *decode_extra], workdir, env, timeout)
        deployment.services.append(decode)
        deployment.address = decode.address
        return deployment
    except BaseException:
        deployment.stop()
        raise


def model_vocab_size(model: str) -> int:
    """The vocabulary of --model without loading its weights."""
    if model == "demo":
        from common.tokenizer import CharTokenizer

        return CharTokenizer().vocab_size
    from common.model.loader import checkpoint_config  # names a bad --model in one line

    return checkpoint_config(Path(model)).vocab_size
