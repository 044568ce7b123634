"""A context worker's engine core in a process of its own, for tests that stop or kill it.

    python tests/support/kv_ctx_process.py tcp

Prints `@ready`, then for each `<request id>` line on stdin hands PROMPT off under that id
and prints `@` and the KV handle and first tokens as JSON on one line (lines without the `@`
are libraries' logs). Exits when stdin closes.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import msgspec  # noqa: E402
import torch  # noqa: E402

from disagg_utils import engine, handoff  # noqa: E402
from splitserve.model.loader import load_model_source  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    ctx = engine(load_model_source("tiny-random"), sys.argv[1], lease=120.0)
    print("@ready", flush=True)
    try:
        for line in sys.stdin:
            delta = handoff(ctx, line.strip())
            print("@" + msgspec.json.encode({"handle": delta.kv_handle, "tokens": delta.token_ids,
                                       "logprobs": delta.logprobs}).decode(), flush=True)
    finally:
        ctx.remote_kv.close()


if __name__ == "__main__":
    main()
