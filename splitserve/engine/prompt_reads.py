"""The guardrail of length-only relay: every feature of this engine that reads prompt token
values, in one place.

A generation worker may receive only a prompt's length (token relay mode `metadata`): its
KV arrives from the context worker, and decoding needs only the generated tokens. Per
request, these read the prompt's values:

- repetition_penalty != 1: penalizes tokens present in the prompt (sampler.py);
- prompt_logprobs: scores every prompt token (runner.py / sampler.py);
- echo (completions): returns the prompt text and, with logprobs, its tokens.

For such a request the prompt's int32 ids ride the KV pull (engine/disagg.py): the
context worker's lease keeps them, the pull thread checks them against the KV handle's
prompt digest, and they replace the placeholder before the request decodes; echo gets them
back in its first delta as raw bytes. So no relay mode puts the prompt on the generation
worker's event loop. prompt_logprobs alone cannot be served that way (the prompt must be
computed where its logprobs are wanted): the orchestrator runs it aggregated.

Inside the engine, whatever the request asks:

- prefix caching keys blocks by chained hashes of token values: a length-only prompt uses
  the hashes the context worker sent with its KV handle (of its full blocks) to find
  blocks it need not pull, and files the pulled blocks under them (block_manager.py);
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


def reads_prompt(params, prompt_back: bool = False) -> bool:
    """Does a generation_only request read its prompt's values (its sampling params, or the
    front-end, prompt_back: echo)? Then a length-only prompt's ids come with its KV."""
    return prompt_back or bool(prompt_value_readers(
        repetition_penalty=params.repetition_penalty, prompt_logprobs=params.prompt_logprobs))
