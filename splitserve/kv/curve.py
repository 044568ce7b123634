"""CURVE on the KV channel: key pairs derived from the cluster's internal secret, and a ZAP
handler that admits only the cluster's own clients.

Every worker of a cluster holds the same secret, so each derives the same two key pairs: the
server pair (a CTX's ROUTER) and the client pair (a GEN's DEALERs). A peer without the secret
knows neither the server's public key nor the client's secret key, so its handshake fails and
no message of it reaches the KV server; the ZAP handler also refuses a client that learned the
server's public key but holds a key pair of its own. Once connected, every frame is
encrypted and authenticated (CurveZMQ), so leases and block bytes do not cross in clear.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
from dataclasses import dataclass, field

import zmq
from zmq.utils import z85

logger = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"   # where libzmq asks a context's ZAP handler
ZAP_DOMAIN = "splitserve-kv"
# What CURVE adds to each frame on the wire (command name, nonce, MAC, flags): a socket's
# ZMQ_MAXMSGSIZE limits the wire frame, so a limit that fits a block exactly needs this more.
FRAME_OVERHEAD = 64


@dataclass(frozen=True)
class KeyPair:
    public: bytes                          # z85, 40 bytes
    secret: bytes = field(repr=False)      # z85, 40 bytes


def key_pair(secret: str, purpose: bytes) -> KeyPair:
    """A CURVE key pair that only holders of `secret` can compute (one per purpose)."""
    seed = hmac.new(secret.encode(), b"splitserve kv curve " + purpose, hashlib.sha256).digest()
    secret_key = z85.encode(seed)
    return KeyPair(zmq.curve_public(secret_key), secret_key)


@dataclass(frozen=True)
class CurveKeys:
    server: KeyPair
    client: KeyPair

    @classmethod
    def from_secret(cls, secret: str) -> CurveKeys:
        return cls(key_pair(secret, b"server"), key_pair(secret, b"client"))

    def make_server(self, sock: zmq.Socket) -> None:
        """Before bind: sock accepts only CURVE clients this context's ZAP handler admits."""
        sock.curve_server = True
        sock.curve_secretkey = self.server.secret
        sock.curve_publickey = self.server.public
        sock.zap_domain = ZAP_DOMAIN.encode()

    def make_client(self, sock: zmq.Socket) -> None:
        """Before connect: sock talks CURVE to the cluster's server key only."""
        sock.curve_serverkey = self.server.public
        sock.curve_publickey = self.client.public
        sock.curve_secretkey = self.client.secret


class ZapHandler:
    """Answers libzmq's authentication requests for the sockets of one context (RFC 27):
    200 for a CURVE client with the cluster's client key, 400 for anything else. Bound when
    made, so no CURVE server of the context can take a handshake before it is there."""

    def __init__(self, ctx: zmq.Context, keys: CurveKeys, stop: threading.Event):
        self.allowed = z85.decode(keys.client.public)
        self.stop = stop
        self.sock = ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(ZAP_ENDPOINT)
        # The thread takes the socket over; start() is the memory barrier ZeroMQ asks for.
        self.thread = threading.Thread(target=self._run, daemon=True, name="kv-zap")

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                try:
                    if self.sock.poll(200):
                        self.sock.send_multipart(self.reply(self.sock.recv_multipart()))
                except zmq.ContextTerminated:
                    return
                except zmq.ZMQError:   # one request's failure; the handler goes on
                    logger.exception("kv: the ZAP handler failed to answer a request")
        finally:
            self.sock.close(linger=0)

    def reply(self, frames: list[bytes]) -> list[bytes]:
        if len(frames) < 6:
            request_id = frames[1] if len(frames) > 1 else b""
            return [b"1.0", request_id, b"500", b"malformed ZAP request", b"", b""]
        _version, request_id, domain, _address, _identity, mechanism, *credentials = frames
        admitted = (domain == ZAP_DOMAIN.encode() and mechanism == b"CURVE" and
                    len(credentials) == 1 and hmac.compare_digest(credentials[0], self.allowed))
        if admitted:
            return [b"1.0", request_id, b"200", b"OK", b"", b""]
        return [b"1.0", request_id, b"400", b"not a key of this cluster", b"", b""]
