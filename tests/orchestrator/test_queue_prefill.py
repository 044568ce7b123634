"""Local prefill when the context pool is queued (orchestrator/queue_prefill.py): the policy
with numbers, the queued prompt tokens a Server keeps from its reports and its own requests,
and an orchestrator in this process in front of fake workers (peer_utils.py) whose reports
a test sets: a queued CTX sends a long prompt whole to the GEN, an idle one keeps it on the
split path."""

from __future__ import annotations

import asyncio

import pytest

from peer_utils import Peer, good_ctx, good_gen, send_json, serve_through
from server_utils import TEST_SECRET
from splitserve.orchestrator.cluster import ClusterConfig, PoolConfig, Server
from splitserve.orchestrator.queue_prefill import MAX_LOCAL_PREFILLS, gen_is_sooner, pick_gen
from splitserve.protocol.internal_api import load_body, reported_prefill

ISL = 1900        # the prompts of the run this decision was made for (docs/tuning.md)


def server(url: str, prefill: int = 0, running: int = 0) -> Server:
    s = Server(url, healthy=True)
    s.report(load_body(running, 0, running, 0.0, prefill))
    return s


# -- the policy -------------------------------------------------------------------------------
def test_a_prompt_behind_a_deep_ctx_queue_is_sooner_on_a_decoding_gen():
    # seven prompts queued on the CTX: 7 x 1,900 + 1,900 = 15,200 tokens' time there;
    # on a GEN decoding two streams at half a CTX's prefill speed: 2 x 1,900 = 3,800
    assert gen_is_sooner(ISL, 7 * ISL, 0, 2, slowdown=2.0)


def test_an_idle_ctx_keeps_the_split_path_even_against_an_idle_gen():
    assert not gen_is_sooner(ISL, 0, 0, 0, slowdown=2.0)       # equal: the split path
    assert not gen_is_sooner(ISL, 0, 0, 3, slowdown=2.0)


def test_the_ctx_queue_must_outweigh_the_gens_slowdown_and_its_own_queue():
    # one prompt ahead on the CTX: 3,800 there, 3,800 on a decoding GEN: not sooner
    assert not gen_is_sooner(ISL, ISL, 0, 1, slowdown=2.0)
    assert gen_is_sooner(ISL, ISL + 1, 0, 1, slowdown=2.0)
    # the GEN already prefills a prompt of its own: (1,900 + 1,900) x 2 = 7,600 there,
    # 3 x 1,900 + 1,900 = 7,600 behind three on the CTX: not sooner; behind four it is
    assert not gen_is_sooner(ISL, 3 * ISL, ISL, 1, slowdown=2.0)
    assert gen_is_sooner(ISL, 4 * ISL, ISL, 1, slowdown=2.0)
    # a GEN running nothing prefills at a CTX's speed: any queue at all makes it sooner
    assert gen_is_sooner(ISL, 1, 0, 0, slowdown=2.0)


def test_pick_gen_takes_the_cheapest_gen_and_compares_with_the_least_queued_ctx():
    ctxs = [server("c1", prefill=10 * ISL), server("c2", prefill=3 * ISL)]
    busy, decoding = server("g1", prefill=ISL, running=4), server("g2", running=4)
    assert pick_gen(ISL, ctxs, [busy, decoding], 2.0) is decoding
    ctxs[1].report(load_body(0, 0, 0, 0.0, 0))      # c2 went idle: the split path
    assert pick_gen(ISL, ctxs, [busy, decoding], 2.0) is None


def test_a_gen_takes_at_most_one_local_prefill_from_this_orchestrator():
    ctx, gen = server("c", prefill=20 * ISL), server("g", running=1)
    assert pick_gen(ISL, [ctx], [gen], 2.0) is gen
    gen.local_prefills = MAX_LOCAL_PREFILLS
    assert pick_gen(ISL, [ctx], [gen], 2.0) is None


def test_nothing_healthy_is_the_split_path():
    ctx, gen = server("c", prefill=20 * ISL), server("g")
    gen.healthy = False
    assert pick_gen(ISL, [ctx], [gen], 2.0) is None
    gen.healthy, ctx.healthy = True, False
    assert pick_gen(ISL, [ctx], [gen], 2.0) is None


