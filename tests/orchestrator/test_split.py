"""A batch of prompts and n > 1 as single-choice parts (seeds of sibling j), merged in order."""

import json

from splitserve.orchestrator.split import Part, merge, parts, summed_usage


def test_parts_and_merge():
    raw = b'{"prompt": [[5], [1, 2]], "n": 2, "seed": 9223372036854775807}'
    body = json.loads(raw)
    got = parts(raw, body, chat=False)
    assert [(p.body["prompt"], p.body["seed"], p.index, p.first_choice) for p in got] == [
        ([5], 2**63 - 1, 0, True), ([5], -2**63, 1, False),
        ([1, 2], 2**63 - 1, 2, True), ([1, 2], -2**63, 3, False)]
    assert all(p.body["n"] == 1 for p in got)
    assert parts(b'{"prompt": [1, 2]}', {"prompt": [1, 2]}, chat=False) is None
    assert parts(b'{"prompt": ["a"]}', {"prompt": ["a"]}, chat=False) is None
    usage = {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    merged = merge([(Part({}, 1, False), {"choices": [{"index": 0, "text": "b"}],
                                          "usage": usage}),
                    (Part({}, 0, True), {"choices": [{"index": 0, "text": "a"}],
                                         "usage": usage})])
    assert [c["index"] for c in merged["choices"]] == [1, 0]
    assert merged["usage"]["prompt_tokens"] == 4 and merged["usage"]["completion_tokens"] == 4
    assert summed_usage([])["total_tokens"] == 0
