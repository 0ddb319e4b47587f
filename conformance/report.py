"""Case results, case selection (--only/--skip), the printed table and JUnit XML.

A run passes when no MUST case failed; SHOULD cases are reported but never fail a run, and a
skipped case (not applicable to the target, or deselected) neither passes nor fails it.
"""

from __future__ import annotations

import enum
import fnmatch
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


class Outcome(enum.Enum):
    PASS = "pass"
    FAIL = "FAIL"
    SKIP = "skip"


@dataclass(frozen=True)
class CaseResult:
    case_id: str
    rule: str
    level: str  # "MUST" or "SHOULD"
    expectation: str
    outcome: Outcome
    detail: str = ""
    seconds: float = 0.0


@dataclass(frozen=True)
class Selection:
    """Comma-separated case ids or globs; an empty `only` selects every case."""

    only: tuple[str, ...] = ()
    skip: tuple[str, ...] = ()

    @classmethod
    def parse(cls, only: str | None, skip: str | None) -> Selection:
        def split(text: str | None) -> tuple[str, ...]:
            return tuple(p.strip() for p in (text or "").split(",") if p.strip())

        return cls(split(only), split(skip))

    def wants(self, case_id: str) -> bool:
        if self.only and not any(fnmatch.fnmatchcase(case_id, p) for p in self.only):
            return False
        return not any(fnmatch.fnmatchcase(case_id, p) for p in self.skip)


def run_passed(results: Iterable[CaseResult]) -> bool:
    return not any(r.outcome is Outcome.FAIL and r.level == "MUST" for r in results)


def render_table(title: str, results: list[CaseResult]) -> str:
    headers = ("case", "rule", "level", "expectation", "result")
    rows = [(r.case_id, r.rule, r.level, r.expectation, r.outcome.value) for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    widths[3] = min(widths[3], 60)

    def line(cells) -> str:
        return "  ".join(str(c)[: w].ljust(w) for c, w in zip(cells, widths)).rstrip()

    out = [title, line(headers), line("-" * w for w in widths)]
    for r, row in zip(results, rows):
        out.append(line(row))
        if r.outcome is not Outcome.PASS and r.detail:
            out.append(f"    -> {r.detail}")
    counts = {o: sum(r.outcome is o for r in results) for o in Outcome}
    failed_should = sum(r.outcome is Outcome.FAIL and r.level == "SHOULD" for r in results)
    out.append(f"{counts[Outcome.PASS]} passed, {counts[Outcome.FAIL]} failed "
               f"({failed_should} SHOULD), {counts[Outcome.SKIP]} skipped: "
               f"{'CONFORMS' if run_passed(results) else 'DOES NOT CONFORM'}")
    return "\n".join(out)


def write_junit(path: Path, suite_name: str, results: list[CaseResult]) -> None:
    """One <testcase> per case; a failed SHOULD case is reported as skipped with its detail,
    so that CI dashboards agree with the exit status."""
    failures = sum(r.outcome is Outcome.FAIL and r.level == "MUST" for r in results)
    skipped = sum(r.outcome is Outcome.SKIP or (r.outcome is Outcome.FAIL and r.level != "MUST")
                  for r in results)
    suite = ET.Element("testsuite", name=suite_name, tests=str(len(results)),
                       failures=str(failures), errors="0", skipped=str(skipped),
                       time=f"{sum(r.seconds for r in results):.3f}")
    for r in results:
        case = ET.SubElement(suite, "testcase", classname=f"{suite_name}.{r.rule}",
                             name=r.case_id, time=f"{r.seconds:.3f}")
        ET.SubElement(case, "properties").extend([
            ET.Element("property", name="rule", value=r.rule),
            ET.Element("property", name="level", value=r.level),
            ET.Element("property", name="expectation", value=r.expectation)])
        if r.outcome is Outcome.FAIL and r.level == "MUST":
            ET.SubElement(case, "failure", message=r.detail or "failed").text = r.detail
        elif r.outcome is Outcome.FAIL:
            ET.SubElement(case, "skipped", message=f"SHOULD not met: {r.detail}")
        elif r.outcome is Outcome.SKIP:
            ET.SubElement(case, "skipped", message=r.detail or "skipped")
    root = ET.Element("testsuites")
    root.append(suite)
    ET.indent(root)
    path.write_text(ET.tostring(root, encoding="unicode") + "\n")
