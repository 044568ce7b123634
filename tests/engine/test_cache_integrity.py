"""What a generation worker files in its prefix cache is what the context worker computed
for those tokens: a relayed prompt must match the KV handle's prompt digest (two in-process
engines, KV over tcp; the digest does not depend on the backend)."""

import msgspec
import numpy as np
import pytest

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.request import FinishReason, Request
from splitserve.errors import InvalidRequestError
from splitserve.protocol.block_hashes import chain_hash, chain_hashes, prompt_digest
from splitserve.protocol.engine import RemotePrefill
from splitserve.sampling_params import SamplingParams
from splitserve.tokens import PromptTokens

from disagg_utils import GREEDY, PROMPT, drain, engine, handoff, tokens, wait_for_release
from engine_requests import add_request

PARAM = "disaggregated_params.prompt_token_ids"


def with_token(prompt, i, value):
    arr = prompt.array.copy()
    arr[i] = value
    return PromptTokens(arr)


def gen_digest(prompt, block_size=4):
    return prompt_digest(prompt.array, block_size, chain_hashes(b"", prompt.array, block_size))


@pytest.fixture(scope="module")
def pair(tiny_source):
    ctx, gen = engine(tiny_source), engine(tiny_source)
    yield ctx, gen
    for e in (ctx, gen):
        e.remote_kv.close()


def test_chain_hashes_are_the_prefix_caches_block_hashes():
    t = PROMPT.array
    hashes, parent = [], b""
    for i in range(len(t) // 4):
        parent = chain_hash(parent, t[4 * i:4 * i + 4])
        hashes.append(parent)
    assert chain_hashes(b"", t, 4) == hashes
    assert chain_hashes(hashes[1], t[8:], 4) == hashes[2:]


def test_the_context_workers_digest_is_the_one_recomputed_from_the_tokens():
    bm = BlockManager(16, 4)
    for n in (1, 3, 4, 5, 8, 23):
        prompt = PromptTokens(PROMPT.array[:n])
        assert bm.prompt_digest(Request("r", prompt, SamplingParams())) == gen_digest(prompt)


def test_every_token_and_the_length_change_the_digest():
    digests = {gen_digest(PROMPT), gen_digest(PromptTokens(PROMPT.array[:22])),
               gen_digest(PromptTokens(PROMPT.array[:20])),
               gen_digest(PromptTokens(np.concatenate([PROMPT.array, [0]]).astype(np.int32)))}
    digests |= {gen_digest(with_token(PROMPT, i, PROMPT.array[i] + 1)) for i in range(len(PROMPT))}
    assert len(digests) == 4 + len(PROMPT)
    # A prompt of whole blocks is not its last full block's chain hash.
    whole = PromptTokens(PROMPT.array[:20])
    assert gen_digest(whole) != chain_hashes(b"", whole.array, 4)[-1].hex()


@pytest.mark.parametrize("forged_at", [0, 13, 22])   # first block, a middle one, the tail
def test_a_forged_prompt_is_refused_and_nothing_is_pulled_or_cached(pair, forged_at):
    ctx, gen = pair
    first = handoff(ctx, f"c{forged_at}")
    leased, bm = ctx.remote_kv.num_leased_blocks, gen.block_manager
    cached = dict(bm.cached)   # earlier cases cached the genuine prompt's blocks
    forged = with_token(PROMPT, forged_at, (int(PROMPT.array[forged_at]) + 7) % 1000 + 3)
    with pytest.raises(InvalidRequestError) as err:
        add_request(gen, "g", forged, GREEDY, remote=RemotePrefill(first.kv_handle, first.token_ids))
    assert err.value.param == PARAM and "does not match the prompt" in err.value.message
    gen.step()
    assert bm.cached == cached and bm.num_free_blocks == bm.num_blocks and not gen.groups
    ctx.step()
    assert ctx.remote_kv.num_leased_blocks == leased   # nothing pulled, nothing acked
    # The genuine prompt still gets its lease, and decodes as the aggregated reference.
    add_request(gen, "real", PROMPT, GREEDY, remote=RemotePrefill(first.kv_handle, first.token_ids))
    got = tokens(drain(gen))
    add_request(ctx, "agg", PROMPT, GREEDY)
    assert got == tokens(drain(ctx))
    wait_for_release(ctx)
    assert ctx.remote_kv.num_leased_blocks == 0
    forged_hashes = chain_hashes(b"", forged.array, 4)[forged_at // 4:]
    assert not set(forged_hashes) & set(bm.cached)


def test_a_relayed_prompt_needs_a_digest(pair):
    ctx, gen = pair
    first = handoff(ctx, "c-nodigest")
    bare = msgspec.structs.replace(first.kv_handle, prompt_digest="")
    with pytest.raises(InvalidRequestError) as err:
        add_request(gen, "g", PROMPT, GREEDY, remote=RemotePrefill(bare, first.token_ids))
    assert err.value.param == PARAM
    # Length only: no tokens to check, nothing cached, as before.
    cached = dict(gen.block_manager.cached)
    add_request(gen, "g", PromptTokens.placeholder(len(PROMPT)), GREEDY,
                    remote=RemotePrefill(bare, first.token_ids))
    out = drain(gen)
    assert out[-1].finish_reason == FinishReason.LENGTH and gen.block_manager.cached == cached
    wait_for_release(ctx)


def test_a_verified_prompt_is_cached_and_a_later_user_gets_the_same_text(pair):
    """The poisoning attempt first: P1's KV offered under P2's tokens is refused; then P2
    arrives genuinely, its pulled blocks are cached, and P2 plus a prompt that shares its
    prefix decode on the GEN exactly as on the CTX aggregated."""
    ctx, gen = pair
    p1 = PromptTokens(np.random.default_rng(1).integers(3, 49152, 23).astype(np.int32))
    p2 = PromptTokens(np.random.default_rng(2).integers(3, 49152, 23).astype(np.int32))
    shares = PromptTokens(np.concatenate([p2.array[:16], p1.array[:9]]))
    want = {}
    for name, p in (("p2", p2), ("shares", shares)):
        add_request(ctx, f"ref-{name}", p, GREEDY)
        want[name] = tokens(drain(ctx))
    f1 = handoff(ctx, "c-p1", p1)
    with pytest.raises(InvalidRequestError):
        add_request(gen, "poison", p2, GREEDY, remote=RemotePrefill(f1.kv_handle, f1.token_ids))
    assert not set(chain_hashes(b"", p2.array, 4)) & set(gen.block_manager.cached)
    f2 = handoff(ctx, "c-p2", p2)
    add_request(gen, "p2", p2, GREEDY, remote=RemotePrefill(f2.kv_handle, f2.token_ids))
    assert tokens(drain(gen)) == want["p2"]
    assert len(gen.block_manager.cached) >= len(p2) // 4
    add_request(gen, "shares", shares, GREEDY)
    out = drain(gen)
    assert tokens(out) == want["shares"] and out[0].num_cached_tokens == 16
    wait_for_release(ctx)
