"""cache_salt in the engine: a request's chained block hashes start from its salt's root, so
requests share prefix-cache blocks only with requests of the same salt, on one engine and
across a CTX -> GEN handoff (two in-process engines, KV over tcp). Without a salt the
hashes are the ones splitserve always computed, bit for bit. Then the pieces above the
engine, in-process: the offline API's salt, a tenant's salt derived from its key, the gate
naming the key presented, and the salt in every body the orchestrator sends."""

import numpy as np
import pytest

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.request import Request
from splitserve.errors import InvalidRequestError
from splitserve.protocol.block_hashes import chain_hashes, digest_of_tokens, salted_root
from splitserve.protocol.cache_salt import CacheIsolation
from splitserve.protocol.engine import RemotePrefill
from splitserve.sampling_params import SamplingParams
from splitserve.tokens import PromptTokens
from splitserve.trust import INTERNAL_HEADER, Gate

from disagg_utils import GREEDY, drain, engine, serving, tokens, wait_for_release
from engine_requests import add_request

A, B = salted_root("tenant-a"), salted_root("tenant-b")
PROMPT = PromptTokens(np.random.default_rng(3).integers(3, 49152, 23).astype(np.int32))
SHORT = PromptTokens(PROMPT.array[:3])      # not one full block of 4


def computed(bm, prompt, root, rid="r") -> Request:
    """A request whose every prompt token has its KV in blocks, the full ones published."""
    r = Request(rid, prompt, SamplingParams(), hash_root=root)
    assert bm.allocate(r, r.num_prompt_tokens)
    r.num_computed_tokens = r.num_prompt_tokens
    bm.cache_full_blocks(r)
    return r


def test_without_a_salt_the_hashes_are_the_unsalted_ones_bit_for_bit():
    """Known answers computed before salts existed."""
    t = np.arange(100, 110, dtype=np.int32)
    assert salted_root(None) == b""
    assert [h.hex() for h in chain_hashes(salted_root(None), t, 4)] == [
        "d19bfec619a641187c10a3b1a6a392b5", "4c31367ef9c4ab4f756d6b105f66457f"]
    assert digest_of_tokens(t, 4) == "fe08932e11a5a54a040d373056d0ef1e"
    assert digest_of_tokens(t[:3], 4) == "29ea57ad704f5f8e589533d93ccaf87e"
    bm = BlockManager(8, 4)
    assert computed(bm, PromptTokens(t), b"").block_hashes == chain_hashes(b"", t, 4)


def test_the_salt_is_the_root_of_every_block_hash_and_of_the_digest():
    bm = BlockManager(32, 4)
    chains = {root: computed(bm, PROMPT, root, repr(root)).block_hashes for root in (b"", A, B)}
    assert chains[A] == chain_hashes(A, PROMPT.array, 4)
    for x, y in ((b"", A), (b"", B), (A, B)):
        assert not set(chains[x]) & set(chains[y])
    digests = {digest_of_tokens(p.array, 4, root) for p in (PROMPT, SHORT) for root in (b"", A, B)}
    assert len(digests) == 6      # a prompt shorter than a block binds its salt too
    assert len(A) == 16 and A != B and salted_root("tenant-a") == A


def test_different_salts_share_no_block_and_the_same_salt_shares():
    bm = BlockManager(32, 4)
    first = computed(bm, PROMPT, A)
    for root in (B, b""):
        assert bm.find_cached_prefix(Request("x", PROMPT, SamplingParams(),
                                             hash_root=root)).tolist() == []
    same = Request("y", PROMPT, SamplingParams(), hash_root=A)
    assert bm.find_cached_prefix(same).tolist() == first.block_ids[:5].tolist()


@pytest.fixture(scope="module")
def one(tiny_source):
    for (e,) in serving(engine(tiny_source)):
        yield e


def run(e, rid, prompt, root, params=GREEDY):
    add_request(e, rid, prompt, params, hash_root=root)
    return drain(e)


def test_an_engine_reuses_a_prompt_only_within_its_salt(one):
    want = tokens(run(one, "ref", PROMPT, A))
    for rid, root, cached in (("b", B, 0), ("none", b"", 0), ("a", A, 20)):
        out = run(one, rid, PROMPT, root)
        assert out[0].num_cached_tokens == cached, rid
        assert tokens(out) == want


def test_forked_siblings_file_their_output_under_the_salt(one):
    """n = 2 on a prompt shorter than a block: the siblings' blocks fill with output
    only, after the fork, and are hashed from the request's root."""
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=14, ignore_eos=True)
    out = run(one, "fork", SHORT, A, params)
    seqs = {d.index: [] for d in out}
    for d in out:
        seqs[d.index] += d.token_ids
    assert len(seqs) == 2
    salted = set()
    for generated in seqs.values():
        full = np.concatenate([SHORT.array, np.asarray(generated, np.int32)])[:-1]
        salted |= set(chain_hashes(A, full, 4))
    assert salted <= set(one.block_manager.cached)


@pytest.fixture(scope="module")
def pair(tiny_source):
    yield from serving(engine(tiny_source), engine(tiny_source))


