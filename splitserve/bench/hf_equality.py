"""Greedy equality with Hugging Face transformers, token for token, same weights in both.

The engine serves a model (tiny-random, or a `--load-format dummy` config) through LLM with
prefill split into several chunks, a prefix already cached and a batch of several prompts;
transformers' LlamaForCausalLM, given the very tensors ModelSource.weights() streams,
recomputes each prompt alone with no cache. Both run in float32: in bfloat16 two top logits
can tie exactly and either pick is right. Used by tests/test_hf_equality.py and the GPU check.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import numpy as np

PREFIX_LEN, TAIL_LEN, CHUNK = 48, 24, 16    # a prompt = shared prefix + own tail: 5 chunks


@dataclass(frozen=True)
class Equality:
    model: str
    prompts: int
    tokens: int            # generated per prompt
    equal: int             # prompts whose every token matched
    first_mismatch: str    # "" when all match

    def line(self) -> str:
        verdict = "EQUAL" if self.equal == self.prompts else f"DIFFER ({self.first_mismatch})"
        return (f"{self.model}: {self.equal}/{self.prompts} prompts x {self.tokens} greedy "
                f"tokens equal to transformers: {verdict}")


def hf_model(source, device: str):
    """transformers' LlamaForCausalLM (float32, on `device`) holding source's weights."""
    import transformers
    from splitserve.model.hf_loader import config_to_hf
    hf = config_to_hf(source.config)
    config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    missing, unexpected = model.load_state_dict(dict(source.weights()), strict=False)
    # A tied lm_head is the embedding itself: the only weight the stream leaves out.
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.to(device).eval()


def hf_greedy(model, prompt: list[int], max_tokens: int, device: str) -> list[int]:
    import torch
    ids = torch.tensor([prompt], device=device)
    with torch.inference_mode():
        for _ in range(max_tokens):
            nxt = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist()


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """n prompts sharing a PREFIX_LEN-token prefix (ids >= 3: past the special tokens)."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, vocab, PREFIX_LEN).tolist()
    return [prefix + rng.integers(3, vocab, TAIL_LEN).tolist() for _ in range(n)]


def engine_greedy(model: str, load_format: str, device: str, batch: list[list[int]],
                  max_tokens: int) -> list[list[int]]:
    """The first prompt alone (its blocks cached), then the whole batch at once, chunked."""
    from splitserve import LLM, SamplingParams
    kwargs = {"device": device} if "device" in inspect.signature(LLM).parameters else {}
    llm = LLM(model, load_format=load_format, dtype="float32", max_num_batched_tokens=CHUNK,
              num_blocks=256, block_size=16, seed=0, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([batch[0]], params)
    return [list(o.outputs[0].token_ids) for o in llm.generate(batch, params)]


def check(model: str, load_format: str = "auto", device: str = "cpu", n: int = 4,
          max_tokens: int = 12) -> Equality:
    from splitserve.model.loader import load_model_source
    source = load_model_source(model, load_format)
    batch = prompts(n, min(source.config.vocab_size, source.tokenizer.vocab_size))
    ours = engine_greedy(model, load_format, device, batch, max_tokens)
    hf = hf_model(source, device)
    theirs = [hf_greedy(hf, p, max_tokens, device) for p in batch]
    bad = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    first = f"prompt {bad[0]}: ours {ours[bad[0]]} vs {theirs[bad[0]]}" if bad else ""
    return Equality(source.config.name, n, max_tokens, n - len(bad), first)
