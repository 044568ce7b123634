"""A large logprobs body is built in the tokenizer pool, off the event loop, and logprobs a
front-end holds cost the garbage collector nothing (protocol/logprob_bound.py)."""

import asyncio
import json
from types import SimpleNamespace

from splitserve.protocol.cache_salt import CacheIsolation
from splitserve.protocol.engine import CompletionDelta, EngineReady, Logprob
from splitserve.protocol.openai import decode_chat_request
from splitserve.server import generate
from splitserve.server.generate import GenerateHandlers
from splitserve.server.metrics import ServerMetrics
from splitserve.tokens import PromptTokens
from splitserve.trust import Gate

CHAT = [{"role": "user", "content": "Tell me a story."}]


class _Engine:
    """Answers every request with `tokens` tokens at k = 20, in one final delta."""

    def __init__(self, tokens: int):
        self.tokens = tokens
        self.ready = EngineReady("tiny", "float32", vocab_size=100, max_model_len=100_000,
                                 num_blocks=1, block_size=16)

    async def generate(self, request):
        top = [(i, -1.0 - i) for i in range(20)]
        yield CompletionDelta(request.request_id, 0, [7] * self.tokens, "x" * self.tokens,
                              logprobs=[Logprob(7, -0.5, 1, top)] * self.tokens,
                              finish_reason=1, num_prompt_tokens=len(request.prompt))


def _built_in_pool(tokens: int) -> bool:
    pooled = []

    async def in_pool(fn):
        pooled.append(fn)
        return fn()
    server = SimpleNamespace(engine=_Engine(tokens), token_text=str, model_name="tiny",
                             metrics=ServerMetrics(), in_pool=in_pool, gate=Gate(None, None),
                             isolation=CacheIsolation("none", b"k"),
                             config=SimpleNamespace(log_prefix=""))
    req = decode_chat_request(json.dumps({"messages": CHAT, "logprobs": True, "top_logprobs": 20,
                                          "max_tokens": tokens}).encode())
    http = SimpleNamespace(header=lambda name: None)
    handlers = GenerateHandlers(server)
    requests = handlers._engine_requests(http, req, [PromptTokens.from_list([1, 2, 3])],
                                         req.sampling_params(), None)
    resp = asyncio.run(handlers._respond(http, req, requests, (), 0.0))
    assert len(json.loads(resp.body)["choices"][0]["logprobs"]["content"]) == tokens
    return bool(pooled)


def test_a_large_body_is_built_in_the_pool_a_small_one_on_the_loop():
    per_token = 21
    assert not _built_in_pool(generate.ON_LOOP_MAX_ENTRIES // per_token)
    assert _built_in_pool(generate.ON_LOOP_MAX_ENTRIES // per_token + 1)
    assert _built_in_pool(2000)


def test_logprobs_held_by_a_front_end_cost_the_garbage_collector_nothing():
    """A response's logprobs (up to 2^20 entries) live in the front-end while its sequences
    generate: decoded, their alternatives are tuples of numbers, which a collection stops
    tracking, the pairs at one pass and the tuple of them at the next (lists would be walked,
    item by item, by every full pass on the event loop)."""
    import gc
    import msgspec
    sent = Logprob(7, -0.5, 1, [(i, -1.0 - i) for i in range(20)])
    got = msgspec.msgpack.decode(msgspec.msgpack.encode(sent), type=Logprob)
    gc.collect()
    gc.collect()
    assert not gc.is_tracked(got.top) and not gc.is_tracked(got)
