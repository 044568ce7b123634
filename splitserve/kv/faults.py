"""KV transfer faults injected from outside the process, for fault campaigns (`splitserve
bench chaos`): the serving side of a KV transport takes them from a directory.

Off unless SPLITSERVE_KV_FAULTS names a directory: then no transport holds a FaultPlan and
an offer costs one `is None` test. With it, before answering a pull with an offer, the
serving thread looks for an armed fault there: a file `armed-<name>` holding JSON
{"kind": ..., "pick": float in [0, 1), "seconds": float}, written whole (renamed into place)
by whoever arms it. The first transport that finds a fault it can apply to its offer takes
it by renaming it to `struck-<name>` (a rename is atomic: of several processes, exactly one
takes it) and applies it to that one answer:

  kv_cut          the answer ends mid-block: the frames before the picked one, then half of it
  kv_delay        the answer leaves `seconds` late
  kv_duplicate    the picked block's frame is sent again in place of the next one
  kv_reorder      the picked block's frame and the next one trade places
  kv_bitflip      one bit (picked) of one block's frame flips
  kv_lease_expiry the answer leaves `seconds` late, after the lease it offers has expired
                  (its blocks freed and perhaps written again by then)

Frame faults need the tcp backend's block frames (two for a duplicate or a reorder); the
delays apply to any backend. What a GEN must do about each (fail the pull, which is retried
or prefilled again, never decode the bytes) is docs/reliability.md's.
"""

from __future__ import annotations

import json
import logging
import os
import time

logger = logging.getLogger(__name__)

FRAME_KINDS = {"kv_cut": 1, "kv_duplicate": 2, "kv_reorder": 2, "kv_bitflip": 1}   # frames needed
DELAY_KINDS = ("kv_delay", "kv_lease_expiry")
KINDS = (*FRAME_KINDS, *DELAY_KINDS)
ARMED, STRUCK = "armed-", "struck-"


class FaultPlan:
    """The faults armed in one directory, taken by the serving thread of a transport."""

    def __init__(self, directory: str, name: str):
        self.directory, self.name = directory, name

    def strike(self, frames: list) -> list:
        """The frames of an offer, as the fault taken for it (if any) makes them; a delay
        sleeps here, on the serving thread, before the answer leaves."""
        fault = self._take(len(frames))
        if fault is None:
            return frames
        kind, pick = fault["kind"], float(fault.get("pick", 0.0))
        logger.warning("kv-%s: injecting %s into an offer of %d frames (SPLITSERVE_KV_FAULTS)",
                       self.name, kind, len(frames))
        if kind in DELAY_KINDS:
            time.sleep(float(fault.get("seconds", 0.0)))
            return frames
        return _corrupt(kind, pick, list(frames))

    def _take(self, nframes: int) -> dict | None:
        try:
            names = sorted(n for n in os.listdir(self.directory) if n.startswith(ARMED))
        except OSError:
            return None
        for name in names:
            path = os.path.join(self.directory, name)
            try:
                with open(path) as f:
                    fault = json.load(f)
            except (OSError, ValueError):
                continue   # taken meanwhile by another process
            kind = fault.get("kind") if isinstance(fault, dict) else None
            if kind not in KINDS or nframes < FRAME_KINDS.get(kind, 0):
                continue   # not for this offer (or not a fault at all)
            try:
                os.rename(path, os.path.join(self.directory, STRUCK + name[len(ARMED):]))
            except OSError:
                continue
            return fault
        return None


def _corrupt(kind: str, pick: float, frames: list) -> list:
    i = min(int(pick * len(frames)), len(frames) - FRAME_KINDS[kind])
    if kind == "kv_cut":
        return [*frames[:i], bytes(memoryview(frames[i])[:len(frames[i]) // 2])]
    if kind == "kv_duplicate":
        frames[i + 1] = frames[i]
    elif kind == "kv_reorder":
        frames[i], frames[i + 1] = frames[i + 1], frames[i]
    else:   # kv_bitflip
        block = bytearray(frames[i])
        bit = int(pick * 1e9) % (8 * len(block))
        block[bit // 8] ^= 1 << (bit % 8)
        frames[i] = bytes(block)
    return frames


def arm(directory: str, name: str, kind: str, pick: float, seconds: float = 0.0) -> None:
    """Arms one fault for the next offer a transport serving `directory` makes."""
    if kind not in KINDS:
        raise ValueError(f"unknown KV fault {kind!r}; one of {', '.join(KINDS)}")
    tmp = os.path.join(directory, f".{name}.tmp")
    with open(tmp, "w") as f:
        json.dump({"kind": kind, "pick": pick, "seconds": seconds}, f)
    os.rename(tmp, os.path.join(directory, ARMED + name))


def collect(directory: str) -> tuple[list[str], int]:
    """(the kinds of the faults struck since the last call, the count of armed faults no
    transport took): both kinds of file are removed."""
    struck, unused = [], 0
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name.startswith(STRUCK):
            try:
                with open(path) as f:
                    struck.append(json.load(f)["kind"])
            except (OSError, ValueError, KeyError):
                continue
        elif not name.startswith(ARMED):
            continue
        try:
            os.unlink(path)
        except OSError:
            continue   # an armed one taken meanwhile: collected next time
        unused += name.startswith(ARMED)
    return struck, unused
