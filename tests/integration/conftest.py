"""Shared fixtures of the integration tests: a private local Ray per module (started here as `pdserve serve`
starts it: loopback, a per-cluster token; shut down at the module's end, never `ray stop`)."""
from __future__ import annotations

import pytest

from cluster.ray_session import init_ray, shutdown_ray


@pytest.fixture(scope="module")
def ray_session():
    started = init_ray("local", num_cpus=2)
    yield
    if started:
        shutdown_ray()
