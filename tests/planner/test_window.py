"""What the planner reads from /metrics, windowed (planner/window.py)."""

from splitserve.metrics import Gauge, Histogram, Registry
from splitserve.planner.window import ITL, TTFT, Window, read_sample


class Worker:
    """A worker's metrics as its /metrics renders them (splitserve/metrics.py)."""

    def __init__(self):
        self.registry = r = Registry()
        self.ttft = r.register(Histogram(TTFT, "ttft"))
        self.itl = r.register(Histogram(ITL, "itl"))
        self.running = r.register(Gauge("splitserve_num_requests_running", "running"))
        self.waiting = r.register(Gauge("splitserve_num_requests_waiting", "waiting"))

    def sample(self):
        return read_sample(self.registry.render())


def test_read_sample_takes_both_histograms_and_the_load():
    w = Worker()
    w.ttft.observe(0.3)
    w.itl.observe(0.01)
    w.running.set(3)
    w.waiting.set(2)
    s = w.sample()
    assert s.load == 5.0
    assert s.ttft[float("inf")] == 1.0 and s.itl[float("inf")] == 1.0


def test_p90_reads_only_what_the_window_holds_summed_over_workers():
    a, b, window = Worker(), Worker(), Window(10.0)
    for _ in range(100):
        a.ttft.observe(5.0)              # before the first scrape: not in any window
    window.add("a", 0.0, a.sample())
    window.add("b", 0.0, b.sample())
    assert window.p90(["a", "b"], "ttft") == (None, 0)
    for _ in range(90):
        a.ttft.observe(0.1)
    for _ in range(10):
        b.ttft.observe(2.0)
    window.add("a", 1.0, a.sample())
    window.add("b", 1.0, b.sample())
    p90, n = window.p90(["a", "b"], "ttft")
    assert n == 100 and 50 <= p90 <= 100          # the 90th of 100: the last 0.1 s one
    assert window.p90(["b"], "ttft")[1] == 10
    # 20 s on, the old scrapes leave the window: nothing new was observed
    window.add("a", 21.0, a.sample())
    assert window.p90(["a"], "ttft") == (None, 0)


def test_a_restarted_worker_and_a_restart_of_the_window_start_afresh():
    w, window = Worker(), Window(60.0)
    for _ in range(50):
        w.itl.observe(0.2)
    window.add("w", 0.0, w.sample())
    fresh = Worker()                     # its counters went back to zero
    window.add("w", 1.0, fresh.sample())
    for _ in range(30):
        fresh.itl.observe(0.01)
    window.add("w", 2.0, fresh.sample())
    assert window.p90(["w"], "itl")[1] == 30
    window.restart()
    assert window.p90(["w"], "itl") == (None, 0)
    window.keep([])
    assert window.latest("w") is None
