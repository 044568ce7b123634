"""Server.load and the least-loaded router, on hand-built Server objects: the worker's
reported load counts other orchestrators' requests; this orchestrator's own requests since
the report are added until the next one."""

from splitserve.orchestrator.cluster import Server
from splitserve.orchestrator.routers import LeastLoaded

REPORT = {"running": 0, "waiting": 0, "in_flight": 0, "kv_usage": 0.0}


def reported(url: str, running: int = 0, waiting: int = 0, in_flight: int = 0) -> Server:
    s = Server(url)
    s.report({**REPORT, "running": running, "waiting": waiting, "in_flight": in_flight})
    return s


def test_before_any_report_the_load_is_this_orchestrators_in_flight():
    s = Server("a")
    assert s.load == 0
    s.in_flight += 1
    assert s.load == 1


def test_the_report_is_running_plus_waiting_or_the_front_ends_in_flight_if_more():
    assert reported("a", running=3, waiting=2, in_flight=1).load == 5
    assert reported("a", running=1, waiting=0, in_flight=4).load == 4


def test_requests_sent_since_the_report_count_until_the_next_report():
    s = reported("a", running=2)
    s.in_flight += 1
    assert s.load == 3
    s.report({**REPORT, "running": 3})   # ours is in it now
    assert s.load == 3


def test_own_requests_the_report_counted_leave_it_when_they_finish():
    """A report taken while this orchestrator's request was open counts it; once it
    finished the worker is that much idler, whatever the next report will say."""
    s = Server("a")
    s.in_flight += 1
    s.report({**REPORT, "running": 2})
    s.in_flight -= 1
    assert s.load == 1


def test_the_load_is_never_below_this_orchestrators_own_in_flight():
    s = reported("a")
    s.in_flight += 3
    s.report({**REPORT, "running": 1})     # two of ours had not reached the worker yet
    assert s.load == 3


def test_a_malformed_report_is_ignored():
    s = reported("a", running=2)
    for bad in (None, {}, {"running": "x", "waiting": 0, "in_flight": 0}, [1, 2]):
        s.report(bad)
        assert s.load == 2


def test_least_loaded_picks_the_idle_worker_another_orchestrator_keeps_the_other_busy():
    busy, idle = reported("busy", running=1), reported("idle")
    router = LeastLoaded()
    picks = [router.pick([busy, idle], b"") for _ in range(6)]
    assert picks == [idle] * 6


def test_least_loaded_counts_its_own_requests_between_reports():
    a, b = reported("a", running=1), reported("b")
    router = LeastLoaded()
    first = router.pick([a, b], b"")
    first.in_flight += 1                # now both carry one request
    assert first is b and a.load == b.load == 1
    picks = {router.pick([a, b], b"").url for _ in range(4)}
    assert picks == {"a", "b"}          # ties go round robin


def test_least_loaded_without_reports_is_in_flight_as_before():
    a, b = Server("a"), Server("b")
    a.in_flight += 1
    assert LeastLoaded().pick([a, b], b"") is b


def test_servers_compare_by_identity_so_a_failed_try_stays_avoided_as_counts_change():
    s, twin = Server("a"), Server("a")
    avoid = [s]
    s.in_flight += 1
    assert s in avoid and twin not in avoid
