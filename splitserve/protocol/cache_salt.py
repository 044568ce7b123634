"""cache_salt (vLLM's request field) and cache isolation by API key: which salt a request's
prefix-cache blocks are hashed with (protocol/block_hashes.salted_root).

Prefix caching tells a client how much of its prompt someone already sent: `cached_tokens`
in the usage, and a shorter time to first token. Two requests share cached blocks only if
they hash with the same salt, so a salt known only to one tenant closes that channel
between tenants (docs/security.md).

- isolation `none` (the default): the salt is the client's own `cache_salt`, if any.
- isolation `api_key`: the salt is derived from the API key the client presented, keyed by
  a server-side secret (HMAC-SHA256), and the client's own `cache_salt` if any: no client
  can compute another tenant's salt, nor share blocks with a tenant of another key.

Whoever sees the client's key derives it: the orchestrator (which relays the effective
salt to its workers in the `cache_salt` of the bodies it sends them), or a worker serving
a public client directly. An internal request's `cache_salt` is already effective: it is
taken as it is."""

from __future__ import annotations

import hashlib
import hmac
import secrets

from splitserve.errors import InvalidRequestError

ISOLATION_MODES = ("none", "api_key")
# Far above a salt's useful size (vLLM suggests 43 base64 characters, 256 bits); it is
# hashed on the event loop and travels in every body sent to a worker.
MAX_CACHE_SALT_CHARS = 1024
_DOMAIN = b"splitserve cache_salt by api_key v1\0"


def check_cache_salt(value) -> None:
    """A cache_salt is absent (None) or a non-empty string of at most MAX_CACHE_SALT_CHARS
    characters; else 400 naming it (never echoing it)."""
    if value is None:
        return
    if not isinstance(value, str) or not value:
        raise InvalidRequestError("cache_salt must be a non-empty string if provided",
                                  "cache_salt")
    if len(value) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequestError(f"cache_salt must be at most {MAX_CACHE_SALT_CHARS} "
                                  f"characters", "cache_salt")


def check_isolation(mode: str, api_keys: tuple[str, ...]) -> None:
    """A server's cache_isolation setting: a known mode; api_key needs keys to isolate by."""
    if mode not in ISOLATION_MODES:
        raise ValueError(f"cache_isolation must be one of {', '.join(ISOLATION_MODES)}, "
                         f"got {mode!r}")
    if mode == "api_key" and not api_keys:
        raise ValueError("cache_isolation api_key needs API keys (--api-key, "
                         "$SPLITSERVE_API_KEY, or api_key in the cluster file)")


class CacheIsolation:
    """A server's rule for a request's effective salt. secret: what keys the derivation (the
    cluster's internal secret, so the orchestrator and its workers derive alike); never
    logged, never sent."""

    __slots__ = ("mode", "_secret")

    def __init__(self, mode: str, secret: bytes):
        self.mode, self._secret = mode, secret

    def salt(self, client_salt: str | None, api_key: str | None) -> str | None:
        """The salt to hash with. api_key: the configured key the request presented (None:
        an internal request, whose salt is already effective, or an open server)."""
        if self.mode == "none" or api_key is None:
            return client_salt
        key = api_key.encode("utf-8", "surrogateescape")
        # Length-prefixed key, then a flag: (key, salt) pairs never run into each other.
        msg = [_DOMAIN, len(key).to_bytes(4, "little"), key]
        if client_salt is not None:
            msg += [b"\1", client_salt.encode("utf-8", "surrogatepass")]
        return "key:" + hmac.new(self._secret, b"".join(msg), hashlib.sha256).hexdigest()


def derivation_key(internal_secret: str | None) -> bytes:
    """What keys CacheIsolation: the internal secret, which the orchestrator and its workers
    share; a worker without one draws its own (its tenants stay apart, but their blocks are
    shared only within this process's life)."""
    return internal_secret.encode() if internal_secret else secrets.token_bytes(32)
