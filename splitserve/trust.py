"""Who may call what over HTTP.

Public clients present the API key (`Authorization: Bearer <key>`) on the public routes
(/v1/*, /tokenize, /detokenize) when one is configured; /health and /metrics stay open,
as vLLM's do. Internal requests (the orchestrator's to its workers, a worker's
registration with an orchestrator, a fleet child's to its parent) carry a token in
`INTERNAL_HEADER`: only such a request may carry `disaggregated_params` (prefill only,
decode from a KV handle, resume after given tokens), and a worker takes it in place of the
API key (the orchestrator does not forward client keys).

The cluster's internal secret itself never crosses the wire. Every server process group
(a worker and its front-ends; an orchestrator fleet) makes a random instance id at start,
and holders of the secret derive from k = HMAC-SHA256(secret, "splitserve internal v1"):
- identity: `GET /health` carrying `CHALLENGE_HEADER: <nonce>` is answered with
  `IDENTITY_HEADER: <instance id> <HMAC(k, "identity|nonce|instance id")>`. Anyone may
  ask; the proof is bound to the asker's nonce, so it cannot be replayed.
- request token: HMAC(k, "request|instance id"), what an internal request to that
  instance carries. A token someone captured is good for that one instance only: a
  restarted worker has a new id, and a process squatting a dead worker's port cannot use
  it anywhere else.
- response proof: HMAC(k, "response|instance id") in `PROOF_HEADER`, on a worker's answer
  to a request whose token checked out (a public client never gets it): the orchestrator
  refuses an answer without it.
- member MAC: HMAC(k, "member\n" + key + "\n" + record), on a worker's record in etcd
  (protocol/membership.py): every orchestrator reading the members checks it, so only a
  holder of the secret adds a worker.

Comparisons are constant-time (hmac.compare_digest). Keys and tokens are compared as
UTF-8; a header that is not the exact bytes fails the check, it never passes it. Every
derived token and proof is registered with redact.py: no log line shows one. A server may
take several API keys (one per tenant): a presented key is compared with every one of
them, whichever matches, so the time taken does not say which.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from typing import Callable, NamedTuple

import msgspec

from splitserve.httpd.connections import Standing
from splitserve.protocol.openai import error_body
from splitserve.redact import sensitive

INTERNAL_HEADER = "X-Splitserve-Internal"
CHALLENGE_HEADER = "X-Splitserve-Challenge"
IDENTITY_HEADER = "X-Splitserve-Identity"
PROOF_HEADER = "X-Splitserve-Proof"
_NONCE = re.compile(r"[A-Za-z0-9_-]{16,128}")   # what a server takes as a challenge
_INSTANCE = re.compile(r"[0-9a-f]{32}")          # new_instance_id()'s shape
CHALLENGE = {"WWW-Authenticate": "Bearer"}
PUBLIC_PATHS = frozenset({"/tokenize", "/detokenize"})

MISSING_KEY = ("You didn't provide an API key. You need to provide your API key in an "
               "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
WRONG_KEY = "Incorrect API key provided."
NO_SECRET = ("disaggregated_params is only accepted on the cluster's internal requests, and "
             "this worker has no internal secret configured, so it accepts none")
NOT_INTERNAL = ("disaggregated_params is only accepted on the cluster's internal requests; "
                "this request does not carry the cluster's internal token for this server")


class NotInternal(Exception):
    """A request carries disaggregated_params without the internal token: 403."""


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


def new_instance_id() -> str:
    """A server process group's instance id: made once at its start, never reused."""
    return secrets.token_hex(16)


def new_challenge() -> str:
    """A fresh nonce for CHALLENGE_HEADER."""
    return secrets.token_urlsafe(24)