def relay(pair, rid, prompt, ctx_root, gen_root, params=GREEDY, length_only=False):
    """CTX prefills prompt with ctx_root; GEN decodes it from the KV with gen_root."""
    ctx, gen = pair
    first = handoff_salted(ctx, f"c-{rid}", prompt, ctx_root, params)
    remote = RemotePrefill(first.kv_handle, first.token_ids, first.logprobs)
    given = PromptTokens.placeholder(len(prompt)) if length_only else prompt
    try:
        add_request(gen, rid, given, params, remote=remote, hash_root=gen_root)
        return drain(gen)
    except InvalidRequestError:   # nothing pulled: the lease is let go, as on expiry
        ctx.remote_kv.leases.release(first.kv_handle.ctx_request_id, first.kv_handle.lease_token)
        raise
    finally:
        wait_for_release(ctx)


def handoff_salted(ctx, rid, prompt, root, params):
    add_request(ctx, rid, prompt, params, context_only=True, hash_root=root)
    (delta,) = drain(ctx)
    assert delta.kv_handle is not None
    return delta


@pytest.mark.parametrize("prompt", [PROMPT, SHORT], ids=["23 tokens", "3 tokens"])
def test_the_salt_survives_the_split_and_a_missing_one_is_refused(pair, prompt):
    ctx, gen = pair
    want = tokens(run(ctx, f"ref{len(prompt)}", prompt, A))
    assert tokens(relay(pair, f"ok{len(prompt)}", prompt, A, A)) == want
    for root in (b"", B):   # the GEN's digest check catches a salt that did not arrive
        with pytest.raises(InvalidRequestError, match="does not match"):
            relay(pair, f"bad{len(prompt)}{root.hex()}", prompt, A, root)


def test_a_gen_reuses_pulled_blocks_only_within_their_salt(pair):
    ctx, gen = pair
    prompt = PromptTokens(np.random.default_rng(9).integers(3, 49152, 41).astype(np.int32))
    stats = gen.remote_kv.stats
    for rid, root, reused in (("g1", A, 0), ("g2", B, 0), ("g3", A, 10)):
        before = stats.blocks_reused
        relay(pair, rid, prompt, root, root)
        assert stats.blocks_reused - before == reused, rid


def test_ids_pulled_with_the_kv_are_checked_against_the_salt(pair):
    """A length-only prompt whose values a penalty reads: its ids come with the KV and
    must hash, from the GEN's root, to the CTX's digest."""
    params = SamplingParams(temperature=0, max_tokens=4, repetition_penalty=1.3)
    out = relay(pair, "pull-ok", PROMPT, A, A, params, length_only=True)
    assert out[-1].error is None and len(tokens(out)) == 4
    out = relay(pair, "pull-bad", PROMPT, A, B, params, length_only=True)
    assert out[-1].error is not None and "does not match" in out[-1].error


def test_the_offline_api_takes_a_salt():
    from splitserve.llm import LLM
    llm = LLM("tiny-random", dtype="float32", block_size=4, num_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=2)
    runs = [llm.generate(PROMPT, params, cache_salt=salt)[0] for salt in ("a", "b", None, "a")]
    assert [r.num_cached_tokens for r in runs] == [0, 0, 0, 20]
    with pytest.raises(InvalidRequestError) as err:
        llm.generate(PROMPT, params, cache_salt="")
    assert err.value.param == "cache_salt"


def test_a_tenants_salt_needs_the_servers_secret_and_its_key():
    by_key = CacheIsolation("api_key", b"secret")
    one, two = by_key.salt(None, "sk-1"), by_key.salt(None, "sk-2")
    assert len({one, two, by_key.salt("s", "sk-1"), by_key.salt("s", "sk-2"),
                CacheIsolation("api_key", b"other").salt(None, "sk-1")}) == 5
    assert by_key.salt(None, "sk-1") == one and "sk-1" not in one and "secret" not in one
    assert by_key.salt("s", None) == "s"                        # internal: as relayed
    assert CacheIsolation("none", b"secret").salt("s", "sk-1") == "s"
    assert CacheIsolation("none", b"secret").salt(None, "sk-1") is None


def test_the_gate_names_the_key_a_client_presented():
    gate = Gate(("sk-1", "sk-2"), "internal")
    headers = {"sk-1": {"Authorization": "Bearer sk-1"}, "sk-2": {"Authorization": "bearer sk-2"},
               None: {"Authorization": "Bearer sk-3"}}
    for key, h in headers.items():
        assert gate.tenant(h.get) == key
        assert (gate.key_refusal("/v1/completions", h.get) is None) == (key is not None)
    internal = {"Authorization": "Bearer sk-1", INTERNAL_HEADER: gate.token.decode()}
    assert gate.tenant(internal.get) is None
    assert Gate(None, None).tenant(headers["sk-1"].get) is None


def test_every_body_the_orchestrator_sends_carries_the_effective_salt():
    from splitserve.orchestrator import migrate, relay
    body = relay.salted(relay.parse_body(b'{"prompt": "hi", "cache_salt": "mine"}'), "key:ab")
    assert relay.parse_body(b'{"prompt": "hi", "cache_salt": "mine"}')["cache_salt"] == "mine"
    for sent in (body, relay.context_body(body, "b64"), migrate.resume_body(body, [5, 6]),
                 relay.generation_body(body, {"kv_handle": {}, "prompt_len": 1})):
        assert sent["cache_salt"] == "key:ab"
    with pytest.raises(InvalidRequestError) as err:
        relay.parse_body(b'{"prompt": "hi", "cache_salt": ""}')
    assert err.value.param == "cache_salt"
