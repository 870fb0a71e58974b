"""Megatron-style tensor parallelism as an in-place transform of a loaded model (gpt-fast style).

Each of N ranks keeps 1/N of every layer:

    column-parallel  q, k, v (whole heads), gate, up   weight rows split: rank r computes its
                                                        heads / its slice of the intermediate
    row-parallel     o, down                           weight columns split: rank r computes a
                                                        partial sum, all-reduced (LoraLinear.tp_group)

The fused qkv and gate_up GEMMs stay fused: a rank's qkv_proj holds [its q heads; its k heads;
its v heads], and its gate_up_proj [its gate rows; its up rows]. q heads and kv heads are split
into contiguous blocks, so rank r's q heads use exactly its kv heads (GQA groups never straddle
ranks); this needs num_kv_heads % N == 0. Each rank's KV cache holds its num_kv_heads / N heads:
`model.config` becomes the per-rank config, so model.new_kv_cache allocates the rank's shard.
The embedding and lm_head stay replicated (simplest: every rank computes the full logits, no
vocab-parallel gather), as do the norms (the per-head q/k norms of some families too: every
head has the same one). A family's q/k/v bias is split with qkv_proj's rows.

FP8 weights (punica.models.quantized) split with their scales: per-channel scales like the
rows of their weight (column-parallel: split; row-parallel: every rank keeps all of them, and
a row's scale holds for each rank's slice of its columns); block scales by whole blocks, so a
column-parallel rank's row runs and a row-parallel rank's columns must start (and, except at
the weight's end, stop) at block boundaries, or the model is refused.

A mixture-of-experts layer (punica.models.moe) splits every expert the same way over its
intermediate dimension: each expert's gate and up rows column-parallel, its down columns
row-parallel, the router replicated; the block's output (every token's weighted sum of its
experts' partial outputs) is all-reduced once (LoraExperts.tp_group). Its expert LoRA splits as
the dense MLP's: gate_up's A replicated and B by rows, down's A by columns and B replicated.

`split_model_` says where each split parameter lies in the full model's (loader.Shard), so it
works on a model still on the meta device: the loader then reads (checkpoint) or generates
(dummy weights) only the rank's slices, and no rank ever holds the full model.

LoRA, in the canonical pool layout (lora_a [S, R, h_in], lora_b [S, h_out, R]):

    column-parallel  lora_a replicated, lora_b split by output rows. Every rank computes the
                     whole shrink v = x @ A^T (x is replicated; T x R, tiny) and expands only
                     into its own output columns. No communication.
    row-parallel     lora_a split by input columns, lora_b replicated. Rank r holds x_r (its
                     slice of the input) and adds the partial delta (x_r @ A_r^T) @ B^T * s into
                     its partial output *before* the backbone's all-reduce, which sums both:
                         sum_r [x_r W_r^T + (x_r A_r^T) B^T s] = x W^T + (x A^T) B^T s
                     No communication beyond the backbone's own all-reduce.

Why not S-LoRA's row-parallel scheme (all-reduce the partial shrinks v_r, T x R, then expand
with lora_b split by output rows)? It shards lora_b's memory and the expand FLOPs, but adds two
collectives per layer to every step with LoRA rows, and in decode a collective's latency, not its
few bytes, is the cost. Here nothing but the backbone's activations cross ranks; the price is a
replicated o/down lora_b (h x R per slot, the size of one rank's lora_a) and an expand computed
in full on each rank (T x R x h, small next to the T x h x h/N base GEMM). `add_lora` and the
kernels are unchanged: the row-parallel delta is simply a LoRA on the rank's input slice.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from punica.config import ModelConfig, ceil_div
from punica.lora.adapter import LoraAdapter
from punica.lora.pool import LoraPool
from punica.models.decoder import DecoderForCausalLM
from punica.models.loader import Shard
from punica.models.quantized import Fp8Linear

COLUMN_PARALLEL = ("q", "k", "v", "gate", "up")  # output features split: lora_b rows split
ROW_PARALLEL = ("o", "down")                     # input features split: lora_a columns split


def rank_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """The config of one rank's shard: 1/N of the heads, kv heads and intermediate sizes (the
    dense MLP's and the experts')."""
    if config.qk_norm_whole and world_size > 1:
        raise ValueError(f"tensor parallelism of {config.family}: its q/k norms span every head, which the "
                         "ranks split")
    for name in ("num_heads", "num_kv_heads", "intermediate_size", "moe_intermediate_size"):
        if getattr(config, name) % world_size:
            raise ValueError(f"tensor parallelism: {name} ({getattr(config, name)}) is not "
                             f"divisible by the tensor-parallel size {world_size}")
    return dataclasses.replace(config, num_heads=config.num_heads // world_size,
                               num_kv_heads=config.num_kv_heads // world_size,
                               intermediate_size=config.intermediate_size // world_size,
                               moe_intermediate_size=config.moe_intermediate_size // world_size)


def _part(size: int, rank: int, world_size: int) -> slice:
    """Rank r's contiguous 1/N of `size` features."""
    n = size // world_size
    return slice(rank * n, (rank + 1) * n)