class Keys:
    """What holders of the cluster's internal secret derive from it (the module docstring
    says what each is for). Tokens and proofs are hex; the secret, each token and each
    proof are registered with redact.py as they are made."""

    __slots__ = ("_k",)

    def __init__(self, secret: str):
        sensitive(secret)
        self._k = hmac.new(secret.encode(), b"splitserve internal v1", hashlib.sha256).digest()

    def _mac(self, *parts: str) -> str:
        # "|" cannot occur in a nonce (_NONCE) or an instance id: the parts are unambiguous
        return hmac.new(self._k, "|".join(parts).encode(), hashlib.sha256).hexdigest()

    def identity(self, nonce: str, instance: str) -> str:
        """IDENTITY_HEADER's value: instance's answer to the challenge `nonce`."""
        return f"{instance} {self._mac('identity', nonce, instance)}"

    def verify(self, nonce: str, answer: str | None) -> str | None:
        """The instance id that IDENTITY_HEADER's value `answer` proves for our `nonce`;
        None if it proves nothing (absent, malformed, another nonce, another secret)."""
        instance, _, mac = (answer or "").partition(" ")
        if not _INSTANCE.fullmatch(instance):
            return None
        expected = self._mac("identity", nonce, instance)
        return instance if _equal(mac, expected) else None

    def token(self, instance: str) -> str:
        """INTERNAL_HEADER's value on a request to `instance`."""
        return sensitive(self._mac("request", instance))

    def proof(self, instance: str) -> str:
        """PROOF_HEADER's value on `instance`'s answers to internal requests."""
        return sensitive(self._mac("response", instance))


    def member_mac(self, record: bytes) -> str:
        """The MAC of a member's record in etcd (protocol/membership.py): bytes after a
        fixed tag, so no other derived value can collide with it."""
        return hmac.new(self._k, b"member\n" + record, hashlib.sha256).hexdigest()

    def member_mac_ok(self, record: bytes, mac: str) -> bool:
        return _equal(mac, self.member_mac(record))


def proven(answer: str | None, proof: str) -> bool:
    """Whether PROOF_HEADER's value `answer` is `proof` (constant time)."""
    return answer is not None and _equal(answer, proof)


def _equal(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode("utf-8", "replace"), expected.encode())


class Gate:
    """A server's checks: its API keys (none: open) and, from the cluster's internal secret
    (None: no internal request is accepted), the token internal requests to this instance
    carry, its answers to challenges and the proof its internal answers carry."""

    __slots__ = ("api_keys", "keys", "instance", "token", "proof")

    def __init__(self, api_key: str | tuple[str, ...] | None, internal_secret: str | None,
                 instance: str | None = None):
        """instance: the process group's id (new_instance_id(); one is made if None)."""
        self.api_keys = tuple(k.encode() for k in api_keys(api_key))
        self.keys = Keys(internal_secret) if internal_secret else None
        self.instance = instance or new_instance_id()
        self.token = self.keys.token(self.instance).encode() if self.keys else None
        self.proof = self.keys.proof(self.instance) if self.keys else None

    def internal(self, header: Callable[[str], str | None]) -> bool:
        """The request carries this instance's token (header(name) reads a header)."""
        return self.token is not None and _same(header(INTERNAL_HEADER), self.token)

    def identity(self, header: Callable[[str], str | None]) -> dict[str, str] | None:
        """The headers that answer a request's challenge (GET /health); None without one."""
        nonce = header(CHALLENGE_HEADER)
        if self.keys is None or nonce is None or not _NONCE.fullmatch(nonce):
            return None
        return {IDENTITY_HEADER: self.keys.identity(nonce, self.instance)}

    def proven(self, header: Callable[[str], str | None],
               headers: dict[str, str] | None) -> dict[str, str] | None:
        """An answer's headers, with the response proof if the request's token checked out."""
        if not self.internal(header):
            return headers
        return {**headers, PROOF_HEADER: self.proof} if headers else {PROOF_HEADER: self.proof}

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
        """401 for a public route without an API key (or, accept_internal, the token)."""
        if not self.api_keys or not is_public(path):
            return None
        if self._key(header) is not None:
            return None
        if accept_internal and self.internal(header):
            return None
        return unauthorized(header("Authorization"))

    def standing(self, header: Callable[[str], str | None]) -> Standing:
        """What a request shows of its sender, for the connection limits (httpd's
        connections.py): the internal token, the API key (any request when none is set),
        or nothing (an open route such as /health without the key)."""
        if self.internal(header):
            return Standing.INTERNAL
        if not self.api_keys or self._key(header) is not None:
            return Standing.CLIENT
        return Standing.UNPROVEN

    def body_refusal(self, header: Callable[[str], str | None], body: bytes) -> Refusal | None:
        """A worker's check of a body, before anything of it is acted on (the key was
        checked with the head): disaggregated_params only with the internal token."""
        # the token first: the orchestrator's requests skip parsing the body for the field
        if body and not self.internal(header) and carries_disaggregated_params(body):
            return forbidden(self.token is not None)
        return None
