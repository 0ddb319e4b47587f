"""Core borrowing (common/server/core_borrowing.py): decode borrows while none of its handoffs
awaits KV and holds the busy file while it computes; prefill borrows for a pass only when it can
take that file; nobody ever waits for it, and a disabled one changes nothing."""

from __future__ import annotations

import pytest
import torch

from common.counters import Counters
from common.server.borrow_guard import BorrowGuard, BorrowGuardConfig
from common.server.core_borrowing import CoreBorrowing, CoreBorrowingConfig, _BusyLock


@pytest.fixture(autouse=True)
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _pair(tmp_path):
    config = CoreBorrowingConfig(own_threads=1, borrowed_threads=1,
                                 busy_file=str(tmp_path / "decode.busy"))
    counters = Counters()
    return CoreBorrowing(config, counters), CoreBorrowing(config), counters


def _free(path) -> bool:
    """Whether a third party could take the busy file now (and gives it straight back)."""
    probe = _BusyLock(str(path))
    try:
        return probe.try_take()
    finally:
        probe.close()


def test_decode_borrows_only_while_nothing_awaits_kv_and_holds_the_file_while_computing(
        tmp_path):
    decode, _, counters = _pair(tmp_path)
    decode.decode_state(computing=True, awaiting=False)
    assert decode.threads == torch.get_num_threads() == 2
    assert not _free(tmp_path / "decode.busy")
    decode.decode_state(computing=True, awaiting=True)  # a handoff in flight: prefill computes
    assert decode.threads == torch.get_num_threads() == 1
    assert not _free(tmp_path / "decode.busy")  # still computing: prefill may not borrow
    decode.decode_state(computing=False, awaiting=True)
    assert decode.threads == 1 and _free(tmp_path / "decode.busy")
    assert counters.snapshot().get("core_borrows") == 1
    decode.close()


def test_prefill_borrows_for_a_pass_only_while_decode_idles(tmp_path):
    decode, prefill, _ = _pair(tmp_path)
    torch.set_num_threads(1)
    decode.decode_state(computing=True, awaiting=True)
    with prefill.prefill_pass(1024):
        assert torch.get_num_threads() == 1  # decode computes: prefill keeps its own threads
    decode.decode_state(computing=False, awaiting=True)
    with prefill.prefill_pass(1024):
        assert prefill.threads == 2
        assert _free(tmp_path / "decode.busy")  # never held by prefill: decode can signal
        prefill.prefill_layer()
        assert prefill.threads == 2  # decode still idle: the next layer borrows too
        decode.decode_state(computing=True, awaiting=True)  # decode gets busy mid-pass
        prefill.prefill_layer()
        assert prefill.threads == 1  # the rest of the pass on prefill's own threads
    assert prefill.threads == 1
    decode.decode_state(computing=False, awaiting=False)
    assert _free(tmp_path / "decode.busy")
    decode.close()
    prefill.close()


def test_decode_sees_a_pass_that_borrows_its_cpus(tmp_path):
    """The lent file: held by prefill exactly while a pass runs on borrowed threads."""
    decode, prefill, _ = _pair(tmp_path)
    torch.set_num_threads(1)
    assert not decode.peer_borrowing()
    with prefill.prefill_pass(1024):
        assert decode.peer_borrowing() and decode.peer_borrowing()  # a probe changes nothing
        decode.decode_state(computing=True, awaiting=True)  # decode busy: prefill drops back
        prefill.prefill_layer()
        assert prefill.threads == 1 and not decode.peer_borrowing()
    decode.decode_state(computing=False, awaiting=True)
    with prefill.prefill_pass(1024):
        assert decode.peer_borrowing()
    assert not decode.peer_borrowing()
    with prefill.prefill_pass(prefill.config.min_borrow_tokens - 1):
        assert not decode.peer_borrowing()  # a short pass lends nothing
    assert not CoreBorrowing(CoreBorrowingConfig()).peer_borrowing()
    decode.close()
    prefill.close()


def test_a_pass_that_raises_gives_the_file_and_the_threads_back(tmp_path):
    _, prefill, _ = _pair(tmp_path)
    torch.set_num_threads(1)
    with pytest.raises(RuntimeError), prefill.prefill_pass(1024):
        raise RuntimeError("pass failed")
    assert torch.get_num_threads() == 1 and _free(tmp_path / "decode.busy")
    assert _free(tmp_path / "decode.busy.lent")
    prefill.close()


