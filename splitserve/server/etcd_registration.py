"""`splitserve serve --membership etcd://host:port/prefix`: the worker keeps itself among
the cluster's members in etcd while it serves (protocol/membership.py: the key, the record
and its MAC; orchestrator/etcd_membership.py: the orchestrators watching them).

It grants a lease of the target's TTL, puts its signed record under the prefix attached to
that lease, and renews the lease every TTL/3 seconds, putting the record again should it
have been deleted or changed meanwhile. etcd down: it keeps trying the same
lease every second (said once); a lease etcd no longer has (it lapsed meanwhile) is granted
again and the record put again. A clean stop revokes the lease, so the key goes at once
and every orchestrator sees the worker leave; a worker killed outright leaves when its
lease lapses, and meanwhile the orchestrators' health checks route around it.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from splitserve.etcd import EtcdClient, EtcdUnavailable
from splitserve.protocol.membership import EtcdTarget, MemberRecord, parse_target, sign
from splitserve.protocol.roles import REGISTERED_ROLE
from splitserve.trust import Keys

logger = logging.getLogger(__name__)

RETRY = 1.0           # seconds between tries while etcd does not answer
LEAVE_TIMEOUT = 6.0   # a clean stop waits at most this long for etcd


class EtcdRegistration:
    """describe(): this worker's record now, None while it cannot say (its engine is
    restarting: the last record stands); a changed record (a restarted engine's new KV
    endpoint) is put at the next renewal."""

    def __init__(self, target: EtcdTarget, describe, secret: str, log_prefix: str):
        self.target, self.describe, self.log_prefix = target, describe, log_prefix
        self.keys = Keys(secret)
        self.record: MemberRecord = describe()
        self.key = target.key(self.record.url)
        self.session = aiohttp.ClientSession()
        self.client = EtcdClient(self.session, target.endpoint)
        self.lease: str | None = None
        self.held: bytes | None = None   # the value this worker last put
        self.failing = False         # said once per outage
        self.task = asyncio.create_task(self._hold())

    @classmethod
    def start(cls, config, url: str, ready, model: str) -> EtcdRegistration:
        """config: server.config.ServerConfig (membership set); ready(): the engine's
        EngineReady (its KV endpoint and layout), None while it restarts; model: the served
        model's name."""
        role = REGISTERED_ROLE[config.role]

        def describe() -> MemberRecord | None:
            now = ready()
            return None if now is None else MemberRecord(role, url, now.kv_endpoint, model,
                                                         now.layout)
        return cls(parse_target(config.membership), describe, config.internal_secret,
                   config.log_prefix)

    def _value(self) -> bytes:
        """The signed record to hold in etcd, as of now."""
        record = self.describe()
        if record is not None and record != self.record:
            logger.info("%s: this worker's record changed (KV endpoint %s); putting it again",
                        self.log_prefix, record.kv_endpoint or "none")
            self.record = record
        return sign(self.record, self.key, self.keys)

    async def _hold(self) -> None:
        while True:
            try:
                if self.lease is None:
                    await self._join()
                await asyncio.sleep(self.target.ttl / 3)
                if not await self.client.keepalive(self.lease):
                    logger.warning("%s: etcd let this worker's lease lapse; joining again",
                                   self.log_prefix)
                    self.lease = None
                    continue
                self._answered()
                await self._check_record()
            except (EtcdUnavailable, LookupError, TypeError, ValueError) as exc:
                # (LookupError ...: an answer without the fields etcd's answers have)
                if not self.failing:
                    logger.warning("%s: %s; trying every %g s", self.log_prefix, exc, RETRY)
                    self.failing = True
                await asyncio.sleep(RETRY)

    async def _join(self) -> None:
        self.lease = await self.client.grant(self.target.ttl)
        await self._put(self._value())
        logger.info("%s: joined the members in etcd at %s%s as %s (lease of %g s)",
                    self.log_prefix, self.target.endpoint, self.target.prefix,
                    self.record.url, self.target.ttl)
        self._answered()

    async def _check_record(self) -> None:
        """Put the record again if someone deleted or changed it (the lease alone would
        keep this worker out of the members until it restarts), or if it changed here."""
        value, held = self._value(), await self.client.get(self.key)
        if held != self.held:
            logger.warning("%s: this worker's record in etcd was deleted or changed; "
                           "putting it again", self.log_prefix)
        if held != value:
            await self._put(value)

    async def _put(self, value: bytes) -> None:
        await self.client.put(self.key, value, self.lease)
        self.held = value

    def _answered(self) -> None:
        if self.failing:
            logger.info("%s: etcd answers again", self.log_prefix)
            self.failing = False

    async def stop(self) -> None:
        """Revoke the lease (bounded: a gone etcd does not hold up the worker's stop)."""
        self.task.cancel()
        try:
            if self.lease is not None:
                await asyncio.wait_for(self.client.revoke(self.lease), LEAVE_TIMEOUT)
                logger.info("%s: left the members in etcd", self.log_prefix)
        except (EtcdUnavailable, asyncio.TimeoutError) as exc:
            logger.warning("%s: leaving etcd failed (%s); the lease lapses in %g s",
                           self.log_prefix, exc, self.target.ttl)
        finally:
            await self.session.close()
