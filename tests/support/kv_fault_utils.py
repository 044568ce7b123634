"""Misbehaving peers and probes for the KV fault tests (tests/kv/test_faults_kv.py): a fake
context worker built from a real ZeroMQ ROUTER, a context worker's engine core in a process
of its own (to stop or kill), and what the tests read off a drain or the kernel."""

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from splitserve.engine.request import FinishReason
from splitserve.kv.messages import MAX_REQUEST_BYTES, PullAck, PullRequest
from splitserve.protocol.engine import KVHandle, Logprob, RemotePrefill

from disagg_utils import GREEDY, PROMPT, drain, tokens
from engine_requests import add_request

HERE = os.path.dirname(os.path.abspath(__file__))


class FakeCtx:
    """A misbehaving context worker: a real ROUTER on loopback that answers each PullRequest
    with answer(request): a list of frames, or None for no answer at all; `repeat` times."""

    def __init__(self, answer, repeat=1):
        self.answer, self.repeat, self.requests, self.sent = answer, repeat, [], 0
        self.zctx = zmq.Context()
        self.sock = self.zctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        decoder = msgspec.msgpack.Decoder(PullRequest | PullAck)
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, payload = self.sock.recv_multipart()
            msg = decoder.decode(payload)
            if isinstance(msg, PullRequest):
                self.requests.append(msg)
                frames = self.answer(msg)
                for _ in range(self.repeat if frames is not None else 0):
                    self.sock.send_multipart([ident, *frames])
                    self.sent += 1

    def close(self):
        self.stop.set()
        self.thread.join(timeout=5)
        self.zctx.destroy(linger=0)



def outcome(out):
    """(final delta, index of its first delta in out) per request id."""
    first, final = {}, {}
    for i, d in enumerate(out):
        first.setdefault(d.request_id, i)
        if d.finish_reason is not None:
            final[d.request_id] = d
    return final, first


def ended_in_error(delta, *words):
    return delta.finish_reason == FinishReason.ERROR and any(w in delta.error for w in words)


def greedy_reference(ctx):
    """PROMPT's greedy tokens, generated whole by one engine."""
    add_request(ctx, "ref", PROMPT, GREEDY)
    return tokens(drain(ctx))


def pull_with(gen, rid, delta):
    """Decodes PROMPT on gen from the KV a handoff delta leased; returns its tokens."""
    add_request(gen, rid, PROMPT, GREEDY, remote=RemotePrefill(delta.kv_handle, delta.token_ids,
                                                              delta.logprobs))
    return tokens(drain(gen))


def close_engines(*engines):
    for e in engines:
        e.remote_kv.close()


def assert_healthy(*engines):
    for e in engines:
        assert e.remote_kv.health() is None
        assert e.block_manager.num_free_blocks == e.block_manager.num_blocks


def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def connections_to(port):
    """Established TCP connections on this machine whose far end is `port` (client sides)."""
    count = 0
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(path) as f:
            for row in f.readlines()[1:]:
                fields = row.split()
                if int(fields[2].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
                    count += 1
    return count


def wait_for(cond, timeout=15.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def port_of(endpoint):
    return int(endpoint.rsplit(":", 1)[1])



class Handoff(msgspec.Struct):
    handle: KVHandle
    tokens: list[int]
    logprobs: list[Logprob] | None = None


class CtxProcess:
    """tests/support/kv_ctx_process.py: a CTX engine core in its own process."""

    def __init__(self, backend):
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "kv_ctx_process.py"),
                                      backend], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        assert self.lines.get(timeout=120) == "ready"

    def _read(self):
        for line in self.proc.stdout:   # other lines: log lines of libraries (NIXL's)
            if line.startswith("@"):
                self.lines.put(line[1:].strip())

    def handoff(self, rid) -> Handoff:
        self.proc.stdin.write(rid + "\n")
        self.proc.stdin.flush()
        return msgspec.json.decode(self.lines.get(timeout=60), type=Handoff)

    def signal(self, sig):
        os.kill(self.proc.pid, sig)
        if sig == signal.SIGSTOP:   # delivered asynchronously: wait until it has stopped
            assert wait_for(lambda: self.state() == "T")

    def state(self):
        with open(f"/proc/{self.proc.pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]

    def stop(self):
        self.proc.kill()   # SIGKILL ends a stopped process too
        self.proc.wait(timeout=30)



def oversized_message_is_refused(zctx, endpoint):
    """A message over the CTX's limit makes ZeroMQ drop the sender's connection."""
    big = zctx.socket(zmq.DEALER)
    monitor = big.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    big.connect(endpoint)
    big.send(b"\0" * (MAX_REQUEST_BYTES + 1))
    return monitor.poll(15_000) and recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED


