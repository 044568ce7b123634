"""`splitserve up`'s workers and a fleet's orchestrator processes (fleet.py): child
processes restarted when they exit, while the others keep serving. A child can be added
while they run, and retired: stopped with SIGTERM and not started again (the planner's
scaling, orchestrator/up.py).

A worker that exits is started again after a delay that doubles with each exit (1 s up to
30 s), back to 1 s once it has run for a minute: a worker that cannot start does not spin.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import time
from typing import Callable

logger = logging.getLogger(__name__)

BACKOFF_MIN, BACKOFF_MAX = 1.0, 30.0
STABLE_AFTER = 60.0   # seconds of running that reset the backoff
POLL_INTERVAL = 0.25


class WorkerChild:
    """One child: its command, its current process, its restart schedule. stdin: bytes
    written to each process's stdin, which then stays open, non-blocking (the child sees
    EOF when this process is gone; notify() writes to it)."""

    def __init__(self, role: str, url: str, cmd: list[str], env: dict,
                 stdin: bytes | None = None, what: str = "worker", pass_fds=()):
        self.role, self.url, self.cmd, self.env = role, url, cmd, env
        self.stdin, self.what, self.pass_fds = stdin, what, tuple(pass_fds)
        self.retired = False
        self.backoff = BACKOFF_MIN
        self.restart_at: float | None = None
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        if self.proc is not None and self.proc.stdin is not None:
            self.proc.stdin.close()
        if self.stdin is None:
            self.proc = subprocess.Popen(self.cmd, env=self.env, pass_fds=self.pass_fds)
        else:
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdin=subprocess.PIPE,
                                         pass_fds=self.pass_fds)
            self.proc.stdin.write(self.stdin)
            self.proc.stdin.flush()
            os.set_blocking(self.proc.stdin.fileno(), False)
        self.started = time.monotonic()

    def notify(self) -> None:
        """One newline on the child's stdin; dropped if its pipe is full (it is not reading)
        or it is gone."""
        try:
            os.write(self.proc.stdin.fileno(), b"\n")
        except OSError:       # BlockingIOError, BrokenPipeError
            pass

    def __str__(self) -> str:
        return f"{self.role} {self.what} {self.url}"


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


class Supervisor:
    def __init__(self, children: list[WorkerChild], log_prefix: str = "up"):
        self.children, self.log_prefix = children, log_prefix

    async def watch(self, on_exit: Callable[[str], None]) -> None:
        """Restart exited workers until cancelled; on_exit(url) as soon as one exits."""
        while True:
            for child in list(self.children):
                try:
                    self._tend(child, on_exit)
                except OSError as exc:    # could not start it: try again later
                    logger.error("%s: starting %s failed: %s", self.log_prefix, child, exc)
                    self._schedule(child, time.monotonic())
            await asyncio.sleep(POLL_INTERVAL)

    def add(self, child: WorkerChild) -> WorkerChild:
        """One more child (started already), tended from now on."""
        self.children.append(child)
        return child

    def retire(self, url: str) -> bool:
        """SIGTERM the child serving url; it is not started again. False: none does."""
        for child in self.children:
            if child.url == url and not child.retired:
                child.retired = True
                if child.proc.poll() is None:
                    child.proc.send_signal(signal.SIGTERM)
                logger.info("%s: retiring %s (pid %d)", self.log_prefix, child, child.proc.pid)
                return True
        return False

    def _tend(self, child: WorkerChild, on_exit: Callable[[str], None]) -> None:
        now = time.monotonic()
        if child.retired:
            if child.proc.poll() is not None:
                self.children.remove(child)
                logger.info("%s: %s retired (%s)", self.log_prefix, child,
                            describe_exit(child.proc.returncode))
                on_exit(child.url)
            return
        if child.restart_at is None:
            if child.proc.poll() is None:
                return
            if now - child.started >= STABLE_AFTER:
                child.backoff = BACKOFF_MIN
            delay = self._schedule(child, now)
            logger.error("%s: %s (pid %d) %s; restarting it in %.0f s (at %s)",
                         self.log_prefix, child,
                         child.proc.pid, describe_exit(child.proc.returncode), delay,
                         time.strftime("%H:%M:%S", time.localtime(time.time() + delay)))
            on_exit(child.url)
        elif now >= child.restart_at:
            child.restart_at = None
            child.start()
            logger.warning("%s: %s restarted (pid %d); it serves again once healthy",
                           self.log_prefix, child,
                           child.proc.pid)

    @staticmethod
    def _schedule(child: WorkerChild, now: float) -> float:
        delay = child.backoff
        child.backoff = min(delay * 2, BACKOFF_MAX)
        child.restart_at = now + delay
        return delay

    def processes(self) -> list[subprocess.Popen]:
        return [c.proc for c in self.children]


def stop_processes(procs: list[subprocess.Popen], timeout: float = 30.0) -> None:
    """SIGTERM each, SIGKILL what is left after `timeout` seconds, and wait for all."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
