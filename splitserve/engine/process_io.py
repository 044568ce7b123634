"""The engine-core process's two I/O threads: one reads the front-ends' input socket(s),
one writes each output message to the front-end it is for. They only decode and encode, so
a slow front-end never stalls a step and a step never delays reading the next request.

Every front-end binds a pair of sockets; the engine connects to each: one PULL socket
connected to every front-end's input address (fair-queued; AddRequests.peer says who sent
what), one PUSH socket per front-end for its outputs. An output queue item is a message for
front-end 0 or (peer, message)."""

from __future__ import annotations

import logging
import queue
import time

import msgspec
import zmq

from splitserve.errors import InvalidRequestError
from splitserve.protocol.engine import (
    AbortRequests, AddRequests, CompletionDelta, EngineInput, EngineOutputs, EngineRequest,
    FinishReason, decode_leniently, split_prompts, unpack_input)

logger = logging.getLogger(__name__)


class _Unreadable:
    """An input request that failed to decode: its id and why."""

    def __init__(self, request_id: str, error: msgspec.DecodeError):
        self.request_id, self.error = request_id, error

    def delta(self) -> CompletionDelta:
        """A 400 if its parameters failed validation (SamplingParams checks them again on
        decoding), else a server error."""
        cause = self.error.__cause__
        if isinstance(cause, InvalidRequestError):
            return _rejected(self.request_id, cause)
        return _internal_error(self.request_id, "could not read the request")


def _rejected(request_id: str, exc: InvalidRequestError) -> CompletionDelta:
    """Ends a request the engine refused (error_param set: the client's 400)."""
    return CompletionDelta(request_id, 0, [], "", finish_reason=int(FinishReason.ERROR),
                           error=exc.message, error_param=exc.param or "")


def _internal_error(request_id: str, what: str, index: int = -1) -> CompletionDelta:
    """Ends a request (index -1: all its sequences) with a server error."""
    return CompletionDelta(request_id, index, [], "", finish_reason=int(FinishReason.ERROR),
                           error=f"internal error: the engine {what} (see the worker's log)")


def _recv_loop(ctx: zmq.Context, addrs: str | list[str], in_q: queue.Queue) -> None:
    sock = ctx.socket(zmq.PULL)
    for addr in [addrs] if isinstance(addrs, str) else addrs:
        sock.connect(addr)
    decoder = msgspec.msgpack.Decoder(EngineInput)
    while True:
        try:
            frame = sock.recv(copy=False)
        except zmq.ContextTerminated:
            sock.close()
            return
        try:
            _receive(frame.buffer, decoder, in_q)
        except Exception:   # the input thread outlives any one message
            logger.exception("engine: reading an input message failed")


def _receive(buf: memoryview, decoder: msgspec.msgpack.Decoder, in_q: queue.Queue) -> None:
    received = time.time()   # the front-end's part ends here; see Request.admit_time
    header, prompts = unpack_input(buf)
    try:
        msg = decoder.decode(header)
    except msgspec.DecodeError as exc:
        _receive_leniently(header, prompts, received, in_q, exc)
        return
    if not isinstance(msg, AddRequests):
        in_q.put(msg)
        return
    for req, frame in zip(msg.requests, split_prompts(msg.requests, prompts)):
        req.take_tokens(frame, received, msg.peer)
        in_q.put(req)


def _receive_leniently(header: memoryview, prompts: memoryview, received: float,
                       in_q: queue.Queue, exc: Exception) -> None:
    """A message that failed to decode: admit the requests in it that decode alone, and
    answer each of the others that names itself with an error, so none waits forever."""
    requests = decode_leniently(header)
    bad = [named.request_id for named, req in requests if not isinstance(req, EngineRequest)]
    logger.error("engine: an input message failed to decode (%s); %d request(s) in it "
                 "unreadable: %s", exc, len(bad), bad[:10])
    frames = split_prompts([named for named, _ in requests], prompts)
    for (named, req), frame in zip(requests, frames):
        if isinstance(req, EngineRequest):
            req.take_tokens(frame, received)
            in_q.put(req)
        else:
            in_q.put(_Unreadable(named.request_id, req))


def _send_loop(ctx: zmq.Context, addrs: str | list[str], out_q: queue.Queue,
               in_q: queue.Queue) -> None:
    """Front-end 0 (the one that owns the engine) gets its messages as it always did: a
    blocking send, so a slow reader holds the engine's output back rather than losing it.
    Another front-end's are sent without waiting and dropped if it is gone (dead, or being
    restarted): a dead front-end must never stall the engine (PeerGone ends its requests)."""
    socks = []
    for addr in [addrs] if isinstance(addrs, str) else addrs:
        socks.append(ctx.socket(zmq.PUSH))
        socks[-1].setsockopt(zmq.LINGER, 1000)
        socks[-1].connect(addr)
    encoder = msgspec.msgpack.Encoder()
    dropped = 0
    while (item := out_q.get()) is not None:
        peer, msg = item if isinstance(item, tuple) else (0, item)
        try:
            frame = _encode(encoder, msg, in_q)
            if peer == 0:
                socks[0].send(frame, copy=False)
            else:
                socks[peer].send(frame, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            dropped += 1
            if dropped & (dropped - 1) == 0:   # 1, 2, 4, ...
                logger.warning("engine: front-end %d does not read; %d message(s) dropped",
                               peer, dropped)
        except Exception:   # the output thread outlives any one message
            logger.exception("engine: sending an output message failed")
    for sock in socks:
        sock.close()


def _encode(encoder: msgspec.msgpack.Encoder, msg, in_q: queue.Queue) -> bytes:
    """msg encoded; a delta that does not encode becomes an error delta for its sequence,
    and its request is aborted (its output could never leave), the others' go out."""
    try:
        return encoder.encode(msg)
    except Exception:
        if not isinstance(msg, EngineOutputs):
            raise
    deltas, failed = [], []
    for delta in msg.deltas:
        try:
            encoder.encode(delta)
            deltas.append(delta)
        except Exception:
            logger.exception("engine: request %s's output failed to encode", delta.request_id)
            failed.append(delta.request_id)
            deltas.append(_internal_error(delta.request_id, "could not send the output",
                                          delta.index))
    in_q.put(AbortRequests(failed))
    return encoder.encode(EngineOutputs(deltas, msg.stats))
