"""Shared test setup: the `slow` marker's skip rule and the hypothesis profiles.

- `@pytest.mark.slow` tests run only with KVCACHE_SLOW=1.
- Hypothesis runs derandomized (a fixed seed per test, so CI is deterministic and a failure
  reproduces) with a small example budget by default ("ci" profile). KVCACHE_SLOW=1 switches to
  the "slow" profile: random seeds, many more examples and longer stateful runs.
  HYPOTHESIS_PROFILE=<name> picks a profile explicitly.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

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
