"""The suite's case selection, exit status, JUnit output and CLI (no services needed)."""

from __future__ import annotations

import subprocess
import sys

from conformance.report import CaseResult, Outcome, Selection, run_passed, write_junit
from tests.conformance.suite_process import read_junit
from tests.helpers.cluster import REPO


def _result(case_id: str, outcome: Outcome, level: str = "MUST") -> CaseResult:
    return CaseResult(case_id, "D-07", level, "expectation", outcome, "detail")


def test_selection_takes_ids_and_globs():
    s = Selection.parse("chunk_*,status_rejected", "chunk_k_short")
    assert s.wants("chunk_missing") and s.wants("status_rejected")
    assert not s.wants("chunk_k_short") and not s.wants("status_aborted")
    assert Selection.parse(None, None).wants("anything")


def test_only_a_failed_must_case_fails_the_run():
    assert run_passed([_result("a", Outcome.PASS), _result("b", Outcome.SKIP),
                       _result("c", Outcome.FAIL, "SHOULD")])
    assert not run_passed([_result("a", Outcome.PASS), _result("d", Outcome.FAIL)])


def test_junit_reports_each_case(tmp_path):
    path = tmp_path / "out.xml"
    write_junit(path, "suite", [_result("a", Outcome.PASS), _result("b", Outcome.FAIL),
                                _result("c", Outcome.SKIP), _result("d", Outcome.FAIL, "SHOULD")])
    assert read_junit(path) == {"a": "pass", "b": "fail", "c": "skip", "d": "skip"}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvhandoff_cli.main", "conformance", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def test_cli_lists_selected_cases():
    result = _cli("decode", "--target", "x", "--fake-prefill-listen", "y",
                  "--reference-prefill", "z", "--list", "--only", "token_count_*",
                  "--skip", "*_long")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["token_count_zero", "token_count_placeholder",
                                     "token_count_short"]


def test_cli_exits_2_when_the_target_is_unreachable():
    result = _cli("prefill", "--target", "127.0.0.1:1", "--timeout", "1")
    assert result.returncode == 2
    assert "setup failed" in result.stderr
