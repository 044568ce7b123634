"""The engine-core process: EngineCore.step() in the main thread, ZeroMQ in two I/O threads.

The I/O threads only decode and encode messages, so a slow front-end never stalls a step
and a step never delays reading the next request. Protocol: splitserve/protocol/engine.py.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import signal
import sys
import threading
import time

import msgspec
import torch
import zmq

from splitserve import envs, placement
from splitserve.config import EngineConfig
from splitserve.engine.core import EngineCore
from splitserve.errors import InvalidRequestError
from splitserve.protocol.engine import (
    AbortRequests, AddRequests, CompletionDelta, EngineDead, EngineInput, EngineOutputs,
    EngineReady, EngineRequest, EngineStats, FinishReason, Shutdown, decode_leniently,
    split_prompts, unpack_input)
from splitserve.tokens import PromptTokens

logger = logging.getLogger(__name__)

SWITCH_INTERVAL = 0.0005    # seconds: how long the input thread may wait for the GIL


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str,
                    log_prefix: str = "engine") -> None:
    """Process entry point. Ends on Shutdown, on SIGTERM, or when the parent dies."""
    logging.basicConfig(level=envs.log_level(),
                        format=f"%(asctime)s %(levelname)s {log_prefix} %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the front-end decides when we stop
    ctx = zmq.Context()
    out_q: queue.Queue = queue.Queue()
    in_q: queue.Queue = queue.Queue()
    threading.Thread(target=_send_loop, args=(ctx, output_addr, out_q, in_q), daemon=True).start()
    try:
        _pin()
        engine = EngineCore(config)
    except Exception as exc:
        logger.exception("engine failed to start")
        out_q.put(EngineDead(f"engine failed to start: {exc}"))
        out_q.put(None)
        time.sleep(1.0)
        return
    # The model, torch and the tokenizer live as long as the process: out of the garbage
    # collector's full passes, which hold the GIL (and so the input thread) for ~0.1 s each.
    gc.collect()
    gc.freeze()
    # The input thread needs the GIL after each message arrives; while a step runs Python it
    # waits up to a switch interval for it (5 ms by default: the p99 of a held load's
    # front-end -> engine hand-off). The other threads mostly wait without the GIL, so a
    # shorter interval costs the step little.
    sys.setswitchinterval(SWITCH_INTERVAL)
    bm = engine.block_manager
    dtype = str(engine.runner.kv_cache.dtype).removeprefix("torch.")
    logger.info("engine: %s, %d torch thread(s) on CPUs %s", dtype, torch.get_num_threads(),
                placement.format_cpus(tuple(os.sched_getaffinity(0))))
    out_q.put(EngineReady(engine.model_config.name, dtype, engine.model_config.vocab_size,
                          engine.max_model_len, bm.num_blocks, bm.block_size,
                          engine.remote_kv.endpoint))
    threading.Thread(target=_recv_loop, args=(ctx, input_addr, in_q), daemon=True).start()
    parent = os.getppid()
    engine.remote_kv.wake = lambda: in_q.put(_WAKE)   # KV pulls and acks end on other threads
    try:
        _step_loop(engine, in_q, out_q, parent)
    finally:
        out_q.put(None)
        time.sleep(0.1)


_WAKE = object()


def _pin() -> None:
    """Pins the process to its CPUs (SPLITSERVE_ENGINE_CPUS) before torch starts its OpenMP
    threads (at the first parallel region, in EngineCore), so that they inherit them."""
    cpus = envs.engine_cpus()
    if cpus:
        placement.pin_process(placement.parse_cpus(cpus), "engine")


def _step_loop(engine: EngineCore, in_q: queue.Queue, out_q: queue.Queue, parent: int,
               heartbeat: float = 0.5) -> None:
    """Steps until Shutdown or the parent's death. Stats go out when they change and at least
    every `heartbeat` seconds (after a step), so the front-end can tell a stuck engine (its
    step count stands still while it holds work) from a quiet one."""
    last_stats, steps, next_beat = None, 0, 0.0
    while True:
        busy = engine.has_runnable_work()
        try:
            # Idle: block, waking for lease expiry and to notice a dead parent; busy: drain.
            item = in_q.get_nowait() if busy else in_q.get(timeout=0.5)
        except queue.Empty:
            item = None
        deltas: list[CompletionDelta] = []
        while item is not None:
            if isinstance(item, Shutdown):
                return
            if item is not _WAKE:
                _handle(engine, item, deltas)
            item = in_q.get_nowait() if not in_q.empty() else None
        if os.getppid() != parent:
            logger.warning("front-end process died; engine exiting")
            return
        deltas.extend(engine.step())
        steps += 1
        stats = _stats(engine)   # steps left out: a step alone is news only once a beat
        now = time.monotonic()
        if deltas or stats != last_stats or now >= next_beat:
            out_q.put(EngineOutputs(deltas, msgspec.structs.replace(stats, steps=steps)))
            last_stats, next_beat = stats, now + heartbeat


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


def _handle(engine: EngineCore, item, deltas: list[CompletionDelta]) -> None:
    try:
        if isinstance(item, AbortRequests):
            for rid in item.request_ids:
                engine.abort_request(rid)
        elif isinstance(item, _Unreadable):
            deltas.append(item.delta())
        else:
            _add(engine, *item, deltas)
    except Exception:   # one message must not end the step loop
        logger.exception("engine: handling an input message failed")
        if isinstance(item, tuple):
            deltas.append(_internal_error(item[0].request_id, "could not admit the request"))


def _add(engine: EngineCore, msg: EngineRequest, frame, received: float,
         deltas: list[CompletionDelta]) -> None:
    """frame: its token ids' bytes, as split_prompts cut them to its declared lengths."""
    try:
        if frame is None:
            raise InvalidRequestError("the engine received a batch whose prompt bytes do not "
                                      "match its prompt lengths", "prompt_len")
        tokens = PromptTokens.from_bytes(frame)
        resumed = None
        if msg.placeholder:
            prompt = PromptTokens.placeholder(msg.prompt_len)
        else:
            prompt = PromptTokens(tokens.array[:msg.prompt_len])
        if msg.num_resumed:
            resumed = tokens.array[len(tokens) - msg.num_resumed:]
        engine.add_request(msg, prompt, resumed, received)
    except InvalidRequestError as exc:
        deltas.append(_rejected(msg.request_id, exc))