def _run(size: int, rank: int, world_size: int, offset: int = 0) -> tuple[int, int]:
    """Rank r's contiguous 1/N of `size` features that start at `offset`, as (first, end)."""
    part = _part(size, rank, world_size)
    return offset + part.start, offset + part.stop


def _lora_part(config: ModelConfig, projection: str, rank: int, world_size: int) -> slice:
    """The features of a projection rank r keeps: its outputs (column) or its inputs (row)."""
    h_in, h_out = config.projection_shapes()[projection]
    return _part(h_out if projection in COLUMN_PARALLEL else h_in, rank, world_size)


def _set_param(linear: nn.Linear, kind: str, value: torch.Tensor) -> None:
    setattr(linear, kind, nn.Parameter(value.contiguous(), requires_grad=False))
    if kind == "weight":
        linear.out_features, linear.in_features = value.shape


def model_shards(config: ModelConfig, rank: int, world_size: int) -> dict[str, Shard]:
    """Where each split parameter of rank r's shard lies in the full model's; the rest are replicated."""
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    shards = {}
    for i in range(config.num_layers):
        qkv_rows = (_run(q, rank, world_size), _run(kv, rank, world_size, q), _run(kv, rank, world_size, q + kv))
        shards[f"layers.{i}.qkv_proj.base.weight"] = Shard((q + 2 * kv, h), qkv_rows)
        if config.qkv_bias:
            shards[f"layers.{i}.qkv_proj.base.bias"] = Shard((q + 2 * kv,), qkv_rows)
        shards[f"layers.{i}.o_proj.base.weight"] = Shard((h, q), ((0, h),), _run(q, rank, world_size))
        if config.is_moe(i):
            shards |= _expert_shards(config, i, rank, world_size)
            continue
        shards[f"layers.{i}.gate_up_proj.base.weight"] = Shard((2 * inter, h), (
            _run(inter, rank, world_size), _run(inter, rank, world_size, inter)))
        shards[f"layers.{i}.down_proj.base.weight"] = Shard((h, inter), ((0, h),), _run(inter, rank, world_size))
    return shards


def _expert_shards(config: ModelConfig, layer: int, rank: int, world_size: int) -> dict[str, Shard]:
    """A MoE layer's experts split over their intermediate dimension: every expert keeps its gate and
    up rows of the rank's 1/N (column-parallel) and its down columns of it (row-parallel); the
    router is replicated."""
    h, inter, num_experts = config.hidden_size, config.moe_intermediate_size, config.num_experts
    rows = tuple(run for e in range(num_experts) for run in (
        _run(inter, rank, world_size, 2 * inter * e), _run(inter, rank, world_size, 2 * inter * e + inter)))
    prefix = f"layers.{layer}.moe.experts.base"
    return {f"{prefix}.gate_up_proj": Shard((num_experts * 2 * inter, h), rows),
            f"{prefix}.down_proj": Shard((num_experts * h, inter), ((0, num_experts * h),),
                                         _run(inter, rank, world_size))}


