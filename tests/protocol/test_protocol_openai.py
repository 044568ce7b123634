"""OpenAI protocol: request validation names the bad parameter; responses and SSE chunks
have the shapes OpenAI clients parse (checked against the `openai` package's types)."""

import json

import msgspec
import pytest

from splitserve.engine.request import FinishReason
from splitserve.errors import InvalidRequestError
from splitserve.protocol.disagg import DisaggregatedParams
from splitserve.protocol.engine import CompletionDelta, Logprob
from splitserve.protocol.openai import (
    DONE, EchoPrompt, ResponseAccumulator, StreamEncoder, decode_chat_request,
    decode_completion_request, error_body, sse_error)

STOP, LENGTH = int(FinishReason.STOP), int(FinishReason.LENGTH)
USER = [{"role": "user", "content": "hi"}]


def enc(body) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()


def completion(**body):
    return decode_completion_request(enc({"prompt": "hello", **body}))


def chat(**body):
    return decode_chat_request(enc({"messages": USER, **body}))


def token_text(token_id: int) -> str:
    return f"t{token_id}"


def lp(token_id: int, logprob: float = -0.5, top=((1, -0.1), (2, -0.7))) -> Logprob:
    return Logprob(token_id, logprob, 1, [tuple(t) for t in top])


# -- request validation -------------------------------------------------------------------
def param_of(fn, body) -> str | None:
    """Decode and map to SamplingParams; the InvalidRequestError's param."""
    with pytest.raises(InvalidRequestError) as err:
        fn(enc(body)).sampling_params()
    assert err.value.message
    return err.value.param


BAD_COMPLETIONS = [
    (b"{not json", None),
    (b"[1, 2]", None),
    (b'"a string"', None),
    ({}, "prompt"),
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "temperature": -0.5}, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 1000}, "n"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", 1]}, "prompt"),
    ({"prompt": [1, [2]]}, "prompt"),
    ({"prompt": [[1], []]}, "prompt"),
    ({"prompt": [1.5]}, "prompt[0]"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logit_bias": {"abc": 1.0}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 200}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": "big"}}, "logit_bias"),
    ({"prompt": "x", "suffix": "tail"}, "suffix"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "stop": ["s"] * 17}, "stop"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "stop": 3}, "stop"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"prompt": "x", "stream_options": {"include_usage": "y"}}, "stream_options.include_usage"),
    ({"prompt": "x", "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ({"prompt": "x", "disaggregated_params": {"prompt_len": -1}},
     "disaggregated_params.prompt_len"),
    ({"prompt": "x", "disaggregated_params": {"request_type": "both"}},
     "disaggregated_params.request_type"),
    ({"prompt": "x", "disaggregated_params": {"first_gen_tokens": []}},
     "disaggregated_params.first_gen_tokens"),
    # integers and sizes beyond what anything downstream takes (int32 counts and ids, int64 seeds)
    ({"prompt": "x", "seed": 2**63}, "seed"),
    ({"prompt": "x", "seed": 2**64 - 1}, "seed"),
    ({"prompt": "x", "seed": -2**63 - 1}, "seed"),
    ({"prompt": "x", "seed": 10**40}, "seed"),
    ({"prompt": "x", "max_tokens": 2**31}, "max_tokens"),
    ({"prompt": "x", "min_tokens": 2**40, "max_tokens": None}, "min_tokens"),
    ({"prompt": "x", "min_tokens": -1}, "min_tokens"),
    ({"prompt": "x", "top_k": 2**63}, "top_k"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "n": -2**70}, "n"),
    ({"prompt": "x", "logprobs": 2**64}, "logprobs"),
    ({"prompt": "x", "prompt_logprobs": -2**64}, "prompt_logprobs"),
    ({"prompt": "x", "stop_token_ids": [2**31]}, "stop_token_ids"),
    ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": "x", "stop_token_ids": [1] * 1025}, "stop_token_ids"),
    ({"prompt": "x", "stop": "s" * 257}, "stop"),
    ({"prompt": "x", "logit_bias": {"99999999999": 1.0}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"9" * 5000: 1.0}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"-1": 1.0}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"٣": 1.0}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {str(i): 1.0 for i in range(1025)}}, "logit_bias"),
    ({"prompt": [2**31]}, "prompt"),
    ({"prompt": [[1], [-1]]}, "prompt"),
    ({"prompt": [2**64]}, "prompt"),
    ({"prompt": ["a"] * 129}, "prompt"),
    ({"prompt": [[1]] * 129}, "prompt"),
    ({"prompt": "x", "temperature": 1e308}, "temperature"),
    ({"prompt": "x", "top_p": -1e308}, "top_p"),
    ({"prompt": "x", "disaggregated_params": {"prompt_len": 2**31}},
     "disaggregated_params.prompt_len"),
    ({"prompt": "x", "disaggregated_params": {"first_gen_tokens": [2**64]}},
     "disaggregated_params.first_gen_tokens"),
    ({"prompt": "x", "disaggregated_params": {"first_gen_tokens": [1] * 17}},
     "disaggregated_params.first_gen_tokens"),
    ({"prompt": "x", "disaggregated_params": {"prompt_token_ids": [2**40]}},
     "disaggregated_params.prompt_token_ids"),
    ({"prompt": "x", "disaggregated_params": {"ctx_request_id": "r" * 257}},
     "disaggregated_params.ctx_request_id"),
    ({"prompt": "x", "disaggregated_params": {
        "first_gen_tokens": [1], "first_gen_logprobs": [[1, -0.5, 2**64, []]]}},
     "disaggregated_params.first_gen_logprobs"),
    ({"prompt": "x", "disaggregated_params": {
        "first_gen_tokens": [1, 2], "first_gen_logprobs": [[1, -0.5, 1, []]]}},
     "disaggregated_params.first_gen_logprobs"),
    ({"prompt": "x", "disaggregated_params": {"kv_handle": {
        "backend": "tcp", "endpoint": "e", "ctx_request_id": "c", "layout": "l",
        "num_tokens": 2**40}}}, "disaggregated_params.kv_handle"),
]

