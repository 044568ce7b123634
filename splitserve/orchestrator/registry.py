"""Workers that come and go: the registry of workers that joined at run time, and its
HTTP API (internal: only requests carrying this orchestrator's internal token, trust.py).

    POST /internal/workers          {"role": "context"|"generation", "url": ..., "ttl": s}
                                    join, or renew the lease (a heartbeat)
    POST /internal/workers/remove   {"url": ...}  leave (DELETE /internal/workers too)
    POST /internal/workers/role     {"url": ..., "role": ...}  move a member to the other
                                    pool (splitserve/planner/): its heartbeats keep the
                                    role they say, the pools follow the assignment until
                                    it leaves
    GET  /internal/workers          the members

Every answer is the member list, {"object": "list", "data": [{"role", "registered_role",
"url", "ttl", "expires_in"}, ...]} (role: the pool it is in; registered_role: what its
heartbeats say); a bad body is a 400 with an OpenAI error body naming the field.

A member leaves when its lease lapses (no heartbeat for `ttl` seconds) or after failing its
health checks for `remove_unhealthy_after` seconds; the registry runs those checks itself
(probes.challenge: a member passes only if it proves its identity, so a process that took a
dead member's port does not keep it registered).
The YAML's urls are not members: they stay in the pools whatever happens.

Where the registry lives: in a single orchestrator process, in that process
(LocalMembership). In a fleet (orchestrator/fleet.py), in the parent, on a loopback
control port: each child forwards the registration API to it (RemoteMembership) and reads
the member list from it whenever the parent says it changed (a newline on the child's
stdin: fleet.py) and before every round of health checks, so a worker that joins or leaves
through any child joins or leaves all of them within milliseconds.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from urllib.parse import urlsplit

import aiohttp
import msgspec
import orjson

from splitserve.errors import InvalidRequestError
from splitserve.orchestrator.probes import challenge
from splitserve.protocol.internal_api import (
    WORKERS_PATH, WORKERS_REMOVE_PATH, WORKERS_ROLE_PATH, Registration, Removal, RoleAssignment)
from splitserve.protocol.openai import error_body
from splitserve.protocol.roles import REGISTERED_ROLES
from splitserve.trust import INTERNAL_HEADER, Keys

logger = logging.getLogger(__name__)

MAX_URL_CHARS = 512
TTL_RANGE = (1.0, 3600.0)       # seconds a lease may be given
MAX_MEMBERS = 256
PATHS = (WORKERS_PATH, WORKERS_REMOVE_PATH, WORKERS_ROLE_PATH)
NOT_INTERNAL = ("the /internal/ endpoints take only the cluster's internal requests; this "
                "request does not carry the cluster's internal token for this server")


class Member(msgspec.Struct):
    role: str                            # the pool it is in
    url: str
    ttl: float
    expires: float                       # time.monotonic() when the lease lapses
    unhealthy_since: float | None = None
    registered_role: str = ""            # what its heartbeats say ("": role)


def _decode(struct, body: bytes):
    try:
        return msgspec.json.decode(body, type=struct)
    except msgspec.ValidationError as exc:
        # "... at `$.ttl`" or "... field `url`": the field named, as param
        match = re.search(r"(?:at `\$\.|field `)(\w+)`", str(exc))
        raise InvalidRequestError(str(exc), match and match.group(1)) from None
    except msgspec.DecodeError:
        raise InvalidRequestError("the request body is not valid JSON") from None


def _check_role(role: str) -> None:
    if role not in REGISTERED_ROLES:
        raise InvalidRequestError(f"role must be one of {', '.join(REGISTERED_ROLES)}, got "
                                  f"{role[:40]!r}", "role")


def _check_url(url: str) -> str:
    if len(url) > MAX_URL_CHARS:
        raise InvalidRequestError(f"url is longer than {MAX_URL_CHARS} characters", "url")
    try:
        parts = urlsplit(url)
        parts.port   # noqa: B018 (raises on a port out of range)
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname \
            or parts.path not in ("", "/") or parts.query or parts.fragment:
        raise InvalidRequestError("url must be a worker's base url, http://host:port", "url")
    return url.rstrip("/")


class Registry:
    def __init__(self, remove_unhealthy_after: float, max_members: int = MAX_MEMBERS):
        self.remove_after, self.max_members = remove_unhealthy_after, max_members
        self.members: dict[str, Member] = {}
        self.assigned: dict[str, str] = {}   # url -> the role a RoleAssignment gave it
        self.listeners: list = []     # called (no arguments) when a member joins or leaves

    def _changed(self) -> None:
        for listener in self.listeners:
            listener()

    def register(self, body: bytes) -> None:
        reg = _decode(Registration, body)
        _check_role(reg.role)
        if not TTL_RANGE[0] <= reg.ttl <= TTL_RANGE[1]:
            raise InvalidRequestError(f"ttl must be {TTL_RANGE[0]:g} to {TTL_RANGE[1]:g} "
                                      f"seconds, got {reg.ttl!r}", "ttl")
        url = _check_url(reg.url)
        member = self.members.get(url)
        if member is None and len(self.members) >= self.max_members:
            raise InvalidRequestError(f"the cluster holds its limit of {self.max_members} "
                                      f"registered workers", "url")
        role = self.assigned.get(url, reg.role)
        if member is None or member.role != role or member.registered_role != reg.role:
            if member is None or member.role != role:
                logger.info("orch: %s worker %s registered (ttl %g s)", role, url, reg.ttl)
            member = self.members[url] = Member(role, url, reg.ttl, time.monotonic() + reg.ttl,
                                                registered_role=reg.role)
            self._changed()
        member.ttl, member.expires = reg.ttl, time.monotonic() + reg.ttl

    def assign(self, body: bytes) -> None:
        """Move a member to `role`'s pool. Requests in flight on it finish there (a pool
        that loses a server keeps serving what it holds: pools.Pool.sync)."""
        move = _decode(RoleAssignment, body)
        _check_role(move.role)
        url = _check_url(move.url)
        member = self.members.get(url)
        if member is None:
            raise InvalidRequestError(f"no registered worker has the url {url[:80]!r}", "url")
        if move.role == member.registered_role:
            self.assigned.pop(url, None)
        else:
            self.assigned[url] = move.role
        if member.role != move.role:
            logger.info("orch: worker %s moves from the %s pool to the %s pool", url,
                        member.role, move.role)
            member.role = move.role
            self._changed()

    def _leave(self, url: str) -> bool:
        """A member leaves (a worker that joins again starts in the role it registers)."""
        self.assigned.pop(url, None)
        return self.members.pop(url, None) is not None

    def remove(self, body: bytes) -> None:
        url = _check_url(_decode(Removal, body).url)
        if self._leave(url):
            logger.info("orch: worker %s left", url)
            self._changed()

    def forget(self, url: str) -> None:
        """A worker is known to be gone (`splitserve up` saw its process exit)."""
        if self._leave(url):
            logger.info("orch: worker %s exited; it leaves until it registers again", url)
            self._changed()

    def listing(self) -> list[dict]:
        now = time.monotonic()
        return [{"role": m.role, "registered_role": m.registered_role or m.role, "url": m.url,
                 "ttl": m.ttl, "expires_in": round(max(m.expires - now, 0.0), 3)}
                for m in self.members.values()]

    def handle(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        """The HTTP API (the caller checked the internal token): (status, JSON body)."""
        try:
            if (method, path) == ("POST", PATHS[0]):
                self.register(body)
            elif (method, path) in (("POST", PATHS[1]), ("DELETE", PATHS[0])):
                self.remove(body)
            elif (method, path) == ("POST", PATHS[2]):
                self.assign(body)
            elif (method, path) not in (("GET", PATHS[0]), ("HEAD", PATHS[0])):
                return 405 if path in PATHS else 404, error_body(
                    f"no endpoint {method} {path}", "invalid_request_error")
        except InvalidRequestError as exc:
            return 400, error_body(exc.message, "invalid_request_error", exc.param)
        return 200, orjson.dumps({"object": "list", "data": self.listing()})

    # -- leases and health -------------------------------------------------------------
    def expire(self, now: float) -> None:
        before = len(self.members)
        for url, m in list(self.members.items()):
            if m.expires <= now:
                logger.warning("orch: %s worker %s sent no heartbeat for %g s; it leaves",
                               m.role, url, m.ttl)
                self._leave(url)
            elif m.unhealthy_since is not None and now - m.unhealthy_since >= self.remove_after:
                logger.warning("orch: %s worker %s failed its health checks for %g s; it "
                               "leaves", m.role, url, now - m.unhealthy_since)
                self._leave(url)
        if len(self.members) != before:
            self._changed()

    async def run(self, session: aiohttp.ClientSession, keys: Keys, interval: float) -> None:
        """Check the members' health and identity and expire them, every `interval` seconds."""
        while True:
            members = list(self.members.values())
            verdicts = await asyncio.gather(*(_answers(session, keys, m.url) for m in members))
            now = time.monotonic()
            for m, ok in zip(members, verdicts):
                m.unhealthy_since = None if ok else (m.unhealthy_since or now)
            self.expire(now)
            await asyncio.sleep(interval)


