"""A request's prompt as the workers will tokenize it, for deciding where it is prefilled
(orchestrator/decide.py) and for KV-aware routing (its block hashes).

Counting is kept off the event loop: `upper_bound` answers from what the body already
shows (a token-id prompt's length; a text prompt's UTF-8 byte count), and `token_ids` (the
worker's own tokenizer and chat template, so the same ids and the same block hashes) is
meant to run in a thread. The tokenizer comes from the cluster's `model:` (the workers'
model): without one, only the bound is known and chat prompts are not counted at all."""

from __future__ import annotations

import numpy as np

from splitserve.model.loader import load_model_source
from splitserve.protocol.block_hashes import chain_hashes
from splitserve.protocol.openai_requests import convert_chat_request
from splitserve.protocol.prompts import chat_prompt, encode_prompt, with_template_file

# A byte-level BPE turns each byte into at most one token; a BOS, and a SentencePiece-style
# leading-space piece, may add one each: a text prompt of B bytes is at most B + 2 tokens.
SPECIAL_TOKENS_BOUND = 2
# What a chat request's prompt is made of (protocol/prompts.chat_prompt)
_CHAT_FIELDS = ("messages", "add_generation_prompt", "continue_final_message",
                "chat_template", "chat_template_kwargs", "add_special_tokens", "tools",
                "tool_choice")


def text_bound(text: str) -> int:
    """At least as many tokens as the worker's tokenizer makes of text."""
    return len(text.encode("utf-8", "surrogatepass")) + SPECIAL_TOKENS_BOUND


def single_prompt(body: dict):
    """A completion body's one prompt (str or list of ids), else None (chat, a batch)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                   and isinstance(prompt[0], int)):
        return prompt
    return None


class PromptTokenizer:
    """The workers' tokenizer (model: a name or path load_model_source takes; None: none),
    with their chat template file if they have one (chat_template: its path)."""

    def __init__(self, model: str | None, load_format: str = "auto",
                 chat_template: str | None = None):
        source = load_model_source(model, load_format) if model else None
        self.tokenizer = with_template_file(source.tokenizer, chat_template) if source else None
        # No worker's context is longer: a text surely past it is not encoded here (the
        # worker refuses it before encoding too).
        self.max_tokens = source.config.max_position_embeddings if source else 0

    @staticmethod
    def surely_within(body: dict, limit: int) -> bool:
        """The prompt has at most `limit` tokens, known without tokenizing: a token-id
        prompt by its length, a text prompt by text_bound. At most O(limit) work: a text of
        more characters than that has more bytes too, and is not encoded to find out."""
        prompt = single_prompt(body)
        if isinstance(prompt, str):
            return len(prompt) + SPECIAL_TOKENS_BOUND <= limit and text_bound(prompt) <= limit
        return prompt is not None and len(prompt) <= limit

    def token_ids(self, body: dict) -> np.ndarray | None:
        """The prompt's token ids as the worker computes them (blocking: run it in a
        thread); None if that needs a tokenizer there is not, or the prompt is not one the
        worker would take (its 400 says why, not ours)."""
        prompt = single_prompt(body)
        try:
            if isinstance(prompt, list):
                return np.asarray(prompt, dtype=np.int32)
            if self.tokenizer is None:
                return None
            if isinstance(prompt, str):
                return encode_prompt(self.tokenizer, prompt, self.max_tokens, "prompt",
                                     body.get("add_special_tokens") is not False).array
            if "messages" not in body or "prompt" in body:
                return None
            chat = convert_chat_request({k: body[k] for k in _CHAT_FIELDS if k in body})
            return chat_prompt(self.tokenizer, chat, self.max_tokens)[1].array
        except Exception:   # bad ids, a template that raises, a text past any context: the
            return None     # worker's 400 says why


def block_hashes(ids: np.ndarray, block_sizes, root: bytes = b"") -> dict[int, list[bytes]]:
    """The chained hashes of the prompt's full blocks, per block size, from root (the
    request's protocol/block_hashes.salted_root: a worker hashes with its salt too). A
    request's last token is always computed (engine/block_manager.find_cached_prefix), so
    its block counts only if another token follows it: the same blocks a worker could reuse."""
    usable = ids[:max(len(ids) - 1, 0)]
    return {bs: chain_hashes(root, usable, bs) for bs in block_sizes}