def test_a_disabled_one_opens_nothing_and_changes_no_thread_count(tmp_path):
    torch.set_num_threads(1)
    for config in (CoreBorrowingConfig(), CoreBorrowingConfig(1, 0, str(tmp_path / "b")),
                   CoreBorrowingConfig(0, 1, str(tmp_path / "b"))):
        off = CoreBorrowing(config)
        off.decode_state(computing=True, awaiting=False)
        with off.prefill_pass(1024):
            assert torch.get_num_threads() == 1
        off.close()
    assert not (tmp_path / "b").exists()


def test_prefill_keeps_its_own_threads_for_a_short_pass(tmp_path):
    _, prefill, _ = _pair(tmp_path)
    torch.set_num_threads(1)
    with prefill.prefill_pass(prefill.config.min_borrow_tokens - 1):
        assert torch.get_num_threads() == 1 and _free(tmp_path / "decode.busy")
    prefill.close()


def _run_steps(guard: BorrowGuard, n: int, borrowed_s: float, own_s: float) -> list[bool]:
    """n steps, each as the guard advises, taking borrowed_s or own_s; the advice given."""
    advice = []
    for _ in range(n):
        borrow = guard.wants_borrow()
        advice.append(borrow)
        guard.step_done(borrowed_s if borrow else own_s, borrow)
    return advice


def test_the_guard_probes_and_keeps_borrowing_that_pays():
    config = BorrowGuardConfig(probe_every=8, probe_steps=2, min_gain=1.1, backoff_steps=20)
    counters = Counters()
    advice = _run_steps(BorrowGuard(config, counters), 30, borrowed_s=0.006, own_s=0.010)
    assert advice[:8] == [True] * 8 and advice[8:10] == [False, False]  # one probe of 2
    assert advice[10:18] == [True] * 8 and advice[18:20] == [False, False]
    assert counters.get("core_borrow_backoffs") == 0


def test_the_guard_backs_off_when_borrowed_steps_are_no_faster():
    config = BorrowGuardConfig(probe_every=8, probe_steps=2, min_gain=1.1, backoff_steps=20)
    counters = Counters()
    advice = _run_steps(BorrowGuard(config, counters), 40, borrowed_s=0.012, own_s=0.010)
    assert advice[:8] == [True] * 8
    assert advice[8:30] == [False] * 22  # the probe, then the back-off
    assert advice[30:38] == [True] * 8  # borrowing again, probed again after
    assert advice[38:40] == [False, False]
    assert counters.get("core_borrow_backoffs") == 2


def test_own_thread_steps_outside_a_probe_do_not_count_against_borrowing():
    config = BorrowGuardConfig(probe_every=4, probe_steps=2, min_gain=1.1, backoff_steps=20)
    guard = BorrowGuard(config)
    for _ in range(10):  # a handoff in flight: own threads, not by the guard's advice
        guard.step_done(0.001, borrowed=False)
    assert _run_steps(guard, 4, borrowed_s=0.006, own_s=0.010) == [True] * 4


def test_the_engine_thread_stays_on_its_own_cpus_and_the_workers_reach_the_borrowed(tmp_path):
    import os
    import threading

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    config = CoreBorrowingConfig(own_threads=1, borrowed_threads=1,
                                 busy_file=str(tmp_path / "decode.busy"), own_cpus=(cpus[0],),
                                 borrowed_cpus=(cpus[1],))
    seen = {}

    def engine() -> None:
        cores = CoreBorrowing(config)
        cores.on_engine_thread()
        seen["idle"] = os.sched_getaffinity(0)
        cores.decode_state(computing=True, awaiting=False)  # borrows: the workers start
        seen["borrowing"] = (os.sched_getaffinity(0), torch.get_num_threads())
        cores.close()
    thread = threading.Thread(target=engine)
    thread.start()
    thread.join()
    assert seen["idle"] == {cpus[0]}
    assert seen["borrowing"] == ({cpus[0]}, 2)


def test_decodes_own_prefill_pass_borrows_while_the_guard_holds_steps_back(tmp_path):
    decode, _, _ = _pair(tmp_path)
    decode._guard._backoff = 100  # borrowed steps did not pay: steps stay on the own threads
    decode.decode_state(computing=True, awaiting=False)
    assert decode.threads == 1
    decode.decode_state(computing=True, awaiting=False, own_pass=True)
    assert decode.threads == torch.get_num_threads() == 2
    decode.decode_state(computing=True, awaiting=True, own_pass=True)  # prefill computes
    assert decode.threads == 1
    decode.close()
