"""Shared fixtures of the integration tests: one private local Ray for every module that asks for `ray_session`
(started here as `pdserve serve` starts it: loopback, a per-cluster token; never `ray stop`).

Those modules run one after another (`pytest_collection_modifyitems`; otherwise in the usual order, after
the other integration tests) and share that Ray: it starts with the first of them and is shut down after the
last, so no other test runs beside an idle Ray or inherits its token variables. Each module still leaves it as
it found it: every test's router stops its actors, and the module waits at its end until every CPU is free
again (a leaked actor or placement group fails there)."""
from __future__ import annotations

import time

import pytest

from cluster.ray_session import init_ray, shutdown_ray

_SHARED = {"up": False}  # this session started the shared Ray and has not shut it down yet


def _uses_ray(item) -> bool:
    return "ray_session" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(session, config, items):
    """The integration tests that share the Ray move, in their order, behind the other integration tests."""
    integration = [i for i, item in enumerate(items) if "integration" in item.path.parts]
    if not integration:
        return
    block = [items[i] for i in integration]
    block = [t for t in block if not _uses_ray(t)] + [t for t in block if _uses_ray(t)]
    for i, item in zip(integration, block):
        items[i] = item


@pytest.fixture(scope="module")
def ray_session():
    import ray

    if not _SHARED["up"]:
        assert not ray.is_initialized(), "another test left Ray connected"
        _SHARED["up"] = init_ray("local", num_cpus=2)
    total = ray.cluster_resources().get("CPU", 0)
    yield
    end = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < total:
        assert time.monotonic() < end, f"CPUs still held at the module's end: {ray.available_resources()}"
        time.sleep(0.1)


@pytest.hookimpl(trylast=True)  # after the module's fixtures are torn down
def pytest_runtest_teardown(item, nextitem):
    if _SHARED["up"] and (nextitem is None or not _uses_ray(nextitem)):
        shutdown_ray()
        _SHARED["up"] = False
