"""The ZeroMQ sockets of the KV pull conversation, set up so that no peer can hold them.

CTX: one ROUTER that takes only small messages (ZMQ_MAXMSGSIZE) and drops connections that
stall their handshake or stop answering heartbeats. GEN: a `Peer` per CTX endpoint, a
DEALER whose monitor tells a refused or lost connection from a slow answer, so a pull to a
CTX that is gone fails in a fraction of a second instead of waiting for its timeout. With
CurveKeys (kv/curve.py) both ends speak CURVE and a handshake that fails ends the pull at once.
"""

from __future__ import annotations

import logging
import re
import threading
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from splitserve.kv.curve import FRAME_OVERHEAD, CurveKeys
from splitserve.kv.messages import MAX_REQUEST_BYTES

logger = logging.getLogger(__name__)

ENDPOINT = re.compile(r"tcp://[A-Za-z0-9.\-]+:[0-9]{1,5}|tcp://\[[0-9A-Fa-f:.]+\]:[0-9]{1,5}")
CONNECT_ATTEMPTS = 3          # refused or failed handshakes before a pull gives up on a CTX
RECONNECT_MS = 100
HANDSHAKE_MS = 10_000         # a connection that has not greeted by then is dropped
HEARTBEAT_MS = 20_000         # the CTX pings idle GENs ...
HEARTBEAT_TIMEOUT_MS = 60_000  # ... and drops one that sent nothing for this long after a ping
SLICE = 0.1                   # seconds: how often a waiting pull looks at the stop flag


class PeerUnavailable(Exception):
    """The CTX could not be reached, dropped the connection or did not answer in time: the
    pulls queued behind this one would wait on it too."""


class BadReply(Exception):
    """The CTX answered, but not with a reply this pull can take: nothing was copied."""


class PullRefused(Exception):
    """The CTX answered with an error (unknown lease, layout mismatch): the conversation is
    in step, the connection stays."""


def valid_endpoint(endpoint: str) -> bool:
    return ENDPOINT.fullmatch(endpoint) is not None


class Throttled:
    """Warnings about what peers send, at most one per `every` seconds per kind: a peer
    spraying garbage must not flood the log."""

    def __init__(self, every: float = 10.0):
        self.every = every
        self._last: dict[str, tuple[float, int]] = {}
        self._lock = threading.Lock()

    def warning(self, kind: str, msg: str, *args) -> None:
        now = time.monotonic()
        with self._lock:
            last, skipped = self._last.get(kind, (-self.every, 0))
            if now - last < self.every:
                self._last[kind] = (last, skipped + 1)
                return
            self._last[kind] = (now, 0)
        suffix = f" ({skipped} more like it since the last warning)" if skipped else ""
        logger.warning(msg + suffix, *args)


def server_socket(ctx: zmq.Context, host: str, port: int,
                  keys: CurveKeys | None) -> tuple[zmq.Socket, str, zmq.Socket]:
    """(ROUTER, its endpoint, a monitor of its connections) for a CTX's KV server."""
    sock = ctx.socket(zmq.ROUTER)
    if keys is not None:
        keys.make_server(sock)
    for opt, value in ((zmq.LINGER, 0), (zmq.MAXMSGSIZE, MAX_REQUEST_BYTES),
                       (zmq.HANDSHAKE_IVL, HANDSHAKE_MS), (zmq.HEARTBEAT_IVL, HEARTBEAT_MS),
                       (zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)):
        sock.setsockopt(opt, value)
    if port:
        sock.bind(f"tcp://{host}:{port}")
    else:
        port = sock.bind_to_random_port(f"tcp://{host}")
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL |
                                      zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL |
                                      zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    return sock, f"tcp://{host}:{port}", monitor


def monitor_events(monitor: zmq.Socket) -> list[int]:
    """The events waiting on a monitor socket, without blocking."""
    events = []
    while monitor.poll(0):
        events.append(recv_monitor_message(monitor)["event"])
    return events


def close_monitored(sock: zmq.Socket, monitor: zmq.Socket) -> None:
    try:
        sock.disable_monitor()
    except zmq.ZMQError:
        pass
    monitor.close(linger=0)
    sock.close(linger=0)


