"""The engine-core process: EngineCore.step() in the main thread, ZeroMQ in two I/O threads.

The I/O threads (process_io.py) only decode and encode messages, so a slow front-end never
stalls a step and a step never delays reading the next request. Protocol:
splitserve/protocol/engine.py.
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
import zmq

from splitserve import envs, redact
from splitserve.config import EngineConfig
from splitserve.engine.core import EngineCore
from splitserve.engine.kv_report import CacheReporter
from splitserve.engine.output_router import OutputRouter
from splitserve.engine.process_io import (
    _internal_error, _recv_loop, _rejected, _send_loop, _Unreadable)
from splitserve.errors import InvalidRequestError
from splitserve.protocol.engine import (
    AbortRequests, CompletionDelta, Drain, EngineDead, EngineOutputs, EngineReady,
    EngineRequest, EngineStats, PeerGone, Shutdown)

logger = logging.getLogger(__name__)

SWITCH_INTERVAL = 0.0005    # seconds: how long the input thread may wait for the GIL


def run_engine_core(config: EngineConfig, input_addrs: str | list[str],
                    output_addrs: str | list[str], log_prefix: str = "engine",
                    parent: int | None = None) -> None:
    """Process entry point. Ends on Shutdown, on SIGTERM, or when the parent dies. One
    (input, output) address pair per front-end (process_io.py); the first is the parent's.
    parent: the pid of the process that started this one, given by it: one that dies while
    this process imports torch and builds the model is noticed too (os.getppid() read
    here would already be init's)."""
    parent = os.getppid() if parent is None else parent
    logging.basicConfig(level=envs.log_level(),
                        format=f"%(asctime)s %(levelname)s {log_prefix} %(message)s")
    redact.install(config.kv.secret)
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the front-end decides when we stop
    ctx = zmq.Context()
    out_q: queue.Queue = queue.Queue()
    in_q: queue.Queue = queue.Queue()
    threading.Thread(target=_send_loop, args=(ctx, output_addrs, out_q, in_q), daemon=True).start()
    try:
        config.platform.place_process()   # before torch starts its OpenMP threads, which inherit it
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
    platform = engine.runner.platform
    logger.info("engine: %s on %s, %s%s", dtype, platform.name, platform.describe(),
                platform.start_helpers(engine.runner.kv_cache.dtype))
    out_q.put(EngineReady(engine.model_config.name, dtype, engine.model_config.vocab_size,
                          engine.max_model_len, bm.num_blocks, bm.block_size,
                          engine.remote_kv.endpoint, engine.remote_kv.layout))
    threading.Thread(target=_recv_loop, args=(ctx, input_addrs, in_q), daemon=True).start()
    engine.remote_kv.wake = lambda: in_q.put(_WAKE)   # KV pulls and acks end on other threads
    try:
        peers = 1 if isinstance(output_addrs, str) else len(output_addrs)
        _step_loop(engine, in_q, out_q, parent, OutputRouter(peers) if peers > 1 else None)
    finally:
        out_q.put(None)
        time.sleep(0.1)
    _exit(engine)


def _exit(engine: EngineCore) -> None:
    """The step loop ended (Shutdown, or the parent is gone): the KV transport is closed, so
    its peers see its sockets go, and the process ends at once. The interpreter's own
    teardown (torch, the frozen heaps, sockets still lingering) takes seconds when the CPU
    is shared with a busy engine, and the worker waits for it to stop."""
    engine.remote_kv.close()
    logging.shutdown()
    os._exit(0)


_WAKE = object()


def _step_loop(engine: EngineCore, in_q: queue.Queue, out_q: queue.Queue, parent: int,
               router: OutputRouter | None = None, heartbeat: float = 0.5) -> None:
    """Steps until Shutdown or the parent's death. Stats go out when they change and at least
    every `heartbeat` seconds (after a step), so the front-end can tell a stuck engine (its
    step count stands still while it holds work) from a quiet one. With several front-ends
    (a router), each gets its requests' deltas and every one the stats."""
    last_stats, steps, next_beat = None, 0, 0.0
    cache_report = CacheReporter(engine.block_manager)
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
                _handle(engine, item, deltas, router)
            item = in_q.get_nowait() if not in_q.empty() else None
        if os.getppid() != parent:
            logger.warning("the process that started the engine died; engine exiting")
            return
        deltas.extend(engine.step())
        steps += 1
        stats = _stats(engine)   # steps left out: a step alone is news only once a beat
        now = time.monotonic()
        if deltas or stats != last_stats or now >= next_beat:
            sent = msgspec.structs.replace(stats, steps=steps)
            if router is None:
                out_q.put(EngineOutputs(deltas, sent))
            else:
                _route(engine, router, out_q, deltas, sent, stats != last_stats, now >= next_beat)
            last_stats, next_beat = stats, now + heartbeat
        report = cache_report.due()
        if report is not None:      # every front-end serves /internal/kv_blocks
            for peer in range(router.num_peers if router else 1):
                out_q.put((peer, report))


def _route(engine: EngineCore, router: OutputRouter, out_q: queue.Queue, deltas, stats,
           changed: bool, beat: bool) -> None:
    """Several front-ends: each its requests' deltas, all the stats when they are news."""
    for item in router.route(deltas, stats, changed or beat):
        out_q.put(item)
    if beat:   # twice a second: forget the requests that finished
        router.prune(engine.groups.__contains__)


def _handle(engine: EngineCore, item, deltas: list[CompletionDelta],
            router: OutputRouter | None = None) -> None:
    """item: an input message, or an EngineRequest with its tokens (take_tokens())."""
    try:
        if isinstance(item, AbortRequests):
            for rid in item.request_ids:
                engine.abort_request(rid)
        elif isinstance(item, PeerGone):
            engine.undrain(item.peer)
            ids = router.gone(item.peer) if router is not None else []
            logger.warning("engine: front-end %d is gone; aborting its %d request(s)",
                           item.peer, len(ids))
            for rid in ids:
                engine.abort_request(rid)
        elif isinstance(item, Drain):
            logger.info("engine: front-end %d drains: its decoding streams are handed off",
                        item.peer)
            engine.drain(item.peer)
        elif isinstance(item, _Unreadable):
            deltas.append(item.delta())
        else:
            if router is not None:
                router.admit(item.request_id, item.peer)
            _add(engine, item, deltas)
    except Exception:   # one message must not end the step loop
        logger.exception("engine: handling an input message failed")
        if isinstance(item, EngineRequest):
            deltas.append(_internal_error(item.request_id, "could not admit the request"))


def _add(engine: EngineCore, request: EngineRequest, deltas: list[CompletionDelta]) -> None:
    try:
        if request.prompt is None:   # split_prompts found no bytes of its declared lengths
            raise InvalidRequestError("the engine received a batch whose prompt bytes do not "
                                      "match its prompt lengths", "prompt_len")
        engine.add_request(request)
    except InvalidRequestError as exc:
        deltas.append(_rejected(request.request_id, exc))


def _stats(engine: EngineCore) -> EngineStats:
    bm, pulls = engine.block_manager, engine.remote_kv.stats
    return EngineStats(engine.num_running, engine.num_waiting, bm.num_used_blocks, bm.num_blocks,
                       bm.prefix_queries, bm.prefix_hits, engine.remote_kv.num_leased_blocks,
                       kv_error=engine.remote_kv.health() or "",
                       kv_bytes_pulled=pulls.bytes_pulled, kv_blocks_pulled=pulls.blocks_pulled,
                       kv_blocks_reused=pulls.blocks_reused,
                       num_prefill_tokens=engine.num_prefill_tokens)


