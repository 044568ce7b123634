"""A client that opens connections and sends nothing, reopening each one the server closes:
`python flood_client.py HOST PORT N SECONDS MAX_OPENS` tries to hold N open for SECONDS
(at most MAX_OPENS connections in all), then prints what happened as one JSON line:
{"opened", "closed_by_server", "open_at_end", "failed_connects"}."""

from __future__ import annotations

import json
import resource
import selectors
import socket
import sys
import time


def flood(host: str, port: int, n: int, seconds: float, max_opens: int) -> dict:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    sel = selectors.DefaultSelector()
    held: set[socket.socket] = set()
    opened = closed = failed = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        while len(held) < n and opened < max_opens and time.monotonic() < deadline:
            try:
                s = socket.create_connection((host, port), timeout=2)
            except OSError:
                failed += 1
                break
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ)
            held.add(s)
            opened += 1
        for key, _ in sel.select(timeout=0.05):
            s = key.fileobj
            try:
                data = s.recv(65536)
            except OSError:
                data = b""
            if not data:            # (an answer, then the close, also ends here)
                sel.unregister(s)
                s.close()
                held.discard(s)
                closed += 1
    out = {"opened": opened, "closed_by_server": closed, "open_at_end": len(held),
           "failed_connects": failed}
    for s in held:
        s.close()
    return out


if __name__ == "__main__":
    host, port, n, seconds, max_opens = sys.argv[1:6]
    print(json.dumps(flood(host, int(port), int(n), float(seconds), int(max_opens))), flush=True)
