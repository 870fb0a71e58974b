"""Ray for the cluster tests: one local instance per test module, usage stats off."""

import os

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import pytest  # noqa: E402
import ray  # noqa: E402


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()
