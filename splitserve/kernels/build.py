"""Builds the engine's C kernels for this machine, once, and loads them with ctypes.

A kernel source (splitserve/kernels/*.c, with the headers beside it) is plain C11 with no
Python or torch headers, so it compiles in about a second. It is built with `-march=native`: the same source gets
AVX512 code on a CPU that has it and AVX2 code on one that does not. The shared object is
(SPLITSERVE_KERNEL_MARCH names another target) and cached under SPLITSERVE_KERNEL_CACHE
(default ~/.cache/splitserve/kernels), named by a
digest of the source, the compiler's version, the flags and the CPU's flags, so a changed
source, compiler or machine builds afresh. Concurrent builds (several workers starting at
once) each write a private file and rename it into place; the last rename wins, and every
one of them is the same build.

A cached file that no longer loads (damaged after its build) is built again. No compiler, a
failed build or SPLITSERVE_NATIVE_KERNELS=0 gives None: the engine then
runs its PyTorch path and logs why once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from splitserve import envs

logger = logging.getLogger(__name__)

_SOURCES = Path(__file__).parent
KERNELS = ("attention", "attention_decode", "elementwise", "gemv", "gemv_bf16", "pool")
# -ffp-contract=fast: ISO C mode would otherwise keep every a * b + c as two roundings and
# two instructions, where the kernels want one FMA.
FLAGS = ("-O3", "-fPIC", "-shared", "-std=c11", "-ffp-contract=fast", "-fno-math-errno",
         "-fno-trapping-math", "-Wall", "-Werror")
# The attention kernels fuse exactly the multiply-adds they name (vec.h: vfma) and no
# others, so a prefill chunk and a decode step round a query's sums alike (attention_decode.c).
_KERNEL_FLAGS = {"attention": ("-ffp-contract=off",), "attention_decode": ("-ffp-contract=off",)}


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return ""


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _version(cc: str) -> str:
    out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    return out.stdout


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """The kernel library `name` (splitserve/kernels/<name>.c) built for this machine, or
    None when it cannot be had (the reason is logged once)."""
    return build_for(name, envs.kernel_march())


def status() -> str:
    """What the engine's C kernels run as here, for log lines and reports. Builds them
    all first if need be (about a second each, once per machine), so an engine that asks at
    start does not build one during its first request."""
    if not envs.native_kernels():
        return "PyTorch kernels (SPLITSERVE_NATIVE_KERNELS=0)"
    if any(load(name) is None for name in KERNELS):
        return "PyTorch kernels (the C kernels could not be built; see the warning above)"
    return f"C kernels for -march={envs.kernel_march()}"


def build_for(name: str, march: str) -> ctypes.CDLL | None:
    """`name` built with -march=`march` ("native", or e.g. "haswell" for AVX2 code)."""
    if not envs.native_kernels():
        logger.info("native kernels off (SPLITSERVE_NATIVE_KERNELS=0): %s runs in PyTorch", name)
        return None
    cc = _compiler()
    if cc is None:
        logger.warning("no C compiler found (cc, gcc or $CC): %s runs in PyTorch, slower", name)
        return None
    try:
        path, cached = _build(cc, name, march)
        try:
            return ctypes.CDLL(str(path))
        except OSError as e:
            if not cached:
                raise
            # A cached file damaged after its build (truncated, overwritten): build it again.
            logger.warning("the cached %s kernel does not load (%s): building it again", name, e)
            return ctypes.CDLL(str(_build(cc, name, march, again=True)[0]))
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("building the %s kernel failed, it runs in PyTorch: %s", name, e)
        return None


def _build(cc: str, name: str, march: str, again: bool = False) -> tuple[Path, bool]:
    """-> (the shared object, whether it came from the cache); `again` builds it even if
    the cache holds it."""
    source = b"".join(p.read_bytes() for p in [_SOURCES / f"{name}.c", *sorted(_SOURCES.glob("*.h"))])
    flags = (*FLAGS, *_KERNEL_FLAGS.get(name, ()), f"-march={march}", f"-mtune={march}")
    digest = hashlib.sha256(b"\0".join([source, _version(cc).encode(), " ".join(flags).encode(),
                                         _cpu_flags().encode()])).hexdigest()[:16]
    cache = Path(envs.kernel_cache())
    target = cache / f"{name}-{digest}.so"
    if target.exists() and not again:
        return target, True
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        out = subprocess.run([cc, *flags, "-o", tmp, str(_SOURCES / f"{name}.c"), "-lm"],
                             capture_output=True, text=True, timeout=300)
        if out.returncode:
            raise OSError(f"{cc} exited {out.returncode}: {out.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("built the %s kernel for -march=%s: %s", name, march, target)
    return target, False
