"""Sampler: turns one decode step's logits into one token per request (vLLM semantics).

Order per row: logit_bias -> min_tokens (forbid eos / stop ids) -> repetition penalty ->
frequency / presence penalties -> the grammar's token mask (structured output) -> greedy
argmax, or temperature -> top_k -> top_p -> min_p -> a random draw. Rows only pay for what their parameters ask for: a batch of plain greedy rows
costs one argmax over (B, V) and no Python loop over the vocabulary.

Logprobs are "raw": log_softmax of the model's logits as given, before bias, penalties and
temperature (vLLM's default `logprobs_mode="raw_logprobs"`), so they describe the model, not
the sampling recipe. Only the first `vocab_size` columns count as the vocabulary: padded
columns of a wider lm_head are never sampled and never normalised over.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from splitserve.engine import seeded
from splitserve.engine.grammar import allowed_tokens
from splitserve.engine.request import Request
from splitserve.protocol.engine import Logprob

_PROMPT_LOGPROBS_CHUNK = 256   # rows of (T, V) log_softmax materialised at once
_MIN_TEMPERATURE = 1e-5
_TOP_P_WINDOW = 512            # candidates searched for the nucleus before a full sort


# Logprob(token_id, logprob, rank, top): rank is 1 + entries with a strictly greater
# logprob; top holds the k most likely (id, logprob), best first.
TokenLogprobs = Logprob


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]   # one per row; None where not requested


class Sampler:
    """Stateless per step apart from its own generator, which serves every row whose
    request has no seed. A seeded row's draw is a pure function of its seed and output
    position (engine/seeded.py), so its tokens do not depend on what else shares the batch,
    nor on which worker sampled them."""

    def __init__(self, vocab_size: int, seed: int | None = None,
                 device: torch.device | str = "cpu"):
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.vocab_size = vocab_size
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little")
        self.generator = torch.Generator(device).manual_seed(seed)   # the logits' device

    def __call__(self, logits: Tensor, requests: list[Request]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise ValueError(f"logits must be (B, V) with B={len(requests)} rows, "
                             f"got {tuple(logits.shape)}")
        if logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits have {logits.shape[1]} columns, fewer than the "
                             f"vocabulary ({self.vocab_size})")
        raw = logits[:, :self.vocab_size].float()            # (B, V), a view when float32
        x = self._adjust(raw, requests)                      # (B, V), raw itself if untouched
        x = self._constrain(x, raw, requests)
        greedy = [i for i, r in enumerate(requests) if r.params.greedy]
        if len(greedy) == len(requests):
            tokens = x.argmax(dim=-1)                        # (B,)
        elif not greedy:
            tokens = self._sample(x, requests)
        else:
            tokens = torch.empty(len(requests), dtype=torch.long, device=x.device)
            rand = [i for i, r in enumerate(requests) if not r.params.greedy]
            g_idx = torch.tensor(greedy, device=x.device)
            r_idx = torch.tensor(rand, device=x.device)
            tokens[g_idx] = x[g_idx].argmax(dim=-1)
            tokens[r_idx] = self._sample(x[r_idx], [requests[i] for i in rand])
        token_ids = tokens.tolist()
        return SamplerOutput(token_ids, self._logprobs(raw, token_ids, requests))

    # -- logit processing ---------------------------------------------------------------
    def _adjust(self, raw: Tensor, requests: list[Request]) -> Tensor:
        """Bias, min_tokens and penalties. Copies `raw` only if some row needs them: the
        caller's logits and the raw logprobs must stay untouched."""
        x = None
        for i, req in enumerate(requests):
            p = req.params
            masks_eos = req.num_output_tokens < p.min_tokens
            if not (p.logit_bias or masks_eos or p.needs_token_counts):
                continue
            if x is None:
                x = raw.clone()
            self._adjust_row(x[i], req, masks_eos)
        return raw if x is None else x

    def _constrain(self, x: Tensor, raw: Tensor, requests: list[Request]) -> Tensor:
        """Structured output: tokens a row's grammar forbids get -inf, before greedy argmax
        and before temperature, top-k and top-p, so no draw or argmax can leave the grammar.
        One mask for all such rows; rows without a grammar are not touched."""
        rows = [i for i, r in enumerate(requests) if r.grammar is not None]
        if not rows:
            return x
        allowed = allowed_tokens([requests[i].grammar for i in rows], self.vocab_size,
                                 x.device)                                  # (G, V)
        if len(rows) == len(requests):   # one pass, a new tensor: raw stays as it was
            return torch.where(allowed, x, float("-inf"))
        if x is raw:
            x = raw.clone()
        idx = torch.tensor(rows, device=x.device)
        x[idx] = torch.where(allowed, x[idx], float("-inf"))
        return x

    def _adjust_row(self, row: Tensor, req: Request, masks_eos: bool) -> None:
        """In place on one (V,) row."""
        p, vocab = req.params, row.shape[0]
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias.keys()), dtype=torch.long, device=row.device)
            row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype,
                                     device=row.device)
        if masks_eos:
            banned = [t for t in (*req.eos_token_ids, *p.stop_token_ids) if 0 <= t < vocab]
            row[banned] = float("-inf")
        if p.repetition_penalty != 1.0:
            # The only read of prompt values in the sampler. On a generation worker the
            # prompt may be a length-only placeholder that raises PlaceholderReadError;
            # the guard that keeps such requests away from this branch lives beside us.
            seen = (_counts(req.prompt.array, vocab, row.device)
                    + _counts(req.output_token_ids, vocab, row.device) > 0)
            penalized = torch.where(row > 0, row / p.repetition_penalty,
                                    row * p.repetition_penalty)
            row.copy_(torch.where(seen, penalized, row))
        if p.frequency_penalty or p.presence_penalty:
            # OpenAI: only generated tokens count; the prompt is not penalised.
            counts = _counts(req.output_token_ids, vocab, row.device).to(row.dtype)      # (V,)
            row -= counts * p.frequency_penalty + (counts > 0).to(row.dtype) * p.presence_penalty

    # -- random sampling ----------------------------------------------------------------
    def _sample(self, x: Tensor, requests: list[Request]) -> Tensor:
        """x: (R, V) adjusted logits of non-greedy rows -> (R,) token ids."""
        ps = [r.params for r in requests]
        # A tiny positive temperature is clamped, not special-cased: logits / 1e-10 overflow.
        temps = torch.tensor([max(p.temperature, _MIN_TEMPERATURE) for p in ps], dtype=x.dtype,
                             device=x.device)
        x = x / temps.unsqueeze(1)
        x = _top_k_top_p(x, [p.top_k for p in ps], [p.top_p for p in ps])
        if any(p.min_p > 0 for p in ps):
            probs = x.softmax(dim=-1)                                           # (R, V)
            min_p = torch.tensor([p.min_p for p in ps], dtype=x.dtype, device=x.device).unsqueeze(1)
            x = x.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
        probs = x.softmax(dim=-1)                                               # (R, V)
        keyed = [i for i, r in enumerate(requests) if r.params.seed is not None]
        if not keyed:
            return self._race(probs)
        if len(keyed) == len(requests):
            return self._seeded(probs, requests)
        tokens = torch.empty(len(requests), dtype=torch.long, device=probs.device)
        shared = [i for i, r in enumerate(requests) if r.params.seed is None]
        s_idx = torch.tensor(keyed, device=probs.device)
        u_idx = torch.tensor(shared, device=probs.device)
        tokens[s_idx] = self._seeded(probs[s_idx], [requests[i] for i in keyed])
        tokens[u_idx] = self._race(probs[u_idx])
        return tokens

    def _race(self, probs: Tensor) -> Tensor:
        """(R, V) probabilities of unseeded rows -> (R,) tokens, noise from self.generator.
        Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) picks i with probability p_i.
        With E = -log U, argmax(p / E) = argmin(p / log U): saves two passes over (R, V)."""
        u = torch.empty(probs.shape, device=probs.device).uniform_(generator=self.generator)  # (R, V)
        # U == 0 would give log U = -inf and p / -inf = -0, a tie with p = 0 tokens.
        # Strictly negative and finite: p > 0 always scores below every p = 0 token.
        log_u = u.clamp_(min=torch.finfo(u.dtype).tiny).log_()
        return (probs / log_u).argmin(dim=-1)

    @staticmethod
    def _seeded(probs: Tensor, requests: list[Request]) -> Tensor:
        """(R, V) probabilities of seeded rows -> (R,) tokens, each at the uniform of its
        (seed, output position): the position counts resumed tokens too."""
        seeds = torch.tensor([r.params.seed for r in requests], dtype=torch.int64,
                             device=probs.device)
        positions = torch.tensor([r.num_output_tokens for r in requests], dtype=torch.int64,
                                 device=probs.device)
        return seeded.sample(probs, seeded.uniforms(seeds, positions))

    # -- logprobs -----------------------------------------------------------------------
    def _logprobs(self, raw: Tensor, token_ids: list[int],
                  requests: list[Request]) -> list[TokenLogprobs | None]:
        out: list[TokenLogprobs | None] = [None] * len(requests)
        rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        if not rows:
            return out
        idx = torch.tensor(rows, device=raw.device)
        lps = token_logprobs(raw[idx].log_softmax(dim=-1),
                             torch.tensor(token_ids, device=raw.device)[idx],
                             [requests[i].params.logprobs for i in rows])
        for i, lp in zip(rows, lps):
            out[i] = lp
        return out


