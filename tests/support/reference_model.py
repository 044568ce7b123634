"""A naive dense Llama-family forward pass: the yardstick the paged engine is tested against.

Deliberately simple: no KV cache, every step recomputes the whole sequence, one sequence at
a time, written to match Hugging Face's LlamaForCausalLM / MistralForCausalLM /
Qwen2ForCausalLM line by line (RMSNorm in float32, rotate-half RoPE with optional llama3
frequency scaling, GQA by repeating K/V heads, SiLU-gated MLP, optional q/k/v bias, tied
embeddings, and Mistral's sliding window: query i sees keys j with i - window < j <= i).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from splitserve.model.config import ModelConfig, RopeScaling


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed down by `factor`, short ones kept, a smooth blend
    in between."""
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
              / (s.high_freq_factor - s.low_freq_factor))
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def rope_cos_sin(cfg: ModelConfig, positions: torch.Tensor):
    """cos, sin: (T, head_dim), the two halves repeated (Hugging Face layout)."""
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64)
                                         .float() / cfg.head_dim))
    if cfg.rope_scaling is not None:
        inv_freq = llama3_inv_freq(inv_freq, cfg.rope_scaling)
    freqs = positions.float()[:, None] * inv_freq[None, :]      # (T, head_dim/2)
    emb = torch.cat([freqs, freqs], dim=-1)                     # (T, head_dim)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class ReferenceModel:
    def __init__(self, source, dtype: torch.dtype = torch.float32):
        self.cfg: ModelConfig = source.config
        self.dtype = dtype
        self.w = {name: t.to(dtype) for name, t in source.weights()}
        if self.cfg.tie_word_embeddings:
            self.w["lm_head.weight"] = self.w["model.embed_tokens.weight"]

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        bias = self.w.get(name + ".bias")
        return F.linear(x, self.w[name + ".weight"], bias)

    def _mask(self, T: int) -> torch.Tensor:
        i = torch.arange(T)[:, None]
        j = torch.arange(T)[None, :]
        allowed = j <= i
        if self.cfg.sliding_window is not None:
            allowed &= j > i - self.cfg.sliding_window
        return allowed                                          # (T, T) bool

    def _attention(self, x: torch.Tensor, p: str, cos, sin, mask) -> torch.Tensor:
        cfg, T = self.cfg, x.shape[0]
        q = self._linear(x, p + "q_proj").view(T, cfg.num_heads, cfg.head_dim).transpose(0, 1)
        k = self._linear(x, p + "k_proj").view(T, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)
        v = self._linear(x, p + "v_proj").view(T, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)
        q = q * cos + rotate_half(q) * sin                      # (H, T, D)
        k = k * cos + rotate_half(k) * sin                      # (KV, T, D)
        group = cfg.num_heads // cfg.num_kv_heads
        k = k.repeat_interleave(group, dim=0)                   # (H, T, D)
        v = v.repeat_interleave(group, dim=0)
        scores = (q @ k.transpose(1, 2)) / math.sqrt(cfg.head_dim)   # (H, T, T)
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out = (probs @ v).transpose(0, 1).reshape(T, cfg.q_size)    # (T, H*D)
        return self._linear(out, p + "o_proj")

    def _mlp(self, x: torch.Tensor, p: str) -> torch.Tensor:
        return self._linear(F.silu(self._linear(x, p + "gate_proj"))
                            * self._linear(x, p + "up_proj"), p + "down_proj")

    @torch.inference_mode()
    def hidden_states(self, token_ids: list[int]) -> torch.Tensor:
        """Final-normed hidden states (T, hidden)."""
        cfg, T = self.cfg, len(token_ids)
        x = self.w["model.embed_tokens.weight"][torch.tensor(token_ids)]   # (T, hidden)
        cos, sin = (t.to(self.dtype) for t in rope_cos_sin(cfg, torch.arange(T)))
        mask = self._mask(T)
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            h = rms_norm(x, self.w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
            x = x + self._attention(h, p + "self_attn.", cos, sin, mask)
            h = rms_norm(x, self.w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
            x = x + self._mlp(h, p + "mlp.")
        return rms_norm(x, self.w["model.norm.weight"], cfg.rms_norm_eps)

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """(T, vocab) logits, float32."""
        with torch.inference_mode():
            return F.linear(self.hidden_states(token_ids), self.w["lm_head.weight"]).float()

    def greedy(self, token_ids: list[int], max_new_tokens: int,
               eos_ids=()) -> list[int]:
        """Generated ids only; stops after emitting an eos id (which is included)."""
        seq, out = list(token_ids), []
        for _ in range(max_new_tokens):
            with torch.inference_mode():
                last = self.hidden_states(seq)[-1]
                nxt = int(F.linear(last, self.w["lm_head.weight"]).float().argmax())
            seq.append(nxt)
            out.append(nxt)
            if nxt in eos_ids:
                break
        return out
