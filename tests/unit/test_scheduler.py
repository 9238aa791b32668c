"""Step traces of `engine.scheduler.Scheduler` over real BlockTables and a small PageAllocator.

The "runner" is fake: it checks each scheduled chunk against the block tables and returns a scripted
`SampledToken` for every sampled chunk, keyed by (request, output index) the way the real sampler keys its
randomness, so a preempted-and-recomputed request must produce exactly the tokens it would have produced
without preemption. Every test ends with `assert_scheduler_empty` (no queue entry, no table, no page).
"""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.kv_cache.allocator import PageAllocator
from engine.kv_cache.block_table import BlockTables
from engine.request import Request, RequestStatus
from engine.sampler import SampledToken
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from tests.unit.leak_checks import assert_scheduler_empty

EOS = 2


def tok(rid: str, index: int) -> int:
    """Default scripted output token: never EOS, distinct per request and index."""
    return 100 + 10 * (sum(map(ord, rid)) % 7) + index


def make_req(rid: str, prompt_len: int, max_tokens: int = 4, prefill_only: bool = False, **params) -> Request:
    prompt = [10 + (3 * i + len(rid)) % 80 for i in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params), seed=0, arrival_time=0.0,
                   prefill_only=prefill_only)


class FakeRunner:
    def __init__(self, sched: Scheduler, script: dict[str, list[int]] | None = None):
        self.sched = sched
        self.script = script or {}
        self.trace: list[list[tuple[str, int, int, bool]]] = []  # per step: (rid, start, n, sample)

    def token(self, req: Request) -> int:
        s = self.script.get(req.request_id)
        i = req.num_output
        return s[i] if s is not None and i < len(s) else tok(req.request_id, i)

    def run(self, out: SchedulerOutput) -> dict[str, SampledToken]:
        cfg, tables = self.sched.cfg, self.sched.tables
        assert sum(c.num_tokens for c in out.chunks) <= cfg.max_num_batched_tokens
        assert len(out.chunks) <= max(cfg.max_num_seqs, len(self.sched.running))
        assert len({c.request.request_id for c in out.chunks}) == len(out.chunks)
        seen_slots: set[int] = set()
        for c in out.chunks:
            req, t = c.request, tables.get(c.request.request_id)
            assert req.status == RequestStatus.RUNNING and req in self.sched.running
            assert c.num_tokens >= 1
            assert c.start == c.num_cached == req.num_computed  # no eviction here: slots == positions
            assert t.num_slots == c.num_cached + c.num_tokens
            assert len(t.pages) == tables.pages_for(t.num_slots)
            assert c.start + c.num_tokens <= len(req.token_ids)
            assert c.sample == (c.start + c.num_tokens == len(req.token_ids))
            slots = tables.slots(req.request_id, 0, t.num_slots)
            assert not seen_slots & set(slots), "two sequences share a physical slot"
            seen_slots |= set(slots)
        self.trace.append([(c.request.request_id, c.start, c.num_tokens, c.sample) for c in out.chunks])
        return {c.request.request_id: SampledToken(self.token(c.request)) for c in out.chunks if c.sample}


def make_sched(num_pages: int, page_size: int, budget: int = 64, max_seqs: int = 32, chunked: bool = True,
               eos: tuple[int, ...] = (EOS,)) -> Scheduler:
    tables = BlockTables(PageAllocator(num_pages), page_size)
    return Scheduler(SchedulerConfig(max_seqs, budget, chunked), tables, eos)


def step(sched: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[Request]]:
    out = sched.schedule()
    if out.empty:
        runner.trace.append([])
        return out, []
    return out, sched.update(out, runner.run(out), now=float(len(runner.trace)))


def run_to_end(sched: Scheduler, runner: FakeRunner, max_steps: int = 500) -> list[Request]:
    ended = []
    for _ in range(max_steps):
        if not sched.has_work:
            return ended
        ended += step(sched, runner)[1]
    raise AssertionError(f"no progress after {max_steps} steps: waiting={[r.request_id for r in sched.waiting]} "
                         f"running={[r.request_id for r in sched.running]}")


def expected_outputs(rid: str, n: int) -> list[int]:
    return [tok(rid, i) for i in range(n)]


# ---- token budget and chunked prefill ----------------------------------------------------------
def test_chunked_prefill_spends_the_token_budget():
    s = make_sched(16, 4, budget=8)
    r = FakeRunner(s)
    a = make_req("a", 20, max_tokens=3)
    s.add(a)
    for _ in range(5):
        step(s, r)
    assert r.trace == [[("a", 0, 8, False)], [("a", 8, 8, False)], [("a", 16, 4, True)],
                       [("a", 20, 1, True)], [("a", 21, 1, True)]]
    assert s.stats.num_chunked_prefills == 2 and s.stats.num_steps == 5
    assert a.finished and a.finish_reason == "length" and a.output_token_ids == expected_outputs("a", 3)
    assert a.first_token_time == 3.0  # the step that finished the prompt
    assert_scheduler_empty(s)


