"""Shared test setup: the `slow` marker's skip rule and the hypothesis profiles.

- `@pytest.mark.slow` tests run only with KVCACHE_SLOW=1.
- Hypothesis runs derandomized (a fixed seed per test, so CI is deterministic and a failure
  reproduces) with a small example budget by default ("ci" profile). KVCACHE_SLOW=1 switches to
  the "slow" profile: random seeds, many more examples and longer stateful runs.
  HYPOTHESIS_PROFILE=<name> picks a profile explicitly.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from servers import Cluster, Server, need_redis_server

from kvcache.devices import available_devices

SLOW = os.environ.get("KVCACHE_SLOW") == "1"

settings.register_profile(
    "ci",
    max_examples=100,
    stateful_step_count=50,
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "slow",
    max_examples=600,
    stateful_step_count=120,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "slow" if SLOW else "ci"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if SLOW:
        return
    skip_slow = pytest.mark.skip(reason="slow test: set KVCACHE_SLOW=1 to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)


#: KVCACHE_TEST_THREADS=N runs the whole suite on N torch threads (CI runs it with 1 and with 2:
#: every exactness claim must hold for both, and every tolerance was measured under both).
TEST_THREADS = int(os.environ["KVCACHE_TEST_THREADS"]) if os.environ.get("KVCACHE_TEST_THREADS") else None
if TEST_THREADS is not None:
    torch.set_num_threads(TEST_THREADS)


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's tiny models on one torch thread (faster, and a shared machine stays responsive);
    modules opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`. Under
    KVCACHE_TEST_THREADS the suite-wide thread count wins."""
    threads = torch.get_num_threads()
    torch.set_num_threads(TEST_THREADS or 1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[Server]:
    """A `redis-server` of the test's own on 127.0.0.1 (skipped where none is installed, outside CI)."""
    need_redis_server()
    server = Server(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A 3-node Redis Cluster on 127.0.0.1, shared by a module's tests."""
    need_redis_server()
    cluster = Cluster(tmp_path_factory.mktemp("cluster"))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


#: The device matrix: the CPU always, CUDA and MPS where present (`kvcache.devices`). Tests that
#: take the `device` fixture run once per device, so one command runs them on a GPU machine too.
DEVICES = available_devices()


@pytest.fixture(params=DEVICES, ids=lambda d: d.type)
def device(request: pytest.FixtureRequest) -> torch.device:
    return request.param
