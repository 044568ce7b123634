"""Internal hops keep the cluster's secret to themselves, over real sockets: an orchestrator
in this process (its log captured as it is written, before any redaction) in front of fake
workers (peer_utils.py) that answer malformed HTTP or redirect elsewhere; the synchronous
internal client (a worker's registration) in front of the same; and the log filter that
backs it all up."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import select
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from peer_utils import KEYS, PROMPT, Peer, good_ctx, good_gen, send_json, serve_through
from server_utils import TEST_SECRET
from splitserve import redact
from splitserve.internal_client import InternalClient, NotProven
from splitserve.orchestrator.cluster import ClusterConfig, PoolConfig
from splitserve.trust import INTERNAL_HEADER, Keys, new_instance_id

MALFORMED = b"HTTP/1.1 200 OK\r\nContent-Length: nope\r\n\r\n{}"


def malformed(h, body) -> None:
    h.wfile.write(MALFORMED)


class Recorder:
    """A listening socket that a redirect points at: it must never see a connection."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/stolen"

    def untouched(self, seconds: float = 1.0) -> bool:
        return not select.select([self.sock], [], [], seconds)[0]


def redirect_to(recorder: Recorder):
    def answer(h, body=None) -> None:
        h.send_response(307)
        h.send_header("Location", recorder.url)
        h.send_header("Content-Length", "0")
        h.end_headers()
    return answer


async def _serve_one(ctx: Peer, gens: list[Peer], body: dict) -> tuple[int, dict]:
    """One client request through an orchestrator in this process, once a GEN is verified,
    and a few more health checks."""
    config = ClusterConfig(PoolConfig((ctx.url,)), PoolConfig(tuple(g.url for g in gens)),
                           port=0, internal_secret=TEST_SECRET, health_check_interval=0.2,
                           max_retries=0, first_byte_timeout=10)
    status, answer, _ = await serve_through(config, body, after=0.5)
    return status, json.loads(answer)


@pytest.mark.parametrize("role", ["ctx", "gen"])
def test_a_malformed_answer_is_logged_without_the_secret_or_a_token(role, caplog):
    """aiohttp's error for a malformed response holds the request's headers in its repr;
    the log says the error's type and words, never its repr."""
    ctx, gen = Peer(good_ctx), Peer(good_gen)
    (ctx if role == "ctx" else gen).answer = malformed
    try:
        with caplog.at_level(logging.INFO, logger="splitserve"):
            status, body = asyncio.run(_serve_one(ctx, [gen], PROMPT))
    finally:
        for p in (ctx, gen):
            p.shutdown()
    assert status == 503, body
    log = caplog.text
    assert "connection lost before the answer: ClientResponseError" in log, log
    for peer in (ctx, gen):
        assert KEYS.token(peer.instance) not in log and KEYS.proof(peer.instance) not in log
    assert TEST_SECRET not in log and INTERNAL_HEADER not in log, log


@pytest.mark.parametrize("role", ["ctx", "gen"])
def test_no_internal_hop_follows_a_redirect(role):
    """A worker's answer (and another's /health) redirecting elsewhere: the orchestrator
    follows neither, so nothing of the request, its token included, reaches the target;
    neither redirecting server is served from."""
    recorder = Recorder()
    ctx, gen = Peer(good_ctx), Peer(good_gen)
    (ctx if role == "ctx" else gen).answer = redirect_to(recorder)
    elsewhere = Peer(good_gen, health=redirect_to(recorder))
    try:
        status, body = asyncio.run(_serve_one(ctx, [gen, elsewhere], PROMPT))
        assert status == 503, body
        assert recorder.untouched(), "the redirect was followed"
        assert elsewhere.requests == 0
    finally:
        for p in (ctx, gen, elsewhere):
            p.shutdown()
        recorder.sock.close()


@pytest.fixture
def orchestrator_like():
    """What a registering worker calls: a server proving itself (a Peer) that answers its
    token's requests with {}."""
    peer = Peer(lambda h, body: send_json(h, {}))
    yield peer
    peer.shutdown()


def register(client: InternalClient, url: str):
    req = urllib.request.Request(url + "/internal/workers", b"{}", method="POST",
                                 headers={"Content-Type": "application/json"})
    with client.urlopen(req, timeout=10) as r:
        return r.status


def test_the_internal_client_learns_a_restarted_servers_token_once(orchestrator_like):
    client = InternalClient(TEST_SECRET)
    assert register(client, orchestrator_like.url) == 200
    orchestrator_like.instance = new_instance_id()          # it restarted
    assert register(client, orchestrator_like.url) == 200
    assert orchestrator_like.refused == 1 and orchestrator_like.requests == 2 + 1
    with pytest.raises(NotProven):                           # another cluster's secret
        register(InternalClient("not-the-secret"), orchestrator_like.url)


def test_the_internal_client_follows_no_redirect(orchestrator_like):
    recorder = Recorder()
    try:
        orchestrator_like.answer = redirect_to(recorder)
        with pytest.raises(urllib.error.HTTPError) as exc:
            register(InternalClient(TEST_SECRET), orchestrator_like.url)
        assert exc.value.code == 307
        orchestrator_like.health = redirect_to(recorder)
        with pytest.raises(NotProven):
            register(InternalClient(TEST_SECRET), orchestrator_like.url)
        assert recorder.untouched(), "the redirect was followed"
    finally:
        recorder.sock.close()


def test_the_log_filter_hides_the_secret_and_every_derived_value():
    secret, token, proof = "a secret only this test knows", "0123abcd" * 8, "4567cdef" * 8
    for value in (secret, token, proof):    # (trust.Keys registers what it derives)
        redact.sensitive(value)
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(redact.RedactingFilter())
    log = logging.getLogger("test_redaction")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("secret %s, headers %r", secret, {"X": token})
        try:
            raise ValueError(f"an error that quotes {proof}")
        except ValueError:
            log.exception("failed with %s", proof)
    finally:
        log.removeHandler(handler)
    text = out.getvalue()
    assert secret not in text and token not in text
    assert proof not in text and text.count(redact.MARKER) == 4, text
    assert "ValueError: an error that quotes [redacted]" in text


def test_every_value_derived_from_the_secret_is_hidden_from_the_log():
    keys, instance = Keys("another secret only this test knows"), new_instance_id()
    for value in ("another secret only this test knows", keys.token(instance),
                  keys.proof(instance)):
        assert redact.redact(f"[{value}]") == f"[{redact.MARKER}]"
    assert redact.redact(instance) == instance      # an instance id is no secret


def test_every_command_logs_through_the_filter():
    """cli.main installs the filter: a line naming the secret comes out redacted."""
    code = ("import logging, os, sys; from splitserve import cli; "
            "cli._up = lambda args: logging.getLogger('splitserve.x').warning("
            "'the secret: %s', os.environ['SPLITSERVE_INTERNAL_SECRET']) or 0; "
            "sys.exit(cli.main(['up']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, SPLITSERVE_INTERNAL_SECRET="a-secret-to-hide"),
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "the secret: [redacted]" in proc.stderr and "a-secret-to-hide" not in proc.stderr
