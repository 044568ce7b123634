"""A worker process renders its --chat-template file, and a request's own template when it
trusts them; a guided field with a bad regex is refused by the running worker."""

from splitserve.model.loader import load_model_source

from server_utils import Worker, post

USER = [{"role": "user", "content": "hi"}]


def test_a_worker_renders_its_template_file_and_a_trusted_requests(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("From the file: {{ messages[-1].content }}")
    w = Worker("--model", "tiny-random", "--chat-template", str(template),
               "--trust-request-chat-template")
    try:
        tok = load_model_source("tiny-random").tokenizer
        status, ids = post(w.url + "/tokenize", {"messages": USER})
        assert status == 200 and ids["tokens"] == tok.encode("From the file: hi", False).tolist()
        chat = {"messages": USER, "max_tokens": 2, "temperature": 0}
        for extra, text in [({}, "From the file: hi"),
                            ({"chat_template": "{{ messages[0].content }}!"}, "hi!")]:
            status, body = post(w.url + "/v1/chat/completions", {**chat, **extra})
            assert status == 200 and body["usage"]["prompt_tokens"] == len(tok.encode(text, False))
        status, body = post(w.url + "/v1/chat/completions", {**chat, "guided_regex": "(a"})
        assert status == 400 and body["error"]["param"] == "guided_regex"
    finally:
        w.close()
