"""`splitserve bench serve` and `bench plot`: against a real tiny worker, against a server
that misbehaves on purpose, and the plots drawn from result files."""

import argparse
import asyncio
import json
import math
import struct
import subprocess
import sys
import time

import msgspec
import pytest
from aiohttp import web

from splitserve.bench import metrics, plot
from splitserve.bench.serve import compare
from splitserve.bench.serve import main as serve
from splitserve.bench.serve.main import ServeBenchConfig
from splitserve.bench.serve.workloads import WorkloadConfig
from splitserve.cli import main
from splitserve.prometheus import parse_prometheus
from server_utils import Worker

LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
STATS = {"count", "mean", "p50", "p90", "p99", "max"}
SERVER_E2E = "splitserve_e2e_request_latency_seconds"
SERVER_TTFT = "splitserve_time_to_first_token_seconds"


@pytest.fixture(scope="module")
def worker():
    w = Worker("--model", "tiny-random", "--dtype", "float32")
    yield w
    w.close()


def bench(url: str, workload: WorkloadConfig, **kwargs) -> dict:
    cfg = ServeBenchConfig(url=url, workload=workload, progress=False, **kwargs)
    return asyncio.run(serve.benchmark(cfg))


def agree(server_ms: float, client_ms: float) -> bool:
    """The client sees everything the server measures plus the network and its own loop."""
    return server_ms <= client_ms <= 2 * server_ms + 50


# -- against a real worker --------------------------------------------------------------------
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("stream", [True, False])
def test_benchmark_matches_the_servers_own_metrics(worker, endpoint, stream):
    wl = WorkloadConfig(endpoint=endpoint, input_len=32, output_len=8)
    result = bench(worker.url, wl, stream=stream, concurrency=4, num_requests=12)
    m = result["metrics"]
    assert m["completed"] == 12 and m["failed"] == 0 and result["errors"] == {}
    assert all(set(m[k]) == STATS for k in LATENCIES)
    assert m["request_throughput"] > 0 and m["output_throughput"] > 0
    assert [(r["output_tokens"], r["usage"]) for r in result["requests"]] == [(8, True)] * 12
    assert m["total_output_tokens"] == 96
    if endpoint == "completions":
        assert m["total_input_tokens"] == 12 * 32     # token ids: exact input lengths
    server = result["server"]
    assert server["available"]
    assert server["counters"]["splitserve_generation_tokens_total"] == 96
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    assert server["counters"][f'splitserve_requests_total{{endpoint="{path}",status="200"}}'] == 12
    e2e = server["histograms"][SERVER_E2E]
    assert e2e["count"] == 12 and agree(e2e["mean_ms"], m["e2e_ms"]["mean"])
    if stream:
        assert m["ttft_ms"]["count"] == m["tpot_ms"]["count"] == 12 and m["itl_ms"]["count"] > 0
        assert agree(server["histograms"][SERVER_TTFT]["mean_ms"], m["ttft_ms"]["mean"])
    else:    # no stream, no token timing: absent, never made up
        assert m["ttft_ms"]["count"] == m["itl_ms"]["count"] == 0 and m["ttft_ms"]["mean"] is None


def test_command_line_writes_json_and_prints_table(worker, tmp_path, capsys):
    out = tmp_path / "run.json"
    main(["bench", "serve", "--url", worker.url, "--concurrency", "2", "--num-requests", "6",
          "--input-len", "16", "--output-len", "4", "--warmup", "2", "--slo", "ttft=10,tpot=10",
          "--label", "tiny-c2", "--json", str(out), "--no-progress"])
    table = capsys.readouterr().out
    assert "tiny-c2" in table and "TTFT" in table and SERVER_E2E in table
    result = json.loads(out.read_text())
    assert set(result) == {"label", "timestamp", "command", "versions", "machine", "target",
                           "load", "workload", "metrics", "metrics_by_class", "errors", "server",
                           "requests"}
    assert result["target"]["model"] == "tiny-random"       # asked /v1/models
    assert result["machine"]["nproc"] >= 1 and result["versions"]["splitserve"]
    assert len(result["requests"]) == 6                      # warm-up not recorded
    assert result["server"]["histograms"][SERVER_E2E]["count"] == 6   # nor in the deltas
    assert result["metrics"]["goodput"] == pytest.approx(result["metrics"]["request_throughput"])