def _counts(ids, vocab: int, device) -> Tensor:
    """(V,) occurrences of each id in `ids` (a list or an int32 array), on `device`."""
    t = torch.from_numpy(np.asarray(ids, dtype=np.int64))    # copies: prompt arrays are read-only
    return torch.bincount(t.to(device), minlength=vocab)[:vocab]


def _top_k_top_p(x: Tensor, top_k: list[int], top_p: list[float]) -> Tensor:
    """x: (R, V) temperature-scaled logits. Keeps each row's top_k most likely tokens (<= 0:
    all), then the smallest set whose probability reaches top_p; always keeps the top token."""
    vocab = x.shape[1]
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=x.device)  # (R,)
    ps = torch.tensor(top_p, dtype=x.dtype, device=x.device)                    # (R,)
    # top_p == 1 must keep everything even when a float cumsum reaches 1 early.
    ps = ps.masked_fill(ps >= 1.0, float("inf"))
    uses_k, uses_p = ks < vocab, ps < 1.0
    if not (uses_k | uses_p).any():
        return x
    # A full sort of (R, V) costs ~30x a topk of a few hundred, and the nucleus almost
    # always lies inside the top few hundred tokens: look there first.
    width = int(ks[uses_k].max()) if uses_k.any() else 0
    if bool((uses_p & ~uses_k).any()):
        width = max(width, _TOP_P_WINDOW)
    vals, order, spills = _nucleus(x, ks, ps, min(width, vocab))
    out = x.masked_fill((uses_k | uses_p).unsqueeze(1), float("-inf"))
    out.scatter_(-1, order, vals)
    if spills.any():                     # nuclei wider than the window: sort those rows
        rows = spills.nonzero().flatten()
        vals, order, _ = _nucleus(x[rows], ks[rows], ps[rows], vocab)
        out[rows] = torch.full_like(vals, float("-inf")).scatter_(-1, order, vals)
    return out


