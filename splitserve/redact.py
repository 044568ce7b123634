"""No log line shows the cluster's internal secret or a value derived from it.

Code that logs an error logs its type and `str`, never a repr that may carry request
headers (an aiohttp error's repr holds its RequestInfo, headers included). This is the
backstop: every value that must not be logged is registered here (`sensitive`:
trust.Keys registers the secret and each token and proof it derives), and a filter on
the root logger's handlers replaces any whole occurrence of one, in the formatted
message and in the exception and stack text, with MARKER. Every process installs it
where it sets up logging (cli.py, a front-end process, an engine process).
"""

from __future__ import annotations

import logging
import re

MARKER = "[redacted]"
# The values to hide, oldest first. An orchestrator derives a token and a proof per
# worker instance it verifies (restarts make new ones): bounded, the oldest go first.
MAX_VALUES = 4096
_values: dict[str, None] = {}
_pattern: list[re.Pattern | None] = [None]   # rebuilt after a change, on the next use
_TOKEN_CHARS = r"A-Za-z0-9_\-"                # what secrets and tokens are made of


def sensitive(value: str | None) -> str | None:
    """Register `value` as never to be logged; returns it."""
    if value and value not in _values:
        _values[value] = None
        if len(_values) > MAX_VALUES:
            del _values[next(iter(_values))]
        _pattern[0] = None
    return value


def redact(text: str) -> str:
    """text with every registered value replaced by MARKER."""
    if not _values or not text:
        return text
    pattern = _pattern[0]
    if pattern is None:
        # longest first: a value that contains another is replaced whole
        values = sorted(tuple(_values), key=len, reverse=True)
        # Whole values only: a secret or token stands between quotes, spaces or
        # punctuation wherever it is written, and a short test secret ("s") must not
        # redact every word that holds its letters.
        pattern = _pattern[0] = re.compile(
            rf"(?<![{_TOKEN_CHARS}])(?:{'|'.join(map(re.escape, values))})(?![{_TOKEN_CHARS}])")
    return pattern.sub(MARKER, text)


class RedactingFilter(logging.Filter):
    """Rewrites a record whose message, exception or stack text holds a registered value."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not _values:
            return True
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


def install(*secrets: str | None) -> None:
    """The filter on every handler of the root logger (call after logging.basicConfig);
    `secrets` registered too."""
    for secret in secrets:
        sensitive(secret)
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
