"""Sampler: each parameter's effect on the chosen tokens, checked against math done here."""

import numpy as np
import pytest
import torch

from splitserve.engine.request import Request
from splitserve.engine.sampler import Sampler, _top_k_top_p, prompt_logprobs
from splitserve.errors import PlaceholderReadError
from splitserve.sampling_params import SamplingParams
from splitserve.tokens import PromptTokens

V = 32
EOS = 2


def make_req(rid="r", prompt=(5, 6, 7), out=(), **params) -> Request:
    req = Request(rid, PromptTokens.from_list(list(prompt)), SamplingParams(**params),
                  eos_token_ids=(EOS,))
    req.output_token_ids = list(out)
    return req


def sampler(seed=0, vocab=V) -> Sampler:
    s = Sampler(vocab)
    s.generator.manual_seed(seed)
    return s


def pick(row, req, vocab=V) -> int:
    return sampler(vocab=vocab)(torch.as_tensor(row, dtype=torch.float32)[None], [req]).token_ids[0]


def draws(logits_row, n, seed=0, **params) -> np.ndarray:
    """n tokens sampled from one (V,) row repeated n times in a single batch."""
    row = torch.as_tensor(logits_row, dtype=torch.float32)
    reqs = [make_req(f"r{i}", **params) for i in range(n)]
    out = sampler(seed, vocab=row.shape[0])(row.expand(n, -1).contiguous(), reqs)
    return np.asarray(out.token_ids)


def freqs(tokens, vocab) -> np.ndarray:
    return np.bincount(tokens, minlength=vocab) / len(tokens)


# -- greedy and truncation ------------------------------------------------------------