def _nucleus(x: Tensor, ks: Tensor, ps: Tensor, width: int) -> tuple[Tensor, Tensor, Tensor]:
    """The `width` best logits per row, best first, with those outside top_k / top_p set to
    -inf; their ids; and (R,) which top_p rows' nucleus does not fit in `width`."""
    vals, order = x.topk(width, dim=-1)                                         # (R, W) each
    positions = torch.arange(width, device=x.device).unsqueeze(0)               # (1, W)
    vals = vals.masked_fill(positions >= ks.unsqueeze(1), float("-inf"))
    # Rows whose top_k fits in the window normalise over it; the rest over the whole row.
    lse = torch.where(ks <= width, vals.logsumexp(dim=-1), x.logsumexp(dim=-1))  # (R,)
    probs = (vals - lse.unsqueeze(1)).exp()                                     # (R, W)
    mass = probs.cumsum(dim=-1)
    spills = (ks > width) & (ps < 1.0) & (mass[:, -1] < ps)
    return vals.masked_fill(mass - probs >= ps.unsqueeze(1), float("-inf")), order, spills


def token_logprobs(logprobs: Tensor, token_ids: Tensor, ks: list[int]) -> list[TokenLogprobs]:
    """logprobs: (N, V) log-probabilities; token_ids: (N,) the token each row scores;
    ks[n]: how many top alternatives row n reports."""
    chosen = logprobs.gather(1, token_ids.long().unsqueeze(1))                  # (N, 1)
    ranks = (logprobs > chosen).sum(dim=-1) + 1                                 # (N,)
    kmax = min(max(ks, default=0), logprobs.shape[1])
    top_vals, top_ids = logprobs.topk(kmax, dim=-1)                             # (N, kmax)
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    return [TokenLogprobs(tok, lp, rank, tuple(zip(top_ids[n][:k], top_vals[n][:k])))
            for n, (tok, lp, rank, k) in enumerate(zip(token_ids.tolist(),
                                                       chosen.squeeze(1).tolist(),
                                                       ranks.tolist(), ks))]


def prompt_logprobs(logits: Tensor, target_ids, k: int,
                    vocab_size: int | None = None) -> list[TokenLogprobs]:
    """logits: (T, V), row t predicting target_ids[t] (the next prompt token) -> T entries,
    each with its k best alternatives. Works in row chunks so a long prompt never holds a
    second full (T, V) float tensor. `vocab_size` drops padded lm_head columns."""
    targets = torch.as_tensor(np.asarray(target_ids, dtype=np.int64), device=logits.device)  # (T,)
    if logits.dim() != 2 or targets.shape != (logits.shape[0],):
        raise ValueError(f"prompt_logprobs needs (T, V) logits and (T,) targets, got "
                         f"{tuple(logits.shape)} and {tuple(targets.shape)}")
    if vocab_size is not None:
        logits = logits[:, :vocab_size]
    out: list[TokenLogprobs] = []
    for start in range(0, logits.shape[0], _PROMPT_LOGPROBS_CHUNK):
        end = start + _PROMPT_LOGPROBS_CHUNK
        lps = logits[start:end].float().log_softmax(dim=-1)                     # (chunk, V)
        out += token_logprobs(lps, targets[start:end], [k] * lps.shape[0])
    return out
