"""Shared fixtures of the integration tests: a private local Ray per module (started here, shut down at
the module's end; never `ray stop`)."""
from __future__ import annotations

import pytest

from cluster.serving.actors import init_ray


@pytest.fixture(scope="module")
def ray_session():
    started = init_ray("local", num_cpus=2)
    yield
    if started:
        import ray

        ray.shutdown()