def test_budget_goes_to_running_first_then_waiting():
    s = make_sched(16, 4, budget=8)
    r = FakeRunner(s)
    a, b = make_req("a", 6, max_tokens=3), make_req("b", 6, max_tokens=3)
    s.add(a)
    s.add(b)
    step(s, r)
    step(s, r)
    assert r.trace == [[("a", 0, 6, True), ("b", 0, 2, False)], [("a", 6, 1, True), ("b", 2, 4, True)]]
    assert s.stats.num_chunked_prefills == 1
    run_to_end(s, r)
    assert a.output_token_ids == expected_outputs("a", 3) and b.output_token_ids == expected_outputs("b", 3)
    assert_scheduler_empty(s)


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    s = make_sched(16, 4, budget=8, chunked=False)
    r = FakeRunner(s)
    a, b = make_req("a", 4, max_tokens=3), make_req("b", 8, max_tokens=2)
    s.add(a)
    s.add(b)
    for _ in range(4):
        step(s, r)
    assert r.trace == [[("a", 0, 4, True)], [("a", 4, 1, True)], [("a", 5, 1, True)], [("b", 0, 8, True)]]
    run_to_end(s, r)
    assert s.stats.num_chunked_prefills == 0 and b.output_token_ids == expected_outputs("b", 2)
    assert_scheduler_empty(s)


# ---- admission and preemption ------------------------------------------------------------------
def test_admission_waits_for_free_pages():
    s = make_sched(4, 4)
    r = FakeRunner(s)
    a, b = make_req("a", 8, max_tokens=2), make_req("b", 12, max_tokens=4)
    s.add(a)
    s.add(b)
    step(s, r)
    assert r.trace[-1] == [("a", 0, 8, True)] and b.status == RequestStatus.WAITING and "b" not in s.tables
    step(s, r)  # a's decode takes the last page; a finishes (max_tokens=2) and frees its pages
    assert r.trace[-1] == [("a", 8, 1, True)] and a.finished and b.status == RequestStatus.WAITING
    step(s, r)
    assert r.trace[-1] == [("b", 0, 12, True)]
    run_to_end(s, r)
    assert s.stats.num_preemptions == 0 and b.output_token_ids == expected_outputs("b", 4)
    assert_scheduler_empty(s)


def test_preempts_newest_and_recomputes_from_prompt_plus_outputs():
    s = make_sched(6, 2, max_seqs=3)
    r = FakeRunner(s)
    a, b, c, d = (make_req(x, 3, max_tokens=4) for x in "abcd")
    for x in (a, b, c, d):
        s.add(x)
    step(s, r)  # a, b, c prefilled: 2 pages each, pool full; d waits on max_num_seqs
    step(s, r)  # decode slot 3: fits in each second page
    assert s.tables.allocator.num_free == 0 and s.stats.num_preemptions == 0
    out, _ = step(s, r)  # a needs a page for slot 4: c (newest) is preempted
    assert out.preempted == ["c"] and s.stats.num_preemptions == 1
    assert [ch[0] for ch in r.trace[-1]] == ["a", "b"]
    assert c.status == RequestStatus.WAITING and c.num_computed == 0 and c.num_preemptions == 1
    assert list(s.waiting) == [c, d]  # requeued at the front, ahead of d
    assert "c" not in s.tables and c.output_token_ids == expected_outputs("c", 2)  # outputs kept
    assert a.num_preemptions == b.num_preemptions == 0
    run_to_end(s, r)
    recompute = [ch for st_ in r.trace for ch in st_ if ch[0] == "c" and ch[1] == 0]
    assert recompute[-1] == ("c", 0, 5, True)  # prompt (3) + both kept outputs, in one chunk
    for x in (a, b, c, d):
        assert x.finished and x.finish_reason == "length"
        assert x.output_token_ids == expected_outputs(x.request_id, 4), x.request_id  # nothing lost or repeated
    assert_scheduler_empty(s)


