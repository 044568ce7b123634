"""A request's grammar compiles in the tokenizer pool within the server's
grammar_compile_seconds, else a 400 naming its field; the compile goes on in its thread
and is cached, so the same grammar is served at once afterwards."""

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from splitserve.errors import InvalidRequestError
from splitserve.grammar_compile import GrammarCompiler
from splitserve.protocol.openai import decode_chat_request
from splitserve.server.generate import GenerateHandlers

SCHEMA = {"type": "object", "properties": {f"k{i}": {"type": "string", "pattern": "[a-z]{3,9}"}
                                           for i in range(24)}}


def handlers(tiny_source, seconds: float, pool: ThreadPoolExecutor) -> GenerateHandlers:
    tok = tiny_source.tokenizer
    grammars = GrammarCompiler(tok.to_json(), tok.vocab_size, tok.eos_token_ids)
    grammars._llt()                         # the vocabulary's one-time build, not the bound's

    async def in_pool(fn):
        return await asyncio.get_running_loop().run_in_executor(pool, fn)
    return GenerateHandlers(SimpleNamespace(
        grammars=grammars, in_pool=in_pool,
        config=SimpleNamespace(log_prefix="", grammar_compile_seconds=seconds)))


def test_a_compile_past_the_bound_is_a_400_naming_the_field_then_cached(tiny_source):
    req = decode_chat_request(json.dumps({
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "r", "schema": SCHEMA}}}).encode())
    params = req.sampling_params()
    with ThreadPoolExecutor(1) as pool:
        h = handlers(tiny_source, 1e-4, pool)
        with pytest.raises(InvalidRequestError) as err:
            asyncio.run(h._check_grammar(params))
        assert err.value.param == "response_format.json_schema.schema"
        assert "longer than 0.0001 s" in err.value.message
        deadline = time.monotonic() + 30
        while h.server.grammars.cached(params.grammar) is None:   # it went on, and is kept
            assert time.monotonic() < deadline
            time.sleep(0.01)
        asyncio.run(h._check_grammar(params))        # served at once from the cache
        roomy = handlers(tiny_source, 30.0, pool)
        asyncio.run(roomy._check_grammar(params))    # within the bound: compiled, no 400
