"""`kvhandoff conformance prefill|decode`: run the suite, print the table, write JUnit XML.

Exit status: 0 when every selected MUST case passed, 1 when one failed, 2 on a usage or setup
error (the target never became reachable, the fake could not listen).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from conformance.report import CaseResult, Selection, render_table, run_passed, write_junit


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvhandoff conformance",
                                description="Check an implementation of kvhandoff.v1 against "
                                            "protos/kvhandoff/v1/SPEC.md.")
    sub = p.add_subparsers(dest="role", required=True)
    pre = sub.add_parser("prefill", help="act as a decode against the prefill at --target")
    dec = sub.add_parser("decode", help="serve a scripted fake prefill to the decode at --target "
                         "(start that decode with --prefill = --fake-prefill-listen)")
    for s in (pre, dec):
        s.add_argument("--target", help="HOST:PORT of the service under test (required "
                       "except with --list)")
        s.add_argument("--junit", type=Path, help="write JUnit XML here")
        s.add_argument("--only", help="comma-separated case ids or globs to run")
        s.add_argument("--skip", help="comma-separated case ids or globs to leave out")
        s.add_argument("--timeout", type=float, default=120.0, help="deadline of each call (s)")
        s.add_argument("--settle-timeout", type=float, default=15.0,
                       help="how long a pool may take to return to baseline (s)")
        s.add_argument("--list", action="store_true", help="print the case ids and exit")
        s.add_argument("--quiet", action="store_true", help="print only the table")
    pre.add_argument("--reference-prefill",
                     help="HOST:PORT of a trusted prefill of the same model: the KV content case "
                          "(kv_matches_reference) compares the target's KV with its KV")
    pre.add_argument("--kv-tolerance", type=float,
                     help="KV closeness: |a - b| <= tol * (1 + |b|) (default: SPEC.md section 8 "
                          "per dtype)")
    dec.add_argument("--fake-prefill-listen",
                     help="HOST:PORT the fake prefill listens on (required except with --list)")
    dec.add_argument("--reference-prefill",
                     help="HOST:PORT of a real prefill of the same model as the decode "
                          "(required except with --list)")
    dec.add_argument("--wait", type=float, default=180.0,
                     help="how long to wait for the decode to report SERVING (s)")
    dec.add_argument("--stall-deadline", type=float, default=3.0,
                     help="the client deadline of the stall case (s)")
    dec.add_argument("--shm-dir", default="/dev/shm",
                     help="the decode's shared-memory directory: when its requests ask for "
                          "SHARED_MEMORY, the fake reads the reference's regions and writes its "
                          "own there")
    return p


def _case_ids(role: str) -> list[str]:
    if role == "prefill":
        from conformance.prefill_suite import prefill_cases

        return [c.case_id for c in prefill_cases()]
    from conformance.decode_suite import suite_cases

    return [c.case_id for c in suite_cases()]


async def _run(args: argparse.Namespace, selection: Selection) -> list[CaseResult]:
    def progress(r: CaseResult) -> None:
        if not args.quiet:
            print(f"  {r.outcome.value:<4} {r.case_id} ({r.seconds:.2f}s)", file=sys.stderr,
                  flush=True)

    if args.role == "prefill":
        from conformance.prefill_suite import run_prefill_suite

        return await run_prefill_suite(args.target, selection, args.timeout,
                                       args.settle_timeout, progress, args.reference_prefill,
                                       args.kv_tolerance)
    from conformance.decode_suite import run_decode_suite

    return await run_decode_suite(args.target, args.fake_prefill_listen, args.reference_prefill,
                                  selection, args.timeout, args.settle_timeout, args.wait,
                                  args.stall_deadline, progress, args.shm_dir)


# What a run needs besides --list (SPEC.md section 8: --list prints the cases, nothing else).
RUN_NEEDS = {"prefill": ("target",), "decode": ("target", "fake_prefill_listen",
                                                "reference_prefill")}


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    selection = Selection.parse(args.only, args.skip)
    if args.list:
        print("\n".join(i for i in _case_ids(args.role) if selection.wants(i)))
        return 0
    missing = [f"--{name.replace('_', '-')}" for name in RUN_NEEDS[args.role]
               if not getattr(args, name)]
    if missing:
        print(f"kvhandoff conformance {args.role}: error: {' and '.join(missing)} "
              f"{'is' if len(missing) == 1 else 'are'} required to run the suite (--list "
              f"prints the cases without them)", file=sys.stderr)
        return 2
    try:
        results = asyncio.run(_run(args, selection))
    except (TimeoutError, OSError) as err:
        print(f"kvhandoff conformance {args.role}: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # grpc errors during setup (GetPrefillInfo, GetStats)
        print(f"kvhandoff conformance {args.role}: setup failed: {type(err).__name__}: {err}",
              file=sys.stderr)
        return 2
    title = f"kvhandoff.v1 conformance: {args.role} at {args.target}"
    print(render_table(title, results))
    if args.junit:
        write_junit(args.junit, f"kvhandoff.conformance.{args.role}", results)
    return 0 if run_passed(results) else 1
