"""A tiny-checkpoint cluster whose services run through tests.isolation.patched_service, so that
chosen prompts are slow: prompts starting with SLOW_PREFILL stream their handoff slowly, prompts
starting with SLOW_DECODE generate slowly. Everything else is the real code path."""

from __future__ import annotations

from pathlib import Path

import grpc

from tests.faults.waits import wait_until
from tests.helpers.checkpoints import SPECS, make_checkpoint
from tests.helpers.cluster import Service, generate
from tests.isolation.launch import PATCHED, start

SLOW_PREFILL, SLOW_DECODE = 9, 8
PREFILL_SECONDS_PER_CHUNK = 2.0
DECODE_SECONDS_PER_TOKEN = 0.2
NORMAL_PROMPT = [5, 17, 33, 60, 71, 88, 90, 101, 150, 201]
SLOW_PREFILL_PROMPT = [SLOW_PREFILL, 40, 41, 42, 43, 44, 45, 46, 47]
SLOW_DECODE_PROMPT = [SLOW_DECODE, 50, 51, 52, 53, 54]
BOTH = ["--page-size", "4", "--pool-tokens", "512", "--max-context-tokens", "256",
        "--poison-freed-pages", "--check-page-owners"]


def checkpoint(root: Path) -> str:
    path, _ = make_checkpoint(SPECS[0], root)
    return str(path)


def start_prefill(model: str, workdir: Path, port: int = 0) -> Service:
    return start("prefill", workdir, ["--model", model, *BOTH], module=PATCHED, port=port, env={
        "KVH_TEST_SLOW_PREFILL_MARKER": str(SLOW_PREFILL),
        "KVH_TEST_SLOW_SECONDS": str(PREFILL_SECONDS_PER_CHUNK)})


def start_decode(model: str, workdir: Path, prefill: Service) -> Service:
    return start("decode", workdir, ["--model", model, "--prefill", prefill.address, *BOTH],
                 module=PATCHED, env={"KVH_TEST_SLOW_DECODE_MARKER": str(SLOW_DECODE),
                                      "KVH_TEST_SLOW_SECONDS": str(DECODE_SECONDS_PER_TOKEN)})


def normal_output(address: str) -> list[int]:
    return generate(address, token_ids=NORMAL_PROMPT, max_tokens=12, ignore_eos=True).token_ids


def normal_output_once_reachable(address: str, timeout: float = 90.0) -> list[int]:
    """Retries while decode answers UNAVAILABLE (its channel to prefill still reconnecting)."""
    got: list[list[int]] = []

    def attempt() -> bool:
        try:
            got.append(normal_output(address))
            return True
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            return False

    wait_until(attempt, timeout, f"decode at {address} serving again")
    return got[0]
