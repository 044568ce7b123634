"""Tokenizer: text <-> int32 token ids, plus the model's chat template.

A thin wrapper over a `tokenizers.Tokenizer` (Rust), whatever file it was built from (a
GGUF's metadata or a Hugging Face `tokenizer.json`). BOS handling lives here, not in the
wrapped tokenizer's post-processor, so "add BOS exactly once" has one owner.

Thread-safety: encode/decode are called from a thread pool. The wrapped tokenizer is never
mutated after construction (no enable_truncation/padding calls), which is what keeps its
Rust-side borrows from conflicting between threads.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence

import jinja2
import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from splitserve.errors import InvalidRequestError, ModelLoadError
from splitserve.model.chat_template import render_chat_template

logger = logging.getLogger(__name__)

# What a user-supplied message list can make a template raise besides TemplateError: a
# missing key concatenated with a string, `None + str`, indexing an empty list, ...
_RENDER_ERRORS = (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError)

# GGUF token_type values (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4
# Split patterns of the BPE pre-tokenizers llama.cpp names in `tokenizer.ggml.pre`.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = _QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")


class Tokenizer:
    def __init__(self, tk: tokenizers.Tokenizer, *, bos_token_id: int | None,
                 eos_token_ids: tuple[int, ...], chat_template: str | None, add_bos: bool,
                 name: str):
        if add_bos and bos_token_id is None:
            raise ModelLoadError(f"tokenizer {name!r}: add_bos is set but there is no BOS token")
        self._tk = tk
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(int(i) for i in eos_token_ids)
        self.chat_template = chat_template
        self.add_bos = add_bos
        self.name = name
        special = {i for i, t in tk.get_added_tokens_decoder().items() if t.special}
        special.update(self.eos_token_ids)
        if bos_token_id is not None:
            special.add(bos_token_id)
        self._special_ids = frozenset(special)
        # The longest token's text (as the vocabulary spells it: a byte-level BPE one char
        # per byte, a byte-fallback piece 6 chars for 1 byte): no token covers more of the
        # normalized text than this.
        self.max_token_chars = max(map(len, tk.get_vocab(with_added_tokens=True)), default=1)

    def replace(self, **changes) -> Tokenizer:
        """A copy with some constructor keywords changed, sharing the (immutable) backend."""
        kwargs = dict(bos_token_id=self.bos_token_id, eos_token_ids=self.eos_token_ids,
                      chat_template=self.chat_template, add_bos=self.add_bos, name=self.name)
        kwargs.update(changes)
        return Tokenizer(self._tk, **kwargs)

    def to_json(self) -> str:
        """The wrapped tokenizer as tokenizer.json text (what grammar compilers read)."""
        return self._tk.to_str()

    # -- ids ----------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> np.ndarray:
        """int32 ids (1-D). Special-token text such as "<|im_start|>" always maps to its
        single id; `add_special_tokens` only controls the BOS prefix."""
        # encode_batch, not encode: it lets go of the GIL while it runs (encode holds it
        # throughout), so tokenizing in a thread leaves the caller's event loop running.
        ids = self._tk.encode_batch([text], add_special_tokens=False)[0].ids
        if (add_special_tokens and self.add_bos
                and (not ids or ids[0] != self.bos_token_id)):
            ids.insert(0, self.bos_token_id)
        return np.asarray(ids, dtype=np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray, skip_special_tokens: bool = True) -> str:
        if isinstance(ids, np.ndarray):
            ids = ids.tolist()
        return self._tk.decode(ids, skip_special_tokens=skip_special_tokens)

    def surely_too_long(self, text: str, max_tokens: int) -> bool:
        """Whether text surely encodes to more than max_tokens tokens, found without
        encoding it (which takes ~150x the text's size in memory): each token covers at
        most max_token_chars characters of the normalized text. O(len(text)) at most (a
        normalizer's copy, for a text past the bound only). Characters the vocabulary has
        no token for are dropped by encode (tests/model/test_tokenizer.py), yet count here: a
        text padded with them is refused."""
        limit = max_tokens * self.max_token_chars
        if len(text) <= limit:
            return False
        normalizer = self._tk.normalizer
        return normalizer is None or len(normalizer.normalize_str(text)) > limit

    @property
    def vocab_size(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> frozenset[int]:
        return self._special_ids

    def id_to_token(self, i: int) -> str | None:
        return self._tk.id_to_token(int(i))

    def token_to_id(self, s: str) -> int | None:
        return self._tk.token_to_id(s)

    # -- chat ---------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools=None, **kwargs) -> str:
        if not self.chat_template:
            raise InvalidRequestError(
                f"model {self.name!r} has no chat template; use the completions API with a "
                "plain prompt", param="messages")
        context = dict(add_generation_prompt=add_generation_prompt, tools=tools,
                       bos_token=self._token_text(self.bos_token_id),
                       eos_token=self._token_text(self._first_eos()))
        context.update(kwargs)
        try:
            return render_chat_template(self.chat_template, messages, **context)
        except _RENDER_ERRORS as exc:
            raise InvalidRequestError(f"chat template could not render these messages: {exc}",
                                      param="messages") from None

    def _first_eos(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def _token_text(self, i: int | None) -> str:
        return "" if i is None else (self._tk.id_to_token(i) or "")

    # -- export -------------------------------------------------------------------------
    def save_hf(self, folder: str) -> None:
        """Write tokenizer.json and tokenizer_config.json so a Hugging Face folder (and our
        hf_loader) rebuilds the same ids, special tokens and template."""
        os.makedirs(folder, exist_ok=True)
        self._tk.save(os.path.join(folder, "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": self.add_bos,
            "bos_token": self._token_text(self.bos_token_id) or None,
            "eos_token": self._token_text(self._first_eos()) or None,
            "chat_template": self.chat_template,
        }
        with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, ensure_ascii=False, indent=2)

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab={self.vocab_size}, add_bos={self.add_bos})"


# -- building from GGUF metadata ----------------------------------------------------------
def _gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    if pre in ("default", "gpt-2", "gpt2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    patterns = {"qwen2": _QWEN2_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT}
    if pre in patterns:
        split = pre_tokenizers.Split(Regex(patterns[pre]), behavior="isolated")
        return pre_tokenizers.Sequence([split, byte_level])
    raise ModelLoadError(f"GGUF BPE pre-tokenizer {pre!r} is not supported; supported: "
                         "smollm, gpt-2, qwen2, llama-bpe")


def tokenizer_from_gguf_metadata(md: dict, name: str) -> Tokenizer:
    """Rebuild a byte-level BPE `tokenizers.Tokenizer` from `tokenizer.ggml.*` keys."""
    if md.get("tokenizer.ggml.model") != "gpt2":
        raise ModelLoadError(f"GGUF tokenizer model {md.get('tokenizer.ggml.model')!r} is "
                             "not supported; only byte-level BPE ('gpt2') is")
    tokens = md["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in md["tokenizer.ggml.merges"]]
    tk = tokenizers.Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tk.pre_tokenizer = _gguf_pre_tokenizer(md.get("tokenizer.ggml.pre", "default"))
    tk.decoder = decoders.ByteLevel()
    # Control tokens must be matched whole before BPE runs, or "<|im_start|>" would be
    # split into "<", "|", ... pieces.
    types = md.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    tk.add_tokens([AddedToken(tokens[i], special=t == _CONTROL, normalized=False)
                   for i, t in enumerate(types) if t in (_CONTROL, _USER_DEFINED)])
    eos = [md[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
           if k in md]
    return Tokenizer(tk, bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
                     eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos)),
                     chat_template=md.get("tokenizer.chat_template"),
                     add_bos=bool(md.get("tokenizer.ggml.add_bos_token", False)), name=name)
