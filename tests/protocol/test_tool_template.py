"""Which chat template renders tools: SmolLM2's ChatML one ignores them, so a request with
tools (or tool turns) gets the shipped Hermes-style template, every other request the
model's own; a template that renders tools keeps doing so. The orchestrator's counting
makes the same ids of a tool request as a worker."""

import json

from splitserve.orchestrator.prompt_tokens import PromptTokenizer
from splitserve.protocol.openai import decode_chat_request
from splitserve.protocol.prompts import chat_prompt
from splitserve.protocol.tool_template import renders_tools, tool_tokenizer

from tool_utils import TOOLS

USER = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"}]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}
HISTORY = [*USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
           {"role": "tool", "tool_call_id": "call_2", "content": "sunny"}]


def prompt(tok, **body) -> str:
    return chat_prompt(tok, decode_chat_request(json.dumps(body).encode()), 4096)[0]


def test_smollm2_template_ignores_tools_so_tool_requests_get_the_shipped_one(tiny_source):
    tok = tiny_source.tokenizer
    assert not renders_tools(tok) and renders_tools(tool_tokenizer(tok))
    plain = prompt(tok, messages=USER)
    assert plain == tok.apply_chat_template([{"role": m["role"], "content": m["content"]}
                                             for m in USER])    # no tools: as before
    text = prompt(tok, messages=HISTORY, tools=TOOLS)
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nBe brief.\n\n")
    for t in TOOLS:
        assert json.dumps(t) in system.split("<tools>\n")[1].split("</tools>")[0]
    assert rest == (
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
        "{\"city\": \"Paris\", \"days\": 2}}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\nsunny\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert prompt(tok, messages=USER, tools=TOOLS, tool_choice="none") != plain


def test_a_template_that_renders_tools_is_kept(tiny_source):
    own = tiny_source.tokenizer.replace(chat_template=(
        "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<{{ c.function.arguments.city }}>{% endfor %}"
        "|{% endfor %}"))
    assert tool_tokenizer(own) is own
    assert prompt(own, messages=HISTORY[1:3], tools=TOOLS, add_generation_prompt=False) == (
        "[get_weather][now]user:Weather in Paris?|assistant:<Paris>|")


def test_the_orchestrator_counts_a_tool_request_as_the_worker_renders_it(tiny_source):
    body = {"model": "tiny-random", "messages": HISTORY, "tools": TOOLS,
            "tool_choice": "required"}
    worker = chat_prompt(tiny_source.tokenizer, decode_chat_request(json.dumps(body).encode()),
                         4096)[1].array
    assert PromptTokenizer("tiny-random").token_ids(body).tolist() == worker.tolist()