def test_multi_turn_and_mixed_workloads(worker):
    wl = WorkloadConfig(kind="multi-turn", endpoint="chat", input_len=8, output_len=4, turns=3)
    result = bench(worker.url, wl, concurrency=2, num_requests=6)
    convs = {}
    for r in result["requests"]:
        convs.setdefault(r["conversation"], []).append(r["prompt_tokens"])
    assert result["metrics"]["completed"] == 6 and len(convs) == 2
    assert all(len(p) == 3 and p[0] < p[1] < p[2] for p in convs.values())   # history grows

    # A fixed seed: with a fresh one, all 10 requests draw the same class once in 512 runs
    # (2 * 0.5**10), and metrics_by_class is {} for a run of one class.
    wl = WorkloadConfig(kind="mixed", endpoint="chat", input_len=8, output_len=4,
                        long_fraction=0.5, long_len_min=200, long_len_max=300, seed=0)
    result = bench(worker.url, wl, request_rate=50.0, num_requests=10)
    by_class = result["metrics_by_class"]
    assert set(by_class) == {"short", "long"} and result["metrics"]["failed"] == 0
    assert sum(c["completed"] for c in by_class.values()) == 10


# -- --compare: the same workload against several servers, one table --------------------------
REQUESTS_OK = 'splitserve_requests_total{endpoint="/v1/completions",status="200"}'


def test_compare_two_workers_one_table(worker, tmp_path, capsys):
    other = Worker("--model", "tiny-random", "--dtype", "float32")
    try:
        out = tmp_path / "cmp.json"
        main(["bench", "serve", "--url", worker.url, "--name", "first", "--compare",
              f"second={other.url}", "--concurrency", "1,2", "--num-requests", "4",
              "--input-len", "16", "--output-len", "4", "--warmup", "1", "--seed", "7",
              "--out", str(out), "--no-progress", "--settle", "1"])
    finally:
        other.close()
    table = capsys.readouterr().out.splitlines()
    doc = json.loads(out.read_text())
    assert [(s["name"], s["model"]) for s in doc["servers"]] == [("first", "tiny-random"),
                                                                 ("second", "tiny-random")]
    assert [(r["server"], r["concurrency"]) for r in doc["rows"]] == [
        ("first", 1), ("second", 1), ("first", 2), ("second", 2)]
    for row in doc["rows"]:
        assert row["completed"] == 4 and row["failed"] == 0
        values = [row[key] for key, _, _ in compare.COLUMNS] + list(row["ratios"].values())
        assert all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in values)
        if row["server"] == "first":
            assert set(row["ratios"].values()) == {1.0}
        assert any(line.startswith(row["server"]) and f"c={row['concurrency']}" in line
                   for line in table)
    # Each run reached its own server (warm-up not counted), with the same prompts per level.
    runs = doc["runs"]
    assert [r["target"]["url"] for r in runs] == [worker.url, other.url] * 2
    assert all(r["server"]["counters"][REQUESTS_OK] == 4 for r in runs)
    seeds = [r["workload"]["seed"] for r in runs]
    assert seeds[0] == seeds[1] == 7 and seeds[2] == seeds[3] != 7
    assert [r["load"]["warmup"] for r in runs] == [1, 1, 0, 0]
    # Each run waited for a quiet machine first, at most --settle (+ one 0.5 s window).
    assert all(0.4 <= r["settle"]["waited_s"] <= 1.6 for r in runs)


def _spinner(seconds: float) -> subprocess.Popen:
    """A process that keeps one core busy for `seconds`."""
    return subprocess.Popen([sys.executable, "-c", "import time\nt = time.monotonic() + "
                             f"{seconds}\nwhile time.monotonic() < t: pass"])


def test_settle_waits_for_a_busy_core_to_go_quiet():
    assert asyncio.run(compare.settle(0)) == {"waited_s": 0.0, "busy_cores": None}
    spinner = _spinner(30)
    try:
        time.sleep(0.3)
        busy = asyncio.run(compare.settle(1.0))
    finally:
        spinner.kill()
        spinner.wait()
    # Never quiet while a process spins: it gives up at the limit and says how busy it was.
    assert 1.0 <= busy["waited_s"] < 2.5 and busy["busy_cores"] >= 0.7
    doc = {"label": "x",
           "workload": {"kind": "random", "endpoint": "completions", "input_len": 1,
                        "output_len": 1, "seed": 0},
           "load": {"stream": True, "num_requests": 1, "duration": None}, "servers": [],
           "rows": [{"server": "a", "concurrency": 8, "request_rate": None, "completed": 1,
                     "failed": 0, "errors": {}, "settle": busy,
                     "ratios": {"output_throughput": 1.0, "itl_mean_ms": 1.0},
                     **{key: 1.0 for key, _, _ in compare.COLUMNS}}]}
    assert "started on a busy machine: a c=8 (" in compare.format_table(doc)
    # A spinner that stops after 1.5 s: it waits at least until then.
    spinner = _spinner(1.5)
    try:
        quiet = asyncio.run(compare.settle(20.0))
    finally:
        spinner.kill()
        spinner.wait()
    assert quiet["waited_s"] >= 1.2


