"""KV pull throughput of a transport: two in-process transports on loopback, one lease of
a large prompt's blocks pulled again and again; prints the median. Not a test (timing only).

    python tests/support/kv_pull_timing.py --backend tcp --tokens 8192 --reps 9 [--secret S]

--secret: the channel speaks CURVE (encrypted), keyed by S, as a cluster with an internal
secret does.
"""

import argparse
import queue
import statistics
import time

import numpy as np
import torch

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
    walls = []
    try:
        for i in range(args.reps + 1):
            results = queue.Queue()
            t0 = time.perf_counter()
            gen.pull(handle, np.arange(n)[::-1].copy(), results.put)
            result = results.get(timeout=300)
            wall = time.perf_counter() - t0
            assert result.ok, result.error
            if i:   # the first pull connects and warms up
                walls.append(wall)
        assert torch.equal(dst, src.flip(0))
    finally:
        ctx.close()
        gen.close()
    nbytes = src.numel() * src.element_size()
    med = statistics.median(walls)
    print(f"{args.backend}{' CURVE' if args.secret else ''}: {n} blocks, {nbytes / 1e6:.0f} MB per pull, {args.reps} pulls: "
          f"median {med * 1e3:.2f} ms = {nbytes / med / 1e9:.2f} GB/s "
          f"(min {min(walls) * 1e3:.2f}, max {max(walls) * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
