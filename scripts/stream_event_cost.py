"""Per-event CPU of the orchestrator's stream pass-through: plain, with StreamTap (a migratable
stream), with event ids (orchestrator/resume.py), and both. Median of 5 runs of 100,000
one-event chunks. Run: PYTHONPATH=. python3 scripts/stream_event_cost.py"""
import asyncio, json, statistics, time
from splitserve.orchestrator.migrate import StreamTap
from splitserve.orchestrator.resume import EventStream, Numbering

EV = b"data: " + json.dumps({"id": "cmpl-" + "ab" * 16, "object": "text_completion",
                             "created": 1765000000, "model": "tiny-random",
                             "choices": [{"index": 0, "text": " word", "logprobs": None,
                                          "finish_reason": None}]},
                            separators=(",", ":")).encode() + b"\n\n"
class Sink:
    def __init__(self): self.conn = self; self.transport = self
    def is_closing(self): return False
    def stream(self, h, s=200): return self
    async def write(self, d): pass

async def run(n, tap, number):
    sink = Sink()
    out = EventStream(sink, Numbering(b"1765000000." + b"A" * 22), {}, 200) if number else sink
    feed = StreamTap().feed if tap else None
    t = time.perf_counter()
    for _ in range(n):
        chunk = feed(EV) if feed else EV
        await out.write(chunk)
    return (time.perf_counter() - t) / n * 1e6

for name, tap, number in [("plain", False, False), ("tap", True, False), ("numbered", False, True), ("tap+numbered", True, True)]:
    runs = [asyncio.run(run(100_000, tap, number)) for _ in range(5)]
    print(f"{name:14s} median {statistics.median(runs):.2f} us/event  runs {[round(r, 2) for r in runs]}")