def _scale_shard(name: str, weight: Shard, block_size: tuple[int, int] | None) -> Shard | None:
    """Where the scales of an fp8 weight split as `weight` lie in the full weight's scales (None: all of them)."""
    num_rows, num_cols = weight.full_shape
    if block_size is None:
        return Shard((num_rows,), weight.rows) if weight.cols is None else None
    b0, b1 = block_size
    full = (ceil_div(num_rows, b0), ceil_div(num_cols, b1))
    bounds = ((b0, num_rows, [x for run in weight.rows for x in run]) if weight.cols is None else
              (b1, num_cols, list(weight.cols)))
    block, end, edges = bounds
    if any(x % block and x != end for x in edges):
        raise ValueError(f"tensor parallelism: the {b0} x {b1} fp8 weight blocks of {name} do not split at this "
                         f"rank's shard bounds {weight.rows if weight.cols is None else weight.cols}")
    if weight.cols is None:
        return Shard(full, tuple((a // b0, ceil_div(b, b0)) for a, b in weight.rows))
    return Shard(full, ((0, full[0]),), (weight.cols[0] // b1, ceil_div(weight.cols[1], b1)))


def split_model_(model: DecoderForCausalLM, rank: int, world_size: int) -> dict[str, Shard]:
    """Keep rank r's shard of every layer in place (real or meta tensors); where each lies in the full model."""
    full, local = model.config, rank_config(model.config, world_size)
    shards = model_shards(full, rank, world_size)
    for name, where in list(shards.items()):
        module = model.get_submodule(name.rsplit(".", 1)[0])
        if isinstance(module, Fp8Linear) and name.endswith(".weight"):
            scale = _scale_shard(name, where, module.block_size)
            if scale is not None:
                shards[f"{name}_scale"] = scale
    params = dict(model.named_parameters())
    for name, where in shards.items():
        module, kind = name.rsplit(".", 1)
        _set_param(model.get_submodule(module), kind, where.take(params[name]))
    lq, lkv, linter = local.q_size, local.kv_size, local.intermediate_size
    for layer in model.layers:
        layer.num_heads, layer.num_kv_heads = local.num_heads, local.num_kv_heads
        layer.qkv_slices = {"q": (0, lq), "k": (lq, lq + lkv), "v": (lq + lkv, lq + 2 * lkv)}
        layer.gate_up_slices = {"gate": (0, linter), "up": (linter, 2 * linter)}
    for layer in model.layers:
        if layer.moe is not None:
            layer.moe.experts.base.intermediate_size = local.moe_intermediate_size
    model.config = local
    return shards


def shard_model_(model: DecoderForCausalLM, group: dist.ProcessGroup) -> dict[str, Shard]:
    """Keep this rank's shard of every layer in place and sum row-parallel outputs over `group`.

    Also a loader ShardFn (`shard=lambda m: shard_model_(m, group)`): on the meta device it
    only reshapes, and the loader fills in the rank's slices."""
    shards = split_model_(model, dist.get_rank(group), dist.get_world_size(group))
    for layer in model.layers:
        layer.o_proj.tp_group = group
        if layer.moe is not None:
            layer.moe.experts.tp_group = group
        else:
            layer.down_proj.tp_group = group
    return shards


def shard_pool_(pool: LoraPool, group: dist.ProcessGroup) -> None:
    """Keep rank r's shard of every adapter slot in place; write later adapters with shard_adapter."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    full, full_a, full_b = pool.config, pool.a, pool.b
    full_expert_a, full_expert_b = pool.expert_a, pool.expert_b
    pool.allocate(rank_config(full, world_size), pool.buffer.dtype, pool.buffer.device)
    for p in COLUMN_PARALLEL:
        pool.a[p].copy_(full_a[p])
        pool.b[p].copy_(full_b[p][:, :, _lora_part(full, p, rank, world_size)])
    for p in ROW_PARALLEL:
        pool.a[p].copy_(full_a[p][..., _lora_part(full, p, rank, world_size)])
        pool.b[p].copy_(full_b[p])
    gate, up, inter = _expert_parts(full, rank, world_size)
    pool.expert_a["gate_up"].copy_(full_expert_a["gate_up"])
    pool.expert_b["gate_up"].copy_(torch.cat([full_expert_b["gate_up"][..., gate, :],
                                              full_expert_b["gate_up"][..., up, :]], dim=-2))
    pool.expert_a["down"].copy_(full_expert_a["down"][..., inter])
    pool.expert_b["down"].copy_(full_expert_b["down"])


def _expert_parts(config: ModelConfig, rank: int, world_size: int) -> tuple[slice, slice, slice]:
    """Rank r's rows of an expert's gate_up output [2I] (its gate part, its up part) and its part of I."""
    inter = _part(config.moe_intermediate_size, rank, world_size)
    n = config.moe_intermediate_size
    return inter, slice(n + inter.start, n + inter.stop), inter


def shard_adapter(adapter: LoraAdapter, config: ModelConfig, rank: int, world_size: int) -> LoraAdapter:
    """Rank r's shard of an adapter loaded for the full model `config`, ready for a sharded pool."""
    lora_a, lora_b = dict(adapter.lora_a), dict(adapter.lora_b)
    for p in adapter.lora_a:
        part = _lora_part(config, p, rank, world_size)
        if p in COLUMN_PARALLEL:
            lora_b[p] = lora_b[p][:, part].contiguous()
        else:
            lora_a[p] = lora_a[p][..., part].contiguous()
    gate, up, inter = _expert_parts(config, rank, world_size)
    experts = {}
    for (param, layer), (a, b) in adapter.experts.items():
        if param == "gate_up":  # A replicated; B's rows: the rank's gate rows, then its up rows
            experts[param, layer] = (a, torch.cat([b[:, gate], b[:, up]], dim=1))
        else:  # A's columns: the rank's part of I; B replicated
            experts[param, layer] = (a[..., inter].contiguous(), b)
    return dataclasses.replace(adapter, lora_a=lora_a, lora_b=lora_b, experts=experts)


def tensor_parallel_(model: DecoderForCausalLM, pool: LoraPool | None, group: dist.ProcessGroup) -> None:
    """Shard a loaded model and its adapter pool in place for this rank of `group`."""
    if pool is not None:
        shard_pool_(pool, group)
    shard_model_(model, group)