def test_greedy_is_argmax_and_leaves_logits_untouched():
    logits = torch.randn(32, V, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    out = sampler()(logits, [make_req(f"r{i}", temperature=0.0) for i in range(32)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 32
    assert torch.equal(logits, before)


def test_padded_vocab_columns_are_never_sampled():
    logits = torch.zeros(4, V + 8)
    logits[:, V:] = 100.0                       # lm_head padding beyond the tokenizer
    reqs = [make_req("g", temperature=0.0), make_req("s", temperature=1.0, logprobs=1),
            make_req("k", top_k=3), make_req("p", top_p=0.5)]
    out = sampler()(logits, reqs)
    assert all(t < V for t in out.token_ids)
    assert out.logprobs[1].logprob == pytest.approx(-np.log(V))


@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0, 50.0])
def test_top_k_1_equals_greedy_at_any_temperature(temperature):
    logits = torch.randn(64, V, generator=torch.Generator().manual_seed(2))
    reqs = [make_req(f"r{i}", temperature=temperature, top_k=1) for i in range(64)]
    assert sampler()(logits, reqs).token_ids == logits.argmax(-1).tolist()


def test_tiny_top_p_keeps_only_the_top_token():
    row = torch.randn(V, generator=torch.Generator().manual_seed(3))
    tokens = draws(row, 500, temperature=2.0, top_p=1e-6)
    assert set(tokens.tolist()) == {int(row.argmax())}


def test_min_p_drops_unlikely_tokens_and_renormalises():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    tokens = draws(np.log(probs), 4000, min_p=0.5)      # keeps p >= 0.25: tokens 0 and 1
    f = freqs(tokens, 4)
    assert f[2] == f[3] == 0
    assert f[0] == pytest.approx(0.5 / 0.8, abs=0.03)


def test_temperature_matches_softmax_of_scaled_logits():
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    for t in (0.5, 1.0, 2.0):
        expected = torch.softmax(torch.tensor(logits) / t, -1).numpy()
        assert np.abs(freqs(draws(logits, 4000, temperature=t), 6) - expected).max() < 0.03


def test_top_k_and_top_p_distributions():
    probs = np.array([0.4, 0.3, 0.2, 0.1])
    f = freqs(draws(np.log(probs), 4000, top_k=2), 4)
    assert np.abs(f - [0.4 / 0.7, 0.3 / 0.7, 0, 0]).max() < 0.03
    # top_p=0.75: 0.4 and 0.3 come before the mass reaches 0.75, 0.2 completes it.
    f = freqs(draws(np.log(probs), 4000, top_p=0.75), 4)
    assert f[3] == 0 and np.abs(f[:3] - probs[:3] / 0.9).max() < 0.03


def _reference_keep(row: torch.Tensor, k: int, p: float) -> set[int]:
    """Kept token ids, the slow obvious way: full sort, top_k, then the top_p prefix."""
    order = row.argsort(descending=True).tolist()
    order = order[:k] if k > 0 else order
    probs = torch.softmax(row[order].double(), -1).tolist()
    kept, mass = [], 0.0
    for tok, prob in zip(order, probs):
        if mass >= p and p < 1.0:
            break
        kept.append(tok)
        mass += prob
    return set(kept)


@pytest.mark.parametrize("scale", [0.001, 0.05, 1.0, 8.0])   # flat ... peaked
@pytest.mark.parametrize("ks", [[0, 700, 5, 0, -1, 1000], [0, 0, 3, 0, -1, 0]])
def test_top_k_top_p_keep_the_same_set_as_a_full_sort(scale, ks):
    # 2000 columns: flat rows' nuclei spill past the topk window, peaked ones fit in it.
    logits = torch.randn(6, 2000, generator=torch.Generator().manual_seed(8)) * scale
    ps = [0.9, 0.95, 1.0, 1.0, 0.3, 0.999]
    out = _top_k_top_p(logits, ks, ps)
    for i in range(6):
        kept = set(torch.isfinite(out[i]).nonzero().flatten().tolist())
        ref = _reference_keep(logits[i], ks[i], ps[i])
        assert len(kept ^ ref) <= 1            # float rounding may move the cut by one token
        assert torch.equal(out[i][list(kept)], logits[i][list(kept)])


def test_seeded_rows_follow_the_softmax_too():
    logits = torch.tensor([1.0, 0.0, -1.0])
    reqs = [make_req(f"r{i}", seed=i) for i in range(3000)]
    tokens = sampler(vocab=3)(logits.expand(3000, -1).contiguous(), reqs).token_ids
    assert np.abs(freqs(tokens, 3) - torch.softmax(logits, -1).numpy()).max() < 0.03


# -- randomness ownership -------------------------------------------------------------

def _run(steps, batch_fn, seed_of_sampler):
    """Decode `steps` steps; batch_fn(step) -> (logits, requests, row of interest)."""
    s, tokens = sampler(seed_of_sampler), []
    for step in range(steps):
        logits, reqs, row = batch_fn(step)
        tokens.append(s(logits, reqs).token_ids[row])
        reqs[row].output_token_ids.append(tokens[-1])   # as the scheduler appends it
    return tokens


def test_seeded_request_reproduces_regardless_of_batch():
    step_logits = torch.randn(20, V, generator=torch.Generator().manual_seed(4)) * 0.5
    alone = make_req("a", seed=123, temperature=0.9)
    ref = _run(20, lambda t: (step_logits[t][None], [alone], 0), 0)
    crowded = make_req("a", seed=123, temperature=0.9)
    others = [make_req("x", seed=7), make_req("y"), make_req("z", temperature=0.0)]

    def batch(t):
        rows = torch.randn(4, V)
        rows[t % 4] = step_logits[t]           # the seeded row moves around the batch
        reqs = others[:t % 4] + [crowded] + others[t % 4:]
        return rows, reqs, t % 4
    assert _run(20, batch, 99) == ref
    assert len(set(ref)) > 3                   # the logits really left room for chance


def test_siblings_with_different_seeds_differ():
    logits = torch.zeros(2, 1000)              # uniform: identical rows, n=2 siblings
    a, b = make_req("a", seed=1), make_req("b", seed=2)
    ta = [sampler()(logits, [a, b]).token_ids for _ in range(5)]
    assert [x for x, _ in ta] != [y for _, y in ta]
    unseeded = sampler()(logits, [make_req("c"), make_req("d")]).token_ids
    assert unseeded[0] != unseeded[1]


# -- logit processing -----------------------------------------------------------------

def test_logit_bias_forces_and_bans_tokens():
    row = torch.randn(V, generator=torch.Generator().manual_seed(5))
    assert pick(row, make_req(logit_bias={3: 100.0}, temperature=0.0)) == 3
    assert pick(row, make_req(logit_bias={3: 100.0}, temperature=1.5)) == 3
    top = int(row.argmax())
    assert pick(row, make_req(logit_bias={top: -100.0}, temperature=0.0)) != top


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    row = torch.zeros(V)
    row[EOS], row[4], row[9] = 10.0, 9.0, 1.0
    params = dict(min_tokens=2, stop_token_ids=(4,), temperature=0.0)
    assert pick(row, make_req(**params)) == 9
    assert pick(row, make_req(out=[11], **params)) == 9
    assert pick(row, make_req(out=[11, 12], **params)) == EOS
    assert pick(row, make_req(min_tokens=2, stop_token_ids=(4,), out=[11], seed=0)) not in (EOS, 4)


def _contest(value_a, a, value_b, b, req) -> int:
    """Greedy winner between token a and token b (all others far below)."""
    row = torch.full((V,), -50.0)
    row[a], row[b] = value_a, value_b
    return pick(row, req)


def test_repetition_penalty_uses_prompt_and_output_tokens():
    # prompt (5, 6, 7), output [8]; 3.0 / 2 = 1.5 and -1.0 * 2 = -2.0
    rp = dict(out=[8], repetition_penalty=2.0, temperature=0.0)
    for tok in (5, 8):
        assert _contest(3.0, tok, 1.49, 20, make_req(**rp)) == tok
        assert _contest(3.0, tok, 1.51, 20, make_req(**rp)) == 20
    assert _contest(-1.0, 6, -2.01, 20, make_req(**rp)) == 6
    assert _contest(-1.0, 6, -1.99, 20, make_req(**rp)) == 20
    assert _contest(3.0, 9, 2.99, 20, make_req(**rp)) == 9       # unseen: untouched


def test_frequency_and_presence_penalties_use_output_tokens_only():
    # output has token 9 three times: 3.0 - (3 * 0.5 + 0.3) = 1.2; prompt token 5 untouched.
    params = dict(prompt=(5,), out=[9, 9, 9, 4], frequency_penalty=0.5,
                  presence_penalty=0.3, temperature=0.0)
    assert _contest(3.0, 9, 1.19, 20, make_req(**params)) == 9
    assert _contest(3.0, 9, 1.21, 20, make_req(**params)) == 20
    assert _contest(3.0, 4, 2.19, 20, make_req(**params)) == 4     # 3.0 - 0.8
    assert _contest(3.0, 4, 2.21, 20, make_req(**params)) == 20
    assert _contest(3.0, 5, 2.99, 20, make_req(**params)) == 5
    negative = dict(params, frequency_penalty=-1.0, presence_penalty=0.0)
    assert _contest(3.0, 9, 5.99, 20, make_req(**negative)) == 9    # -(-1 * 3) rewards


def test_prompt_values_read_only_for_repetition_penalty():
    def placeholder_req(**params):
        req = Request("p", PromptTokens.placeholder(4), SamplingParams(**params), (EOS,))
        req.output_token_ids = [1, 1]
        return req
    row = torch.randn(V)
    pick(row, placeholder_req(frequency_penalty=1.0, presence_penalty=1.0, min_tokens=3,
                              logit_bias={1: 2.0}, top_k=5, logprobs=2))
    with pytest.raises(PlaceholderReadError):
        pick(row, placeholder_req(repetition_penalty=1.2))


# -- logprobs -------------------------------------------------------------------------

def test_logprobs_are_raw_with_ranks_and_top_k():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(6)) * 3
    reqs = [make_req("a", logprobs=5, logit_bias={7: 100.0}, temperature=0.5),
            make_req("b"), make_req("c", logprobs=0, temperature=0.0),
            make_req("d", logprobs=20, frequency_penalty=2.0, out=[1, 1])]
    out = sampler()(logits, reqs)
    assert out.token_ids[0] == 7 and out.logprobs[1] is None
    ref = torch.log_softmax(logits, -1)
    for i, k in ((0, 5), (2, 0), (3, 20)):
        lp, tok = out.logprobs[i], out.token_ids[i]
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(ref[i, tok].item(), abs=1e-5)
        assert lp.rank == 1 + int((ref[i] > ref[i, tok]).sum())
        vals, ids = ref[i].topk(k)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(vals.tolist(), abs=1e-5)
    assert out.logprobs[2].rank == 1


def test_prompt_logprobs_score_next_prompt_tokens():
    t = 300                                                  # spans more than one chunk
    logits = torch.randn(t, V, generator=torch.Generator().manual_seed(7))
    targets = np.random.default_rng(0).integers(0, V, t).astype(np.int32)
    out = prompt_logprobs(logits, targets, 3)
    ref = torch.log_softmax(logits, -1)
    assert len(out) == t
    for row in (0, 255, 256, 299):
        lp, tok = out[row], int(targets[row])
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(ref[row, tok].item(), abs=1e-5)
        assert lp.rank == 1 + int((ref[row] > ref[row, tok]).sum())
        assert [i for i, _ in lp.top] == ref[row].topk(3).indices.tolist()
    assert prompt_logprobs(logits[:2], torch.tensor([1, 2]), 0)[1].top == ()
