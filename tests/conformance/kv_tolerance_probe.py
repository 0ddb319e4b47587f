"""How far apart two correct prefills' KV are: the measurement behind the suite's KV tolerance
(SPEC.md section 8, conformance/spec.py KV_TOLERANCE).

    python -m tests.conformance.kv_tolerance_probe [--dtype float32] [--lengths 1,17,67,256]

starts two real prefills of the demo model, one on the torch ops and one on the Triton kernels
(through the Triton interpreter on a CPU), asks both for the same prompts, and prints per length
the max |a - b| and the scaled error max |a - b| / (1 + |b|) that the suite compares with its
tolerance, and on each backend the scaled error between the KV of a prompt's first half and the
KV of that half alone (the kv_prefix_consistent case).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

import grpc

from common.pb.kvhandoff.v1 import common_pb2, handoff_pb2, handoff_pb2_grpc
from conformance.kv_content import handoff_kv, max_abs_diff, scaled_error
from conformance.prefill_checks import check_handoff
from conformance.runner import prompt_ids
from conformance.wire import read_handoff
from tests.helpers.cluster import start_service


def _request(info, prompt: list[int], rid: str) -> handoff_pb2.PrefillRequest:
    return handoff_pb2.PrefillRequest(
        request_id=rid, token_ids=prompt, model_fingerprint=info.model_fingerprint,
        protocol_version=common_pb2.ProtocolVersion(major=1),
        sampling=common_pb2.SamplingParams(temperature=0.0))


async def _kv(address: str, prompt: list[int], rid: str):
    async with grpc.aio.insecure_channel(
            address, options=[("grpc.max_receive_message_length", 256 << 20)]) as channel:
        info = await handoff_pb2_grpc.HandoffServiceStub(channel).GetPrefillInfo(
            handoff_pb2.GetPrefillInfoRequest(), timeout=60)
        request = _request(info, prompt, rid)
        received = await read_handoff(channel, request, 600)
        problems = check_handoff(request, info, received)
        if problems:
            raise RuntimeError(f"{address}: {problems}")
        return handoff_kv(received, info.layout, len(prompt))


def _error(x, y) -> float:
    return max(scaled_error(x.k, y.k), scaled_error(x.v, y.v))


async def _measure(a: str, b: str, lengths: list[int]) -> None:
    print(f"{'tokens':>6}  {'max_abs_diff':>12}  {'scaled_error':>12}  {'max_abs_value':>13}  "
          f"{'prefix_error_a':>14}  {'prefix_error_b':>14}")
    for n in lengths:
        prompt = prompt_ids(n, 96, 1000 + n)
        x = await _kv(a, prompt, f"probe-a-{n}")
        y = await _kv(b, prompt, f"probe-b-{n}")
        prefix = ["-", "-"]
        if n >= 2:
            m = n // 2
            prefix = [f"{_error(whole.head(m), await _kv(addr, prompt[:m], f'probe-h-{n}')):.3e}"
                      for whole, addr in ((x, a), (y, b))]
        top = float(max(abs(y.k).max(), abs(y.v).max()))
        print(f"{n:>6}  {max_abs_diff(x, y):>12.3e}  {_error(x, y):>12.3e}  {top:>13.3f}  "
              f"{prefix[0]:>14}  {prefix[1]:>14}", flush=True)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="float32")
    p.add_argument("--lengths", default="1,17,67,256")
    p.add_argument("--kernels", default="torch,triton", help="the two backends to compare")
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    flags = ["--model", "demo", "--device", "cpu", "--dtype", args.dtype, "--pool-tokens",
             str(max(1024, max(lengths))), "--max-context-tokens", str(max(1024, max(lengths)))]
    first, second = args.kernels.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        a = start_service("prefill", Path(tmp) / "a", [*flags, "--kernels", first])
        try:
            b = start_service("prefill", Path(tmp) / "b", [*flags, "--kernels", second])
            try:
                print(f"demo model, {args.dtype}: {first} ops vs {second} ops")
                asyncio.run(_measure(a.address, b.address, lengths))
            finally:
                b.stop()
        finally:
            a.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
