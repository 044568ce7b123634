"""Property: for random sampling parameters, a length-only prompt (metadata relay) gives
exactly the output of the full prompt (list relay); whatever reads the prompt's values gets
them with the KV (engine/prompt_reads.py), so auto relays the length only."""

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from splitserve.engine.prompt_reads import prompt_value_readers
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
def test_metadata_equals_list(trio, params, echo):
    ctx, gen_list, gen_meta = trio
    readers = prompt_value_readers(repetition_penalty=params.repetition_penalty,
                                   prompt_logprobs=params.prompt_logprobs, echo=echo)
    body = {"repetition_penalty": params.repetition_penalty,
            "prompt_logprobs": params.prompt_logprobs, "echo": echo}
    assert relay_mode(dict(body), "auto") == "metadata"
    if params.prompt_logprobs is not None:
        return   # routed aggregated by the orchestrator: GEN never prefills
    outs = []
    for gen, prompt in ((gen_list, PROMPT), (gen_meta, PromptTokens.placeholder(len(PROMPT)))):
        first = handoff(ctx, f"c{len(outs)}", params=params)
        remote = RemotePrefill(first.kv_handle, first.token_ids, first.logprobs)
        add_request(gen, "g", prompt, params, remote=remote, prompt_back=echo)
        deltas = drain(gen)
        assert not any(d.error for d in deltas), deltas
        outs.append((tokens(deltas), "".join(d.text for d in deltas),
                     [lp for d in deltas for lp in (d.logprobs or [])]))
        if prompt.is_placeholder and readers:   # echo: the prompt's ids come back as bytes
            assert deltas[0].prompt_bytes == (PROMPT.tobytes() if echo else b"")
        ctx.step()
    assert outs[0] == outs[1]
    for e in trio:
        assert e.block_manager.num_free_blocks == e.block_manager.num_blocks
