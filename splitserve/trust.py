"""Who may call what over HTTP.

Public clients present the API key (`Authorization: Bearer <key>`) on the public routes
(/v1/*, /tokenize, /detokenize) when one is configured; /health and /metrics stay open,
as vLLM's do. The orchestrator's requests to its workers carry the cluster's internal
secret in `INTERNAL_HEADER`: only such a request may carry `disaggregated_params` (prefill
only, decode from a KV handle, resume after given tokens), and a worker takes it in place
of the API key (the orchestrator does not forward client keys).

Both comparisons are constant-time (hmac.compare_digest). Keys and secrets are compared as
UTF-8; a header that is not the exact bytes fails the check, it never passes it. A server
may take several API keys (one per tenant): a presented key is compared with every one of
them, whichever matches, so the time taken does not say which.
"""

from __future__ import annotations

import hmac
from typing import Callable, NamedTuple

import msgspec

from splitserve.httpd.connections import Standing
from splitserve.protocol.openai import error_body

INTERNAL_HEADER = "X-Splitserve-Internal-Secret"
CHALLENGE = {"WWW-Authenticate": "Bearer"}
PUBLIC_PATHS = frozenset({"/tokenize", "/detokenize"})

MISSING_KEY = ("You didn't provide an API key. You need to provide your API key in an "
               "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
WRONG_KEY = "Incorrect API key provided."
NO_SECRET = ("disaggregated_params is only accepted on the cluster's internal requests, and "
             "this worker has no internal secret configured, so it accepts none")
NOT_INTERNAL = ("disaggregated_params is only accepted on the cluster's internal requests; "
                "this request does not carry the cluster's internal secret")


class NotInternal(Exception):
    """A request carries disaggregated_params without the internal secret: 403."""


class Refusal(NamedTuple):
    """An answer to send instead of serving the request: status, OpenAI error body, headers."""
    status: int
    body: bytes
    headers: dict[str, str] | None


def is_public(path: str) -> bool:
    return path.startswith("/v1/") or path in PUBLIC_PATHS


def _same(given: str | None, expected: bytes | None) -> bool:
    if given is None or expected is None:
        return False
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), expected)


def bearer_token(authorization: str | None) -> str | None:
    """The token of `Authorization: Bearer <token>` (the scheme in any case), else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def unauthorized(authorization: str | None) -> Refusal:
    """401 as OpenAI answers it: the key is missing or wrong (never echoed back)."""
    message = WRONG_KEY if bearer_token(authorization) else MISSING_KEY
    return Refusal(401, error_body(message, "invalid_request_error", None, "invalid_api_key"),
                   CHALLENGE)


def forbidden(has_secret: bool) -> Refusal:
    """403: a public client sent what only the orchestrator may send."""
    return Refusal(403, error_body(NOT_INTERNAL if has_secret else NO_SECRET,
                                   "invalid_request_error", "disaggregated_params"), None)


class _Probe(msgspec.Struct):
    disaggregated_params: msgspec.Raw = msgspec.Raw(b"null")


_probe = msgspec.json.Decoder(_Probe)


def carries_disaggregated_params(body: bytes) -> bool:
    """Whether a JSON body sets disaggregated_params (to anything but null), under any
    spelling JSON allows for the name. The body is parsed for that one field, the others
    skipped (faster than searching the bytes for the name). A body that is not a JSON
    object, or nests too deeply to parse, does not carry it: the handler refuses it with a
    400."""
    try:
        return bytes(_probe.decode(body).disaggregated_params) != b"null"
    except (msgspec.DecodeError, RecursionError):
        return False


def api_keys(value) -> tuple[str, ...]:
    """A server's API keys from a configuration value: None (open), one key, or several."""
    keys = (value,) if isinstance(value, str) else value or ()
    if not isinstance(keys, (list, tuple)) or not all(isinstance(k, str) and k for k in keys):
        raise ValueError("api_key must be a non-empty string or a list of them")
    return tuple(keys)


class Gate:
    """A server's checks: its API keys (none: open) and the cluster's internal secret (None:
    no internal request is accepted)."""

    __slots__ = ("api_keys", "secret")

    def __init__(self, api_key: str | tuple[str, ...] | None, internal_secret: str | None):
        self.api_keys = tuple(k.encode() for k in api_keys(api_key))
        self.secret = internal_secret.encode() if internal_secret else None

    def internal(self, header: Callable[[str], str | None]) -> bool:
        """The request carries the cluster's internal secret (header(name) reads a header)."""
        return self.secret is not None and _same(header(INTERNAL_HEADER), self.secret)

    def _key(self, header: Callable[[str], str | None]) -> str | None:
        """The configured API key the request presents, else None. Every key is compared."""
        given, found = bearer_token(header("Authorization")), None
        for key in self.api_keys:
            if _same(given, key):
                found = given
        return found

    def tenant(self, header: Callable[[str], str | None]) -> str | None:
        """The API key a public client presented (whose cache it may share,
        protocol/cache_salt.py); None for an internal request or an open server."""
        if not self.api_keys or self.internal(header):
            return None
        return self._key(header)

    def key_refusal(self, path: str, header: Callable[[str], str | None],
                    accept_internal: bool = False) -> Refusal | None:
        """401 for a public route without an API key (or, accept_internal, the secret)."""
        if not self.api_keys or not is_public(path):
            return None
        if self._key(header) is not None:
            return None
        if accept_internal and self.internal(header):
            return None
        return unauthorized(header("Authorization"))

    def standing(self, header: Callable[[str], str | None]) -> Standing:
        """What a request shows of its sender, for the connection limits (httpd's
        connections.py): the internal secret, the API key (any request when none is set),
        or nothing (an open route such as /health without the key)."""
        if self.internal(header):
            return Standing.INTERNAL
        if not self.api_keys or self._key(header) is not None:
            return Standing.CLIENT
        return Standing.UNPROVEN

    def body_refusal(self, header: Callable[[str], str | None], body: bytes) -> Refusal | None:
        """A worker's check of a body, before anything of it is acted on (the key was
        checked with the head): disaggregated_params only with the internal secret."""
        # the secret first: the orchestrator's requests skip parsing the body for the field
        if body and not self.internal(header) and carries_disaggregated_params(body):
            return forbidden(self.secret is not None)
        return None
