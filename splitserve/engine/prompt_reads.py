"""The guardrail of length-only relay: every feature of this engine that reads prompt token
values, in one place.

A generation worker may receive only a prompt's length (token relay mode `metadata`): its
KV arrives from the context worker, and decoding needs only the generated tokens. That is
correct exactly when nothing reads the prompt's values. Per request, these do:

- repetition_penalty != 1: penalizes tokens present in the prompt (sampler.py);
- prompt_logprobs: scores every prompt token (runner.py / sampler.py);
- echo (completions): returns the prompt text and, with logprobs, its tokens.

And inside the engine, whatever the request asks:

- prefix caching keys blocks by token values: skipped for length-only prompts
  (block_manager.py);
- preemption recomputes a request from its tokens: length-only requests are never chosen
  as victims (scheduler.py);
- detokenization reads only generated tokens (byte-level BPE decodes them exactly without
  prompt context), so the first generated tokens come out right.

frequency/presence penalties count generated tokens only (OpenAI semantics), and stop
strings, logit_bias, min_tokens and seeds never look at the prompt. A length-only prompt
that something reads anyway raises PlaceholderReadError (tokens.py): loud, never wrong.
"""

from __future__ import annotations


def prompt_value_readers(*, repetition_penalty: float | None = None,
                         prompt_logprobs: int | None = None, echo: bool | None = False) -> list[str]:
    """Names of the requested features that read prompt token values; empty: none do."""
    readers = []
    if repetition_penalty is not None and repetition_penalty != 1.0:
        readers.append("repetition_penalty")
    if prompt_logprobs is not None:
        readers.append("prompt_logprobs")
    if echo:
        readers.append("echo")
    return readers
