"""Summaries, the side-by-side table and the plots of `kvhandoff bench serve`.

Metrics (as in `vllm bench serve`): TTFT, the send-to-first-token time; TPOT, a request's mean
time per output token after the first; ITL, every gap between consecutive tokens; E2E, the
send-to-last-message time. Throughputs are over the run's wall time. Goodput counts the
requests that meet every SLO given (TTFT and/or TPOT), per second. Server CPU seconds per output
token are the CPU time the server's processes used during the load over the tokens it streamed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from bench.serve_client import RequestResult

PERCENTILES = (50, 90, 99)
LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))


def _stats(values_s: list[float]) -> dict:
    if not values_s:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    ms = np.asarray(values_s) * 1000.0
    return {"mean": float(ms.mean()),
            **{f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES}}


def meets_slo(result: RequestResult, slo_ttft_ms: float | None, slo_tpot_ms: float | None
              ) -> bool:
    if not result.ok:
        return False
    if slo_ttft_ms is not None and result.ttft * 1000.0 > slo_ttft_ms:
        return False
    tpot = result.tpot
    return slo_tpot_ms is None or tpot is None or tpot * 1000.0 <= slo_tpot_ms


def summarize(results: list[RequestResult], duration: float, slo_ttft_ms: float | None,
              slo_tpot_ms: float | None) -> dict:
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_len for r in ok)
    input_tokens = sum(r.prompt_len for r in ok)
    has_slo = slo_ttft_ms is not None or slo_tpot_ms is not None
    good = sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in results) if has_slo else None
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "input_tokens": input_tokens, "output_tokens": output_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "goodput": None if good is None else good / duration,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": _stats([gap for r in ok for gap in r.itl]),
        "e2e_ms": _stats([r.latency for r in ok]),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }


def _rows(summary: dict) -> list[tuple[str, str]]:
    def num(value, digits=2) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    rows = [("completed / failed", f"{summary['completed']} / {summary['failed']}"),
            ("duration (s)", num(summary["duration_s"])),
            ("request throughput (req/s)", num(summary["request_throughput"], 3)),
            ("output throughput (tok/s)", num(summary["output_throughput"], 1)),
            ("total throughput (tok/s)", num(summary["total_token_throughput"], 1)),
            ("goodput (req/s)", num(summary["goodput"], 3)),
            ("server CPU s / output token", num(summary.get("cpu_s_per_output_token"), 4))]
    for key, name in LATENCIES:
        for stat in ("mean", *(f"p{p}" for p in PERCENTILES)):
            rows.append((f"{name} {stat} (ms)", num(summary[key][stat])))
    return rows


def print_table(title: str, summaries: dict[str, dict], out=sys.stdout) -> None:
    """One column per mode, one row per metric."""
    modes = list(summaries)
    columns = {mode: dict(_rows(s)) for mode, s in summaries.items()}
    names = [name for name, _ in _rows(next(iter(summaries.values())))]
    width = max(len(n) for n in names) + 2
    print(f"\n=== {title} ===", file=out)
    print(f"{'metric':<{width}}" + "".join(f"{m:>16}" for m in modes), file=out)
    for name in names:
        print(f"{name:<{width}}" + "".join(f"{columns[m][name]:>16}" for m in modes), file=out)


# the side-by-side table: (column, summary key, stat or None, digits)
HEADLINE = (("out tok/s", "output_throughput", None, 1), ("req/s", "request_throughput", None, 3),
            ("TTFT p50", "ttft_ms", "p50", 0), ("TTFT p90", "ttft_ms", "p90", 0),
            ("TPOT p50", "tpot_ms", "p50", 1), ("ITL p90", "itl_ms", "p90", 1),
            ("CPU s/tok", "cpu_s_per_output_token", None, 4))
# ratios against the base system: higher is better for throughput, lower for latency
RATIOS = (("tok/s x", "output_throughput", None), ("TTFT p50 x", "ttft_ms", "p50"),
          ("TPOT p50 x", "tpot_ms", "p50"))


def _value(summary: dict, key: str, stat: str | None) -> float | None:
    value = summary.get(key)
    return value.get(stat) if stat is not None and isinstance(value, dict) else value


def ratio(summary: dict, base: dict, key: str, stat: str | None) -> float | None:
    """summary's value over base's; None when either is missing or base's is 0."""
    mine, theirs = _value(summary, key, stat), _value(base, key, stat)
    return None if mine is None or not theirs else mine / theirs