BAD_CHATS = [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "bot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [*USER, {"role": "user", "content": 5}]}, "messages[1].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0]"),
    ({"messages": USER, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": USER, "logprobs": 5}, "logprobs"),
    ({"messages": USER, "max_completion_tokens": -3}, "max_completion_tokens"),
    ({"messages": USER, "max_tokens": -3}, "max_tokens"),
    ({"messages": USER, "temperature": -1}, "temperature"),
    ({"messages": USER, "chat_template_kwargs": []}, "chat_template_kwargs"),
    ({"messages": USER, "max_completion_tokens": 2**64}, "max_completion_tokens"),
    ({"messages": USER, "chat_template_kwargs": {"add_generation_prompt": [1]}},
     "chat_template_kwargs"),
    ({"messages": USER, "chat_template_kwargs": {"messages": 5}}, "chat_template_kwargs"),
    ({"messages": USER, "seed": -2**64}, "seed"),
    ({"messages": USER, "logprobs": True, "top_logprobs": 2**70}, "top_logprobs"),
]


def test_integer_bounds_are_inclusive():
    params = completion(seed=2**63 - 1, max_tokens=2**31 - 1, min_tokens=2**31 - 1,
                        top_k=2**31 - 1, stop_token_ids=[0, 2**31 - 1],
                        logit_bias={" +7 ": 1.0}).sampling_params()
    assert params.seed == 2**63 - 1 and params.logit_bias == {7: 1.0}
    assert chat(seed=-2**63).sampling_params().seed == -2**63
    assert completion(prompt=[0, 2**31 - 1]).prompts() == [[0, 2**31 - 1]]


@pytest.mark.parametrize("body, param", BAD_COMPLETIONS)
def test_bad_completion_request_names_param(body, param):
    assert param_of(decode_completion_request, body) == param


@pytest.mark.parametrize("body, param", BAD_CHATS)
def test_bad_chat_request_names_param(body, param):
    assert param_of(decode_chat_request, body) == param


def test_malformed_and_non_object_messages():
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        decode_chat_request(b'{"messages": [')
    with pytest.raises(InvalidRequestError, match="JSON object"):
        decode_completion_request(b"[]")


def test_explicit_nulls_mean_defaults():
    req = completion(n=None, temperature=None, top_p=None, stop=None, max_tokens=None,
                     logprobs=None, stream_options=None, seed=None)
    sp = req.sampling_params()
    assert (sp.n, sp.temperature, sp.top_p, sp.max_tokens, sp.stop) == (1, 1.0, 1.0, None, ())


def test_prompt_forms():
    assert completion(prompt="a").prompts() == ["a"]
    assert completion(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert completion(prompt=[1, 2, 3]).prompts() == [[1, 2, 3]]
    assert completion(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]


def test_content_parts_are_flattened():
    req = chat(messages=[
        {"role": "system", "content": None},
        {"role": "user", "name": "bob",
         "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
        {"role": "assistant", "content": "ok", "tool_calls": []}])
    assert req.conversation() == [
        {"role": "system", "content": ""},
        {"role": "user", "content": "one\ntwo", "name": "bob"},
        {"role": "assistant", "content": "ok"}]


def test_completion_sampling_params_mapping():
    sp = completion(max_tokens=7, temperature=0, top_p=0.9, n=2, logprobs=3, stop="x",
                    presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={"12": -100},
                    seed=4, top_k=5, min_p=0.1, repetition_penalty=1.2, min_tokens=2,
                    ignore_eos=True, stop_token_ids=[7], include_stop_str_in_output=True,
                    skip_special_tokens=False, best_of=2).sampling_params()
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.n, sp.logprobs) == (7, 0.0, 0.9, 2, 3)
    assert sp.stop == ("x",) and sp.logit_bias == {12: -100.0} and sp.stop_token_ids == (7,)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.seed) == (0.5, -0.5, 4)
    assert (sp.top_k, sp.min_p, sp.repetition_penalty, sp.min_tokens) == (5, 0.1, 1.2, 2)
    assert sp.ignore_eos and sp.include_stop_str_in_output and not sp.skip_special_tokens
    assert sp.prompt_logprobs is None
    assert completion().sampling_params().max_tokens == 16          # the OpenAI default
    assert completion().sampling_params().top_k == 0
    assert completion(echo=True, logprobs=2).sampling_params().prompt_logprobs == 2
    assert completion(echo=True).sampling_params().prompt_logprobs is None


def test_chat_sampling_params_mapping():
    assert chat().sampling_params().max_tokens is None               # up to the context
    assert chat(max_tokens=5).sampling_params().max_tokens == 5
    assert chat(max_tokens=5, max_completion_tokens=9).sampling_params().max_tokens == 9
    assert chat().sampling_params().logprobs is None
    assert chat(logprobs=True).sampling_params().logprobs == 0
    assert chat(logprobs=True, top_logprobs=4).sampling_params().logprobs == 4
    assert chat(logprobs=False, top_logprobs=0).sampling_params().logprobs is None
    req = chat(add_generation_prompt=False, chat_template_kwargs={"enable_thinking": False},
               stream=True, stream_options={"include_usage": True})
    assert not req.add_generation_prompt and req.chat_template_kwargs == {"enable_thinking": False}
    assert req.include_usage and not chat(stream=True).include_usage
    with pytest.raises(InvalidRequestError, match="only allowed when stream") as err:
        chat(stream_options={"include_usage": True})
    assert err.value.param == "stream_options"


def test_disaggregated_params_are_carried():
    handle = {"backend": "tcp", "endpoint": "tcp://x:1", "ctx_request_id": "c1",
              "layout": "m|float32", "num_tokens": 9}
    dp = {"request_type": "generation_only", "ctx_request_id": "c1", "first_gen_tokens": [42],
          "prompt_len": 9, "kv_handle": handle, "prompt_token_ids": list(range(9))}
    req = completion(disaggregated_params=dp)
    assert req.disaggregated_params.kv_handle.endpoint == "tcp://x:1"
    req.disaggregated_params.check_generation_only()
    assert msgspec.json.decode(msgspec.json.encode(req))["disaggregated_params"] == dp
    with pytest.raises(InvalidRequestError) as err:
        DisaggregatedParams(prompt_len=-1)
    assert err.value.param == "disaggregated_params.prompt_len"


# -- responses ------------------------------------------------------------------------------
def deltas_for_two(**first):
    """n=2: sequence 0 stops after two tokens, sequence 1 hits the length limit."""
    return [
        CompletionDelta("r", 0, [5], "Hel", num_prompt_tokens=4, num_cached_tokens=2, **first),
        CompletionDelta("r", 1, [6], "Wor", num_prompt_tokens=4, num_cached_tokens=2, **first),
        CompletionDelta("r", 0, [7], "lo", finish_reason=STOP, stop_reason="!"),
        CompletionDelta("r", 1, [8], "ld", finish_reason=LENGTH),
    ]


def accumulate(request, deltas, **kwargs) -> dict:
    acc = ResponseAccumulator(request, "tiny", token_text=token_text, **kwargs)
    for d in deltas:
        acc.add(d)
    assert acc.error_response() is None
    return json.loads(acc.body())


def test_completion_body_n2_with_usage():
    body = accumulate(completion(n=2), deltas_for_two())
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == "tiny" and isinstance(body["created"], int)
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "Hello", "stop"), (1, "World", "length")]
    assert body["choices"][0]["stop_reason"] == "!" and body["choices"][0]["logprobs"] is None
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8,
                             "prompt_tokens_details": {"cached_tokens": 2}}
    openai = pytest.importorskip("openai")
    openai.types.Completion.model_validate(body)


