"""`cluster.serving.membership.PoolMembership`: the states a pool's members move through (join, drain, leave,
fence, replace), what admission may pick (`placeable`) and what is polled (`live`), and every bad transition
raising a typed `MembershipError` that names pool, worker, action and state while changing nothing.
Pure Python: plain handles, no router, no event loop."""
from __future__ import annotations

import pytest

from cluster.serving.membership import (DRAINING, FENCED, GONE, LIVE, AwaitingRestart, MembershipError,
                                        PoolHealth, PoolMembership, Worker)
from cluster.serving_api import BackendUnavailableError


class Handle:
    def __init__(self, name: str):
        self.name, self.info = name, {}


def pool(n: int = 2, name: str = "decode") -> PoolMembership:
    return PoolMembership(name, [Handle(f"{name}-{i}") for i in range(n)], now=1.0)


def snapshot(m: PoolMembership):
    return [(w.name, w.state, w.reason) for w in m.members], m.pending


def test_joined_members_are_live_placeable_and_in_slot_order():
    m = pool(2)
    a, b = m.members
    assert [w.name for w in m.members] == ["decode-0", "decode-1"] and a.state == b.state == LIVE
    assert m.live() == [a, b] and m.placeable() == [a, b] and a.alive and a.since == a.last_seen == 1.0
    c = m.join(Handle("decode-2"), now=5.0)
    assert m.members[-1] is c and c.pool == "decode" and c.since == 5.0 and c in m


def test_a_draining_member_takes_no_new_work_stays_polled_and_leaves_once_it_holds_nothing():
    m = pool(2)
    a, b = m.members
    m.drain(a, "scale down", now=2.0)
    assert a.state == DRAINING and a.reason == "scale down" and a.since == 2.0
    assert m.placeable() == [b] and m.live() == [a, b] and a.alive
    a.flights.add("r#0")
    with pytest.raises(MembershipError, match="still holds 1 request"):
        m.leave(a)
    assert a in m and a.state == DRAINING  # nothing changed
    a.flights.clear()
    m.leave(a, now=3.0)
    assert a not in m and a.state == GONE and not a.alive and m.members == [b]


def test_fence_is_idempotent_and_a_fenced_member_is_neither_live_nor_placeable():
    m = pool(2)
    a, b = m.members
    assert m.fence(a, "drain raised", now=4.0) is True
    assert a.state == FENCED and not a.alive and a.reason == "drain raised" and a.since == 4.0
    assert m.fence(a, "heartbeat") is False and a.reason == "drain raised"  # a second detection: no change
    assert m.live() == [b] and m.placeable() == [b] and m.members == [a, b]  # still listed
    m.drain(b)
    assert m.fence(b, "killed while draining") is True and b.state == FENCED
    m.leave(a)
    assert m.fence(a, "late poller") is False and a.state == GONE  # gone stays gone


def test_replace_puts_a_fresh_member_in_a_fenced_ones_slot():
    m = pool(3)
    a, b, c = m.members
    m.fence(b, "killed")
    b.flights.add("r#1")  # (the harmed flights moved on; the old record may still name them)
    fresh = m.replace(b, Handle("decode-1"), now=9.0)
    assert m.members == [a, fresh, c] and fresh is not b and fresh.state == LIVE and fresh.since == 9.0
    assert fresh.last_seen == fresh.joined == 9.0 and fresh.generation == 1  # a heartbeat from its start
    assert b.state == GONE and not fresh.flights and fresh.stats is None and fresh.queued_tokens == 0
    assert m.placeable() == [a, fresh, c]


def test_an_empty_pool_waits_for_a_replacement_under_way_else_fails_typed():
    m = pool(1)
    (a,) = m.members
    m.fence(a, "killed")
    with pytest.raises(BackendUnavailableError, match="no live decode worker"):
        m.placeable()
    m.expect_replacement()
    with pytest.raises(AwaitingRestart):
        m.placeable()
    m.replacement_settled()
    assert m.pending == 0
    with pytest.raises(BackendUnavailableError):
        m.placeable()
    m.drain(m.join(Handle("decode-9")))
    with pytest.raises(BackendUnavailableError):  # a draining member is no placement either
        m.placeable()


def test_health_says_degraded_why_and_since_until_the_pool_is_whole_again():
    m = pool(2)
    a, b = m.members
    assert m.health() == PoolHealth("decode", 2, 2, 0, False)
    m.fence(a, "drain raised", now=3.0)
    m.expect_replacement(now=3.5)
    h = m.health()
    assert (h.degraded, h.live, h.pending, h.since) == (True, 1, 1, 3.0) and "decode-0 lost: drain raised" in h.reason
    m.fence(b, "heartbeat", now=4.0)  # worse, but the spell began at 3.0 for the first reason
    assert (m.health().since, m.health().reason) == (3.0, h.reason)
    m.replace(a, Handle("decode-0"), now=5.0)
    m.replacement_settled(now=5.0)
    assert m.health().degraded and m.health().live == 1  # b is still down
    m.expect_replacement(now=6.0)
    m.replace(b, Handle("decode-1"), now=7.0)
    m.replacement_settled(now=7.0)
    assert m.health() == PoolHealth("decode", 2, 2, 0, False)
    m.drain(m.members[0], "scale down", now=8.0)  # fewer live than the target: degraded (a resize lowers it)
    assert m.health().degraded and "draining: scale down" in m.health().reason


BAD = {  # name: (setup(m) -> the call that must fail, words of the reason, the action named)
    "drain a fenced worker": (lambda m, a, o: (m.fence(a, "x"), lambda: m.drain(a))[1], "only a live worker", "drain"),
    "drain twice": (lambda m, a, o: (m.drain(a), lambda: m.drain(a))[1], "only a live worker", "drain"),
    "leave while live": (lambda m, a, o: lambda: m.leave(a), "drain or fence it first", "leave"),
    "replace a live worker": (lambda m, a, o: lambda: m.replace(a, Handle("n")), "only a fenced", "replace"),
    "replace a draining worker": (lambda m, a, o: (m.drain(a), lambda: m.replace(a, Handle("n")))[1],
                                  "only a fenced", "replace"),
    "replace under a live member's name": (lambda m, a, o: (m.fence(a, "x"), lambda: m.replace(a, Handle("decode-1")))[1],
                                           "already has that name", "replace"),
    "join a taken name": (lambda m, a, o: lambda: m.join(Handle("decode-0")), "already has that name", "join"),
    "a worker of another pool": (lambda m, a, o: lambda: m.drain(o), "belongs to pool 'prefill'", "drain"),
    "fence a worker of another pool": (lambda m, a, o: lambda: m.fence(o, "x"), "belongs to pool 'prefill'", "fence"),
    "a record that is not a member": (lambda m, a, o: lambda: m.drain(Worker(Handle("decode-7"), "decode")),
                                      "not a member", "drain"),
    "replace a worker that left": (lambda m, a, o: (m.fence(a, "x"), m.leave(a), lambda: m.replace(a, Handle("n")))[2],
                                   "not a member", "replace"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_transitions_raise_a_typed_error_and_change_nothing(name):
    setup, words, action = BAD[name]
    m = pool(2)
    a = m.members[0]
    other = PoolMembership("prefill", [Handle("prefill-0")]).members[0]
    bad = setup(m, a, other)
    before = snapshot(m)
    with pytest.raises(MembershipError) as err:
        bad()
    assert words in str(err.value) and err.value.action == action and err.value.pool == "decode"
    assert isinstance(err.value, ValueError) and err.value.worker and err.value.state
    assert snapshot(m) == before
