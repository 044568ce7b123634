"""The X-Request-Id a request is known by in every log line and on every hop.

A client's own id is kept when it is short and plain (at most MAX_LENGTH characters of
letters, digits and `-_.:`), so it can be echoed in a header and written to a log as is;
any other value, and a missing one, is replaced by a new id. The answer always carries the
id used, so a client whose id was replaced sees which one its request had.
"""

from __future__ import annotations

import os
import re

HEADER = "X-Request-Id"
MAX_LENGTH = 128
_PLAIN = re.compile(r"[A-Za-z0-9_.:\-]{1,%d}" % MAX_LENGTH)


def new_request_id() -> str:
    return os.urandom(16).hex()


def request_id(sent: str | None) -> str:
    """The id a request carrying `sent` (its X-Request-Id, or None) is known by."""
    if sent is not None and _PLAIN.fullmatch(sent):
        return sent
    return new_request_id()