def test_compare_names():
    servers = compare.servers_from_args("http://127.0.0.1:1", None,
                                        ["vllm=http://127.0.0.1:2", "http://127.0.0.1:3?a=b"],
                                        None)
    assert [(s.name, s.url) for s in servers] == [
        ("127.0.0.1:1", "http://127.0.0.1:1"), ("vllm", "http://127.0.0.1:2"),
        ("127.0.0.1:3", "http://127.0.0.1:3?a=b")]
    named = compare.servers_from_args("http://h:1", "ours", ["http://h:2"], ["theirs"])
    assert [s.name for s in named] == ["ours", "theirs"]
    with pytest.raises(ValueError, match="named twice"):
        compare.servers_from_args("http://h:1", None, ["a=http://h:2"], ["b"])
    with pytest.raises(ValueError, match="must differ"):
        compare.servers_from_args("http://h:1", "x", ["x=http://h:2"], None)


# -- the API key: sent to every server, never recorded ---------------------------------------
KEY = "sk-test-0123"


async def _keyed_server(seen: list[str | None]) -> tuple[web.AppRunner, str]:
    """An OpenAI-style server that answers only requests carrying Bearer KEY."""
    async def check(request: web.Request) -> None:
        seen.append(request.headers.get("Authorization"))
        if request.headers.get("Authorization") != f"Bearer {KEY}":
            raise web.HTTPUnauthorized(text='{"error": {"message": "bad key"}}',
                                       content_type="application/json")

    async def models(request: web.Request) -> web.Response:
        await check(request)
        return web.json_response({"data": [{"id": "keyed-model"}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        await check(request)
        resp = web.StreamResponse(headers=SSE)
        await resp.prepare(request)
        for text in "ab":
            await resp.write(_chunk(text))
        await resp.write(b"data: [DONE]\n\n")
        return resp
    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def _against_keyed(api_key: str | None) -> tuple[dict, list]:
    seen = []
    runner, url = await _keyed_server(seen)
    try:
        cfg = ServeBenchConfig(url=url, progress=False, api_key=api_key, num_requests=3,
                               model="keyed-model", workload=WorkloadConfig(input_len=3,
                                                                            output_len=2))
        return await serve.benchmark(cfg), seen
    finally:
        await runner.cleanup()


def test_api_key_is_sent_as_bearer_and_never_recorded(monkeypatch):
    result, seen = asyncio.run(_against_keyed(KEY))
    assert result["metrics"]["completed"] == 3 and f"Bearer {KEY}" in seen
    result, seen = asyncio.run(_against_keyed(None))
    assert result["errors"] == {"http_401": 3} and set(seen) == {None}

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    monkeypatch.setattr("sys.argv", ["splitserve", "bench", "serve", "--api-key", KEY])
    cfg = serve.config_from_args(parser.parse_args(["--api-key", KEY]))
    assert cfg.api_key == KEY and KEY not in " ".join(cfg.command) and KEY not in repr(cfg)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env")
    assert serve.config_from_args(parser.parse_args([])).api_key == "sk-from-env"


# -- against a server that fails on purpose ---------------------------------------------------
SSE = {"Content-Type": "text/event-stream"}
BEHAVIOURS = ["ok", "http_500", "drop", "no_done", "error_event", "garbage", "empty", "slow"]
TIMEOUT = 1.0


def _event(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _chunk(text: str) -> bytes:
    return _event({"choices": [{"index": 0, "text": text, "finish_reason": None}]})


async def _misbehave(request: web.Request, n: list[int]) -> web.StreamResponse:
    behaviour = BEHAVIOURS[n[0] % len(BEHAVIOURS)]    # by arrival: each kind equally often
    n[0] += 1
    if behaviour == "http_500":
        return web.json_response({"error": {"message": "boom"}}, status=500)
    if behaviour == "slow":
        await asyncio.sleep(30 * TIMEOUT)   # cancelled when the client gives up
    resp = web.StreamResponse(headers=SSE)
    await resp.prepare(request)
    if behaviour == "ok":
        await asyncio.sleep(0.05)      # successes are slow: a failure counted as one would show
        for text in "abcd":
            await resp.write(_chunk(text))
        await resp.write(_event({"choices": [], "usage": {"prompt_tokens": 3,
                                                          "completion_tokens": 4}}))
    elif behaviour == "drop":
        await resp.write(_chunk("a"))
        request.transport.abort()      # the connection breaks mid-stream
        return resp
    elif behaviour == "no_done":
        await resp.write(_chunk("a"))
        await resp.write_eof()         # a clean end, but no [DONE]
        return resp
    elif behaviour == "error_event":
        await resp.write(_event({"error": {"message": "engine failed", "code": 500}}))
    elif behaviour == "garbage":
        await resp.write(b"data: {not json\n\n")
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _against_fake(num_requests: int) -> dict:
    app, n = web.Application(), [0]

    async def handler(request: web.Request) -> web.StreamResponse:
        return await _misbehave(request, n)
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        cfg = ServeBenchConfig(url=f"http://127.0.0.1:{port}", model="fake", progress=False,
                               workload=WorkloadConfig(input_len=3, output_len=4),
                               concurrency=3, num_requests=num_requests, timeout=TIMEOUT)
        return await serve.benchmark(cfg)
    finally:
        await runner.cleanup()


def test_failures_are_errors_by_kind_never_fast_requests():
    result = asyncio.run(_against_fake(2 * len(BEHAVIOURS)))
    m = result["metrics"]
    assert result["errors"] == {"http_500": 2, "connection": 2, "incomplete_stream": 2,
                                "error_event": 2, "invalid_response": 2, "empty_response": 2,
                                "timeout": 2}
    assert m["completed"] == 2 and m["failed"] == 14
    assert m["e2e_ms"]["count"] == m["ttft_ms"]["count"] == m["tpot_ms"]["count"] == 2
    assert m["itl_ms"]["count"] == 2 * 3
    assert m["ttft_ms"]["max"] >= 50 and m["e2e_ms"]["mean"] >= 50   # only the slow successes
    assert m["total_output_tokens"] == 8 and m["total_input_tokens"] == 6
    for r in result["requests"]:
        assert (r["error"] is None) == (r["e2e"] is not None)
    assert not result["server"]["available"]        # no /metrics: said so, and carried on


# -- metric math ------------------------------------------------------------------------------
def test_server_deltas_and_bucket_quantiles():
    def scrape(counts, total, n):
        text = "".join(f'x_seconds_bucket{{le="{le}"}} {c}\n' for le, c in counts)
        return parse_prometheus(text + f"x_seconds_sum {total}\nx_seconds_count {n}\n"
                                        f"y_total {n}\n")
    before = scrape([("0.1", 0), ("1.0", 0), ("+Inf", 0)], 0.0, 0)
    after = scrape([("0.1", 50), ("1.0", 100), ("+Inf", 100)], 30.0, 100)
    d = metrics.server_deltas(before, after)
    h = d["histograms"]["x_seconds"]
    assert h["count"] == 100 and h["mean_ms"] == pytest.approx(300)
    assert h["p50_ms"] == pytest.approx(100) and h["p99_ms"] == pytest.approx(982)
    assert d["counters"] == {"y_total": 100}
    assert metrics.parse_slo("ttft=0.5, tpot=0.05") == {"ttft": 0.5, "tpot": 0.05}
    assert metrics.parse_slo("itl=0.2") == {"itl": 0.2}     # every gap of a request
    with pytest.raises(ValueError, match="--slo"):
        metrics.parse_slo("speed=1")


# -- plots ------------------------------------------------------------------------------------
def _fake_result(label: str, concurrency: int, scale: float) -> dict:
    records = [metrics.RequestRecord(ttft=scale * (1 + i), e2e=scale * (10 + i), itl=[scale] * 3,
                                     output_tokens=4, cls="short" if i % 3 else "long")
               for i in range(12)]
    return {"label": label, "load": {"concurrency": concurrency},
            "metrics": metrics.summarize(records, 1.0, {}),
            "requests": msgspec.to_builtins(records)}


def test_plot_writes_png_files(tmp_path):
    paths = []
    for label, c, scale in (("agg-c1", 1, 0.01), ("agg-c4", 4, 0.02)):
        paths.append(tmp_path / f"{label}.json")
        paths[-1].write_text(json.dumps(_fake_result(label, c, scale)))
    written = plot.plot_results([str(p) for p in paths], str(tmp_path / "img"))
    assert sorted(p.rsplit("/", 1)[1] for p in written) == [
        "cdf_e2e.png", "cdf_itl.png", "cdf_ttft.png", "vs_concurrency.png"]
    for p in written:
        with open(p, "rb") as f:
            head = f.read(24)
        assert head[:8] == b"\x89PNG\r\n\x1a\n"
        width, height = struct.unpack(">II", head[16:24])
        assert width > 100 and height > 100