def print_headline(runs: list[dict], base_mode: str | None = None, out=None) -> None:
    """One row per (point, system): the headline metrics (ms for latencies) and, when two or
    more systems ran, each one's ratios to base_mode's row of the same point (default: the
    last system listed)."""
    out = out or sys.stdout
    modes = list(dict.fromkeys(run["mode"] for run in runs))
    base = base_mode or modes[-1]
    points = list(dict.fromkeys(run["point"] for run in runs))
    show_ratios = len(modes) > 1
    columns = [name for name, *_ in HEADLINE] + ([f"{n} {base}" for n, *_ in RATIOS]
                                                  if show_ratios else [])
    width = max(len(p) for p in points) + 2
    label = max(len(m) for m in modes) + 2
    print(f"\n=== side by side{f' (ratios: each system over {base})' if show_ratios else ''}"
          " ===", file=out)
    print(f"{'point':<{width}}{'system':<{label}}" + "".join(f"{c:>{max(11, len(c) + 2)}}"
                                                           for c in columns), file=out)
    for point in points:
        here = {run["mode"]: run["summary"] for run in runs if run["point"] == point}
        for mode, summary in here.items():
            cells = [_format(_value(summary, key, stat), digits)
                     for _name, key, stat, digits in HEADLINE]
            if show_ratios:
                cells += [_format(ratio(summary, here[base], key, stat), 2) + "x"
                          if base in here and mode != base else "-"
                          for _name, key, stat in RATIOS]
            print(f"{point:<{width}}{mode:<{label}}" + "".join(
                f"{cell:>{max(11, len(c) + 2)}}" for cell, c in zip(cells, columns)), file=out)


def _format(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def write_plots(runs: list[dict], results: dict, plot_dir: Path) -> list[Path]:
    """Latency CDFs per load level and throughput against load; [] when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the plots (the JSON has every number)",
              file=sys.stderr)
        return []
    plot_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for load in sorted({run["load"] for run in runs}):
        fig, axes = plt.subplots(1, 4, figsize=(18, 4))
        for axis, (key, name) in zip(axes, LATENCIES):
            for run in (r for r in runs if r["load"] == load):
                values = _latencies(results[(run["mode"], load)], key)
                if values:
                    xs = np.sort(values)
                    axis.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=run["mode"])
            axis.set_xlabel(f"{name} (ms)")
            axis.set_ylabel("fraction of requests" if key != "itl_ms" else "fraction of gaps")
            axis.grid(alpha=0.3)
            axis.legend()
        fig.suptitle(f"latency distributions, {load}")
        path = plot_dir / f"latency_{_slug(load)}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for mode in sorted({run["mode"] for run in runs}):
        mine = sorted((r for r in runs if r["mode"] == mode), key=lambda r: r["offered"])
        xs = [r["offered"] for r in mine]
        axes[0].plot(xs, [r["summary"]["output_throughput"] for r in mine], "o-", label=mode)
        axes[1].plot(xs, [r["summary"]["ttft_ms"]["p50"] or 0 for r in mine], "o-", label=mode)
    axes[0].set_ylabel("output tokens/s")
    axes[1].set_ylabel("TTFT p50 (ms)")
    for axis in axes:
        axis.set_xlabel("offered load (req/s; all-at-once plotted at the measured rate)")
        axis.grid(alpha=0.3)
        axis.legend()
    path = plot_dir / "throughput_vs_load.png"
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [*written, path]


def _latencies(results: list[RequestResult], key: str) -> list[float]:
    ok = [r for r in results if r.ok]
    if key == "ttft_ms":
        values = [r.ttft for r in ok]
    elif key == "tpot_ms":
        values = [r.tpot for r in ok if r.tpot is not None]
    elif key == "itl_ms":
        values = [gap for r in ok for gap in r.itl]
    else:
        values = [r.latency for r in ok]
    return [v * 1000.0 for v in values]


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text).strip("_")
