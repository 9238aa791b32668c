"""KV transfer with CUDA pages (skipped without a GPU; needs no bundled weights): page_io's device path (pinned
staging, non-blocking copies, the receive side's copy stream behind a reservation fence) moves exactly the
bytes the CPU path moves, and a prefill engine -> loopback gRPC -> decode engine handoff on one GPU
(bench/gpu/disagg_check.py's core) gives one engine's greedy tokens in float32, both engines ending empty."""
from __future__ import annotations

import random

import pytest
import torch

from engine.kv_cache import page_io
from engine.kv_cache.backend import RawKVBackend
from engine.kv_cache.spec import KVPageSpec
from tests.conftest import assert_engine_empty

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def no_tf32():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@pytest.mark.parametrize("kind", ["consecutive", "shuffled"])
@pytest.mark.parametrize("span", [(0, 96), (5, 77)])
def test_cuda_pages_round_trip_like_cpu_pages(kind, span):
    spec = KVPageSpec(2, 4, 64, 16, "bfloat16")
    cpu, gpu = RawKVBackend(spec, 12), RawKVBackend(spec, 12, "cuda")
    for pool in (*cpu.k, *cpu.v):
        pool.normal_()
    for src, dst in zip((*cpu.k, *cpu.v), (*gpu.k, *gpu.v)):
        dst[:src.shape[0]].copy_(src)
    pages = list(range(1, 7))
    if kind == "shuffled":
        random.Random(0).shuffle(pages)
    k, v = page_io.export_kv(gpu, 1, pages, *span)
    want = page_io.export_kv(cpu, 1, pages, *span)
    assert bytes(k) == bytes(want[0]) and bytes(v) == bytes(want[1])
    k, v, ready = page_io.export_kv_async(gpu, 0, pages, *span)
    ready()
    assert bytes(k) == bytes(page_io.export_kv(cpu, 0, pages, *span)[0])
    into = RawKVBackend(spec, 12, "cuda")
    dst_pages = [11, 3, 4, 5, 9, 0] if kind == "shuffled" else list(range(6))
    page_io.import_kv(into, 1, dst_pages, *span, bytes(want[0]) + bytes(want[1]), after=page_io.stream_fence(into))
    back = page_io.export_kv(into, 1, dst_pages, *span)
    assert bytes(back[0]) == bytes(want[0]) and bytes(back[1]) == bytes(want[1])


@pytest.mark.parametrize("graphs", ["auto", "off"])
def test_handoff_on_one_gpu_equals_one_engine(tmp_path, graphs):
    from bench.gpu.disagg_check import Check, check

    c = Check("tiny", device="cuda", dtype="float32", prompts=3, prompt_len=40, tokens=12, page_size=16,
              graphs=graphs)
    r = check(c, tmp_path, idle_check=assert_engine_empty)
    assert r["ok"] and r["held"]["bytes"] > 0, r