def test_chat_body_n2_with_logprobs():
    deltas = deltas_for_two(logprobs=[lp(5)])
    for d in deltas[2:]:
        d.logprobs = [lp(d.token_ids[0], float("-inf"))]
    body = accumulate(chat(n=2, logprobs=True, top_logprobs=1), deltas)
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Hello"}
    content = choice["logprobs"]["content"]
    assert content[0] == {"token": "t5", "logprob": -0.5, "bytes": list(b"t5"),
                          "top_logprobs": [{"token": "t1", "logprob": -0.1, "bytes": list(b"t1")}]}
    assert content[1]["logprob"] == -9999.0                         # -inf is not JSON
    assert body["usage"]["completion_tokens"] == 4
    openai = pytest.importorskip("openai")
    openai.types.chat.ChatCompletion.model_validate(body)


def test_completion_logprobs_format():
    deltas = [CompletionDelta("r", 0, [5], "t5", logprobs=[lp(5)], num_prompt_tokens=1),
              CompletionDelta("r", 0, [9], "t9", logprobs=[lp(9, -2.0)], finish_reason=LENGTH)]
    logprobs = accumulate(completion(logprobs=1), deltas)["choices"][0]["logprobs"]
    assert logprobs == {"tokens": ["t5", "t9"], "token_logprobs": [-0.5, -2.0],
                        "top_logprobs": [{"t1": -0.1, "t5": -0.5}, {"t1": -0.1, "t9": -2.0}],
                        "text_offset": [0, 2]}


