"""One real prefill (demo model, pool below its window) shared by the package: the target of
the prefill suite and the reference prefill behind the decode suite's fake."""

from __future__ import annotations

import pytest

from tests.conformance.suite_process import PREFILL_FLAGS
from tests.helpers.cluster import start_service


@pytest.fixture(scope="package")
def reference_prefill(tmp_path_factory):
    service = start_service("prefill", tmp_path_factory.mktemp("reference"), PREFILL_FLAGS)
    yield service
    service.stop()


@pytest.fixture(scope="package")
def shared_memory_reference(tmp_path_factory):
    """A reference prefill offering SHARED_MEMORY on a directory of its own: (service, dir)."""
    root = tmp_path_factory.mktemp("shm-reference")
    shm_dir = root / "shm"
    shm_dir.mkdir()
    service = start_service("prefill", root, [*PREFILL_FLAGS, "--shm-dir", str(shm_dir)])
    yield service, shm_dir
    service.stop()
