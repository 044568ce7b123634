"""Every command and `LLM` start from the config dataclasses' defaults and offer exactly the
choices the configs accept: `serve`, the workers `up` starts, `up`'s orchestrator,
`bench engine`, `chat` and `LLM(...)` cannot drift from splitserve/config.py and
server/config.py (or from each other)."""

from __future__ import annotations

import argparse
import functools
import inspect
from dataclasses import replace

import pytest

from splitserve import LLM
from splitserve.cli import build_parser, server_config
from splitserve.config import (LOAD_FORMATS, QUANTIZATIONS, CacheConfig, EngineConfig,
                               SchedulerConfig)
from splitserve.kv import TRANSPORT_MODULES
from splitserve.listen import local_url
from splitserve.orchestrator.cluster import ClusterConfig, PoolConfig
from splitserve.orchestrator.up import cluster_config, worker_command
from splitserve.placement import WorkerPlan
from splitserve.protocol.roles import WORKER_ROLES as ROLES
from splitserve.server.config import ServerConfig

ENGINE_COMMANDS = [("serve",), ("up",), ("bench", "engine"), ("chat",)]
ARGS = {("chat",): ["hi"]}   # positional arguments a command needs


@pytest.fixture(autouse=True)
def no_environment(monkeypatch):
    for name in ("SPLITSERVE_INTERNAL_SECRET", "SPLITSERVE_API_KEY", "SPLITSERVE_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def command(path: tuple[str, ...]) -> argparse.ArgumentParser:
    parser = build_parser()
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


def choices(path: tuple[str, ...], flag: str) -> tuple:
    action = next(a for a in command(path)._actions if flag in a.option_strings)
    return tuple(action.choices)


def same_worker(a: ServerConfig, b: ServerConfig) -> bool:
    """Equal but for the instance id, which is new for every config."""
    return replace(a, instance_id="i") == replace(b, instance_id="i")


def test_serve_without_flags_is_the_configs_defaults():
    assert same_worker(server_config(parse("serve")), ServerConfig())


def test_up_starts_workers_on_the_configs_defaults():
    args = parse("up")
    args.log_level = "INFO"
    argv = worker_command(args, "gen", 9001, WorkerPlan((1,), 1, (0,)))
    worker = server_config(parse(*argv[argv.index("--log-level"):]), 1)
    # What up decides for each worker: its role, port, CPUs and orchestrator.
    expected = ServerConfig(role="gen", port=9001, register=local_url(args.host, args.port),
                            engine=EngineConfig(num_threads=1))
    assert same_worker(worker, expected)


def test_ups_kv_lease_reaches_every_worker():
    args = parse("up", "--kv-lease-seconds", "3")
    args.log_level = "INFO"
    argv = worker_command(args, "ctx", 9001, WorkerPlan((1,), 1, (0,)))
    assert server_config(parse(*argv[argv.index("--log-level"):]), 1).engine.kv.lease_seconds == 3


def test_ups_enforce_eager_reaches_every_worker():
    args = parse("up", "--enforce-eager")
    args.log_level = "INFO"
    argv = worker_command(args, "gen", 9001, WorkerPlan((1,), 1, (0,)))
    assert server_config(parse(*argv[argv.index("--log-level"):]), 1).engine.enforce_eager


@pytest.mark.parametrize("flags, chunk", [((), 0), (("--local-prefill-when-queued",), 32),
                                          (("--local-prefill-when-queued",
                                            "--max-prefill-tokens-while-decoding", "8"), 8)])
def test_ups_queue_driven_local_prefill_bounds_every_workers_prefill_beside_decodes(flags,
                                                                                   chunk):
    args = parse("up", *flags)
    args.log_level = "INFO"
    for role in ("ctx", "gen"):       # a role is a label: the planner may move either
        argv = worker_command(args, role, 9001, WorkerPlan((1,), 1, (0,)))
        worker = server_config(parse(*argv[argv.index("--log-level"):]), 1)
        assert worker.engine.scheduler.max_prefill_tokens_while_decoding == chunk
    config = cluster_config(args, {"SPLITSERVE_INTERNAL_SECRET": "s"})
    assert config.local_prefill_when_queued == bool(flags)


def test_ups_orchestrator_is_the_configs_defaults():
    config = cluster_config(parse("up"), {"SPLITSERVE_INTERNAL_SECRET": "s"})
    defaults = ClusterConfig(PoolConfig(()), PoolConfig(()))
    # up's own: the routers of its pools, its secret, and the model it names
    assert replace(config, context_servers=defaults.context_servers, internal_secret=None,
                   generation_servers=defaults.generation_servers, model=None) == defaults


def test_bench_engine_without_flags_is_the_configs_engine():
    from splitserve.bench.engine.main import engine_config
    config = engine_config(parse("bench", "engine"))
    # the benchmark's own: seeded, no prefix caching, a whole prefill per step
    assert config.cache == CacheConfig(enable_prefix_caching=False)
    assert replace(config, seed=None, cache=CacheConfig(),
                   scheduler=SchedulerConfig()) == EngineConfig()


def test_chat_without_flags_is_the_configs_model_and_dtype():
    args = parse("chat", "hi")
    assert (args.model, args.dtype) == (EngineConfig.model, EngineConfig.dtype)


@pytest.mark.parametrize("path", ENGINE_COMMANDS, ids=" ".join)
def test_dtype_offers_what_the_config_accepts(path):
    offered = choices(path, "--dtype")
    accepted = []
    for dtype in ("auto", "float32", "bfloat16", "float16", "float64", "int8", "half"):
        try:
            EngineConfig(dtype=dtype)
        except ValueError:
            continue
        accepted.append(dtype)
    assert set(offered) == set(accepted)
    assert parse(*path, *ARGS.get(path, []), "--dtype", "float16").dtype == "float16"


@pytest.mark.parametrize("path, flag, expected", [
    pytest.param(("serve",), "--quantization", QUANTIZATIONS, id="serve --quantization"),
    pytest.param(("bench", "engine"), "--quantization", QUANTIZATIONS,
                 id="bench engine --quantization"),
    pytest.param(("serve",), "--kv-backend", tuple(TRANSPORT_MODULES), id="serve --kv-backend"),
    # none moves no KV: a cluster's generation_only output would be garbage
    pytest.param(("up",), "--kv-backend", tuple(b for b in TRANSPORT_MODULES if b != "none"),
                 id="up --kv-backend"),
    pytest.param(("serve",), "--role", ROLES, id="serve --role"),
    *(pytest.param(path, "--load-format", LOAD_FORMATS, id=" ".join(path) + " --load-format")
      for path in (("serve",), ("up",), ("bench", "engine"), ("chat",))),
])
def test_choice_lists_are_the_configs(path, flag, expected):
    assert set(choices(path, flag)) == set(expected)


# LLM's keyword -> the EngineConfig field it sets.
LLM_FIELDS = {
    "model": "model", "device": "device", "load_format": "load_format", "dtype": "dtype",
    "quantization": "quantization", "gpu_memory_utilization": "gpu_memory_utilization",
    "max_model_len": "max_model_len", "seed": "seed", "num_threads": "num_threads",
    "enforce_eager": "enforce_eager", "cuda_graph_max_batch": "cuda_graph_max_batch",
    "block_size": "cache.block_size", "num_blocks": "cache.num_blocks",
    "kv_cache_memory_bytes": "cache.memory_bytes",
    "enable_prefix_caching": "cache.enable_prefix_caching",
    "max_num_batched_tokens": "scheduler.max_num_batched_tokens",
    "max_num_seqs": "scheduler.max_num_seqs",
}


def test_llm_keywords_default_to_the_configs():
    params = inspect.signature(LLM).parameters
    assert set(params) == set(LLM_FIELDS)    # a new keyword needs its row above
    defaults = EngineConfig()
    for name, path in LLM_FIELDS.items():
        want = functools.reduce(getattr, path.split("."), defaults)
        assert params[name].default == want, f"LLM({name}=...) defaults to " \
            f"{params[name].default!r}, EngineConfig.{path} to {want!r}"


def test_llm_without_keywords_runs_the_configs_engine():
    llm = LLM("tiny-random", num_threads=1)
    assert llm.engine.config == EngineConfig(model="tiny-random", num_threads=1)
