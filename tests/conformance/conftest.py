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
