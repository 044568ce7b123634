"""`splitserve up`'s command line (up.py runs it). Kept apart from up.py so that building
the parser imports no more of the orchestrator than the config whose defaults it shows.
The workers' engine flags are `serve`'s own (splitserve/flags.py), passed on to each."""

from __future__ import annotations

from splitserve.config import EngineConfig, SchedulerConfig
from splitserve.flags import add_flags, config_flags
from splitserve.orchestrator.cluster import ClusterConfig
from splitserve.protocol.tool_parsers import ToolParserFlag

# A GEN's prompt tokens per step beside its decodes under --local-prefill-when-queued:
# on one core in float32, 8 decodes at 2k context cost about what 17-31 prompt tokens do,
# so a step stays within about 3x a decode step's time (docs/tuning.md).
QUEUED_PREFILL_CHUNK = 32

# The config's KV transports but none, which moves no KV: a cluster's generation_only output
# would be garbage (bench frontend only)
KV_BACKENDS = tuple(b for b in config_flags(EngineConfig)["--kv-backend"][2].choices
                    if b != "none")


def add_arguments(p) -> None:
    add_flags(p, EngineConfig, "--model", "--device", "--load-format", "--dtype", "--gpu-memory-utilization",
              "--enforce-eager",
              help={"--gpu-memory-utilization": "fraction of the GPU's memory each worker may "
                    "use (device cuda only; CTX and GEN sharing one GPU: at most 1 together)"})
    p.add_argument("--host", default=ClusterConfig.host,
                   help="address the orchestrator listens on (0.0.0.0: every interface); "
                        "the workers stay on --worker-host (default: %(default)s)")
    # The workers' own choice, not serve's default: exposing the orchestrator exposes no worker.
    p.add_argument("--worker-host", default="127.0.0.1",
                   help="address the workers listen on (default loopback: only this machine, "
                        "the orchestrator included, reaches them; 0.0.0.0 exposes them too)")
    p.add_argument("--port", type=int, default=ClusterConfig.port,
                   help="the orchestrator's; workers take the next ports (default: %(default)s)")
    p.add_argument("--num-ctx", type=int, default=1)
    p.add_argument("--num-gen", type=int, default=1)
    p.add_argument("--gen-api-servers", type=int, default=1,
                   help="front-end processes per GEN worker (serve --api-server-count)")
    p.add_argument("--orchestrators", type=int, default=ClusterConfig.processes,
                   help="orchestrator processes serving --port together, SO_REUSEPORT "
                        "(default: %(default)s)")
    add_flags(p, EngineConfig, "--threads", "--kv-backend", "--kv-cache-gib", "--kv-lease-seconds",
              help={"--threads": "torch threads of each worker's engine (default: one per CPU "
                                 "it gets)",
                    "--kv-backend": "how KV moves from CTX to GEN workers",
                    "--kv-cache-gib": "each worker's KV cache size in GiB",
                    "--kv-lease-seconds": "seconds a context worker holds a prompt's KV for "
                                          "its pull"},
              choices={"--kv-backend": KV_BACKENDS})
    p.add_argument("--ctx-router", default="prefix_aware")
    p.add_argument("--gen-router", default="least_loaded")
    p.add_argument("--local-prefill-max-tokens", type=int,
                   default=ClusterConfig.local_prefill_max_tokens,
                   help="prompts of at most this many tokens (or all but this many cached "
                        "on a generation worker) are prefilled there, skipping the context "
                        "worker and the KV transfer (default %(default)s: off)")
    p.add_argument("--local-prefill-when-queued", action="store_true",
                   help="a long prompt is prefilled on a generation worker too when the "
                        "context workers' queue would delay its first token more than that "
                        "worker would take (it runs --max-prefill-tokens-while-decoding)")
    p.add_argument("--local-prefill-gen-slowdown", type=float,
                   default=ClusterConfig.local_prefill_gen_slowdown,
                   help="how many times longer a generation worker that runs requests takes "
                        "to prefill a prompt than a context worker (default: %(default)s)")
    add_flags(p, SchedulerConfig, "--max-prefill-tokens-while-decoding",
              help={"--max-prefill-tokens-while-decoding": "each worker's: prompt tokens a "
                    "step computes at most while other requests decode; 0: "
                    f"{QUEUED_PREFILL_CHUNK} with --local-prefill-when-queued, else the "
                    "whole step"})
    add_flags(p, ClusterConfig, "--chat-template", "--trust-request-chat-template")
    add_flags(p, ToolParserFlag, "--tool-call-parser")
    from splitserve.cli import add_worker_flags
    add_worker_flags(p, "--grammar-compile-seconds", "--drain-grace-seconds")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--max-in-flight", type=int, default=ClusterConfig.max_in_flight,
                   help="requests served at once; past it, 503 with Retry-After at once "
                        "(default: %(default)s)")
    p.add_argument("--first-byte-timeout", type=float, default=ClusterConfig.first_byte_timeout,
                   help="seconds a worker may take to a CTX answer or a GEN stream's first "
                        "event (default: %(default)s)")
    p.add_argument("--idle-timeout", type=float, default=ClusterConfig.idle_timeout,
                   help="seconds a GEN stream may go without sending anything (default: "
                        "%(default)s)")
    p.add_argument("--disable-log-requests", action="store_true",
                   help="no log line per finished request, on the orchestrator and the workers")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="no throughput line from the workers every 10 s while there is traffic")
    from splitserve.planner.config import PlannerConfig as Planner
    p.add_argument("--planner", action="store_true",
                   help="also run `splitserve planner`: it moves workers between the pools "
                        "to keep --ttft-p90-ms / --itl-p90-ms (give at least one)")
    p.add_argument("--ttft-p90-ms", type=float, default=None,
                   help="the planner's SLO on the context pool's time to first token")
    p.add_argument("--itl-p90-ms", type=float, default=None,
                   help="the planner's SLO on the generation pool's inter-token latency")
    p.add_argument("--max-workers", type=int, default=None,
                   help="the planner may start workers up to this many in all (and stop them "
                        "again down to one per pool); each has a slot reserved at start: a "
                        "port, a KV port, CPUs (default: none, it only moves workers)")
    p.add_argument("--planner-interval", type=float, default=Planner.interval,
                   help="seconds between the planner's looks (default: %(default)s)")
    p.add_argument("--planner-window", type=float, default=Planner.window,
                   help="seconds of metrics a planner decision reads (default: %(default)s)")
    p.add_argument("--planner-cooldown", type=float, default=Planner.cooldown,
                   help="seconds after a move before the planner's next (default: %(default)s)")
    from splitserve.cli import add_allowed_origins_argument
    add_allowed_origins_argument(p, "(the orchestrator's; default: none)")
    from splitserve.cli import add_api_key_arguments
    add_api_key_arguments(p, "clients must send `Authorization: Bearer <key>` with one of "
                             "these keys to the orchestrator and the workers (default: "
                             "$SPLITSERVE_API_KEY, comma-separated; none: open). The internal "
                             "secret is $SPLITSERVE_INTERNAL_SECRET, else generated")
