"""splitserve command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def _bench(args) -> int:
    if args.bench_cmd == "engine":
        from splitserve.bench.engine import main as engine
        try:
            engine.engine_config(args)
        except ValueError as exc:
            _bad_config("bench engine", exc)
        engine.place(args)
        engine.run(args)
    elif args.bench_cmd == "serve":
        from splitserve.bench.serve import main as serve
        serve.run(args)
    elif args.bench_cmd == "frontend":
        from splitserve.bench.frontend import main as frontend
        return frontend.run(args)
    elif args.bench_cmd == "chaos":
        from splitserve.bench.chaos import main as chaos
        return chaos.run(args)
    elif args.bench_cmd == "planner":
        from splitserve.bench.planner import main as planner
        return planner.run(args)
    elif args.bench_cmd == "plot":
        from splitserve.bench import plot
        for path in plot.run(args):
            print(path)
    return 0


def _chat(args) -> int:
    from splitserve import LLM, SamplingParams
    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    out = llm.chat([{"role": "user", "content": args.message}], params)[0]
    print(out.outputs[0].text)
    return 0


def _add_placement_arguments(p) -> None:
    from splitserve.placement import cpu_list_argument
    p.add_argument("--cpus", type=cpu_list_argument, default=None,
                   help="CPUs of the engine, e.g. 1-3 (default: all usable but the first, "
                        "kept for the front-end)")
    p.add_argument("--frontend-cpus", type=cpu_list_argument, default=None,
                   help="CPUs of the front-end (default: those the engine does not get)")


def _add_secret_arguments(p, what: str, isolation_default: str | None = "none") -> None:
    add_api_key_arguments(p, f"clients of {what} must send `Authorization: Bearer <key>` "
                             f"with one of these keys on /v1/*, /tokenize and /detokenize "
                             f"(default: $SPLITSERVE_API_KEY, comma-separated; none: open)",
                          isolation_default)
    p.add_argument("--internal-secret", default=None,
                   help="the cluster's internal secret, from which workers prove who they are "
                        "and the orchestrator's requests to them are authorized, never sent "
                        "itself (default: $SPLITSERVE_INTERNAL_SECRET; prefer the "
                        "variable: every local user can read a command line)")


def add_worker_flags(p, *names: str) -> None:
    """`serve`'s flags of these names (server/config.py), for `up` to pass to its workers."""
    from splitserve.flags import add_flags
    from splitserve.server.config import ServerConfig
    add_flags(p, ServerConfig, *names)


def add_allowed_origins_argument(p, more: str) -> None:
    from splitserve.httpd.cors import parse_origins
    p.add_argument("--allowed-origins", type=parse_origins, default=None,
                   help="browser origins allowed cross-origin requests (CORS), "
                        f"comma-separated, * for any {more}")


def add_api_key_arguments(p, help: str, isolation_default: str | None = "none") -> None:
    """--api-key (vLLM's spelling: several after one flag, or the flag again) and
    --cache-isolation. isolation_default None: the cluster file's, else none."""
    from splitserve.protocol.cache_salt import ISOLATION_MODES
    p.add_argument("--api-key", action="extend", nargs="+", default=None, metavar="KEY",
                   help=help)
    p.add_argument("--cache-isolation", choices=ISOLATION_MODES, default=isolation_default,
                   help="api_key: a client shares prefix-cache blocks only with clients of "
                        "its own API key (its cached_tokens and TTFT tell it nothing of other "
                        "tenants' prompts); none: with every request of the same cache_salt "
                        + ("(default: none)" if isolation_default else
                           "(default: the cluster file's cache_isolation, else none)"))


def server_config(args, threads: int | None = None):
    """`serve`'s ServerConfig: the secrets from the command line or the environment, and
    the engine's torch threads (placement.py's plan). Warns if it serves beyond loopback
    with no API key."""
    from splitserve import envs
    from splitserve.config import EngineConfig, KVTransferConfig
    from splitserve.flags import from_flags
    from splitserve.listen import warn_if_open
    from splitserve.server.config import ServerConfig
    secret = args.internal_secret or envs.internal_secret()
    # The engine process keys the KV channel with it (its config crosses pickled, not argv).
    engine = from_flags(EngineConfig, args,
                        num_threads=threads or args.threads or envs.num_threads(),
                        kv=from_flags(KVTransferConfig, args, secret=secret))
    config = from_flags(ServerConfig, args, engine=engine, internal_secret=secret,
                        api_key=tuple(args.api_key or envs.api_keys()),
                        cache_isolation=args.cache_isolation)
    warn_if_open(config.log_prefix, config.host, config.api_key)
    return config


