"""A real worker process (front-end + engine core) on the tiny model, over HTTP."""

import json
import socket
import time

import pytest

from splitserve import LLM, SamplingParams
from server_utils import Worker, get, metrics, post, stream


@pytest.fixture(scope="module")
def worker():
    w = Worker("--model", "tiny-random", "--dtype", "float32", "--max-body-bytes", "200000")
    yield w
    w.close()


@pytest.fixture(scope="module")
def offline():
    return LLM("tiny-random", dtype="float32", num_threads=1)


def completion(worker, **body):
    return post(worker.url + "/v1/completions", {"model": "tiny-random", **body})


def test_models_and_health(worker):
    status, body = get(worker.url + "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == "tiny-random"
    assert get(worker.url + "/health")[0] == 200
    import urllib.request
    with urllib.request.urlopen(urllib.request.Request(worker.url + "/health", method="HEAD")) as r:
        assert r.status == 200 and r.read() == b"" and int(r.headers["Content-Length"]) > 0
    status, body = get(worker.url + "/v1/nope")
    assert status == 404 and json.loads(body)["error"]["type"] == "NotFoundError"
    status, body = get(worker.url + "/v1/completions")
    assert status == 405 and "takes POST" in json.loads(body)["error"]["message"]


def test_greedy_completion_equals_offline(worker, offline):
    prompt = "The quick brown fox"
    status, body = completion(worker, prompt=prompt, max_tokens=12, temperature=0)
    assert status == 200
    want = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    choice = body["choices"][0]
    assert choice["text"] == want.text and choice["finish_reason"] == want.finish_reason
    assert body["usage"]["completion_tokens"] == len(want.token_ids)
    assert body["usage"]["prompt_tokens"] == len(offline.tokenizer.encode(prompt))


def test_token_id_prompts_and_batches(worker, offline):
    prompts = [[5, 6, 7], [100, 200, 300, 400]]
    status, body = completion(worker, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert status == 200 and len(body["choices"]) == 4
    for i, p in enumerate(prompts):
        want = offline.generate(p, SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].text
        got = [c["text"] for c in body["choices"] if c["index"] // 2 == i]
        assert got == [want, want]


def test_streaming_equals_non_streaming(worker):
    body = {"model": "tiny-random", "prompt": "Hello there", "max_tokens": 10, "temperature": 0}
    events = stream(worker.url + "/v1/completions",
                    {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    usage = events[-2]["usage"]
    text = "".join(c["text"] for e in events[:-2] for c in e["choices"])
    _, full = post(worker.url + "/v1/completions", body)
    assert text == full["choices"][0]["text"] and usage == full["usage"]


def test_chat_stream_and_not(worker, offline):
    messages = [{"role": "user", "content": "Say something."}]
    body = {"model": "tiny-random", "messages": messages, "max_tokens": 8, "temperature": 0}
    status, full = post(worker.url + "/v1/chat/completions", body)
    assert status == 200
    want = offline.chat(messages, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    assert full["choices"][0]["message"] == {"role": "assistant", "content": want}
    events = stream(worker.url + "/v1/chat/completions", body)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
    assert text == want


def test_stop_logprobs_and_echo(worker):
    _, base = completion(worker, prompt="One two", max_tokens=10, temperature=0)
    text = base["choices"][0]["text"]
    stop = text[3:6]
    _, stopped = completion(worker, prompt="One two", max_tokens=10, temperature=0, stop=[stop])
    assert stopped["choices"][0]["text"] == text[:text.index(stop)]
    assert stopped["choices"][0]["finish_reason"] == "stop"
    _, lp = completion(worker, prompt="One two", max_tokens=3, temperature=0, logprobs=2, echo=True)
    choice = lp["choices"][0]
    assert choice["text"].startswith("One two")
    assert choice["logprobs"]["token_logprobs"][0] is None        # first prompt token
    assert all(len(t) <= 2 or True for t in choice["logprobs"]["top_logprobs"][1:])


def test_openai_client(worker):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=worker.url + "/v1", api_key="none", timeout=120, max_retries=0)
    out = client.completions.create(model="tiny-random", prompt="Hi", max_tokens=5, temperature=0)
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model="tiny-random", max_tokens=5, temperature=0,
                                          messages=[{"role": "user", "content": "Hi"}],
                                          logprobs=True, top_logprobs=2, n=2)
    assert len(chat.choices) == 2 and len(chat.choices[0].logprobs.content) == 5
    chunks = list(client.chat.completions.create(model="tiny-random", max_tokens=5, temperature=0,
                                                 messages=[{"role": "user", "content": "Hi"}],
                                                 stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"


BAD = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": [5, 99999999]}, 400, "prompt"),
    ({"prompt": "x", "max_tokens": 10**7}, 400, "max_tokens"),
    ({"prompt": "x", "model": "no-such-model"}, 404, "model"),
    ({"prompt": "x" * 300_000}, 413, None),
    # prompt logprobs: 2,000 tokens x n = 25 x 21 = 1,050,000 entries, past 2^20
    ({"prompt": [[7] * 1000] * 2, "n": 25, "prompt_logprobs": 20, "max_tokens": 1}, 400,
     "prompt_logprobs"),
    ({"prompt": [[7] * 1000] * 2, "n": 25, "echo": True, "logprobs": 20, "max_tokens": 1}, 400,
     "logprobs"),
]


@pytest.mark.parametrize("body, status, param", BAD)
def test_bad_input_gets_openai_error_and_server_keeps_serving(worker, body, status, param):
    got, err = post(worker.url + "/v1/completions", body)
    assert got == status, err
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"]
    assert err["error"]["param"] == param
    assert completion(worker, prompt="still alive?", max_tokens=2)[0] == 200


def test_prompt_logprobs_up_to_the_bound_are_served(worker):
    """2^20 entries: 1,000 tokens x n = 49 x 21 = 1,029,000 (one more choice is refused)."""
    status, body = completion(worker, prompt=[[7] * 1000], n=49, prompt_logprobs=20, max_tokens=1)
    assert status == 200 and len(body["choices"]) == 49, body
    assert all(len(c["prompt_logprobs"]) == 1000 for c in body["choices"])
    status, body = completion(worker, prompt=[[7] * 1000], n=50, prompt_logprobs=20, max_tokens=1)
    assert status == 400 and body["error"]["param"] == "prompt_logprobs", body


def test_tokenize_detokenize(worker, offline):
    status, tok = post(worker.url + "/tokenize", {"prompt": "Hello world"})
    assert status == 200 and tok["tokens"] == offline.tokenizer.encode("Hello world").tolist()
    status, detok = post(worker.url + "/detokenize", {"tokens": tok["tokens"]})
    assert status == 200 and detok["prompt"] == "Hello world"


def test_aborted_stream_frees_blocks(worker):
    body = json.dumps({"model": "tiny-random", "prompt": "abort me", "max_tokens": 5000,
                       "ignore_eos": True, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", worker.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    assert b"200" in sock.recv(4096)
    deadline = time.monotonic() + 20
    while metrics(worker.url)["splitserve_kv_blocks_used"] == 0:
        assert time.monotonic() < deadline, "the request never got blocks"
        time.sleep(0.05)
    sock.close()   # the client goes away mid-stream
    deadline = time.monotonic() + 20
    while metrics(worker.url)["splitserve_kv_blocks_used"] > 0:
        assert time.monotonic() < deadline, "blocks still held after the client left"
        time.sleep(0.2)
    m = metrics(worker.url)
    assert m["splitserve_num_requests_running"] == 0
