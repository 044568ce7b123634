"""The models the GPU check serves, as folders built from config files and one tokenizer.

The bundled model file cannot travel to the GPU machine, and tiny-random borrows its
tokenizer from it. So `prepare(out)` (run where the bundled model is installed, by
scripts/gpu_wheels.sh) writes that tokenizer and tiny-random's config beside the wheels, and
`assemble(prepared, work)` (run there) makes one folder per model: a config.json and the
tokenizer. `--load-format dummy` of the tiny-random folder is tiny-random itself: the same
config and the same seeded weights (model/random_weights.py).
"""

from __future__ import annotations

import json
import os
import shutil

from splitserve.model.dummy import CONFIGS_DIR

TOKENIZER, TINY_CONFIG = "tokenizer", "tiny-random.json"
MODELS = {"tiny-random": None, "tiny-llama": "tiny-llama.json", "llama-3-8b": "llama-3-8b.json"}


def prepare(out: str) -> None:
    from splitserve.model.hf_loader import config_to_hf
    from splitserve.model.loader import load_model_source
    tiny = load_model_source("tiny-random")
    tiny.tokenizer.save_hf(os.path.join(out, TOKENIZER))
    with open(os.path.join(out, TINY_CONFIG), "w", encoding="utf-8") as f:
        json.dump(config_to_hf(tiny.config), f, indent=2)


def assemble(prepared: str, work: str) -> dict[str, str]:
    """Model name -> its folder under work (config.json + the prepared tokenizer files)."""
    folders = {}
    for name, shipped in MODELS.items():
        src = os.path.join(CONFIGS_DIR, shipped) if shipped else os.path.join(prepared, TINY_CONFIG)
        folder = folders[name] = os.path.join(work, name)
        shutil.copytree(os.path.join(prepared, TOKENIZER), folder, dirs_exist_ok=True)
        shutil.copyfile(src, os.path.join(folder, "config.json"))
    return folders


if __name__ == "__main__":
    import sys
    prepare(sys.argv[1])
