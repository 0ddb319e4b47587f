"""`kvhandoff bench ...`: the benchmarks, one subcommand each."""

from __future__ import annotations

import sys

BENCHMARKS = {
    "transfer": ("bench.transfer", "Measures KV handoff GB/s through the services' code against "
                 "a plain socket."),
    "serve": ("bench.serve", "Runs a serving load test (TTFT, TPOT, ITL, goodput), "
              "disaggregated against --local-prefill."),
    "ttft": ("bench.ttft", "Measures the exposed transfer time: TTFT disaggregated minus TTFT "
             "in one process."),
    "decode": ("bench.decode_throughput", "Measures decode tokens/s at several batch sizes."),
    "scrub": ("bench.scrub", "Measures what --scrub-freed-pages costs."),
    "prefill": ("bench.chunked_prefill", "Measures prefill throughput of one long prompt, "
                "chunked vs unchunked."),
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHMARKS:
        lines = [f"  {name:<10} {text}" for name, (_, text) in BENCHMARKS.items()]
        print("usage: kvhandoff bench BENCHMARK [options]   (kvhandoff bench BENCHMARK --help)"
              "\n\nbenchmarks:\n" + "\n".join(lines)
              + "\n\n(the Triton kernel benchmark runs as `python bench/kernels.py`)")
        return 2 if argv and argv[0] not in ("-h", "--help") else 0
    import importlib

    from bench.errors import user_errors

    module = importlib.import_module(BENCHMARKS[argv[0]][0])
    try:
        return module.main(argv[1:])
    except user_errors() as err:  # the user's input, said in one line; a bug keeps its trace
        print(f"kvhandoff bench {argv[0]}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