def test_logprobs_encoded_piece_by_piece_equal_them_encoded_whole():
    """A whole choice's logprobs are encoded PIECE positions at a time (a thread building a
    large body holds the GIL one piece at a time): the bytes are those of one encode."""
    from splitserve.protocol import openai_logprobs as L
    entries = [lp(i % 50, -0.01 * i, top=[(i % 7, -0.5), (3, -9.0)])
               for i in range(2 * L.PIECE + 5)]
    whole = msgspec.json.encode
    for n in (0, 1, L.PIECE, len(entries)):
        part = entries[:n]
        assert bytes(L.chat_logprobs_json(part, token_text, 1)) == whole(
            {"content": L.chat_logprobs(part, token_text, 1)})
        items = [(3, None)] + [(e.token_id, e) for e in part]
        assert bytes(L.completion_logprobs_json(items, token_text, 2)) == whole(
            L.completion_logprobs(items, token_text, 2, 0)[0])
        assert bytes(L.vllm_prompt_logprobs_json([None, *part], token_text)) == whole(
            [None, *(L.vllm_prompt_entry(e, token_text) for e in part)])


def test_echo_prepends_prompt_and_its_logprobs():
    prompt_lps = [None, lp(4, -3.0)]
    deltas = [CompletionDelta("r", 0, [5], "t5", logprobs=[lp(5)], prompt_logprobs=prompt_lps,
                              num_prompt_tokens=2, finish_reason=LENGTH)]
    echo = [EchoPrompt("t3t4", first_token_id=3)]
    choice = accumulate(completion(echo=True, logprobs=1), deltas, echo=echo)["choices"][0]
    assert choice["text"] == "t3t4t5"
    assert choice["logprobs"]["tokens"] == ["t3", "t4", "t5"]
    assert choice["logprobs"]["token_logprobs"] == [None, -3.0, -0.5]
    assert choice["logprobs"]["top_logprobs"][0] is None
    assert choice["logprobs"]["text_offset"] == [0, 2, 4]
    plain = accumulate(completion(echo=True),
                       [CompletionDelta("r", 0, [5], "!", finish_reason=STOP)],
                       echo=[EchoPrompt("Say")])
    assert plain["choices"][0]["text"] == "Say!"


def test_batch_of_prompts_numbers_choices_by_prompt():
    acc = ResponseAccumulator(completion(prompt=["a", "b"], n=2), "m", num_prompts=2)
    for p in range(2):
        for i in range(2):
            acc.add(CompletionDelta("r", i, [1], f"{p}{i}", finish_reason=STOP,
                                    num_prompt_tokens=3), prompt_index=p)
    body = json.loads(acc.body())
    assert [c["text"] for c in body["choices"]] == ["00", "01", "10", "11"]
    assert body["usage"]["prompt_tokens"] == 6 and body["usage"]["completion_tokens"] == 4