def _rejected(request_id: str, exc: InvalidRequestError) -> CompletionDelta:
    """Ends a request the engine refused (error_param set: the client's 400)."""
    return CompletionDelta(request_id, 0, [], "", finish_reason=int(FinishReason.ERROR),
                           error=exc.message, error_param=exc.param or "")


def _internal_error(request_id: str, what: str, index: int = -1) -> CompletionDelta:
    """Ends a request (index -1: all its sequences) with a server error."""
    return CompletionDelta(request_id, index, [], "", finish_reason=int(FinishReason.ERROR),
                           error=f"internal error: the engine {what} (see the worker's log)")


def _stats(engine: EngineCore) -> EngineStats:
    bm, pulls = engine.block_manager, engine.remote_kv.stats
    return EngineStats(engine.num_running, engine.num_waiting, bm.num_used_blocks, bm.num_blocks,
                       bm.prefix_queries, bm.prefix_hits, engine.remote_kv.num_leased_blocks,
                       kv_error=engine.remote_kv.health() or "",
                       kv_bytes_pulled=pulls.bytes_pulled, kv_blocks_pulled=pulls.blocks_pulled,
                       kv_blocks_reused=pulls.blocks_reused)


def _recv_loop(ctx: zmq.Context, addr: str, in_q: queue.Queue) -> None:
    sock = ctx.socket(zmq.PULL)
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
    else:
        for req, frame in zip(msg.requests, split_prompts(msg.requests, prompts)):
            in_q.put((req, frame, received))


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
            in_q.put((req, frame, received))
        else:
            in_q.put(_Unreadable(named.request_id, req))


def _send_loop(ctx: zmq.Context, addr: str, out_q: queue.Queue, in_q: queue.Queue) -> None:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(addr)
    encoder = msgspec.msgpack.Encoder()
    while (msg := out_q.get()) is not None:
        try:
            sock.send(_encode(encoder, msg, in_q), copy=False)
        except Exception:   # the output thread outlives any one message
            logger.exception("engine: sending an output message failed")
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
