"""Property: for random sampling parameters, a length-only prompt (metadata relay) gives
exactly the output of the full prompt (list relay), and every parameter that reads prompt
values is caught by the guardrail, so auto falls back to b64."""

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from splitserve.engine.prompt_reads import prompt_value_readers
from splitserve.errors import InvalidRequestError
from splitserve.orchestrator.relay import relay_mode
from splitserve.protocol.engine import RemotePrefill
from splitserve.sampling_params import SamplingParams
from splitserve.tokens import PromptTokens

from disagg_utils import PROMPT, drain, engine, handoff, tokens
from engine_requests import add_request

params_strategy = st.builds(
    SamplingParams,
    max_tokens=st.integers(2, 10),
    temperature=st.sampled_from([0.0, 0.5, 1.0, 1.5]),
    top_p=st.sampled_from([1.0, 0.9, 0.5]),
    top_k=st.sampled_from([0, 1, 5, 50]),
    min_p=st.sampled_from([0.0, 0.05]),
    seed=st.integers(0, 2**31),
    frequency_penalty=st.sampled_from([0.0, 0.5, -0.5]),
    presence_penalty=st.sampled_from([0.0, 1.0]),
    repetition_penalty=st.sampled_from([1.0, 1.0, 1.3]),
    prompt_logprobs=st.sampled_from([None, None, 1]),
    logprobs=st.sampled_from([None, 0, 2]),
    min_tokens=st.integers(0, 2),
    ignore_eos=st.booleans(),
    logit_bias=st.sampled_from([None, {7: 5.0}]),
)


@pytest.fixture(scope="module")
def trio(tiny_source):
    engines = [engine(tiny_source) for _ in range(3)]   # CTX, GEN for list, GEN for metadata
    yield engines
    for e in engines:
        e.remote_kv.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(params=params_strategy, echo=st.booleans())
def test_metadata_equals_list_or_falls_back(trio, params, echo):
    ctx, gen_list, gen_meta = trio
    readers = prompt_value_readers(repetition_penalty=params.repetition_penalty,
                                   prompt_logprobs=params.prompt_logprobs, echo=echo)
    body = {"repetition_penalty": params.repetition_penalty,
            "prompt_logprobs": params.prompt_logprobs, "echo": echo}
    assert relay_mode(dict(body), "auto") == ("b64" if readers else "metadata")
    if params.prompt_logprobs is not None:
        return   # routed aggregated by the orchestrator: GEN never prefills
    outs = []
    for gen, prompt in ((gen_list, PROMPT), (gen_meta, PromptTokens.placeholder(len(PROMPT)))):
        first = handoff(ctx, f"c{len(outs)}", params=params)
        remote = RemotePrefill(first.kv_handle, first.token_ids, first.logprobs)
        engine_readers = [r for r in readers if r != "echo"]   # echo is the front-end's
        if prompt.is_placeholder and engine_readers:
            with pytest.raises(InvalidRequestError):
                add_request(gen, "g", prompt, params, remote=remote)
            ctx.remote_kv.leases.release(first.kv_handle.ctx_request_id,
                                         first.kv_handle.lease_token)
            ctx.step()
            return
        add_request(gen, "g", prompt, params, remote=remote)
        deltas = drain(gen)
        outs.append((tokens(deltas), "".join(d.text for d in deltas),
                     [lp for d in deltas for lp in (d.logprobs or [])]))
        ctx.step()
    assert outs[0] == outs[1]
    for e in trio:
        assert e.block_manager.num_free_blocks == e.block_manager.num_blocks
