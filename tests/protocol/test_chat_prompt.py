"""A chat request becomes the same prompt ids on every path that renders one
(protocol/prompts.chat_prompt): /v1/chat/completions and /tokenize on a worker in this
process (its engine a real child process), LLM.chat, and the orchestrator's counting, whose
block hashes must be the worker's for kv_aware routing to find its cached prefixes. The
model's chat template reads a chat_template_kwargs key, and a message comes in content
parts, so a path that drops either makes other ids."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import aiohttp
import pytest

from splitserve import LLM, SamplingParams
from splitserve.config import EngineConfig
from splitserve.errors import InvalidRequestError
from splitserve.model.hf_loader import save_hf_folder
from splitserve.orchestrator.prompt_tokens import PromptTokenizer
from splitserve.protocol.openai_requests import decode_tokenize_request
from splitserve.server.app import WorkerServer
from splitserve.server.config import ServerConfig

TEMPLATE = ("{% if persona %}<|im_start|>system\nYou are {{ persona }}.<|im_end|>\n{% endif %}"
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PARTS = [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Answer in French."}]
REQUESTS = [   # (the request's chat fields, the text the template must make of them)
    ({"messages": [{"role": "system", "content": PARTS}, {"role": "user", "content": "Hi"}],
      "chat_template_kwargs": {"persona": "a pirate"}, "add_generation_prompt": False},
     "<|im_start|>system\nYou are a pirate.<|im_end|>\n<|im_start|>system\nBe brief.\n"
     "Answer in French.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]},
     "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
]


@pytest.fixture(scope="module")
def model(tiny_source, tmp_path_factory) -> str:
    """tiny-random with TEMPLATE as its chat template, as a Hugging Face folder."""
    folder = str(tmp_path_factory.mktemp("templated"))
    tokenizer = tiny_source.tokenizer.replace(chat_template=TEMPLATE)
    save_hf_folder(dataclasses.replace(tiny_source, tokenizer=tokenizer), folder)
    return folder


@pytest.fixture(scope="module")
def worker_ids(model) -> list[tuple[list[int], list[int], int]]:
    """For each of REQUESTS: /tokenize's ids, the prompt ids a chat completion's
    prompt_logprobs name (all but the first, which has none), and its usage.prompt_tokens."""
    async def run():
        server = WorkerServer(ServerConfig(port=0, engine=EngineConfig(
            model=model, dtype="float32", num_threads=1)))
        await server.start()
        try:
            async with aiohttp.ClientSession() as client:
                return [await _ask(client, f"http://127.0.0.1:{server.http.port}", fields)
                        for fields, _ in REQUESTS]
        finally:
            await server.stop()
    return asyncio.run(run())


async def _ask(client: aiohttp.ClientSession, url: str, fields: dict):
    async with client.post(url + "/tokenize", json=fields) as r:
        tokenized = await r.json()
        assert r.status == 200, tokenized
    body = {**fields, "max_tokens": 1, "prompt_logprobs": 0}
    async with client.post(url + "/v1/chat/completions", json=body) as r:
        answer = await r.json()
        assert r.status == 200, answer
    named = [int(next(iter(entry))) for entry in answer["prompt_logprobs"][1:]]
    return tokenized["tokens"], named, answer["usage"]["prompt_tokens"]


@pytest.mark.parametrize("i", range(len(REQUESTS)))
def test_every_path_makes_the_same_ids_of_a_chat_request(i, model, worker_ids, tiny_source):
    fields, text = REQUESTS[i]
    want = tiny_source.tokenizer.encode(text, add_special_tokens=False).tolist()
    tokenized, named, counted = worker_ids[i]
    assert tokenized == want                                  # /tokenize
    assert (named, counted) == (want[1:], len(want))          # /v1/chat/completions
    offline = LLM(model, dtype="float32", num_threads=1).chat(
        fields["messages"], SamplingParams(max_tokens=1),
        add_generation_prompt=fields.get("add_generation_prompt", True),
        chat_template_kwargs=fields.get("chat_template_kwargs"))[0]
    assert offline.prompt_token_ids.tolist() == want and offline.prompt == text   # LLM.chat
    assert PromptTokenizer(model).token_ids(json.loads(json.dumps(fields))).tolist() == want


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": 1}},
     "chat_template_kwargs"),
    ({"messages": [{"role": "nobody", "content": "x"}]}, "messages[0].role"),
    ({"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt"),
    ({}, "prompt"),
])
def test_a_bad_tokenize_body_is_refused_naming_the_parameter(body, param):
    with pytest.raises(InvalidRequestError) as err:
        decode_tokenize_request(json.dumps(body).encode())
    assert err.value.param == param, err.value.message
