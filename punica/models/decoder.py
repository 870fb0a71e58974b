"""The decoder of every family punica serves (punica.families), whose 7 projections per layer
add each token's LoRA delta. A family is a set of features of the config (ModelConfig): biased
q/k/v (`qkv_bias`, the LoRA delta adding to the biased projection), an RMSNorm over each head
of q and k before rotary (`qk_norm`), sliding-window attention on some layers
(`layer_windows`, with a rope of their own: `local_rope`), and Gemma's: GeGLU (`hidden_act`),
embeddings times sqrt(hidden) (`embed_scale`), RMSNorms on the attention and MLP outputs
before their residual adds (`sandwich_norms`), softcapped attention scores and logits, and its
query scale (`attn_scale`); with none of them it is Llama. On the layers a mixture-of-experts
family makes sparse (`moe_layers`) the MLP is a MoeBlock (punica.models.moe). (Gemma's (1 + w) norm weights are
stored with the 1 added, by the loader.)

The forward pass takes one fused batch of tokens (prefill tokens first, decode tokens after)
and one ForwardBatch (punica.models.forward_batch: the step's AttnBatch, LoraBatch and KV
cache), which every layer takes as it is. q/k/v and gate/up run as one fused projection each;
each of the four projection groups is a LoraLinear (punica.lora.layers) around its base linear,
which adds the group's LoRA deltas by the batch's LoraBatch, so the decoder picks no LoRA
kernel and holds no adapter weights (punica.lora.layers.attach_pool points each LoraLinear at
its part of the adapter pool).
The elementwise work runs fused (punica.ops.layers): each residual add folds into the RMSNorm
after it, so a layer takes and returns (output, residual stream) as vLLM's layers do; rotary
and the KV-cache append run as one kernel (q rotated in place, k rotated on its way into the
cache, k in qkv left as it was); SiLU-and-mul reads the gate/up GEMM's output once. The LoRA
deltas that the side stream computed beside the projections' GEMMs (decode steps on CUDA) are added
by the op that reads the output next (rotary + KV append, the norms, the activation), not by
launches of their own (LoraLinear.forward_deferred): a layer also takes and returns the delta
pending on its output.
With a `weight_format` (punica.models.quantized) the four fused projections hold fp8 weights
(Fp8Linear, punica.ops.fp8's GEMMs); everything else, and the LoRA path, is unchanged. Under
tensor parallelism (punica.parallel.tensor_parallel) o and down are row-parallel: their
LoraLinears all-reduce the ranks' partial outputs.
"""

from __future__ import annotations

import torch
from torch import nn

