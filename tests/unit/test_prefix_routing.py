"""cluster/serving/prefix_routing.py: chained page digests, the router's per-worker LRU prefix index, and the
load-vs-cache score."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.serving.prefix_routing import PrefixIndex, pick


def test_index_hashes_are_the_engines_chain():
    idx, other = PrefixIndex(16, salt=b"a" * 16), PrefixIndex(16, salt=b"b" * 16)
    a = list(range(40))
    b = list(range(16)) + [999] + list(range(17, 40))  # differs in page 1 only
    ha, hb = idx.hashes(a), idx.hashes(b)
    assert len(ha) == 2 and idx.hashes(a[:15]) == []  # the partial last page is not hashed
    assert ha[0] == hb[0] and ha[1] != hb[1]
    assert idx.hashes([7] * 16 + list(range(16, 32)))[1] != ha[1]  # same page after another prefix
    assert other.hashes(a) != ha  # another model/layout never matches
    # a worker's report of its cache replaces the router's guess
    idx.record("w", ha)
    idx.replace("w", hb[:1])
    assert idx.matched_tokens("w", ha) == 16 and idx.num_pages("w") == 1


def test_index_matches_the_longest_recorded_prefix_and_evicts_lru():
    idx = PrefixIndex(page_size=4, capacity_pages={"w": 3})
    p = idx.hashes(list(range(12)))  # 3 pages
    assert idx.matched_tokens("w", p) == 0
    idx.record("w", p)
    assert idx.matched_tokens("w", p) == 12 and idx.matched_tokens("other", p) == 0
    q = idx.hashes(list(range(8)) + [50, 51, 52, 53])  # shares two pages with p
    assert idx.matched_tokens("w", q) == 8
    idx.record("w", q)  # q's third page pushes out p's third page, the least recently used
    assert idx.num_pages("w") == 3 and idx.matched_tokens("w", p) == 8 and idx.matched_tokens("w", q) == 12
    idx.forget("w")
    assert idx.matched_tokens("w", q) == 0


def test_pick_weighs_cached_tokens_against_load():
    idx = PrefixIndex(page_size=16)
    prompt = list(range(320))  # 20 pages
    h = idx.hashes(prompt)
    idx.record("warm", h[:15])  # 240 tokens cached there
    # equal load: the warm worker computes 80 tokens instead of 320
    assert pick(["cold", "warm"], h, idx, {"cold": 0, "warm": 0}, len(prompt)) == "warm"
    # 200 queued tokens on the warm one still beat 320 uncached tokens on an idle one...
    assert pick(["cold", "warm"], h, idx, {"cold": 0, "warm": 200}, len(prompt)) == "warm"
    # ...but not 300: load wins once it outweighs the cached prefix
    assert pick(["cold", "warm"], h, idx, {"cold": 0, "warm": 300}, len(prompt)) == "cold"
    # ties keep the caller's order; a fully cached prompt still computes its last token
    assert pick(["a", "b"], h, idx, {}, len(prompt)) == "a"
    idx.record("b", h)
    assert pick(["a", "b"], h, idx, {"a": 0, "b": 318}, len(prompt)) == "b"  # 318 + 1 < 320
    assert pick(["a", "b"], h, idx, {"a": 0, "b": 319}, len(prompt)) == "a"  # 319 + 1 ties 320: first


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("xyz"), st.lists(st.integers(0, 3), min_size=0, max_size=24)),
                max_size=30), st.integers(1, 6))
def test_index_never_exceeds_capacity_and_matches_only_recorded_chains(ops, cap):
    idx = PrefixIndex(page_size=4, default_capacity=cap)
    recorded: dict[str, set] = {}
    for worker, tokens in ops:
        h = idx.hashes(tokens)
        m = idx.matched_pages(worker, h)
        assert all(d in recorded.get(worker, set()) for d in h[:m])  # a match was recorded there once
        idx.record(worker, h)
        recorded.setdefault(worker, set()).update(h)
        assert idx.num_pages(worker) <= cap
        if len(h) <= cap:
            assert idx.matched_pages(worker, h) == len(h)  # just recorded and within capacity: all there
