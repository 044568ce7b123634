"""`splitserve bench frontend`'s parts that need no worker: targets, its in-flight count, the
request mix and the raw HTTP client."""

import asyncio
import json

from splitserve.bench.frontend import client as frontend_client
from splitserve.bench.frontend import main as frontend
from splitserve.bench.frontend import report as frontend_report


def test_targets_use_the_grid_values_nearest_to_the_issue():
    def row(mode, isl, c, cpu_us, p99_ms=1.0):
        return {"mode": mode, "isl": isl, "concurrency": c, "server_cpu_per_request_us": cpu_us,
                "gen_preprocessing_ms": {"p99_ms": p99_ms}}
    runs = [row("list", 1024, 8, 100), row("b64", 1024, 8, 10), row("metadata", 1024, 8, 4),
            row("list", 32768, 8, 1000), row("b64", 32768, 8, 300),
            row("metadata", 32768, 8, 5, p99_ms=12.0)]
    b64, meta, flat, p99 = frontend_report.evaluate_targets(runs)
    assert (b64["value"], b64["pass"]) == (0.3, False) and "32768" in b64["name"]
    assert (meta["value"], meta["pass"]) == (0.005, True)
    assert (flat["value"], flat["pass"]) == (1.25, True) and "32768 / ISL 1024" in flat["name"]
    assert (p99["value"], p99["pass"]) == (12.0, False) and "concurrency 8" in p99["name"]
    assert "closed loop" in p99["name"]
    # With requests held decoding in the runs, the p99 bound is judged on those.
    held = dict(row("metadata", 1024, 8, 5, p99_ms=4.0), max_tokens=16, think_time_s=1.0)
    p99 = frontend_report.evaluate_targets(runs + [held])[3]
    assert (p99["value"], p99["pass"]) == (4.0, True)
    assert "8 requests held decoding, think time 1 s" in p99["name"]
    assert frontend._ints("1k, 32k,500") == (1024, 32768, 500)


def test_mean_in_flight_counts_each_request_over_its_share_of_the_window():
    spans = [(0.0, 2.0), (1.0, 3.0), (2.5, 10.0), (-5.0, -1.0)]
    # over [1, 3]: the first is in flight 1 s, the second 2 s, the third 0.5 s, the last 0
    assert frontend_client._mean_in_flight(spans, 1.0, 3.0) == 3.5 / 2
    assert frontend_client._mean_in_flight([], 0.0, 1.0) == 0.0


def test_held_requests_cycle_through_lengths_around_max_tokens():
    target = frontend_client.Target("http://x", "tiny-random", "layout", 49152)
    (one,) = frontend_client.body_variants(target, "b64", 64, 1)
    assert json.loads(b"r".join(one))["max_tokens"] == 1
    held = [json.loads(b"r".join(v)) for v in frontend_client.body_variants(target, "b64", 64, 64)]
    lengths = [b["max_tokens"] for b in held]
    assert len(set(lengths)) == 16 and min(lengths) == 32 and max(lengths) == 96
    assert abs(sum(lengths) / len(lengths) - 64) <= 1
    assert all(b["ignore_eos"] and b["disaggregated_params"]["prompt_len"] == 64 for b in held)


def test_raw_client_reads_chunked_and_sized_answers_and_stamps_the_write(monkeypatch):
    from splitserve.httpd.client import HTTPConnection
    monkeypatch.delenv("SPLITSERVE_INTERNAL_SECRET", raising=False)   # a plain server: no challenge
    seen = []

    async def serve(reader, writer):
        while head := await reader.readuntil(b"\r\n\r\n"):
            fields = dict(line.split(b": ", 1) for line in head[:-4].split(b"\r\n")[1:])
            seen.append((float(fields[b"X-Sent-At"]), await reader.readexactly(
                int(fields[b"Content-Length"]))))
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n" if len(seen) == 1 else
                         b"HTTP/1.1 404 Not Found\r\nContent-Length: 2\r\n\r\nno")

    async def main():
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        conn = await HTTPConnection.open("http://127.0.0.1:%d" % server.sockets[0].getsockname()[1])
        first = await conn.post("/v1/completions", b"{}")
        second = await conn.post("/v1/completions", b"[1]")     # same keep-alive connection
        conn.close()
        server.close()
        return first, second
    (s1, b1, t1), (s2, b2, t2) = asyncio.run(main())
    assert (s1, b1, s2, b2) == (200, b"abcde", 404, b"no")
    assert seen == [(t1, b"{}"), (t2, b"[1]")]


def test_raw_client_calls_a_worker_with_the_token_of_the_instance_it_proves(monkeypatch):
    """As the orchestrator does: the instance id learnt through the challenge, its token on
    every request; a 403 (the worker restarted) learns the new one and sends again, once."""
    from splitserve.httpd.client import HTTPConnection
    from splitserve.trust import (CHALLENGE_HEADER, IDENTITY_HEADER, INTERNAL_HEADER, Keys,
                                  new_instance_id)
    keys, instance, tokens = Keys("raw-client-secret"), [new_instance_id()], []
    monkeypatch.setenv("SPLITSERVE_INTERNAL_SECRET", "raw-client-secret")

    async def serve(reader, writer):
        while head := await reader.readuntil(b"\r\n\r\n"):
            fields = dict(line.decode().split(": ", 1) for line in head[:-4].split(b"\r\n")[1:])
            await reader.readexactly(int(fields["Content-Length"]))
            if CHALLENGE_HEADER in fields:
                proof = keys.identity(fields[CHALLENGE_HEADER], instance[0])
                writer.write(f"HTTP/1.1 200 OK\r\n{IDENTITY_HEADER}: {proof}\r\n"
                             f"Content-Length: 0\r\n\r\n".encode())
                continue
            tokens.append(fields.get(INTERNAL_HEADER))
            ok = fields.get(INTERNAL_HEADER) == keys.token(instance[0])
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok" if ok else
                         b"HTTP/1.1 403 Forbidden\r\nContent-Length: 2\r\n\r\nno")

    async def main():
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        conn = await HTTPConnection.open("http://127.0.0.1:%d" % server.sockets[0].getsockname()[1])
        first = await conn.post("/v1/completions", b"{}")
        old = instance[0]
        instance[0] = new_instance_id()                          # it restarted
        second = await conn.post("/v1/completions", b"{}")
        conn.close()
        server.close()
        return first[0], second[0], old
    first, second, old = asyncio.run(main())
    assert (first, second) == (200, 200)
    assert tokens == [keys.token(old), keys.token(old), keys.token(instance[0])]
    assert "raw-client-secret" not in tokens
