"""Every environment variable splitserve reads, in one place."""

from __future__ import annotations

import os


def log_level() -> str:
    """SPLITSERVE_LOG_LEVEL: logging level of every splitserve process (default INFO)."""
    return os.environ.get("SPLITSERVE_LOG_LEVEL", "INFO").upper()


def num_threads() -> int | None:
    """SPLITSERVE_NUM_THREADS: torch intra-op threads of engine processes when the command
    line does not say (default: the CPU plan's, see splitserve/placement.py)."""
    value = os.environ.get("SPLITSERVE_NUM_THREADS")
    return int(value) if value else None


ENGINE_CPUS = "SPLITSERVE_ENGINE_CPUS"


def engine_cpus() -> str | None:
    """SPLITSERVE_ENGINE_CPUS: the CPUs (a list like 0,2-3) engine processes are pinned to
    when the command line does not say. `serve` sets it from its CPU plan for the engine
    process it starts; unset there, the engine is not pinned."""
    return os.environ.get(ENGINE_CPUS) or None


ENGINE_HELPER_CPU = "SPLITSERVE_ENGINE_HELPER_CPU"


def engine_helper_cpu() -> int | None:
    """SPLITSERVE_ENGINE_HELPER_CPU: the CPU whose idle time a one-thread engine's C kernels
    borrow (splitserve/model/native_pool.py). `serve` sets it to its front-end's CPU when
    that is not one of the engine's and no container CPU quota below the CPUs makes idle
    time cost (placement.WorkerPlan.helper_cpu); `none` turns the helper off."""
    value = os.environ.get(ENGINE_HELPER_CPU, "").strip().lower()
    if value in ("", "none"):
        return None
    if not value.isdigit():
        raise ValueError(f"{ENGINE_HELPER_CPU} must be a CPU number or none, got {value!r}")
    return int(value)


PARENT_STDIN = "SPLITSERVE_PARENT_STDIN"


def parent_stdin() -> bool:
    """SPLITSERVE_PARENT_STDIN=1: this worker's stdin is a pipe from the process that started
    it (`splitserve up`), and EOF there means that process is gone, however it ended: the
    worker then stops as on SIGTERM instead of serving on as an orphan."""
    return os.environ.get(PARENT_STDIN) == "1"


PLANNER_SCALE_FD = "SPLITSERVE_PLANNER_SCALE_FD"


def planner_scale_fd() -> int | None:
    """SPLITSERVE_PLANNER_SCALE_FD: the descriptor of the pipe a planner asks for workers
    on, set by the process that started it and may start and stop workers (`up --planner
    --max-workers`: orchestrator/up.py); unset, the planner only moves workers."""
    value = os.environ.get(PLANNER_SCALE_FD, "")
    return int(value) if value.isdigit() else None


API_KEY = "SPLITSERVE_API_KEY"


def api_keys() -> tuple[str, ...]:
    """SPLITSERVE_API_KEY: the keys public endpoints take (`Authorization: Bearer`), one or
    several separated by commas, when no --api-key is given; empty: none."""
    return tuple(k for k in os.environ.get(API_KEY, "").split(",") if k)


def internal_secret() -> str | None:
    """SPLITSERVE_INTERNAL_SECRET: the cluster's internal secret when no --internal-secret
    is given. `splitserve up` sets it for the processes it starts, so no command line shows it."""
    return os.environ.get("SPLITSERVE_INTERNAL_SECRET") or None


def native_kernels() -> bool:
    """SPLITSERVE_NATIVE_KERNELS: 0 runs every engine kernel in PyTorch instead of the C
    kernels splitserve/kernels/build.py compiles for this CPU (default 1)."""
    return os.environ.get("SPLITSERVE_NATIVE_KERNELS", "1") != "0"


def kernel_cache() -> str:
    """SPLITSERVE_KERNEL_CACHE: where the C kernels built for this machine are kept
    (default ~/.cache/splitserve/kernels)."""
    return os.environ.get("SPLITSERVE_KERNEL_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "splitserve", "kernels")


KV_FAULTS = "SPLITSERVE_KV_FAULTS"


def kv_faults() -> str | None:
    """SPLITSERVE_KV_FAULTS: a directory from which the KV transports' serving side takes
    faults to inject into the pulls it answers (kv/faults.py), for fault campaigns
    (`splitserve bench chaos`). Unset (the default): no fault is ever injected."""
    return os.environ.get(KV_FAULTS) or None


def kernel_march() -> str:
    """SPLITSERVE_KERNEL_MARCH: the -march the C kernels are built for (default native, this
    CPU; e.g. haswell gives AVX2 code on an AVX-512 machine, to measure what an AVX2 one gets)."""
    return os.environ.get("SPLITSERVE_KERNEL_MARCH") or "native"


ATTENTION = "SPLITSERVE_ATTENTION"


def attention_backend() -> str | None:
    """SPLITSERVE_ATTENTION: `torch` runs a CPU engine's attention in plain torch ops (gather
    blocks + SDPA, the backend a GPU uses) instead of the C kernels, so tests cover it; `native`
    or unset: the platform's choice."""
    value = os.environ.get(ATTENTION, "").strip().lower()
    if value not in ("", "native", "torch"):
        raise ValueError(f"{ATTENTION} must be native or torch, got {value!r}")
    return value or None
