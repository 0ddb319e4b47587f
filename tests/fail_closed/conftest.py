"""One reference prefill, one in-process fake prefill and one real decode for the package."""

from __future__ import annotations

import pytest

from tests.fail_closed.harness import DecodeHarness


@pytest.fixture(scope="package")
def harness(tmp_path_factory):
    h = DecodeHarness(tmp_path_factory.mktemp("fail_closed"))
    yield h
    h.close()
