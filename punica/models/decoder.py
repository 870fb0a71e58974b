"""The decoder of every family punica serves (punica.families), whose 7 projections per layer
add each token's LoRA delta. A family is a set of features of the config (ModelConfig): biased
q/k/v (`qkv_bias`, the LoRA delta adding to the biased projection), an RMSNorm over each head
of q and k before rotary (`qk_norm`), sliding-window attention on some layers
(`layer_windows`, with a rope of their own: `local_rope`), and Gemma's: GeGLU (`hidden_act`),
embeddings times sqrt(hidden) (`embed_scale`), RMSNorms on the attention and MLP outputs
before their residual adds (`sandwich_norms`), softcapped attention scores and logits, and its
query scale (`attn_scale`); with none of them it is Llama. (Gemma's (1 + w) norm weights are
stored with the 1 added, by the loader.)

The forward pass takes one fused batch (prefill tokens first, decode tokens after) with its
per-step metadata as explicit frozen dataclasses: `AttnBatch` (positions, pages, lengths)
and `LoraBatch` (which adapter slot each token uses). q/k/v and gate/up run as one fused
projection each; each of the four projection groups is a LoraLinear (punica.lora.layers) around
its base linear, which adds the group's LoRA deltas by the LoraBatch, so the decoder picks no
LoRA kernel and holds no adapter weights (punica.lora.layers.attach_pool points each LoraLinear
at its part of the adapter pool).
The elementwise work runs fused (punica.ops.layers): each residual add folds into the RMSNorm
after it, so a layer takes and returns (output, residual stream) as vLLM's layers do; rotary
and the KV-cache append run as one kernel (q rotated in place, k rotated on its way into the
cache, k in qkv left as it was); SiLU-and-mul reads the gate/up GEMM's output once.
With a `weight_format` (punica.models.quantized) the four fused projections hold fp8 weights
(Fp8Linear, punica.ops.fp8's GEMMs); everything else, and the LoRA path, is unchanged. Under
tensor parallelism (punica.parallel.tensor_parallel) o and down are row-parallel: their
LoraLinears all-reduce the ranks' partial outputs.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from punica.config import ModelConfig, RopeConfig
from punica.lora.batch import LoraBatch
from punica.lora.layers import LoraLinear
from punica.models.quantized import Fp8Format, Fp8Linear, Linear, projection
from punica.ops.attention import AttnBatch, paged_attention, rope_and_write_kv_, softcap_ref
from punica.ops.kv_cache import KVCache
from punica.ops.layers import gelu_tanh_and_mul, rms_norm, silu_and_mul


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, **factory):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, **factory), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x), or with a residual (norm(x + residual), x + residual): punica.ops.layers.rms_norm."""
        return rms_norm(x, self.weight, self.eps, residual)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in float32, with linear or llama3 scaling applied."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq
        return torch.where(wavelen > low_wavelen, inv_freq / rope.factor,
                           torch.where(wavelen < high_wavelen, inv_freq, smoothed))
    return inv_freq


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int, weight_format: Fp8Format | None = None, **factory):
        super().__init__()
        c, fmt = config, weight_format
        self.index = index
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.window, self.rope = c.window(index), c.layer_rope(index)
        self.scale, self.softcap = c.attn_scale or c.head_dim ** -0.5, c.attn_softcap
        self.act = gelu_tanh_and_mul if c.hidden_act == "gelu_tanh" else silu_and_mul

        def lora_projection(group: str, in_features: int, out_features: int, bias: bool = False) -> LoraLinear:
            """A fused projection (Linear, or Fp8Linear in `fmt`) with the LoRA deltas of its group."""
            return LoraLinear(projection(in_features, out_features, bias, fmt, **factory), index, group)

        self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, **factory)
        self.qkv_proj = lora_projection("qkv", c.hidden_size, c.q_size + 2 * c.kv_size, c.qkv_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, **factory) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, **factory) if c.qk_norm else None
        self.o_proj = lora_projection("o", c.q_size, c.hidden_size)
        self.post_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, **factory)  # before the MLP
        # with sandwich norms: on the attention output and on the MLP output
        self.attn_out_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, **factory) if c.sandwich_norms else None
        self.mlp_out_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, **factory) if c.sandwich_norms else None
        self.gate_up_proj = lora_projection("gate_up", c.hidden_size, 2 * c.intermediate_size)
        self.down_proj = lora_projection("down", c.intermediate_size, c.hidden_size)
        q, kv, inter = c.q_size, c.kv_size, c.intermediate_size
        self.qkv_slices = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}
        self.gate_up_slices = {"gate": (0, inter), "up": (inter, 2 * inter)}

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttnBatch,
                lora: LoraBatch, kv_layer: torch.Tensor, residual: torch.Tensor | None = None,
                kv_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, h], the previous layer's MLP output before its residual add (the embeddings
        for the first layer, with residual None)  ->  (this layer's MLP output, residual stream);
        the stream after the layer is their sum, which the next norm computes. kv_layer, kv_scales:
        this layer's part of the KVCache (KVCache.layer)."""
        num_tokens = x.shape[0]
        h, residual = (self.input_norm(x), x) if residual is None else self.input_norm(x, residual)
        qkv = self.qkv_proj(h, lora)
        q_end, k_end = self.qkv_slices["k"][0], self.qkv_slices["v"][0]
        q = qkv[:, :q_end].view(num_tokens, self.num_heads, self.head_dim)
        k = qkv[:, q_end:k_end].view(num_tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, k_end:].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # over each head: rows of head_dim
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(num_tokens, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(num_tokens, self.num_kv_heads, self.head_dim)
        rope_and_write_kv_(q, k, v, cos, sin, kv_layer, attn.slot_mapping, kv_scales)  # q rotated in place
        o = paged_attention(q, kv_layer, attn, self.scale, self.window, self.softcap, kv_scales)
        o = self.o_proj(o.reshape(num_tokens, -1), lora)
        if self.attn_out_norm is not None:
            o = self.attn_out_norm(o)
        h, residual = self.post_norm(o, residual)
        down = self.down_proj(self.act(self.gate_up_proj(h, lora)), lora)
        if self.mlp_out_norm is not None:
            down = self.mlp_out_norm(down)
        return down, residual


class DecoderForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", weight_format: Fp8Format | None = None):
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self.config, self.weight_format = config, weight_format
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size, **factory)
        self.layers = nn.ModuleList(DecoderLayer(config, i, weight_format, **factory)
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, **factory)
        self.tie_weights()
        self.requires_grad_(False)
        # sqrt(hidden) rounded to the dtype, as transformers' Gemma has it
        scale = torch.tensor(config.hidden_size ** 0.5, dtype=dtype)
        self.embed_multiplier = float(scale) if config.embed_scale else 1.0
        self._inv_freqs: dict[RopeConfig, torch.Tensor] = {}

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

    def new_kv_cache(self, num_pages: int, page_size: int, kv_cache_dtype: str = "auto") -> KVCache:
        """An empty paged KV cache [L, num_pages, 2, page_size, Hkv, D] in the model's dtype ("auto")
        or in e4m3 with its scales ("fp8"; punica.ops.kv_cache)."""
        c, w = self.config, self.embed.weight
        return KVCache.empty(c.num_layers, num_pages, page_size, c.num_kv_heads, c.head_dim, w.dtype, w.device,
                             kv_cache_dtype)

    def group_weight(self, layer: int, group: str) -> torch.Tensor:
        """The base weight [h_out, h_in] of one layer's projection group ("qkv", "o", "gate_up", "down")
        in the activation dtype (an fp8 weight dequantized: DoRA's norms read it)."""
        linear = getattr(self.layers[layer], f"{group}_proj").base
        return linear.dequantized() if isinstance(linear, Fp8Linear) else linear.weight

    def rope_cos_sin(self, positions: torch.Tensor, rope: RopeConfig | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim / 2] of the positions under `rope` (default: the config's)."""
        rope = rope or self.config.rope
        inv_freq = self._inv_freqs.get(rope)
        if inv_freq is None or inv_freq.device != positions.device:
            inv_freq = self._inv_freqs[rope] = rope_inv_freq(rope, self.config.head_dim).to(positions.device)
        freqs = positions.float()[:, None] * inv_freq[None, :]
        return freqs.cos(), freqs.sin()

    def forward(self, input_ids: torch.Tensor, attn: AttnBatch, lora: LoraBatch,
                kv_cache: KVCache) -> torch.Tensor:
        """input_ids: [T]; kv_cache: pages [L, P, 2, page_size, Hkv, D]  ->  logits [num_logits, V] float32."""
        x, residual = self.embed(input_ids), None
        if self.embed_multiplier != 1.0:
            x = x * self.embed_multiplier
        tables = {}
        for i, layer in enumerate(self.layers):
            if layer.rope not in tables:
                tables[layer.rope] = self.rope_cos_sin(attn.positions, layer.rope)
            kv_layer, kv_scales = kv_cache.layer(i)
            x, residual = layer(x, *tables[layer.rope], attn, lora, kv_layer, residual, kv_scales)
        rows = attn.logits_indices
        x = self.norm(x[rows]) if residual is None else self.norm(x[rows], residual[rows])[0]
        return softcap_ref(self.lm_head(x).float(), self.config.final_softcap)
