"""Test-wide fixtures: one torch thread per process (as workers run), leak checks, tiny models."""
from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)


def assert_engine_empty(llm) -> None:
    """Every engine test ends here: no pages in use, no reservations, no requests left."""
    usage = llm.kv_usage()
    assert usage["pages_in_use"] == 0, f"leaked KV pages: {usage}"
    assert usage["reservations"] == 0, f"leaked reservations: {usage}"
    assert not llm.has_unfinished(), "requests still queued or running"
    assert not llm.scheduler.held, f"held requests left: {list(llm.scheduler.held)}"


@pytest.fixture(scope="session")
def smollm2_dir():
    from engine.loader import resolve_model

    return resolve_model("smollm2-135m")
