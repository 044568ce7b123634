"""`--load-format dummy`: a model from a config.json alone, with seeded random weights.

vLLM's name and meaning: the real shapes of a model (e.g. Llama-3-8B) with no checkpoint
read, so the engine can be measured where no checkpoint can be fetched. The spec is a folder
holding config.json, a path to a .json file, or the name of a config shipped in
splitserve/model/configs/ ("llama-3-8b", "tiny-llama"). The tokenizer is the folder's
tokenizer.json where there is one, else the bundled model's (as tiny-random's): token ids
past that tokenizer's vocabulary are fine, they decode to nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from splitserve.errors import ModelLoadError
from splitserve.model.config import ModelConfig
from splitserve.model.hf_loader import WeightsFn, config_from_hf, read_json, tokenizer_from_hf
from splitserve.model.random_weights import random_weights
from splitserve.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

CONFIGS_DIR = os.path.join(os.path.dirname(__file__), "configs")
SEED = 0


def shipped_configs() -> list[str]:
    return sorted(n.removesuffix(".json") for n in os.listdir(CONFIGS_DIR) if n.endswith(".json"))


def config_path(spec: str) -> str:
    """The config.json a dummy spec names; ModelLoadError naming what was expected if none."""
    shipped = os.path.join(CONFIGS_DIR, f"{spec.lower()}.json")
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise ModelLoadError(f"--load-format dummy: {spec} holds no config.json")
        return path
    if os.path.isfile(path) and path.endswith(".json"):
        return path
    if os.path.isfile(shipped):
        return shipped
    raise ModelLoadError(f"--load-format dummy: {spec!r} is not a folder holding config.json, "
                         f"a .json file, nor a shipped config ({', '.join(shipped_configs())})")


def _tokenizer(folder: str, config: ModelConfig) -> tuple[ModelConfig, Tokenizer]:
    """The folder's tokenizer, else the bundled model's, whose BOS/EOS then replace the
    config's (the config's ids mean other tokens, or none, in that tokenizer)."""
    if os.path.isfile(os.path.join(folder, "tokenizer.json")):
        return config, tokenizer_from_hf(folder, config)
    from splitserve.model.loader import bundled_gguf_path
    from splitserve.model.tiny import tiny_tokenizer
    tokenizer = tiny_tokenizer(bundled_gguf_path()).replace(name=config.name)
    if tokenizer.vocab_size > config.vocab_size:
        raise ModelLoadError(f"--load-format dummy: {folder} has no tokenizer.json and the "
                             f"bundled tokenizer's {tokenizer.vocab_size} tokens do not fit "
                             f"the config's vocab_size {config.vocab_size}")
    logger.info("dummy %s: no tokenizer.json beside its config; using the bundled model's "
                "tokenizer (%d of its %d token ids)", config.name, tokenizer.vocab_size,
                config.vocab_size)
    return dataclasses.replace(config, bos_token_id=tokenizer.bos_token_id,
                               eos_token_ids=tokenizer.eos_token_ids), tokenizer


def load_dummy(spec: str, seed: int = SEED) -> tuple[ModelConfig, Tokenizer, WeightsFn]:
    """(config, tokenizer, weights) with nothing read but the config and a tokenizer.
    weights() streams fresh random tensors (random_weights) on each call."""
    path = os.path.abspath(config_path(spec))
    folder = os.path.dirname(path)
    file = os.path.basename(path)
    name = os.path.basename(folder) if file == "config.json" else file.removesuffix(".json")
    config, tokenizer = _tokenizer(folder, config_from_hf(read_json(path), name, where=path))
    logger.info("dummy %s: %s, %d layers, hidden %d, random weights (seed %d), no checkpoint",
                name, config.architecture, config.num_layers, config.hidden_size, seed)
    return config, tokenizer, lambda: random_weights(config, seed)