class Peer:
    """A GEN's connection to one CTX's KV server; one pull at a time uses it."""

    HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL |
                        zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED |
              HANDSHAKE_FAILED)

    def __init__(self, ctx: zmq.Context, endpoint: str, max_frame: int, timeout: float,
                 connect_timeout: float, keys: CurveKeys | None):
        if not valid_endpoint(endpoint):
            raise PeerUnavailable("the KV handle's endpoint is not tcp://host:port")
        self.endpoint, self.timeout, self.connect_timeout = endpoint, timeout, connect_timeout
        self.sock = ctx.socket(zmq.DEALER)
        if keys is not None:
            keys.make_client(self.sock)
            max_frame += FRAME_OVERHEAD
        for opt, value in ((zmq.LINGER, 0), (zmq.MAXMSGSIZE, max_frame),
                           (zmq.RECONNECT_IVL, RECONNECT_MS),
                           (zmq.CONNECT_TIMEOUT, max(1, int(connect_timeout * 1000)))):
            self.sock.setsockopt(opt, value)
        self.monitor = self.sock.get_monitor_socket(self.EVENTS)
        self.connected, self.failed_attempts = False, 0
        self.last_used = time.monotonic()
        try:
            self.sock.connect(endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise PeerUnavailable(f"cannot connect to the context worker's KV server: {exc}") from exc
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)

    def request(self, payload: bytes, deadline: float, stop: threading.Event) -> list:
        """Sends one message and returns the peer's next message (its frames), or raises
        PeerUnavailable: refused, connection lost, no answer by the deadline, or stop set."""
        self._discard_stale()
        self._read_events(waiting=False)
        self.failed_attempts = 0   # each pull gets its own attempts
        try:
            self.sock.send(payload, zmq.NOBLOCK)
        except zmq.Again as exc:
            raise PeerUnavailable("cannot send to the context worker's KV server") from exc
        sent = time.monotonic()
        while True:
            now = time.monotonic()
            if now >= deadline:
                raise PeerUnavailable(f"the context worker's KV server did not answer "
                                      f"within {self.timeout:g} s")
            if stop.is_set():
                raise PeerUnavailable("the KV transport was closed")
            ready = dict(self.poller.poll(max(1, int(min(deadline - now, SLICE) * 1000))))
            if self.sock in ready:
                self.last_used = time.monotonic()
                return self.sock.recv_multipart(copy=False)
            if self.monitor in ready:
                self._read_events(waiting=True)
            if not self.connected and (self.failed_attempts >= CONNECT_ATTEMPTS or
                                       now - sent > self.connect_timeout):
                raise PeerUnavailable("could not connect to the context worker's KV server "
                                      "(connection refused, or no KV server answered)")

    def send(self, payload: bytes) -> None:
        """Fire and forget (an ack): a CTX that does not take it lets its lease expire."""
        try:
            self.sock.send(payload, zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("kv: could not send an ack to %s", self.endpoint)

    def _read_events(self, waiting: bool) -> None:
        for event in monitor_events(self.monitor):
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected, self.failed_attempts = True, 0
            elif event == zmq.EVENT_CONNECT_RETRIED:
                self.failed_attempts += 1
            elif event & self.HANDSHAKE_FAILED:
                raise PeerUnavailable("the context worker's KV server refused the handshake "
                                      "(do both workers have the cluster's internal secret?)")
            elif event == zmq.EVENT_DISCONNECTED:
                if self.connected and waiting:   # the request, or its answer, is lost
                    raise PeerUnavailable("lost the connection to the context worker's KV "
                                          "server before it answered (it went away, or sent "
                                          "a frame larger than a KV block)")
                self.connected = False

    def _discard_stale(self) -> None:
        """A message waiting before the request is sent answers nothing this GEN asked."""
        stale = 0
        while self.sock.poll(0):
            self.sock.recv_multipart(copy=False)
            stale += 1
        if stale:
            logger.warning("kv: dropped %d unrequested messages from %s", stale, self.endpoint)

    def close(self) -> None:
        close_monitored(self.sock, self.monitor)