def test_request_needing_a_page_preempts_itself_when_newest():
    s = make_sched(4, 2)
    r = FakeRunner(s)
    a, b = make_req("a", 3, max_tokens=3), make_req("b", 4, max_tokens=3)
    s.add(a)
    s.add(b)
    step(s, r)  # 2 pages each; a has a free slot in its last page, b does not
    out, _ = step(s, r)
    assert out.preempted == ["b"] and r.trace[-1] == [("a", 3, 1, True)]
    assert list(s.waiting) == [b] and b.num_computed == 0
    run_to_end(s, r)
    assert a.output_token_ids == expected_outputs("a", 3) and b.output_token_ids == expected_outputs("b", 3)
    assert_scheduler_empty(s)


def test_max_num_seqs_limits_admission():
    s = make_sched(32, 4, max_seqs=2)
    r = FakeRunner(s)
    reqs = [make_req(x, 2, max_tokens=2) for x in "abc"]
    for x in reqs:
        s.add(x)
    step(s, r)
    assert [ch[0] for ch in r.trace[-1]] == ["a", "b"] and list(s.waiting) == [reqs[2]]
    step(s, r)  # a and b finish
    assert [ch[0] for ch in r.trace[-1]] == ["a", "b"] and len(s.running) == 0
    step(s, r)
    assert r.trace[-1] == [("c", 0, 2, True)]
    run_to_end(s, r)
    assert all(x.output_token_ids == expected_outputs(x.request_id, 2) for x in reqs)
    assert_scheduler_empty(s)


# ---- token-level stops -------------------------------------------------------------------------
def _run_one(req: Request, script: list[int], eos=(EOS,)) -> Scheduler:
    s = make_sched(16, 4, eos=eos)
    r = FakeRunner(s, {req.request_id: script})
    s.add(req)
    ended = run_to_end(s, r)
    assert ended == [req] and req.finished
    assert_scheduler_empty(s)
    return s


def test_eos_stops_with_reason_stop():
    a = make_req("a", 3, max_tokens=10)
    _run_one(a, [50, 51, EOS, 52, 53])
    assert a.output_token_ids == [50, 51, EOS] and a.finish_reason == "stop"


def test_ignore_eos_runs_to_max_tokens():
    a = make_req("a", 3, max_tokens=5, ignore_eos=True)
    _run_one(a, [50, EOS, EOS, 52, 53, 54])
    assert a.output_token_ids == [50, EOS, EOS, 52, 53] and a.finish_reason == "length"


def test_eos_of_another_model_does_not_stop():
    a = make_req("a", 3, max_tokens=3)
    _run_one(a, [EOS, EOS, EOS, EOS], eos=(7,))
    assert a.num_output == 3 and a.finish_reason == "length"


def test_stop_token_ids_stop_even_with_ignore_eos():
    a = make_req("a", 3, max_tokens=10, stop_token_ids=[77], ignore_eos=True)
    _run_one(a, [50, EOS, 77, 51])
    assert a.output_token_ids == [50, EOS, 77] and a.finish_reason == "stop"


def test_max_tokens_gives_exactly_that_many_outputs():
    for n in (1, 2, 5):
        a = make_req(f"a{n}", 4, max_tokens=n)
        _run_one(a, [60 + i for i in range(10)])
        assert a.output_token_ids == [60 + i for i in range(n)] and a.finish_reason == "length"


# ---- prefill-only, finish, truncate ------------------------------------------------------------
def test_prefill_only_ends_held_with_pages_kept():
    s = make_sched(8, 4, budget=4)
    r = FakeRunner(s)
    a = make_req("a", 10, max_tokens=8, prefill_only=True)
    s.add(a)
    ended = []
    for _ in range(3):
        ended += step(s, r)[1]
    assert [ch for st_ in r.trace for ch in st_] == [("a", 0, 4, False), ("a", 4, 4, False), ("a", 8, 2, True)]
    assert ended == [a] and a.status == RequestStatus.HELD and s.held == {"a": a}
    assert not s.running and not s.waiting and not s.has_work
    assert a.output_token_ids == expected_outputs("a", 1) and a.num_computed == 10
    assert s.tables.get("a").num_slots == 10 and s.tables.allocator.num_in_use == 3  # KV kept to ship
    assert s.schedule().empty
    s.finish(a, "stop")
    assert a.finished and a.finish_reason == "stop"
    assert_scheduler_empty(s)