# -- what a Server keeps ----------------------------------------------------------------------
def test_prompt_tokens_sent_since_the_report_count_until_the_next_one():
    s = server("c", prefill=ISL)
    s.prefill_sent += 500                   # ours, sent after the report
    assert s.prefill_tokens == ISL + 500
    s.report(load_body(1, 1, 2, 0.0, ISL + 500))   # ours is in it now
    assert s.prefill_tokens == ISL + 500
    s.prefill_sent -= 500                   # it answered: the worker has that much less
    assert s.prefill_tokens == ISL
    s.report(load_body(0, 0, 0, 0.0, 0))
    assert s.prefill_tokens == 0 and s.running == 0


def test_the_estimate_never_goes_below_zero_and_a_report_without_the_field_keeps_it():
    s = server("c", prefill=100)
    s.prefill_sent = 600
    s.report(load_body(1, 0, 1, 0.0, 100))   # counted it half done
    s.prefill_sent = 0
    assert s.prefill_tokens == 0
    old = {"running": 3, "waiting": 0, "in_flight": 3}   # a worker from before the field
    assert reported_prefill(old) is None
    s.report(old)
    assert (s.load, s.prefill_tokens, s.running) == (3, 0, 1)
    assert reported_prefill({**old, "prefill_tokens": -1}) is None


def test_the_slowdown_is_checked():
    pools = {"context_servers": ["http://c:1"], "generation_servers": ["http://g:1"]}
    with pytest.raises(ValueError, match="local_prefill_gen_slowdown"):
        ClusterConfig.from_dict({**pools, "local_prefill_gen_slowdown": 0.5})
    config = ClusterConfig.from_dict({**pools, "local_prefill_when_queued": True})
    assert config.local_prefill_when_queued and config.local_prefill_gen_slowdown == 2.0


# -- an orchestrator in front of fake workers -------------------------------------------------
def reporting(prefill: int, running: int):
    """A /health answer reporting `prefill` prompt tokens to compute and `running` requests."""
    def health(h) -> None:
        send_json(h, {"status": "ok", "load": load_body(running, 0, running, 0.0, prefill)})
    return health


class Recording:
    """A fake worker's answer that keeps the bodies it was sent."""

    def __init__(self, answer):
        self.answer, self.bodies = answer, []

    def __call__(self, h, body) -> None:
        self.bodies.append(body)
        self.answer(h, body)


def _serve(ctx: Peer, gen: Peer, body: dict) -> tuple[int, bytes, str]:
    """Through an orchestrator that has read both workers' reports (verified: checked)."""
    config = ClusterConfig(PoolConfig((ctx.url,)), PoolConfig((gen.url,)), port=0,
                           internal_secret=TEST_SECRET, health_check_interval=0.2,
                           max_retries=0, first_byte_timeout=10, model="tiny-random",
                           local_prefill_when_queued=True)
    return asyncio.run(serve_through(config, body))


@pytest.mark.parametrize("ctx_queued, where", [(20 * ISL, "gen"), (0, "ctx")])
def test_a_queued_ctx_sends_the_prompt_whole_to_the_gen_an_idle_one_keeps_it(ctx_queued,
                                                                             where):
    ctx_answer, gen_answer = Recording(good_ctx), Recording(good_gen)
    ctx = Peer(ctx_answer, health=reporting(ctx_queued, 0))
    gen = Peer(gen_answer, health=reporting(0, 2))          # decoding two streams
    body = {"model": "tiny-random", "prompt": list(range(10, 10 + ISL)), "max_tokens": 2,
            "stream": True}
    status, out, metrics = _serve(ctx, gen, body)
    assert status == 200 and out.endswith(b"data: [DONE]\n\n")
    if where == "gen":
        assert ctx_answer.bodies == [] and len(gen_answer.bodies) == 1
        assert "disaggregated_params" not in gen_answer.bodies[0]      # aggregated, whole
        assert 'splitserve_orchestrator_prefill_total{where="gen",reason="ctx_queue"} 1' \
            in metrics
    else:
        assert len(ctx_answer.bodies) == 1
        sent = gen_answer.bodies[0]["disaggregated_params"]
        assert sent["request_type"] == "generation_only"
        assert 'splitserve_orchestrator_prefill_total{where="ctx",reason="long_prompt"} 1' \
            in metrics
    ctx.shutdown(), gen.shutdown()