def orchestrator_config(args):
    """`orchestrator`'s ClusterConfig: the YAML, then the command line's overrides; the
    secrets from the command line, the YAML or the environment. Warns if it serves beyond
    loopback with no API key."""
    from dataclasses import replace
    from splitserve import envs
    from splitserve.listen import warn_if_open
    from splitserve.orchestrator.cluster import ClusterConfig
    config = ClusterConfig.from_yaml(args.config)
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port),
                                   ("max_in_flight", args.max_in_flight),
                                   ("processes", args.processes),
                                   ("membership", args.membership)) if v is not None}
    # The command line, then the YAML, then the environment.
    overrides["api_key"] = tuple(args.api_key or config.api_key or envs.api_keys())
    if args.cache_isolation is not None:
        overrides["cache_isolation"] = args.cache_isolation
    if args.disable_log_requests:
        overrides["disable_log_requests"] = True
    if args.allowed_origins is not None:
        overrides["allowed_origins"] = args.allowed_origins
    overrides["internal_secret"] = (args.internal_secret or config.internal_secret
                                    or envs.internal_secret())
    config = replace(config, **overrides)
    warn_if_open("orch", config.host, config.api_key)
    return config


def _port_refused(log_prefix: str, host: str, port: int) -> bool:
    """Logs, in one line, why the server cannot listen on host:port (before it loads a
    model or starts a worker): True then."""
    from splitserve.listen import port_in_use
    problem = port_in_use(host, port)
    if problem is not None:
        logging.getLogger(__name__).error("%s: %s", log_prefix, problem)
    return problem is not None


def _bad_config(command: str, exc: Exception) -> None:
    """A flag or config file value the configuration refuses: a usage error (exit 2) that
    names it, not a traceback."""
    build_parser().error(f"{command}: {exc}")


def _place_worker(args):
    """The worker's CPU plan (splitserve/placement.py): pins this process, the front-end,
    and hands the engine process its CPUs through the environment it inherits."""
    from splitserve import envs, placement
    cpus = args.cpus or (envs.engine_cpus() and placement.parse_cpus(envs.engine_cpus()))
    plan = placement.plan_worker(placement.usable_cpus(), args.threads or envs.num_threads(),
                                 cpus, args.frontend_cpus)
    placement.pin_process(plan.frontend_cpus, "front-end")
    os.environ[envs.ENGINE_CPUS] = placement.format_cpus(plan.engine_cpus)
    if envs.ENGINE_HELPER_CPU not in os.environ and plan.helper_cpu is not None:
        os.environ[envs.ENGINE_HELPER_CPU] = str(plan.helper_cpu)
    return plan


def _stop_when_parent_is_gone() -> None:
    """With SPLITSERVE_PARENT_STDIN=1 (set by `up`): SIGTERM to this process once stdin, a
    pipe its parent holds open, reads EOF. The raw descriptor, not sys.stdin: a thread
    blocked in its buffered reader would hold that lock at interpreter exit."""
    import signal
    import threading

    def watch() -> None:
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            return
        logging.getLogger(__name__).warning("the process that started this worker is gone; "
                                            "stopping")
        os.kill(os.getpid(), signal.SIGTERM)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _serve(args) -> int:
    from splitserve import envs
    from splitserve.errors import ModelLoadError
    from splitserve.server.app import serve
    from splitserve.server.engine_process import EngineDeadError
    if envs.parent_stdin():
        _stop_when_parent_is_gone()
    try:
        plan = _place_worker(args)
        config = server_config(args, plan.engine_threads)
    except ValueError as exc:
        _bad_config("serve", exc)
    if _port_refused("%s:%d" % (args.role, args.port), config.host, config.port):
        return 1
    # The resolved dtype is logged once the engine is ready ("serving <model> (<dtype>)"):
    # resolving auto needs torch, which only the engine process loads.
    logging.getLogger(__name__).info("%s:%d: %s", args.role, args.port,
                                     plan.describe(config.api_server_count))
    try:
        serve(config)
    except (ModelLoadError, EngineDeadError) as exc:   # what kept it from starting
        logging.getLogger(__name__).error("%s:%d: %s", args.role, args.port, exc)
        return 1
    return 0


def _orchestrator(args) -> int:
    import asyncio
    from splitserve.orchestrator import fleet
    from splitserve.orchestrator.app import NO_SECRET, run_orchestrator
    import yaml
    if args.fleet_child:
        return fleet.run_child(args.fleet_child)
    if not args.config:
        build_parser().error("orchestrator: -c/--config is required")
    try:
        config = orchestrator_config(args)
    except (ValueError, OSError, yaml.YAMLError) as exc:
        _bad_config("orchestrator", exc)
    if not config.internal_secret:
        logging.getLogger("splitserve.orchestrator").error("orch: %s", NO_SECRET)
        return 2
    if _port_refused("orch", config.host, config.port):
        return 1
    if config.processes > 1:
        asyncio.run(fleet.run_fleet(config, args.log_level))
    else:
        asyncio.run(run_orchestrator(config))
    return 0


def _up(args) -> int:
    from splitserve.orchestrator.up import up
    return up(args)


