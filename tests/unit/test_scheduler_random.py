"""Random scheduler workloads (hypothesis): every request finishes with exactly its scripted tokens, even
after preemption, and nothing leaks. Helpers come from test_scheduler's scripted fake runner."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.leak_checks import assert_scheduler_empty
from tests.unit.test_scheduler import FakeRunner, expected_outputs, make_req, make_sched, step


# ---- random workloads --------------------------------------------------------------------------
@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    page_size=st.integers(1, 4),
    budget=st.integers(1, 12),
    max_seqs=st.integers(1, 4),
    spare_pages=st.integers(0, 6),
    reqs=st.lists(st.tuples(st.integers(1, 9), st.integers(1, 6), st.integers(0, 4)), min_size=1, max_size=6),
)
def test_random_workloads_finish_exactly_and_leak_nothing(page_size, budget, max_seqs, spare_pages, reqs):
    # The pool always fits the largest request alone, so every request must finish.
    need = max(-(-(p + m - 1) // page_size) for p, m, _ in reqs)
    s = make_sched(need + spare_pages, page_size, budget=budget, max_seqs=max_seqs)
    r = FakeRunner(s)
    pending = sorted(((arrive, f"r{i}", p, m) for i, (p, m, arrive) in enumerate(reqs)))
    made: list[Request] = []
    for t in range(1000):
        while pending and pending[0][0] <= t:
            _, rid, p, m = pending.pop(0)
            made.append(make_req(rid, p, max_tokens=m))
            s.add(made[-1])
        if not pending and not s.has_work:
            break
        step(s, r)
        assert s.tables.allocator.num_in_use == sum(len(s.tables.get(x.request_id).pages) for x in s.running)
    else:
        raise AssertionError("workload did not finish")
    for x in made:
        assert x.finished and x.finish_reason == "length"
        assert x.output_token_ids == expected_outputs(x.request_id, x.params.max_tokens)
    assert_scheduler_empty(s)
