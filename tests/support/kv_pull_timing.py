"""KV pull throughput of a transport: two in-process transports on loopback, one lease of
a large prompt's blocks pulled again and again; prints the median. Not a test (timing only).

    python tests/support/kv_pull_timing.py --backend tcp --tokens 8192 --reps 9 [--secret S]

--secret: the channel speaks CURVE (encrypted), keyed by S, as a cluster with an internal
secret does. --checksums-ab: the pulls alternate between checksummed blocks (as served) and
blocks whose checksums are neither computed nor checked (the transport's sum functions
swapped for no-ops in this process), and the medians of both are printed: what the per-block
checksums (kv/checksums.py) cost a pull.
"""

import argparse
import contextlib
import importlib
import queue
import statistics
import time

import numpy as np
import torch

from splitserve.kv import checksums
from splitserve.kv.base import LeaseView, make_transport
from splitserve.protocol.engine import KVHandle


class Leases(LeaseView):
    def __init__(self, table):
        self.table = table

    def lookup(self, rid, token, digest=""):
        return self.table.get(rid) if token == "t" else None

    def release(self, rid, token):
        return True

    def watch(self, started, ended):
        for rid, (blocks, _) in self.table.items():
            started(rid, blocks)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="tcp")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--reps", type=int, default=9)
    # SmolLM2-135M's KV layout in bfloat16: 30 layers, 3 KV heads of 64, blocks of 16.
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--secret", default=None)
    p.add_argument("--checksums-ab", action="store_true")
    args = p.parse_args()
    n = args.tokens // 16
    src = torch.randn(n, args.layers, 2, 16, 3, 64).to(torch.bfloat16)
    dst = torch.zeros_like(src)
    ctx = make_transport(args.backend, src, "L", secret=args.secret)
    gen = make_transport(args.backend, dst, "L", timeout=120.0, secret=args.secret)
    ctx.start(Leases({"r": (np.arange(n), args.tokens)}))
    gen.start(Leases({}))
    handle = KVHandle(backend=args.backend, endpoint=ctx.endpoint, ctx_request_id="r",
                      layout="L", num_tokens=args.tokens, lease_token="t")
    walls: dict[bool, list[float]] = {True: [], False: []}
    try:
        for i in range(args.reps * (2 if args.checksums_ab else 1) + 1):
            summed = not (args.checksums_ab and i % 2)
            with _checksums(args.backend, summed):
                wall = _pull(gen, handle, n)
            if i:   # the first pull connects and warms up
                walls[summed].append(wall)
        assert torch.equal(dst, src.flip(0))
    finally:
        ctx.close()
        gen.close()
    nbytes = src.numel() * src.element_size()
    for summed, times in walls.items():
        if times:
            med = statistics.median(times)
            print(f"{args.backend}{' CURVE' if args.secret else ''}"
                  f"{'' if summed else ' without checksums'}: {n} blocks, "
                  f"{nbytes / 1e6:.0f} MB per pull, {len(times)} pulls: "
                  f"median {med * 1e3:.2f} ms = {nbytes / med / 1e9:.2f} GB/s "
                  f"(min {min(times) * 1e3:.2f}, max {max(times) * 1e3:.2f} ms)")
    if args.checksums_ab:
        ratio = statistics.median(walls[True]) / statistics.median(walls[False])
        print(f"checksummed / not: {ratio:.3f}")


def _pull(gen, handle, n) -> float:
    results = queue.Queue()
    t0 = time.perf_counter()
    gen.pull(handle, np.arange(n)[::-1].copy(), results.put)
    result = results.get(timeout=300)
    assert result.ok, result.error
    return time.perf_counter() - t0


@contextlib.contextmanager
def _checksums(backend: str, on: bool):
    """With on=False, the checksum functions do nothing: no sum computed by the CTX, none
    checked by the GEN (both transports live in this process), which copies each frame as
    the platform does without them."""
    module = importlib.import_module(f"splitserve.kv.{backend}")
    off = {"expected_sums": lambda sums, count: [0] * count,
           "check_block": lambda index, block, want: None,
           "receive_block": lambda platform, index, frame, block, want:
               platform.host_to_block(frame, block)}
    off = {name: f for name, f in off.items() if hasattr(module, name)}
    saved = checksums.block_sums, {name: getattr(module, name) for name in off}
    if not on:
        checksums.block_sums = lambda blocks: b""
        for name, f in off.items():
            setattr(module, name, f)
    try:
        yield
    finally:
        checksums.block_sums = saved[0]
        for name, f in saved[1].items():
            setattr(module, name, f)


if __name__ == "__main__":
    main()
