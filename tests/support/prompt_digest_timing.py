"""What the prompt digest costs the engine thread: a CTX at lease time (its full-block hashes
exist already when prefix caching is on, or are hashed then), a GEN checking a relayed
prompt (every block hashed, the digest compared), and the per-block hashing this replaced.
Prints medians. Not a test (timing only).

    python tests/support/prompt_digest_timing.py --tokens 32768 --block-size 16 --reps 21
"""

import argparse
import statistics
import time

import numpy as np

from splitserve.engine.admission import check_relayed_prompt
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.request import Request
from splitserve.protocol.block_hashes import chain_hash
from splitserve.protocol.engine import KVHandle
from splitserve.sampling_params import SamplingParams
from splitserve.tokens import PromptTokens


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def per_block_hashes(tokens: np.ndarray, bs: int) -> list[bytes]:
    """The block manager's hashing before: one numpy slice and conversion per block."""
    out, parent = [], b""
    for i in range(len(tokens) // bs):
        parent = chain_hash(parent, tokens[i * bs:(i + 1) * bs])
        out.append(parent)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=21)
    args = ap.parse_args()
    bs, n = args.block_size, args.tokens
    prompt = PromptTokens(np.random.default_rng(0).integers(3, 150000, n).astype(np.int32))
    bm = BlockManager(4, bs)

    def fresh() -> Request:
        return Request("r", prompt, SamplingParams())

    hashed = fresh()
    bm.prompt_hashes(hashed)
    handle = KVHandle(backend="tcp", endpoint="tcp://127.0.0.1:1", ctx_request_id="r",
                      layout="L", num_tokens=n, prompt_digest=bm.prompt_digest(hashed))
    rows = [
        ("CTX lease, block hashes cached", lambda: bm.prompt_digest(hashed)),
        ("CTX lease, no prefix caching", lambda: bm.prompt_digest(fresh())),
        ("GEN admission check", lambda: check_relayed_prompt(prompt.array, handle, bs)),
        ("block hashes, per block (before)", lambda: per_block_hashes(prompt.array, bs)),
    ]
    print(f"prompt of {n} tokens, blocks of {bs} ({n // bs} full blocks), median of {args.reps}")
    for name, fn in rows:
        print(f"  {name:34s} {median_ms(fn, args.reps):8.3f} ms")


if __name__ == "__main__":
    main()
