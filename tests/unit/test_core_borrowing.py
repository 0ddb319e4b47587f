"""Core borrowing (common/server/core_borrowing.py): decode borrows while none of its handoffs
awaits KV and holds the busy file while it computes; prefill borrows for a pass only when it can
take that file; nobody ever waits for it, and a disabled one changes nothing."""

from __future__ import annotations

import pytest
import torch

from common.counters import Counters
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
    with prefill.prefill_pass():
        assert torch.get_num_threads() == 1  # decode computes: prefill keeps its own threads
    decode.decode_state(computing=False, awaiting=True)
    with prefill.prefill_pass():
        assert torch.get_num_threads() == 2
        assert not _free(tmp_path / "decode.busy")  # held for the pass
        decode.decode_state(computing=True, awaiting=False)  # decode never waits for it
        assert decode.threads == 2
    # (one process here: the two share torch's count, which prefill set back to its own)
    assert prefill.threads == 1 and torch.get_num_threads() == 1
    decode.decode_state(computing=False, awaiting=False)
    assert _free(tmp_path / "decode.busy")
    decode.close()
    prefill.close()


def test_a_pass_that_raises_gives_the_file_and_the_threads_back(tmp_path):
    _, prefill, _ = _pair(tmp_path)
    torch.set_num_threads(1)
    with pytest.raises(RuntimeError), prefill.prefill_pass():
        raise RuntimeError("pass failed")
    assert torch.get_num_threads() == 1 and _free(tmp_path / "decode.busy")
    prefill.close()


def test_a_disabled_one_opens_nothing_and_changes_no_thread_count(tmp_path):
    torch.set_num_threads(1)
    for config in (CoreBorrowingConfig(), CoreBorrowingConfig(1, 0, str(tmp_path / "b")),
                   CoreBorrowingConfig(0, 1, str(tmp_path / "b"))):
        off = CoreBorrowing(config)
        off.decode_state(computing=True, awaiting=False)
        with off.prefill_pass():
            assert torch.get_num_threads() == 1
        off.close()
    assert not (tmp_path / "b").exists()
