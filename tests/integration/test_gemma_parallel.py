"""Gemma 3 text under tensor / pipeline parallelism (gloo rank processes on loopback, float32): TP=2 (heads and
the MLP split, every norm whole on each rank, the o / down partial sums all-reduced before Gemma's
post-attention / post-feedforward norms) and PP=2 of a multimodal checkpoint's language model (the global
layer on the second stage) are greedy-equal to one process with logits within 1e-4, on prompts longer than
the local layers' window of 8; disaggregated over real gRPC, a one-process prefill shipping every layer's KV
(local layers' too) into a TP=2 decode gives the one-process tokens."""
from __future__ import annotations

from engine import SamplingParams
from tests.exactness import assert_greedy_equal
from tests.integration.test_parallel_kv_transfer import alone, over_grpc
from tests.parallel_helpers import PROMPTS, assert_parallel_equal
from tests.tiny_gemma_models import WINDOW, write_tiny_gemma, write_tiny_gemma_multimodal

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def test_gemma3_tp2_equals_tp1(tmp_path):
    assert max(map(len, PROMPTS)) > WINDOW
    d = write_tiny_gemma(tmp_path / "gemma3", shard="100KB")
    assert_parallel_equal(d, PROMPTS, GREEDY, tensor_parallel_size=2)


def test_gemma3_multimodal_checkpoint_pp2_equals_pp1(tmp_path):
    """The Hub's multimodal layout (language_model.*, a vision tower each stage leaves unread; LM head tied)."""
    d = write_tiny_gemma_multimodal(tmp_path / "gemma3-mm", initializer_range=0.03)
    assert_parallel_equal(d, PROMPTS, GREEDY, pipeline_parallel_size=2)


def test_gemma3_kv_ships_over_grpc_into_tp2_decode(tmp_path):
    d = write_tiny_gemma(tmp_path / "gemma3")
    prompts = PROMPTS[:3]
    assert_greedy_equal(alone(d, prompts, GREEDY), over_grpc(d, {}, dict(tp=2), prompts, GREEDY))
