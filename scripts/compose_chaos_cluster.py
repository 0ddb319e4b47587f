"""The compose cluster as scripts/compose_chaos.py sees it: its containers by service and
replica number, their pools and shared-memory regions (GetStats asked inside each container,
so prefill's handoff port stays unpublished), their logs, and the docker commands that kill,
start and scale them. Talks to the docker CLI and nothing else.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass

# Run inside a container by `docker exec`: the service's GetStats on its own port, and the
# regions left in the shared-memory volume (one tmpfs every container mounts at one path).
STATS_IN_CONTAINER = """
import json, os, grpc
from common.pb.kvhandoff.v1 import stats_pb2, stats_pb2_grpc
with grpc.insecure_channel("127.0.0.1:" + os.environ["KVHANDOFF_PORT"]) as channel:
    r = stats_pb2_grpc.StatsServiceStub(channel).GetStats(stats_pb2.GetStatsRequest(),
                                                          timeout=20)
shm = os.environ.get("KVHANDOFF_SHM_DIR", "")
regions = sorted(n for n in os.listdir(shm) if n.startswith("kvh-")) if shm else []
print(json.dumps({"pool": {f.name: getattr(r.pool, f.name) for f in r.pool.DESCRIPTOR.fields},
                  "counters": dict(r.counters), "refusals": dict(r.refusals),
                  "regions": regions}))
"""


class ClusterError(RuntimeError):
    """A docker command failed or the cluster did not reach the state asked for."""


def docker(*argv: str, timeout: float = 120.0) -> str:
    done = subprocess.run(["docker", *argv], capture_output=True, text=True, timeout=timeout,
                          check=False)
    if done.returncode != 0:
        raise ClusterError(f"docker {' '.join(argv[:3])} ...: {done.stderr.strip()[-300:]}")
    return done.stdout


@dataclass(frozen=True)
class Replica:
    """One container of the cluster; `api` is decode's published HOST:PORT ("" for prefill)."""

    service: str
    number: int
    container: str
    api: str = ""

    @property
    def name(self) -> str:
        return f"{self.service}#{self.number}"


@dataclass(frozen=True)
class Stats:
    """GetStats of one service plus the regions its shared-memory directory holds."""

    pool: dict
    counters: dict
    regions: list

    @property
    def at_baseline(self) -> bool:
        pool = self.pool
        return (pool["pages_free"] == pool["pages_total"] and pool["running_requests"] == 0
                and pool["waiting_requests"] == 0)


@dataclass(frozen=True)
class Cluster:
    """The project's containers; `compose` is the compose argv (with -p and every -f)."""

    project: str
    compose: tuple[str, ...]
    api_port: int = 50051

    def replicas(self, service: str) -> list[Replica]:
        """Every container of the service, stopped ones too, by replica number."""
        ids = docker("ps", "-aq", "--filter", f"label=com.docker.compose.project={self.project}",
                     "--filter", f"label=com.docker.compose.service={service}").split()
        found = []
        for cid in ids:
            number = int(docker("inspect", "-f",
                                '{{index .Config.Labels "com.docker.compose.container-number"}}',
                                cid).strip())
            api = ""
            if service == "decode" and self.running(cid):
                api = docker("port", cid, f"{self.api_port}/tcp").split()[0]
            found.append(Replica(service, number, cid, api))
        return sorted(found, key=lambda r: r.number)

    @staticmethod
    def running(container: str) -> bool:
        return docker("inspect", "-f", "{{.State.Running}}", container).strip() == "true"

    @staticmethod
    def health(container: str) -> str:
        return docker("inspect", "-f", "{{if .State.Health}}{{.State.Health.Status}}{{end}}",
                      container).strip()

    def stats(self, replica: Replica) -> Stats:
        out = docker("exec", replica.container, "python", "-c", STATS_IN_CONTAINER, timeout=60)
        data = json.loads(out.strip().splitlines()[-1])
        return Stats(data["pool"], data["counters"], data["regions"])

    @staticmethod
    def kill(replica: Replica) -> None:
        docker("kill", "-s", "KILL", replica.container)

    def ensure_running(self, replica: Replica, timeout: float = 240.0) -> str:
        """Starts the container unless its restart policy already did; waits until healthy.
        Returns how it came back: "restarted by docker" or "docker start"."""
        how = "restarted by docker"
        time.sleep(2.0)  # the restart policy's first restart comes within a second or two
        if not self.running(replica.container):
            docker("start", replica.container)
            how = "docker start"
        self.wait_healthy(replica.container, timeout)
        return how

    def wait_healthy(self, container: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.health(container) == "healthy":
                return
            time.sleep(1.0)
        raise ClusterError(f"{container[:12]} not healthy after {timeout:.0f} s")

    def scale(self, prefills: int, decodes: int) -> None:
        argv = [*self.compose, "up", "-d", "--no-build", "--no-recreate",
                "--scale", f"prefill={prefills}", "--scale", f"decode={decodes}"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=400, check=False)
        if done.returncode != 0:
            raise ClusterError(f"{' '.join(argv[-5:])}: {done.stderr.strip()[-400:]}")

    @staticmethod
    def events(replica: Replica, since: float) -> list[dict]:
        """The JSON log events of a container since a time.time()."""
        text = subprocess.run(["docker", "logs", "--since", f"{since:.3f}", replica.container],
                              capture_output=True, text=True, timeout=60, check=False)
        events = []
        for line in (text.stdout + text.stderr).splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and "event" in event:
                events.append(event)
        return events


def wait_for(what: str, check, timeout: float, interval: float = 1.0):
    """Polls check() until it returns something truthy; ClusterError naming `what` if not."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise ClusterError(f"{what}: not after {timeout:.0f} s")
        time.sleep(interval)