def test_finish_is_idempotent_and_frees_pages_wherever_the_request_is():
    s = make_sched(16, 4, budget=4, max_seqs=2)
    r = FakeRunner(s)
    h = make_req("h", 2, prefill_only=True)  # step 1: prefilled, then held
    a = make_req("a", 10)  # running, mid-prefill after two steps
    w = make_req("w", 2)  # waiting: the budget goes to a
    for x in (h, a, w):
        s.add(x)
    step(s, r)
    step(s, r)
    assert r.trace == [[("h", 0, 2, True), ("a", 0, 2, False)], [("a", 2, 4, False)]]
    assert a.status == RequestStatus.RUNNING and a.num_computed < 10
    assert h.status == RequestStatus.HELD and w.status == RequestStatus.WAITING
    assert s.tables.allocator.num_in_use > 0
    s.finish(a, "abort")
    s.finish(a, "stop")
    assert a.finish_reason == "abort" and "a" not in s.tables
    s.finish(w, "abort")
    s.finish(h, "abort")
    s.finish(h, "abort")
    for x in (a, h, w):
        assert x.finished and x.finish_reason == "abort"
    assert s.schedule().empty
    assert_scheduler_empty(s)


def _decode_with_drafts(s: Scheduler, r: FakeRunner, a: Request, drafts: list[int]) -> None:
    a.token_ids.extend(drafts)  # a proposer's drafts, verified in one 1 + k step
    out, _ = step(s, r)
    assert r.trace[-1] == [("a", a.num_computed - len(drafts) - 1, len(drafts) + 1, True)]


def test_truncate_rolls_back_tokens_computed_count_and_slots():
    s = make_sched(8, 2)
    r = FakeRunner(s)
    a = make_req("a", 3, max_tokens=20)
    s.add(a)
    step(s, r)
    step(s, r)  # 3 prompt + 2 outputs; 4 computed
    _decode_with_drafts(s, r, a, [91, 92, 93])
    assert len(a.token_ids) == 9 and a.num_computed == 8 and s.tables.get("a").num_slots == 8
    alloc = s.tables.allocator
    pages_before = list(s.tables.get("a").pages)
    slots_before = s.tables.slots("a", 0, 8)
    assert alloc.num_in_use == 4
    s.truncate(a, 6)  # keep the first draft only
    assert a.token_ids == a.prompt_token_ids + [tok("a", 0), tok("a", 1), 91]
    assert a.num_computed == 6 and s.tables.get("a").num_slots == 6
    assert s.tables.get("a").pages == pages_before[:3] and alloc.num_in_use == 3
    assert s.tables.slots("a", 0, 6) == slots_before[:6]
    s.truncate(a, 6)  # no-op
    assert a.num_computed == 6 and alloc.num_in_use == 3
    a.token_ids.append(95)  # the verifier's correction token
    step(s, r)
    assert r.trace[-1] == [("a", 6, 1, True)]
    s.finish(a, "abort")
    assert_scheduler_empty(s)


def test_truncate_drops_logprobs_of_removed_tokens():
    s = make_sched(8, 4)
    r = FakeRunner(s)
    a = make_req("a", 3, max_tokens=20, logprobs=0)
    s.add(a)
    for _ in range(4):
        step(s, r)
    assert len(a.output_logprobs) == a.num_output == 4
    s.truncate(a, a.num_prompt + 1)
    assert a.output_token_ids == [tok("a", 0)] and [t.token_id for t in a.output_logprobs] == [tok("a", 0)]
    s.finish(a, "abort")
    assert_scheduler_empty(s)


def test_truncate_drops_logprobs_when_first_token_came_from_elsewhere():
    # Like LLM.add_prefilled_request: the prompt's KV and first token arrive from a prefill worker, so the
    # first output has no SampledToken here; then two tokens are decoded locally with logprobs.
    s = make_sched(8, 4)
    r = FakeRunner(s)
    a = make_req("a", 3, max_tokens=20, logprobs=0)
    s.tables.append("a", a.num_prompt)
    a.token_ids.append(42)
    a.num_computed = a.num_prompt
    s.add_running(a)
    step(s, r)
    step(s, r)
    assert a.num_output == 3 and len(a.output_logprobs) == 2
    s.truncate(a, a.num_prompt)  # roll back every output
    assert a.output_token_ids == []
    assert a.output_logprobs == [], "logprobs left for tokens that no longer exist"
    s.finish(a, "abort")
    assert_scheduler_empty(s)


def test_preempted_request_is_rescheduled_without_chunked_prefill():
    # a and b fit one budget (3 + 3 tokens); b is preempted after 4 outputs, so its recompute (3 + 4 = 7
    # tokens) exceeds the budget of 6. Without chunked prefill it must still run again at some point.
    s = make_sched(6, 2, budget=6, chunked=False)
    r = FakeRunner(s)
    a, b = make_req("a", 3, max_tokens=8), make_req("b", 3, max_tokens=8)
    s.add(a)
    s.add(b)
    run_to_end(s, r, max_steps=100)
    assert s.stats.num_preemptions >= 1
    assert a.output_token_ids == expected_outputs("a", 8) and b.output_token_ids == expected_outputs("b", 8)
    assert_scheduler_empty(s)
