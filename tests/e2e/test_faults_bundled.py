"""The bundled SmolLM2-135M-Instruct under `splitserve up` (1 CTX + 2 GEN, float32): a GEN
killed with SIGKILL mid-stream. The client's stream goes on on the other GEN and equals an
uninterrupted greedy run; `up` restarts the dead worker; every KV block is free again and
the cluster still answers the France chat."""

import os
import signal

import pytest

from server_utils import (UpCluster, descendants, metrics, wait_for, answers_health,
                          wait_kv_free)

pytestmark = pytest.mark.bundled

STORY = [{"role": "user", "content": "Write a short story about a cat who learns to swim."}]
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def worker_pid(up: UpCluster, port: int) -> int:
    """The `splitserve serve --port <port>` process `up` started."""
    for pid in descendants(up.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if b"serve" in args and str(port).encode() in args:
            return pid
    raise LookupError(f"no worker on port {port}")


def relayed(url: str) -> float:
    return sum(v for k, v in metrics(url).items() if k.startswith("splitserve_token_relay_total"))


def running(url: str) -> float:
    return metrics(url)["splitserve_num_requests_running"]


def test_gen_killed_mid_stream_the_stream_goes_on_and_up_restarts_it(tmp_path):
    openai = pytest.importorskip("openai")
    up = UpCluster("--num-gen", "2", "--dtype", "float32", "--kv-cache-gib", "0.25",
                   log=tmp_path / "up.log", log_level="INFO", timeout=600)
    try:
        client = openai.OpenAI(base_url=up.url + "/v1", api_key="none", timeout=300,
                               max_retries=0)
        gens = [f"http://127.0.0.1:{up.port + i}" for i in (2, 3)]

        def story(on_chunk=None) -> str:
            chunks = client.chat.completions.create(
                model="SmolLM2-135M-Instruct", messages=STORY, max_tokens=96, temperature=0,
                stream=True)
            text = ""
            for i, c in enumerate(chunks):
                text += (c.choices[0].delta.content or "") if c.choices else ""
                if on_chunk is not None:
                    on_chunk(i)
            return text

        want = story()
        victim = []

        def kill_at_sixth_chunk(i: int) -> None:
            if i == 6:
                v = 0 if relayed(gens[0]) > before[0] else 1
                # On a loaded machine the GEN may have generated the whole answer before
                # this client read its sixth chunk: then there is no stream to cut.
                if running(gens[v]) < 1:
                    return
                victim.append(v)
                pid = worker_pid(up, up.port + 2 + v)
                for p in (pid, *descendants(pid)):
                    os.kill(p, signal.SIGKILL)
        key = 'splitserve_orchestrator_migrations_total{outcome="completed"}'
        migrated = 0
        for _ in range(3):
            before = [relayed(g) for g in gens]
            assert story(kill_at_sixth_chunk) == want
            migrated = metrics(up.url).get(key, 0)
            if migrated:
                break
            if victim:
                # The GEN sent its last token between the check and the kill: the stream
                # was whole before it died, so nothing migrated. Try again once it is back.
                back = gens[victim.pop()]
                wait_for(lambda: answers_health(back), 300, "the killed worker restarted")
        assert victim, "every stream ended on its GEN before the client read its sixth chunk"
        assert migrated == 1
        dead = gens[victim[0]]
        wait_for(lambda: answers_health(dead), 300, "the killed worker restarted")
        assert "restarting it" in (tmp_path / "up.log").read_text()
        wait_kv_free([f"http://127.0.0.1:{up.port + 1}", *gens], timeout=60)
        out = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=FRANCE,
                                             max_tokens=32, temperature=0)
        assert out.choices[0].message.content == "The capital of France is Paris."
        up.interrupt()
    finally:
        up.close()