def test_engine_errors_become_error_responses():
    acc = ResponseAccumulator(completion(), "m")
    acc.add(CompletionDelta("r", 0, [], "", finish_reason=int(FinishReason.ERROR),
                            error="prompt is too long", error_param="prompt"))
    status, body = acc.error_response()
    assert status == 400 and json.loads(body)["error"]["param"] == "prompt"
    acc = ResponseAccumulator(completion(n=2), "m")
    acc.add(CompletionDelta("r", -1, [], "", finish_reason=int(FinishReason.ERROR),
                            error="engine is not running"))
    status, body = acc.error_response()
    assert status == 500 and json.loads(body)["error"]["type"] == "server_error"


# -- streaming ------------------------------------------------------------------------------
def events(raw: bytes) -> list:
    """Split SSE bytes into events; JSON payloads parsed, [DONE] kept as a string."""
    out = []
    for block in raw.split(b"\n\n")[:-1]:
        assert block.startswith(b"data: ")
        payload = block[len(b"data: "):]
        out.append(payload.decode() if payload == b"[DONE]" else json.loads(payload))
    assert raw.endswith(b"\n\n")
    return out


def stream(request, deltas, **kwargs) -> list:
    enc_ = StreamEncoder(request, "tiny", token_text=token_text, **kwargs)
    raw = b"".join(enc_.chunk(d) for d in deltas)
    if request.include_usage:
        raw += enc_.usage_chunk()
    return events(raw + DONE)


def test_chat_stream_chunks():
    req = chat(n=2, stream=True, stream_options={"include_usage": True})
    evs = stream(req, deltas_for_two() + [CompletionDelta("r", 0, [], "")])   # empty: skipped
    assert evs[-1] == "[DONE]" and evs[-2]["choices"] == []
    assert evs[-2]["usage"]["total_tokens"] == 8
    chunks = evs[:-2]
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    firsts = {}
    for c in chunks:
        assert c["object"] == "chat.completion.chunk" and len(c["choices"]) == 1
        firsts.setdefault(c["choices"][0]["index"], c["choices"][0]["delta"])
    role_only = {"role": "assistant", "content": ""}
    assert firsts == {0: role_only, 1: role_only}
    text = {0: "", 1: ""}
    for c in chunks:
        text[c["choices"][0]["index"]] += c["choices"][0]["delta"].get("content", "")
    assert text == {0: "Hello", 1: "World"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    openai = pytest.importorskip("openai")
    for c in evs[:-1]:
        openai.types.chat.ChatCompletionChunk.model_validate(c)


def test_completion_stream_with_echo_and_logprobs():
    req = completion(stream=True, echo=True, logprobs=0)
    deltas = [CompletionDelta("r", 0, [5], "t5", logprobs=[lp(5, top=())],
                              prompt_logprobs=[None, lp(4, top=())], num_prompt_tokens=2),
              CompletionDelta("r", 0, [6], "t6", logprobs=[lp(6, top=())], finish_reason=LENGTH)]
    evs = stream(req, deltas, echo=[EchoPrompt("t3t4", 3)])
    first, last = evs[0]["choices"][0], evs[1]["choices"][0]
    assert evs[0]["object"] == "text_completion" and evs[0]["id"].startswith("cmpl-")
    assert first["text"] == "t3t4t5" and first["finish_reason"] is None
    assert first["logprobs"]["tokens"] == ["t3", "t4", "t5"]
    assert first["logprobs"]["text_offset"] == [0, 2, 4]
    assert first["logprobs"]["top_logprobs"][1:] == [{"t4": -0.5}, {"t5": -0.5}]
    assert last["text"] == "t6" and last["logprobs"]["text_offset"] == [6]
    assert last["finish_reason"] == "length"
    openai = pytest.importorskip("openai")
    openai.types.Completion.model_validate(evs[1])


def test_stream_error_event():
    raw = StreamEncoder(chat(stream=True), "m").chunk(
        CompletionDelta("r", 0, [], "", finish_reason=int(FinishReason.ERROR), error="boom"))
    [event] = events(raw)
    assert event == {"error": {"message": "boom", "type": "server_error", "param": None,
                               "code": None}}


def test_error_body_shape():
    assert json.loads(error_body("bad", param="n")) == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "n", "code": None}}
    assert json.loads(error_body("gone", "not_found_error", code=404))["error"]["code"] == 404
    assert sse_error("x").startswith(b"data: {") and sse_error("x").endswith(b"}\n\n")


def test_response_ids_are_random_hex_and_unique_across_pool_refills():
    from splitserve.protocol.openai import response_id
    ids = [response_id(i % 2 == 0) for i in range(600)]     # past two refills of 256
    assert len(set(ids)) == 600
    for i, rid in enumerate(ids):
        prefix, _, tail = rid.partition("-")
        assert prefix == ("chatcmpl" if i % 2 == 0 else "cmpl") and len(tail) == 32
        int(tail, 16)