async def _answers(session: aiohttp.ClientSession, keys: Keys, url: str) -> bool:
    """It serves (200) and proves its identity."""
    return (await challenge(session, keys, url))[2] is not None


class LocalMembership:
    """The registry in this orchestrator process."""

    def __init__(self, registry: Registry):
        self.registry = registry

    async def call(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        return self.registry.handle(method, path, body)

    async def members(self) -> list[dict] | None:
        return self.registry.listing()


class RemoteMembership:
    """A fleet child's view: the parent's registry behind its loopback control port,
    called with the session of the pools and `token`: the fleet's instance id is the
    parent's, which gave it to the child (fleet.py), so no challenge is needed."""

    def __init__(self, control_url: str, pools, token: str):
        self.control_url, self.pools = control_url.rstrip("/"), pools
        self.headers = {INTERNAL_HEADER: token}

    async def call(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        try:
            async with self.pools.session.request(
                    method, self.control_url + path, data=body, headers=self.headers,
                    timeout=aiohttp.ClientTimeout(total=5.0), allow_redirects=False) as r:
                return r.status, await r.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            logger.error("orch: the fleet's registry did not answer: %s", exc)
            return 503, error_body("the worker registry is not available; retry later",
                                   "server_error")

    async def members(self) -> list[dict] | None:
        status, body = await self.call("GET", PATHS[0], b"")
        return orjson.loads(body)["data"] if status == 200 else None
