"""One demo cluster shared by the read-only operations tests (metrics, logs, reflection,
errors); tests that stop or kill services start their own."""

from __future__ import annotations

import pytest

from tests.ops.helpers import start_demo_cluster


@pytest.fixture(scope="session")
def ops_cluster(tmp_path_factory):
    cluster = start_demo_cluster(tmp_path_factory.mktemp("ops-cluster"))
    yield cluster
    cluster.stop()
