"""splitserve: disaggregated (prefill/decode) LLM serving."""

from splitserve.version import __version__

__all__ = ["__version__", "LLM", "SamplingParams", "PromptTokens", "RequestOutput", "CompletionOutput"]

_HOMES = {"LLM": "splitserve.llm", "RequestOutput": "splitserve.llm",
          "CompletionOutput": "splitserve.llm", "SamplingParams": "splitserve.sampling_params",
          "PromptTokens": "splitserve.tokens"}


def __getattr__(name: str):
    # Lazy, so `import splitserve.tokens` in a front-end process does not load the engine.
    if name in _HOMES:
        import importlib
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'splitserve' has no attribute {name!r}")
