"""Where `splitserve bench report` runs: the machine (and whether it computes bfloat16
natively), how busy other processes keep its shared cores, and the git commit."""

from __future__ import annotations

import os
import resource
import subprocess
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitserve.bench.report.steps import Service

_TICK = os.sysconf("SC_CLK_TCK")
BACKGROUND = ("background: how many cores other processes on this shared VM kept busy "
              "during the step (/proc/stat minus the benchmark's own processes)")


def machine() -> dict:
    """nproc, CPU model, memory and the ISA flags that decide bfloat16 speed (/proc)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
        with open("/proc/meminfo") as f:
            fields["mem_kib"] = next(ln.split()[1] for ln in f if ln.startswith("MemTotal:"))
    except (OSError, StopIteration):
        pass
    flags = set(fields.get("flags", "").split())
    return {"nproc": os.cpu_count(), "cpu_model": fields.get("model name", "unknown CPU"),
            "memory_gib": int(fields.get("mem_kib", 0)) / (1 << 20),
            "isa": [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile",
                                "amx_bf16") if f in flags],
            "native_bf16": bool(flags & {"avx512_bf16", "amx_bf16"})}


def speed_probe(seconds: float = 0.5) -> float:
    """GFLOP/s of one fixed float32 matmul (512x576 by 576x3072, all cores) repeated for
    about `seconds`. The same work every time: the shared VM's slow phases, which no
    process count shows, show here as a lower number."""
    import torch
    a, b = torch.ones(512, 576), torch.ones(576, 3072)
    torch.mm(a, b)
    n, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        torch.mm(a, b)
        n += 1
    return 2 * 512 * 576 * 3072 * n / elapsed / 1e9


def torch_isa() -> str:
    """The instruction set PyTorch's CPU kernels run at here (AVX2, AVX512, ...)."""
    import torch
    return torch.backends.cpu.get_cpu_capability()


def machine_line() -> str:
    m = machine()
    bf16 = "yes" if m["native_bf16"] else "no (no AVX512-BF16, no AMX)"
    return (f"{m['nproc']} cores ({m['cpu_model']}, {m['memory_gib']:.0f} GiB), ISA flags: "
            f"{', '.join(m['isa']) or 'no AVX2/AVX512'}; native bfloat16: {bf16}")


class LoadProbe:
    """How many cores processes other than the report's kept busy since construction (the
    VM is shared): the machine's CPU time (/proc/stat) minus the report's own, its reaped
    children's, and that of the live process groups of `services` (workers and engines)."""

    def __init__(self, *services: Service):
        self.services = services
        self.t0, self.machine0, self.own0 = time.monotonic(), machine_cpu_s(), self._own_s()

    def _own_s(self) -> float:
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return (time.process_time() + kids.ru_utime + kids.ru_stime
                + sum(_group_cpu_s(s.proc.pid) for s in self.services))

    def cores(self) -> float:
        other = (machine_cpu_s() - self.machine0) - (self._own_s() - self.own0)
        return max(other, 0.0) / max(time.monotonic() - self.t0, 1e-9)


def machine_cpu_s() -> float:
    with open("/proc/stat") as f:      # cpu  user nice system idle iowait irq softirq ...
        user, nice, system, _idle, _iowait, irq, softirq = map(int, f.readline().split()[1:8])
    return (user + nice + system + irq + softirq) / _TICK


def _group_stats(pgid: int) -> list[list[str]]:
    """/proc/PID/stat fields (after the command name) of a process group's live members."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            found.append(fields)
    return found


def _group_cpu_s(pgid: int) -> float:
    """CPU seconds of a process group's live members, and of the children they reaped."""
    return sum(sum(map(int, f[11:15])) for f in _group_stats(pgid)) / _TICK  # utime..cstime


def live_in_group(pgid: int) -> int:
    """How many processes of the group are left, zombies not counted (they hold no CPU)."""
    return sum(1 for f in _group_stats(pgid) if f[0] != "Z")


def git_commit() -> str:
    def git(*args):
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10).stdout
    try:
        commit = git("rev-parse", "--short", "HEAD").strip() or "unknown"
        dirty = git("status", "--porcelain", "--untracked-files=no").strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + (" (with uncommitted changes)" if dirty else "")