from punica.config import ModelConfig
from punica.lora.layers import LoraLinear
from punica.models.forward_batch import ForwardBatch
from punica.models.moe import MoeBlock
from punica.models.quantized import Fp8Format, Fp8Linear, Linear, projection
from punica.models.rotary import Rotary
from punica.ops.attention import paged_attention, rope_and_write_kv_, softcap_ref
from punica.ops.kv_cache import KVCache
from punica.ops.layers import PendingDelta, gelu_tanh_and_mul, rms_norm, silu_and_mul


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, **factory):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, **factory), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, delta: PendingDelta | None = None):
        """norm(x), or with a residual (norm(x + residual), x + residual), a LoRA delta pending on x
        added first: punica.ops.layers.rms_norm."""
        return rms_norm(x, self.weight, self.eps, residual, delta)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int, rotary: Rotary, weight_format: Fp8Format | None = None,
                 **factory):
        super().__init__()
        c, fmt = config, weight_format
        self.index, self.rotary = index, rotary
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.window = c.window(index)
        self.scale, self.softcap = c.attn_scale or c.head_dim ** -0.5, c.attn_softcap
        self.act = gelu_tanh_and_mul if c.hidden_act == "gelu_tanh" else silu_and_mul

        def lora_projection(group: str, in_features: int, out_features: int, bias: bool = False) -> LoraLinear:
            """A fused projection (Linear, or Fp8Linear in `fmt`) with the LoRA deltas of its group."""
            return LoraLinear(projection(in_features, out_features, bias, fmt, **factory), index, group)

        self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, **factory)
        self.qkv_proj = lora_projection("qkv", c.hidden_size, c.q_size + 2 * c.kv_size, c.qkv_bias)
        # over each head, or with qk_norm_whole over the whole projection (all heads)
        self.qk_norm_whole = c.qk_norm_whole
        q_norm_size, k_norm_size = (c.q_size, c.kv_size) if c.qk_norm_whole else (c.head_dim, c.head_dim)
        self.q_norm = RMSNorm(q_norm_size, c.rms_norm_eps, **factory) if c.qk_norm else None
        self.k_norm = RMSNorm(k_norm_size, c.rms_norm_eps, **factory) if c.qk_norm else None
        self.o_proj = lora_projection("o", c.q_size, c.hidden_size)
        self.post_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, **factory)  # before the MLP
        # with sandwich norms: on the attention output and on the MLP output
        self.attn_out_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, **factory) if c.sandwich_norms else None
        self.mlp_out_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, **factory) if c.sandwich_norms else None
        # the MLP: a mixture of experts on the config's MoE layers (punica.models.moe), else dense
        self.moe = MoeBlock(c, index, **factory) if c.is_moe(index) else None
        if self.moe is None:
            self.gate_up_proj = lora_projection("gate_up", c.hidden_size, 2 * c.intermediate_size)
            self.down_proj = lora_projection("down", c.intermediate_size, c.hidden_size)
        q, kv, inter = c.q_size, c.kv_size, c.intermediate_size
        self.qkv_slices = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}
        self.gate_up_slices = {"gate": (0, inter), "up": (inter, 2 * inter)}

    def attention(self, h: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, PendingDelta | None]:
        """h: [T, hidden] normed  ->  (o_proj's output [T, hidden], its LoRA delta if pending);
        this layer's keys and values appended to its part of the KV cache."""
        num_tokens = h.shape[0]
        qkv, delta = self.qkv_proj.forward_deferred(h, batch.lora)
        if delta is not None and self.q_norm is not None:  # the norms read q and k with their delta
            delta.add_to(qkv)
            delta = None
        q_end, k_end = self.qkv_slices["k"][0], self.qkv_slices["v"][0]
        q = qkv[:, :q_end].view(num_tokens, self.num_heads, self.head_dim)
        k = qkv[:, q_end:k_end].view(num_tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, k_end:].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # over each head (rows of head_dim) or each token's whole q and k
            rows = num_tokens if self.qk_norm_whole else -1
            q = self.q_norm(q.reshape(rows, self.q_norm.weight.shape[0])).view(num_tokens, self.num_heads,
                                                                                self.head_dim)
            k = self.k_norm(k.reshape(rows, self.k_norm.weight.shape[0])).view(num_tokens, self.num_kv_heads,
                                                                                self.head_dim)
        cos, sin = batch.rope(self.rotary)
        kv_layer, kv_scales = batch.kv.layer(self.index)
        # q rotated in place, the delta of q, k and v added as they are read
        rope_and_write_kv_(q, k, v, cos, sin, kv_layer, batch.attn.slot_mapping, kv_scales, delta)
        o = paged_attention(q, kv_layer, batch.attn, self.scale, self.window, self.softcap, kv_scales)
        return self.o_proj.forward_deferred(o.reshape(num_tokens, -1), batch.lora)

    def mlp(self, h: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, PendingDelta | None]:
        """h: [T, hidden] normed  ->  (the MLP's output [T, hidden], down's LoRA delta if pending)."""
        if self.moe is not None:
            return self.moe(h, batch), None
        gate_up, delta = self.gate_up_proj.forward_deferred(h, batch.lora)
        return self.down_proj.forward_deferred(self.act(gate_up, delta), batch.lora)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch,
                delta: PendingDelta | None = None) -> tuple[torch.Tensor, torch.Tensor, PendingDelta | None]:
        """x: [T, h], the previous layer's MLP output before its residual add (the embeddings
        for the first layer, with residual None), with `delta` the LoRA delta still pending on it
        ->  (this layer's MLP output, residual stream, the delta pending on that output); the
        stream after the layer is their sum, which the next norm computes. A projection's delta is
        added by the op that reads its output next (the norms, the activation), not by a launch
        of its own (LoraLinear.forward_deferred)."""
        # the first layer's x (the embeddings, residual None) has no delta pending
        h, residual = (self.input_norm(x), x) if residual is None else self.input_norm(x, residual, delta)
        o, delta = self.attention(h, batch)
        if self.attn_out_norm is not None:
            o, delta = self.attn_out_norm(o, delta=delta), None
        h, residual = self.post_norm(o, residual, delta)
        down, delta = self.mlp(h, batch)
        if self.mlp_out_norm is not None:
            down, delta = self.mlp_out_norm(down, delta=delta), None
        return down, residual, delta


class DecoderForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", weight_format: Fp8Format | None = None):
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self.config, self.weight_format = config, weight_format
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size, **factory)
        ropes = {rope: Rotary(rope, config.head_dim) for rope in map(config.layer_rope, range(config.num_layers))}
        self.layers = nn.ModuleList(DecoderLayer(config, i, ropes[config.layer_rope(i)], weight_format, **factory)
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, **factory)
        self.tie_weights()
        self.requires_grad_(False)
        # sqrt(hidden) rounded to the dtype, as transformers' Gemma has it
        scale = torch.tensor(config.hidden_size ** 0.5, dtype=dtype)
        self.embed_multiplier = float(scale) if config.embed_scale else 1.0

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

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """input_ids: [T]  ->  logits [num_logits, V] float32 of the rows batch.attn.logits_indices."""
        x, residual = self.embed(input_ids), None
        if self.embed_multiplier != 1.0:
            x = x * self.embed_multiplier
        delta = None
        for layer in self.layers:
            x, residual, delta = layer(x, residual, batch, delta)
        if delta is not None:
            delta.add_to(x)
        rows = batch.attn.logits_indices
        x = self.norm(x[rows]) if residual is None else self.norm(x[rows], residual[rows])[0]
        return softcap_ref(self.lm_head(x).float(), self.config.final_softcap)
