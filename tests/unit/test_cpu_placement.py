"""--torch-threads and --cpu-affinity: CPU lists parsed and refused in one line, the split
`kvhandoff up` and `bench serve` make of the cores they were given, and the placement applied to
every thread of a process (read back from /proc/PID/task/TID/status)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.servers import placement_flags
from common.server import cpu_placement
from common.server.cpu_placement import (CpuListError, allowed_cpus, check_cpu_affinity,
                                         format_cpu_list, parse_cpu_list, split_cores)
from kvhandoff_cli import up
from kvhandoff_cli.main import main
from tests.helpers.cluster import REPO


@pytest.mark.parametrize("text, cpus", [("0", (0,)), ("0-3,6", (0, 1, 2, 3, 6)),
                                        ("6,0-1, 1", (0, 1, 6)), ("2-2", (2,))])
def test_cpu_lists_parse_and_format_back(text, cpus):
    assert parse_cpu_list(text) == cpus
    assert parse_cpu_list(format_cpu_list(cpus)) == cpus


@pytest.mark.parametrize("text", ["", "x", "1,", "3-1", "-1", "0-", "1.5"])
def test_a_malformed_cpu_list_is_refused(text):
    with pytest.raises(CpuListError, match="use numbers and ranges like 0-3,6"):
        parse_cpu_list(text)


def test_cpus_this_process_may_not_use_are_refused():
    outside = max(allowed_cpus()) + 1
    with pytest.raises(CpuListError, match=f"CPUs {outside} are not among"):
        check_cpu_affinity(f"{min(allowed_cpus())},{outside}")
    assert check_cpu_affinity(format_cpu_list(allowed_cpus())) == allowed_cpus()


@pytest.mark.parametrize("cpus, prefill, decode", [
    ((0,), (0,), (0,)), ((0, 1), (0,), (1,)), ((0, 1, 2, 3, 4), (0, 1), (2, 3, 4)),
    ((2, 5, 7, 9), (2, 5), (7, 9))])
def test_the_split_gives_each_service_its_own_share(cpus, prefill, decode):
    assert split_cores(cpus) == (prefill, decode)


def _up_placement(monkeypatch, cpus: tuple[int, ...], *flags: str):
    monkeypatch.setattr(cpu_placement, "allowed_cpus", lambda: cpus)
    monkeypatch.setattr(up, "allowed_cpus", lambda: cpus)
    return up.cpu_placement(up.parser().parse_args(list(flags)))


def test_up_splits_the_cores_by_default_and_passes_explicit_ones_on(monkeypatch):
    assert _up_placement(monkeypatch, (0, 1, 2, 3)) == {"prefill": (2, (0, 1)),
                                                        "decode": (2, (2, 3))}
    assert _up_placement(monkeypatch, (0, 1, 2, 3), "--decode-cpus", "1-3",
                         "--prefill-torch-threads", "3") == {"prefill": (3, (0, 1)),
                                                             "decode": (3, (1, 2, 3))}
    assert _up_placement(monkeypatch, (0, 1), "--no-cpu-split") == {"prefill": (0, ()),
                                                                    "decode": (0, ())}
    unpinned = {"prefill": (1, (0,)), "decode": (0, ())}
    none = {"prefill": (), "decode": ()}
    line = up._placement_line(unpinned, none)
    assert line == "prefill CPUs 0, 1 torch threads; decode all CPUs, torch's default threads"


def test_up_lends_each_service_the_other_ones_cores_only_when_both_are_pinned():
    split = {"prefill": (1, (0,)), "decode": (2, (1, 2))}
    assert up.borrowed_cpus(split, "prefill", True) == (1, 2)
    assert up.borrowed_cpus(split, "decode", True) == (0,)
    assert up.borrowed_cpus(split, "decode", False) == ()
    assert up.borrowed_cpus({"prefill": (1, (0,)), "decode": (1, (0,))}, "decode", True) == ()
    assert up.borrowed_cpus({"prefill": (1, (0,)), "decode": (0, ())}, "prefill", True) == ()
    line = up._placement_line(split, {"prefill": (1, 2), "decode": (0,)})
    assert line == ("prefill CPUs 0, 1 torch threads (+2 on CPUs 1-2 while decode idles); "
                    "decode CPUs 1-2, 2 torch threads (+1 on CPUs 0 while no handoff is in "
                    "flight)")


def test_up_refuses_a_list_it_cannot_use_naming_the_flag(monkeypatch):
    with pytest.raises(CpuListError, match="--prefill-cpus: CPUs 9 are not among"):
        _up_placement(monkeypatch, (0, 1), "--prefill-cpus", "9")
    with pytest.raises(CpuListError, match="--decode-torch-threads must be >= 0"):
        _up_placement(monkeypatch, (0, 1), "--decode-torch-threads", "-2")


def test_up_refusal_is_one_line_before_anything_starts():
    bad = subprocess.run([sys.executable, "-m", "kvhandoff_cli.main", "up", "--decode-cpus",
                          "0-x"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "kvhandoff up: refusing to start: --decode-cpus: CPU list '0-x': use numbers and "
        "ranges like 0-3,6"]


@pytest.mark.parametrize("flags, message", [
    (["--cpu-affinity", "a-b"], "--cpu-affinity: CPU list 'a-b': use numbers and ranges"),
    (["--cpu-affinity", "4096"], "--cpu-affinity: CPUs 4096 are not among this process's CPUs"),
    (["--torch-threads", "-1"], "--torch-threads: torch_threads must be in [0, 1024], got -1")])
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_service_flags_are_refused_in_one_line(role, flags, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["config", "show", role, *flags])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_the_environment_sets_them_too(monkeypatch, capsys):
    monkeypatch.setenv("KVHANDOFF_CPU_AFFINITY", format_cpu_list(allowed_cpus()[:1]))
    monkeypatch.setenv("KVHANDOFF_TORCH_THREADS", "1")
    assert main(["config", "show", "prefill"]) == 0
    shown = json.loads(capsys.readouterr().out)["service"]
    assert shown["cpu_affinity"] == str(allowed_cpus()[0]) and shown["torch_threads"] == 1


def test_bench_places_its_services_as_up_does(monkeypatch):
    import bench.servers

    monkeypatch.setattr(bench.servers, "allowed_cpus", lambda: (0, 1, 2))
    assert placement_flags("prefill", "disaggregated", 0, True) == [
        "--cpu-affinity", "0", "--torch-threads", "1"]
    assert placement_flags("decode", "disaggregated", 0, True) == [
        "--cpu-affinity", "1-2", "--torch-threads", "2"]
    assert placement_flags("decode", "local", 0, True) == [
        "--cpu-affinity", "0-2", "--torch-threads", "3"]
    assert placement_flags("decode", "local", 2, False) == ["--torch-threads", "2"]
    assert placement_flags("decode", "local", 0, False) == []
    busy = Path("/run/x/decode.busy")
    assert placement_flags("prefill", "disaggregated", 0, True, busy) == [
        "--cpu-affinity", "0", "--torch-threads", "1", "--borrow-cpus", "1-2",
        "--busy-file", str(busy)]
    assert placement_flags("decode", "disaggregated", 0, True, busy) == [
        "--cpu-affinity", "1-2", "--torch-threads", "2", "--borrow-cpus", "0",
        "--busy-file", str(busy)]
    assert placement_flags("decode", "local", 0, True, busy) == [
        "--cpu-affinity", "0-2", "--torch-threads", "3"]


PROBE = """
import json, os, sys, threading
started = threading.Event()
threading.Thread(target=lambda: (started.set(), threading.Event().wait(30)), daemon=True).start()
started.wait()
from common.server.cpu_placement import apply_cpu_placement
threads, cpus = apply_cpu_placement(int(sys.argv[1]), sys.argv[2])
masks = {}
for tid in os.listdir("/proc/self/task"):
    for line in open(f"/proc/self/task/{tid}/status"):
        if line.startswith("Cpus_allowed_list:"):
            masks[tid] = line.split()[1]
print(json.dumps({"threads": threads, "cpus": list(cpus), "masks": masks}))
"""


@pytest.mark.parametrize("torch_threads, expected_threads", [(0, 1), (2, 2)])
def test_placement_pins_every_thread_and_sets_torch_threads(torch_threads, expected_threads):
    cpu = allowed_cpus()[-1]
    out = subprocess.run([sys.executable, "-c", PROBE, str(torch_threads), str(cpu)], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["threads"] == expected_threads and got["cpus"] == [cpu]
    assert len(got["masks"]) >= 2  # the thread started before the placement is pinned too
    assert set(got["masks"].values()) == {str(cpu)}
