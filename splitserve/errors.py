"""Exception types. User-facing errors carry the offending parameter's name so the HTTP
layer can turn them into an OpenAI-style 400 body without guessing."""


class SplitserveError(Exception):
    """Base class for every error splitserve raises on purpose."""


class InvalidRequestError(SplitserveError, ValueError):
    """The caller sent something we cannot serve: a bad parameter, a prompt too long, ..."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class ModelLoadError(SplitserveError):
    """A model path that does not exist, or an architecture / file we cannot load."""


class PlaceholderReadError(SplitserveError, RuntimeError):
    """Something read the token values of a length-only prompt. Always a bug in the guard
    that decided the request never reads prompt values: fail loudly, never guess."""
