"""The KV channel's trust checks in real worker processes with the cluster's internal secret
set: the disaggregated path still gives the greedy reference, the CTX's KV server speaks
only CURVE, a handle naming an endpoint outside the GEN's --kv-peers is a 400 and dials
nothing, a failed pull's error does not name the CTX's endpoint, and `splitserve up` tells its
GENs its CTXs' fixed KV endpoints."""

import json
import socket
import urllib.error
import urllib.request

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from splitserve.bench.server_process import free_port

from server_utils import (TEST_SECRET, Orchestrator, UpCluster, Worker, descendants, internal,
                          metrics, post, stream)

MODEL = ("--model", "tiny-random", "--dtype", "float32")
COMPLETION = {"model": "tiny-random", "prompt": "The quick brown fox jumps", "max_tokens": 12,
              "temperature": 0}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    procs = []
    with pytest.MonkeyPatch.context() as env:   # the processes started here inherit it
        env.setenv("SPLITSERVE_INTERNAL_SECRET", TEST_SECRET)   # server_utils' own
        kv_port = free_port()
        try:
            procs.append(Worker(*MODEL, "--role", "ctx", "--kv-port", str(kv_port)))
            procs.append(Worker(*MODEL, "--role", "gen", "--kv-peers",
                                f"tcp://127.0.0.1:{kv_port}"))
            procs.append(Orchestrator(tmp_path_factory.mktemp("orch"), [procs[0].url],
                                      [procs[1].url]))
            yield (*procs, kv_port)
        finally:
            for p in reversed(procs):
                p.close()


def internal_post(url, body):
    """A worker's internal request, carrying its token as the orchestrator does."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          **internal(url)})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def context_params(ctx):
    status, ans = internal_post(ctx.url + "/v1/completions", {
        **COMPLETION, "disaggregated_params": {"request_type": "context_only"}})
    assert status == 200, ans
    return ans["disaggregated_params"]


def generation(gen, params):
    return internal_post(gen.url + "/v1/completions", {
        **COMPLETION, "disaggregated_params": {**params, "request_type": "generation_only"}})


def test_the_disaggregated_path_with_a_secret_gives_the_greedy_reference(cluster):
    ctx, gen, orch, _ = cluster
    _, want = post(gen.url + "/v1/completions", COMPLETION)   # aggregated on one worker
    status, got = post(orch.url + "/v1/completions", COMPLETION)
    assert status == 200 and got["choices"][0]["text"] == want["choices"][0]["text"]
    events = stream(orch.url + "/v1/completions", COMPLETION)
    assert "".join(c["text"] for e in events[:-1] for c in e["choices"]) == \
        want["choices"][0]["text"]
    assert metrics(gen.url)["splitserve_kv_transfer_seconds_count"] >= 2
    assert metrics(ctx.url)["splitserve_kv_blocks_leased"] == 0


def test_the_ctx_kv_server_takes_no_plaintext_peer(cluster):
    *_, kv_port = cluster
    zctx = zmq.Context()
    try:
        sock = zctx.socket(zmq.DEALER)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED |
                                          zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL |
                                          zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        sock.connect(f"tcp://127.0.0.1:{kv_port}")
        assert monitor.poll(30_000)
        assert recv_monitor_message(monitor)["event"] != zmq.EVENT_HANDSHAKE_SUCCEEDED
    finally:
        zctx.destroy(linger=0)


def test_an_endpoint_outside_kv_peers_is_a_400_and_dials_nothing(cluster):
    ctx, gen, _, kv_port = cluster
    params = context_params(ctx)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(1.0)
        port = listener.getsockname()[1]
        forged = {**params, "kv_handle": {**params["kv_handle"],
                                          "endpoint": f"tcp://127.0.0.1:{port}"}}
        status, err = generation(gen, forged)
        assert status == 400 and err["error"]["param"] == "disaggregated_params.kv_handle"
        assert "--kv-peers" in err["error"]["message"]
        assert str(port) not in json.dumps(err)
        with pytest.raises(socket.timeout):
            listener.accept()
    status, ok = generation(gen, params)   # the lease was never touched: the real handle pulls
    assert status == 200 and ok["usage"]["completion_tokens"] == 12


def test_a_failed_pull_does_not_name_the_ctx_endpoint(cluster):
    ctx, gen, _, kv_port = cluster
    params = context_params(ctx)
    forged = {**params, "kv_handle": {**params["kv_handle"], "lease_token": "forged"}}
    status, err = generation(gen, forged)
    assert status == 500, err
    message = err["error"]["message"]
    assert message.startswith("KV transfer from the context worker failed: unknown or expired")
    assert str(kv_port) not in json.dumps(err) and "tcp://" not in json.dumps(err)
    status, ok = generation(gen, params)   # the real token still pulls
    assert status == 200 and ok["usage"]["completion_tokens"] == 12


def worker_commands(pid):
    """role -> [argv of each `serve` child of process pid]."""
    out = {}
    for child in descendants(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                argv = [a.decode() for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        if "serve" in argv and "--role" in argv:
            out.setdefault(argv[argv.index("--role") + 1], []).append(argv)
    return out


def test_up_gives_every_worker_every_kv_endpoint_as_peers(monkeypatch):
    """A role only labels a worker (the planner moves workers between the pools, a draining
    GEN's KV is pulled by another GEN), so each worker may pull from every other: each has a
    fixed KV port, and every one is in each worker's --kv-peers, and no other endpoint."""
    up = UpCluster(*MODEL, "--num-ctx", "2")
    try:
        cmds = worker_commands(up.proc.pid)
        argvs = cmds["ctx"] + cmds["gen"]
        kv_ports = sorted(int(a[a.index("--kv-port") + 1]) for a in argvs)
        for argv in argvs:
            peers = argv[argv.index("--kv-peers") + 1].split(",")
            assert sorted(peers) == sorted(f"tcp://127.0.0.1:{p}" for p in kv_ports)
        (gen_argv,) = cmds["gen"]
        gen_url = f"http://127.0.0.1:{gen_argv[gen_argv.index('--port') + 1]}"
        _, want = post(gen_url + "/v1/completions", COMPLETION)
        for _ in range(2):   # through whichever CTX the router picks: its KV port is a peer
            status, got = post(up.url + "/v1/completions", COMPLETION)
            assert status == 200 and got["choices"][0]["text"] == want["choices"][0]["text"]
        assert metrics(gen_url)["splitserve_kv_transfer_seconds_count"] >= 2
    finally:
        try:
            up.interrupt()   # Ctrl-C: `up` stops every worker it started
        finally:
            up.close()