def _planner(args) -> int:
    import asyncio
    from splitserve import envs
    from splitserve.flags import from_flags
    from splitserve.planner.config import PlannerConfig
    from splitserve.planner.main import run_planner
    try:
        config = from_flags(PlannerConfig, args)
    except ValueError as exc:
        build_parser().error(f"planner: {exc}")
    if envs.parent_stdin():
        _stop_when_parent_is_gone()
    try:
        asyncio.run(run_planner(config))
    except ValueError as exc:     # no internal secret
        logging.getLogger("splitserve.planner").error("planner: %s", exc)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    from splitserve.config import EngineConfig
    from splitserve.flags import add_flags
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__)
    parser.add_argument("--log-level", default=None,
                        help="default: $SPLITSERVE_LOG_LEVEL, else INFO")
    sub = parser.add_subparsers(dest="cmd", required=True)

    chat = sub.add_parser("chat", help="answer one chat message offline")
    chat.add_argument("message")
    add_flags(chat, EngineConfig, "--model", "--load-format", "--dtype")
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--max-tokens", type=int, default=128)
    chat.set_defaults(func=_chat)

    from splitserve.server.config import ServerConfig
    serve = sub.add_parser("serve", help="run one worker: OpenAI HTTP front-end + engine")
    add_flags(serve, EngineConfig)
    _add_placement_arguments(serve)
    add_flags(serve, ServerConfig)
    _add_secret_arguments(serve, "this worker")
    serve.set_defaults(func=_serve)

    from splitserve.orchestrator.cluster import ClusterConfig
    orch = sub.add_parser("orchestrator", help="the cluster's front door, from a cluster YAML")
    orch.add_argument("-c", "--config", default=None, help="the cluster YAML (required)")
    orch.add_argument("--processes", type=int, default=None,
                      help="orchestrator processes serving the port together (SO_REUSEPORT; "
                           f"overrides the YAML's `processes`, default {ClusterConfig.processes})")
    orch.add_argument("--fleet-child", default=None, help=argparse.SUPPRESS)
    orch.add_argument("--host", default=None)
    orch.add_argument("--port", type=int, default=None)
    orch.add_argument("--max-in-flight", type=int, default=None,
                      help="requests served at once; past it, 503 at once (overrides the YAML)")
    orch.add_argument("--membership", default=None, metavar="etcd://HOST:PORT/PREFIX",
                      help="read the registered workers from etcd under this prefix, with "
                           "every other orchestrator watching it (overrides the YAML's "
                           "membership; default: kept by this orchestrator)")
    add_allowed_origins_argument(orch, "(overrides the YAML's allowed_origins)")
    orch.add_argument("--disable-log-requests", action="store_true",
                      help="no log line per finished request (overrides the YAML's "
                           "disable_log_requests)")
    _add_secret_arguments(orch, "the cluster", isolation_default=None)
    orch.set_defaults(func=_orchestrator)

    from splitserve.orchestrator.up_args import add_arguments as add_up_arguments
    upp = sub.add_parser("up", help="a local cluster: orchestrator + CTX + GEN workers")
    add_up_arguments(upp)
    upp.set_defaults(func=_up)

    from splitserve.planner.config import PlannerConfig
    planner = sub.add_parser("planner", help="move workers between the context and "
                             "generation pools to keep TTFT and ITL within SLOs")
    add_flags(planner, PlannerConfig)
    planner.set_defaults(func=_planner)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_cmd", required=True)
    from splitserve.bench.engine import main as engine
    engine.add_arguments(bench_sub.add_parser("engine", help="engine prefill/decode tok/s"))
    from splitserve.bench.serve import main as bench_serve
    bench_serve.add_arguments(bench_sub.add_parser(
        "serve", help="load-test an OpenAI-compatible server: TTFT, TPOT, ITL, throughput"))
    from splitserve.bench.frontend import main as bench_frontend
    bench_frontend.add_arguments(bench_sub.add_parser(
        "frontend", help="the GEN front-end's cost per token relay mode vs prompt length "
                         "and concurrency"))
    from splitserve.bench.planner import main as bench_planner
    bench_planner.add_arguments(bench_sub.add_parser(
        "planner", help="goodput on a swinging input:output workload, every fixed split "
                        "against the planner"))
    from splitserve.bench.chaos import main as bench_chaos
    bench_chaos.add_arguments(bench_sub.add_parser(
        "chaos", help="a randomized fault campaign against a local cluster, checking "
                      "invariants; exit 0 only if all hold"))
    from splitserve.bench import plot as bench_plot
    bench_plot.add_arguments(bench_sub.add_parser(
        "plot", help="PNG plots (latency CDFs, metric vs concurrency) from `bench serve` results"))
    from splitserve.bench.report import main as bench_report
    bench_report.add_arguments(bench_sub.add_parser(       # sets its own func
        "report", help="run every benchmark and regenerate docs/benchmarks.md"))
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from splitserve import envs
    # The flag wins over the environment; engine processes read the level from it.
    args.log_level = (args.log_level or envs.log_level()).upper()
    os.environ["SPLITSERVE_LOG_LEVEL"] = args.log_level
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(message)s")
    # The secret known now; values read or derived later are registered where they are.
    from splitserve import redact
    redact.install(getattr(args, "internal_secret", None), envs.internal_secret())
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
