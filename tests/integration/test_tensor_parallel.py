"""`LLM(tensor_parallel_size=N)`: rank processes over gloo on loopback, greedy-equal to one process.

Random-weight Llama with 8 query / 4 KV heads at TP=2 and 8 / 2 at TP=4 (KV heads replicated on two
ranks each), SmolLM2 (9 / 3) at TP=3 (`slow`): several prompts in one continuous batch with chunked
prefill, float32, `assert_greedy_equal` against TP=1 and logits within 1e-4. Then the boundaries: degrees
that do not divide and unsupported options fail at construction with typed errors and start nothing; a
rank that dies fails the next step with `RankFailedError` and takes the replica down; ranks stop when
the engine is garbage-collected unclosed, and exit on their own when the driver process dies. Every test
ends with no pages in use and every rank process reaped.
"""
from __future__ import annotations

import os

import pytest

from engine import SamplingParams
from engine.llm import LLM
from engine.parallel.errors import ParallelConfigError, RankFailedError, UnsupportedWithParallelError
from tests.conftest import assert_engine_empty
from tests.exactness import assert_greedy_equal
from tests.parallel_helpers import BATCHING, PROMPTS, assert_parallel_equal, assert_ranks_gone
from tests.tiny_models import write_tiny

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def tiny(tmp_path_factory, heads: int, kv: int):
    return write_tiny("llama", tmp_path_factory.mktemp("tp") / f"l{heads}{kv}", num_attention_heads=heads,
                      num_key_value_heads=kv, initializer_range=0.1)


@pytest.fixture(scope="module")
def tiny84(tmp_path_factory):
    return tiny(tmp_path_factory, 8, 4)


@pytest.fixture(scope="module")
def tiny82(tmp_path_factory):
    return tiny(tmp_path_factory, 8, 2)


def assert_tp_equal(model_dir, size: int, prompts=PROMPTS, params=GREEDY, **kw) -> None:
    assert_parallel_equal(model_dir, prompts, params, tensor_parallel_size=size, **kw)


def test_tp2_llama_8q_4kv_equals_tp1(tiny84):
    assert_tp_equal(tiny84, 2)


def test_tp4_llama_8q_2kv_replicated_kv_heads_equals_tp1(tiny82):
    assert_tp_equal(tiny82, 4)


def test_tp2_with_int8_kv_pages_equals_int8_tp1(tiny84):
    assert_tp_equal(tiny84, 2, prompts=PROMPTS[:2], kv_storage="int8")


@pytest.mark.parametrize("size, what", [(3, "query heads"), (0, "positive integer")])
def test_degree_that_does_not_divide_raises_before_starting_ranks(tiny84, size, what):
    with pytest.raises(ParallelConfigError, match=what) as e:
        LLM(model=str(tiny84), dtype="float32", tensor_parallel_size=size)
    assert e.value.field == "tensor_parallel_size"


def test_kv_heads_neither_divided_nor_replicable(tmp_path_factory):
    d = write_tiny("llama", tmp_path_factory.mktemp("tp") / "l124", hidden_size=96, num_attention_heads=12,
                   num_key_value_heads=4, intermediate_size=96)
    with pytest.raises(ParallelConfigError, match="num_key_value_heads"):
        LLM(model=str(d), dtype="float32", tensor_parallel_size=6)


@pytest.mark.parametrize("kw, field", [(dict(speculative={"method": "ngram"}), "speculative"),
                                       (dict(kv_eviction={"method": "snapkv"}), "kv_eviction")])
def test_unsupported_combinations_raise_at_construction(tiny84, kw, field):
    with pytest.raises(UnsupportedWithParallelError, match="pipeline parallelism") as e:
        LLM(model=str(tiny84), dtype="float32", tensor_parallel_size=2, **kw)
    assert e.value.field == field


def test_refusals_on_a_live_replica_then_a_dead_rank_fails_the_step(tiny84):
    """One TP=2 replica (its ranks started once for three checks): layer hooks are refused; per-request KV
    eviction (it observes attention inside the ranks) is refused when the request arrives, not mid-step;
    then a rank killed fails the next step with RankFailedError and takes the replica down."""
    import dataclasses

    from engine import InvalidRequestError

    with LLM(model=str(tiny84), dtype="float32", tensor_parallel_size=2, **BATCHING) as llm:
        with pytest.raises(UnsupportedWithParallelError, match="layer hooks"):
            llm.runner.add_layer_hook(lambda layer, batch: None)
        assert llm.generate([PROMPTS[1]], GREEDY)[0].finished
        for prefill_only in (False, True):
            with pytest.raises(InvalidRequestError, match="kv_eviction"):
                llm.add_request(PROMPTS[0], dataclasses.replace(GREEDY, kv_eviction={"method": "snapkv"}),
                                prefill_only=prefill_only)
        assert llm.generate([PROMPTS[1]], dataclasses.replace(GREEDY, kv_eviction="off"))[0].finished
        assert_engine_empty(llm)
        llm.runner.ranks.procs[1].kill()
        llm.runner.ranks.procs[1].wait()
        llm.add_request(PROMPTS[0], GREEDY)
        with pytest.raises(RankFailedError):
            llm.step()
        assert llm.runner.ranks.closed
    assert_ranks_gone(llm)


@pytest.mark.slow
def test_smollm2_tp3_equals_tp1(smollm2_dir):
    from engine.tokenizer import Tokenizer

    tok = Tokenizer(smollm2_dir)
    prompts = [tok.encode(p) for p in ("The capital of France is", "def fibonacci(n):",
                                       "Once upon a time, in a small village by the sea, there lived")]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert_tp_equal(smollm2_dir, 3, prompts, params, max_num_batched_tokens=8, page_size=8, num_pages=32)


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for whoever reaps orphans here)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_ranks_stop_when_the_engine_is_collected(tiny84):
    import gc

    llm = LLM(model=str(tiny84), dtype="float32", tensor_parallel_size=2, **BATCHING)
    procs = llm.runner.ranks.procs
    del llm
    gc.collect()  # the launcher's weakref finaliser shuts the ranks down
    assert all(p.returncode is not None for p in procs)


def test_ranks_exit_on_their_own_when_the_driver_dies(tiny84, tmp_path):
    import subprocess
    import sys
    import time

    script = (f"import os\nfrom engine.llm import LLM\nllm = LLM(model={str(tiny84)!r}, dtype='float32', "
              f"tensor_parallel_size=2)\nprint(*llm.runner.pids, flush=True)\nos._exit(0)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 2, out.stderr
    deadline = time.monotonic() + 60
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_running(p) for p in pids), "a rank outlived its driver"


def test_prefix_caching_with_tp_skips_cached_pages_and_stays_equal(tiny84):
    """The prefix cache lives with the driver's page tables: a TP engine reuses the ranks' pages too."""
    shared = list(range(10, 50))
    first, later = [shared + [3]], [shared + [4, 5], shared[:21] + [9]]

    def run(**kw):
        with LLM(model=str(tiny84), dtype="float32", enable_prefix_caching=True, **BATCHING, **kw) as llm:
            outs = llm.generate(first, GREEDY) + llm.generate(later, GREEDY)
            hit = llm.prefix_stats()["hit_tokens"]
            assert_engine_empty(llm)
        return [o.token_ids for o in outs], hit, llm

    ref, ref_hit, _ = run()
    got, hit, llm = run(tensor_parallel_size=2)
    assert hit == ref_hit > 0
    assert_greedy_equal(ref, got)
    assert_ranks_gone(llm)
