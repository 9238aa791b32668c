"""Test-wide fixtures: one torch thread per process (as workers run), leak checks, the tiny model (`tiny_dir`)
and SmolLM2 (`smollm2_dir`)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run under Triton's interpreter (read when triton.jit decorates)
    os.environ.setdefault("TRITON_INTERPRET", "1")
from hypothesis import settings

torch.set_num_threads(1)
# No test asserts on wall-clock time (docs/design.md, Style 8): hypothesis' default 200 ms deadline per example
# failed a pure codec property on a loaded 2-core machine (460 ms once, 0.2 ms on the replay).
settings.register_profile("pdserve", deadline=None)
settings.load_profile("pdserve")


def assert_engine_empty(llm) -> None:
    """Every engine test ends here: no pages in use, no reservations, no requests left."""
    usage = llm.kv_usage()
    assert usage["pages_in_use"] == 0, f"leaked KV pages: {usage}"
    assert usage["reservations"] == 0, f"leaked reservations: {usage}"
    assert not llm.has_unfinished(), "requests still queued or running"
    assert not llm.scheduler.held, f"held requests left: {list(llm.scheduler.held)}"


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """The tiny random Llama (tests/tiny_models.py), written once per session; tests only read it (a test that
    changes its files writes its own copy with `write_tiny_llama`)."""
    from tests.tiny_models import write_tiny_llama

    return write_tiny_llama(tmp_path_factory)


@pytest.fixture(scope="session")
def smollm2_dir():
    from engine.loader import resolve_model

    return resolve_model("smollm2-135m")


# `make test` runs the suite on two pytest-xdist workers (`-n 2 --dist loadgroup`: one per core). A module's
# tests stay together (its module-scoped fixtures -- a loaded model, a reference -- are built once), and every
# test that starts a Ray cluster (the shared `ray_session`, a `ray start` head, a `pdserve serve` with its
# embedded Ray) runs on one worker, one after another, first: no two Ray clusters ever run at once, and the
# longest block of work does not start last. The other worker meanwhile runs the rest.
STARTS_RAY = {"ray_session", "ray_head", "own_server"}


def starts_ray(item) -> bool:
    return bool(STARTS_RAY & set(getattr(item, "fixturenames", ())))


@pytest.hookimpl(trylast=True)  # after tests/integration/conftest.py ordered its Ray modules
def pytest_collection_modifyitems(session, config, items):
    ray_items = [i for i in items if starts_ray(i)]
    for item in items:
        item.add_marker(pytest.mark.xdist_group("ray" if starts_ray(item) else item.nodeid.split("::")[0]))
    if getattr(config.option, "dist", "no") != "no":
        items[:] = ray_items + [i for i in items if not starts_ray(i)]
