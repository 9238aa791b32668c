"""SmolLM2-135M (float32) behind `LocalEngineBackend` over real HTTP on 127.0.0.1: greedy tokens through the
Python client and the official `openai` SDK, streamed and not, one at a time and 16 concurrent, must equal
`engine.LLM.generate` (assert_greedy_equal with the reference logits for near-ties). Ends leak-free.
"""
from __future__ import annotations

import asyncio

import pytest
import torch

from cluster.client import AsyncClient, Client
from cluster.local_backend import LocalEngineBackend
from cluster.server import BackgroundServer
from engine import LLM, SamplingParams
from tests.conftest import assert_engine_empty
from tests.exactness import assert_greedy_equal
from tests.prompts import token_prompts

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
# New tokens per request: the clients' paths (streamed or not, one or 16 at once) either carry every token
# or break: 12 decode steps show that as well as 24 did, at half the decode time (over half of the module's)
NEW = 12
LENGTHS = [8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 224, 256]
GREEDY = dict(max_tokens=NEW, temperature=0, pdserve={"ignore_eos": True, "return_token_ids": True})
CHAT = [{"role": "user", "content": "Name three colors of the rainbow."}]


@pytest.fixture(scope="module")
def reference():
    llm = LLM(MODEL, dtype="float32", num_pages=512, keep_logits=True)
    prompts = token_prompts(llm.tokenizer, LENGTHS)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True))
    chat_ids = llm.tokenizer.apply_chat_template(CHAT)
    chat = llm.generate(chat_ids, SamplingParams(max_tokens=NEW, temperature=0.0))[0]
    assert_engine_empty(llm)
    return prompts, [o.token_ids for o in outs], [torch.stack(o.logits) for o in outs], chat


@pytest.fixture(scope="module")
def served():
    llm = LLM(MODEL, dtype="float32", num_pages=512, max_num_seqs=16)
    backend = LocalEngineBackend(llm, model_name=MODEL)
    srv = BackgroundServer(backend).start()
    yield srv
    srv.stop()
    backend.close()
    assert_engine_empty(llm)


def _ids(chunks) -> list[int]:
    return [t for c in chunks for t in (c.token_ids or [])]


def test_python_client_single_requests_stream_and_not(reference, served):
    prompts, ref, logits, _ = reference
    client = Client(served.base_url)
    pick = [0, 5, 15]
    plain = [client.complete(prompts[i], **GREEDY) for i in pick]
    streamed = [list(client.complete(prompts[i], stream=True, **GREEDY)) for i in pick]
    assert_greedy_equal([ref[i] for i in pick], [o.choices[0].token_ids for o in plain], [logits[i] for i in pick])
    assert_greedy_equal([ref[i] for i in pick], [_ids(s) for s in streamed], [logits[i] for i in pick])
    assert ["".join(c.text for c in s) for s in streamed] == [o.text for o in plain]


def test_python_async_client_16_concurrent(reference, served):
    prompts, ref, logits, _ = reference

    async def run():
        async with AsyncClient(served.base_url) as ac:
            async def one(i):
                if i % 2:
                    return _ids([c async for c in await ac.complete(prompts[i], stream=True, **GREEDY)])
                return (await ac.complete(prompts[i], **GREEDY)).choices[0].token_ids
            return await asyncio.gather(*(one(i) for i in range(16)))
    assert_greedy_equal(ref, asyncio.run(run()), logits)


def test_openai_sdk_single_and_16_concurrent(reference, served):
    openai = pytest.importorskip("openai")
    prompts, ref, logits, _ = reference
    extra = {"pdserve": {"ignore_eos": True, "return_token_ids": True}}
    sdk = openai.OpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0)
    one = sdk.completions.create(model=MODEL, prompt=prompts[3], max_tokens=NEW, temperature=0, extra_body=extra)
    assert_greedy_equal([ref[3]], [one.choices[0].token_ids], [logits[3]])

    async def run():
        client = openai.AsyncOpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0)

        async def call(i):
            kw = dict(model=MODEL, prompt=prompts[i], max_tokens=NEW, temperature=0, extra_body=extra)
            if i % 2:
                stream = await client.completions.create(stream=True, **kw)
                return [t for c in [c async for c in stream] for ch in c.choices for t in (ch.token_ids or [])]
            return (await client.completions.create(**kw)).choices[0].token_ids
        try:
            return await asyncio.gather(*(call(i) for i in range(16)))
        finally:
            await client.close()
    assert_greedy_equal(ref, asyncio.run(run()), logits)


def test_openai_sdk_chat_matches_engine_text(reference, served):
    openai = pytest.importorskip("openai")
    chat_ref = reference[3]
    sdk = openai.OpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0)
    out = sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=NEW, temperature=0)
    assert out.choices[0].message.content == chat_ref.text
    assert out.choices[0].finish_reason == chat_ref.finish_reason
    parts = sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=NEW, temperature=0, stream=True,
                                        stream_options={"include_usage": True})
    chunks = list(parts)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat_ref.text
    assert chunks[-1].usage.completion_tokens == len(chat_ref.token_ids)
