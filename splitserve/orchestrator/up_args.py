"""`splitserve up`'s command line (up.py runs it). Kept apart from up.py so that building
the parser imports nothing of the orchestrator."""

from __future__ import annotations


def add_arguments(p) -> None:
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--host", default="127.0.0.1",
                   help="address the orchestrator listens on (0.0.0.0: every interface); "
                        "the workers stay on --worker-host")
    p.add_argument("--worker-host", default="127.0.0.1",
                   help="address the workers listen on (default loopback: only this machine, "
                        "the orchestrator included, reaches them; 0.0.0.0 exposes them too)")
    p.add_argument("--port", type=int, default=8000, help="orchestrator; workers take the next ports")
    p.add_argument("--num-ctx", type=int, default=1)
    p.add_argument("--num-gen", type=int, default=1)
    p.add_argument("--gen-api-servers", type=int, default=1,
                     help="front-end processes per GEN worker (serve --api-server-count)")
    p.add_argument("--orchestrators", type=int, default=1,
                     help="orchestrator processes serving --port together (SO_REUSEPORT)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per worker")
    p.add_argument("--kv-backend", default="tcp", choices=["tcp", "nixl"])
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--ctx-router", default="prefix_aware")
    p.add_argument("--gen-router", default="least_loaded")
    p.add_argument("--local-prefill-max-tokens", type=int, default=0,
                     help="prompts of at most this many tokens (or all but this many cached "
                          "on a generation worker) are prefilled there, skipping the context "
                          "worker and the KV transfer (default 0: off)")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--max-in-flight", type=int, default=None,
                     help="requests served at once; past it, 503 with Retry-After at once "
                          "(default 4096)")
    p.add_argument("--first-byte-timeout", type=float, default=None,
                     help="seconds a worker may take to a CTX answer or a GEN stream's first "
                          "event (default 600)")
    p.add_argument("--idle-timeout", type=float, default=None,
                     help="seconds a GEN stream may go without sending anything (default 120)")
    from splitserve.cli import add_api_key_arguments
    add_api_key_arguments(p, "clients must send `Authorization: Bearer <key>` with one of "
                             "these keys to the orchestrator and the workers (default: "
                             "$SPLITSERVE_API_KEY, comma-separated; none: open). The internal "
                             "secret is $SPLITSERVE_INTERNAL_SECRET, else generated")
