"""Build a model without allocating it twice: on the meta device first, then fill in weights.

Sources: an HF checkpoint directory (config.json + safetensors, sharded via the index file),
random "dummy" weights for any config, and what punica.models.sources resolves to such a
directory (a GGUF file, the embedded default model).

A `shard` function (tensor parallelism's) may reshape the model while it is still on the meta
device and say where each of its parameters lies in the full model's (a `Shard`); then only
those slices are read from the checkpoint, or generated, straight onto the device: the full
model never exists in this process.

FP8 weights (punica.models.quantized): `quantization="fp8"` quantizes the 7 projections as they
are read or generated (per output channel, each row from its full-precision values: a shard's
rows and scales equal the same slice of the unsharded model's); a checkpoint whose config.json
has a quantization_config (punica.models.fp8_checkpoint) is read as it is stored.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from punica.config import QUANTIZATIONS, ModelConfig
from punica.models.decoder import DecoderForCausalLM
from punica.models.fp8_checkpoint import INPUT_SCALE, check_fused_blocks, checkpoint_fp8, scale_rows
from punica.models.quantized import Fp8Format
from punica.models.sources import resolve_model_dir
from punica.ops.fp8 import FP8_DTYPE, quantize_per_channel

# tensors some checkpoints carry that the model recomputes
IGNORED_TENSORS = re.compile(r".*rotary_emb\.inv_freq$")
LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.(?:self_attn\.|mlp\.)?(\w+?)(?:_proj)?\.(weight|bias)")
# a MoE layer's router and experts (punica.models.moe): transformers 5's fused 3-D experts.gate_up_proj
# [E, 2I, H] and experts.down_proj [E, H, I], or one Linear per expert (Qwen-MoE's gate/up/down_proj,
# Mixtral's w1 (gate), w3 (up), w2 (down)), under mlp. (Mixtral's older checkpoints: block_sparse_moe.)
MOE_TENSOR = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\."
                        r"(?:(gate)\.weight|experts\.(gate_up_proj|down_proj)|experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight)")
EXPERT_PARTS = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def default_dtype(device: torch.device | str) -> torch.dtype:
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


@dataclass(frozen=True)
class Shard:
    """Where a parameter of a sharded model lies in the full model's parameter of the same name:
    its rows are the full rows of each range of `rows`, in order; its columns the full columns
    cols[0]:cols[1] (all of them when None)."""
    full_shape: tuple[int, ...]
    rows: tuple[tuple[int, int], ...]
    cols: tuple[int, int] | None = None

    @classmethod
    def whole(cls, shape: tuple[int, ...]) -> Shard:
        return cls(tuple(shape), ((0, shape[0]),))

    def overlaps(self, lo: int, hi: int) -> Iterator[tuple[int, int, int]]:
        """(first, end, first local row) of each run of the full rows [lo, hi) that this shard holds."""
        local = 0
        for a, b in self.rows:
            first, end = max(a, lo), min(b, hi)
            if first < end:
                yield first, end, local + first - a
            local += b - a

    def columns(self, rows: torch.Tensor) -> torch.Tensor:
        """This shard's columns of some full rows."""
        return rows if self.cols is None else rows[:, self.cols[0]:self.cols[1]]

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This shard of the full parameter."""
        return self.columns(torch.cat([full[a:b] for a, b in self.rows]))


# reshapes a model on the meta device in place; returns where each reshaped parameter lies in the full one
ShardFn = Callable[[DecoderForCausalLM], dict[str, Shard]]


@dataclass(frozen=True)
class DummyWeights:
    """Random weights of a model shape (dummy_model), a model source like a checkpoint directory."""
    config: ModelConfig
    seed: int = 0


def _empty_model(config: ModelConfig, dtype: torch.dtype, device: torch.device | str, shard: ShardFn | None,
                 weight_format: Fp8Format | None = None) -> tuple[DecoderForCausalLM, dict[str, Shard]]:
    """The model (or the shard `shard` makes of it) with uninitialised storage on `device`, allocated
    once, and the shards `shard` made."""
    if weight_format is not None and config.moe_layers:
        raise ValueError(f"fp8 weights of a mixture-of-experts model ({config.family}) are not supported")
    if weight_format is not None:
        check_fused_blocks(config, weight_format)
    model = DecoderForCausalLM(config, dtype=dtype, device="meta", weight_format=weight_format)
    shards = shard(model) if shard is not None else {}
    model.to_empty(device=device)
    model.tie_weights()
    return model, shards


DUMMY_CHUNK_NUMEL = 1 << 24  # random values are generated this many (rounded to whole rows) at a time


def _chunk_seed(seed: int, name: str, first_row: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{first_row}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _quantization_format(quantization: str) -> Fp8Format | None:
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    return Fp8Format() if quantization == "fp8" else None


def dummy_model(config: ModelConfig, dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
                seed: int = 0, shard: ShardFn | None = None, quantization: str = "none") -> DecoderForCausalLM:
    """Random weights for benchmarks: N(0, 0.02) matrices, unit norms; with quantization "fp8", the
    same values in `dtype` quantized per output channel.

    A matrix is generated in chunks of whole rows (DUMMY_CHUNK_NUMEL values), each from a
    generator seeded by (seed, parameter name, first row): its values depend on the seed,
    the name, the full shape and the device type only. A shard (`shard`) generates only the
    chunks that hold some of its rows and keeps its slice, so its values equal the same slice
    of the unsharded model's on any device of that type, and one chunk is all it allocates
    beyond its own parameters.
    """
    dtype = dtype or default_dtype(device)
    model, shards = _empty_model(config, dtype, device, shard, _quantization_format(quantization))
    params = dict(model.named_parameters())
    for name, param in params.items():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
            continue
        if name.endswith("weight_scale"):  # written with its weight
            continue
        scales = params.get(f"{name}_scale")
        where = shards.get(name, Shard.whole(param.shape))
        num_rows, num_cols = (*where.full_shape, 1)[:2]  # a bias: rows of one column
        chunk_rows = max(1, DUMMY_CHUNK_NUMEL // num_cols)
        gen = torch.Generator(device=param.device)
        for lo in range(0, num_rows, chunk_rows):
            hi = min(lo + chunk_rows, num_rows)
            runs = list(where.overlaps(lo, hi))
            if not runs:
                continue
            gen.manual_seed(_chunk_seed(seed, name, lo))
            values = torch.empty(hi - lo, num_cols, dtype=dtype if scales is not None else param.dtype,
                                 device=param.device)
            values.normal_(0.0, 0.02, generator=gen)
            values = values.view(hi - lo, *where.full_shape[1:])
            for first, end, local in runs:
                _write_rows(param, scales, local, values[first - lo:end - lo], where)
    return model


def _write_rows(param: torch.Tensor, scales: torch.Tensor | None, local: int, rows: torch.Tensor,
                where: Shard) -> None:
    """Write full rows of a parameter (their columns of the shard) from local row `local` on; an fp8
    weight (with `scales`) gets them quantized per row, from all their columns, and their scales."""
    if scales is not None and rows.dtype != FP8_DTYPE:
        rows, row_scales = quantize_per_channel(rows.to(param.device))
        scales.data[local:local + rows.shape[0]].copy_(row_scales)
    param.data[local:local + rows.shape[0]].copy_(where.columns(rows))


def _place(config: ModelConfig, name: str) -> tuple[str, int, int]:
    """(model parameter, first row, end row there) of an HF tensor: q/k/v (weights and biases)
    and gate/up are row ranges of the fused qkv_proj and gate_up_proj (each projection's base
    linear: `.base` of its punica.lora.layers.LoraLinear)."""
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    if name == "model.embed_tokens.weight":
        return "embed.weight", 0, config.vocab_size
    if name == "model.norm.weight":
        return "norm.weight", 0, h
    if name == "lm_head.weight":
        return "lm_head.weight", 0, config.vocab_size
    moe = MOE_TENSOR.fullmatch(name)
    if moe is not None and int(moe[1]) < config.num_layers and config.is_moe(int(moe[1])):
        return _place_moe(config, moe)
    m = LAYER_TENSOR.fullmatch(name)
    qkv, gate_up = "qkv_proj.base", "gate_up_proj.base"
    places = {"q": (qkv, 0, q), "k": (qkv, q, q + kv), "v": (qkv, q + kv, q + 2 * kv),
              "o": ("o_proj.base", 0, h), "gate": (gate_up, 0, inter), "up": (gate_up, inter, 2 * inter),
              "down": ("down_proj.base", 0, h), "input_layernorm": ("input_norm", 0, h),
              "post_attention_layernorm": ("post_norm", 0, h),
              "q_norm": ("q_norm", 0, q if config.qk_norm_whole else config.head_dim),
              "k_norm": ("k_norm", 0, kv if config.qk_norm_whole else config.head_dim)}
    if config.fused_projections:  # Phi-3's checkpoints hold the fused projections as they are
        places |= {"qkv": (qkv, 0, q + 2 * kv), "gate_up": (gate_up, 0, 2 * inter)}
    if config.sandwich_norms:  # Gemma's post_attention_layernorm normalises the attention output
        places |= {"post_attention_layernorm": ("attn_out_norm", 0, h), "pre_feedforward_layernorm": (
            "post_norm", 0, h), "post_feedforward_layernorm": ("mlp_out_norm", 0, h)}
    if (m is None or int(m[1]) >= config.num_layers or m[2] not in places
            or (m[3], m[2]) not in _layer_tensors(config, int(m[1]))):
        raise ValueError(f"unexpected tensor {name!r} in checkpoint (for a {config.family} model)")
    module, first, end = places[m[2]]
    return f"layers.{m[1]}.{module}.{m[3]}", first, end


def _place_moe(config: ModelConfig, m: re.Match) -> tuple[str, int, int]:
    """`_place` of a MoE layer's router or experts (MOE_TENSOR's match): rows of the flattened
    experts.base.gate_up_proj [E * 2I, H] and experts.base.down_proj [E * H, I]
    (punica.models.moe; `base` of its punica.lora.experts.LoraExperts)."""
    prefix, h, inter = f"layers.{m[1]}.moe", config.hidden_size, config.moe_intermediate_size
    if m[2]:
        return f"{prefix}.router.weight", 0, config.num_experts
    if m[3]:  # the fused 3-D tensor, read flattened
        rows = config.num_experts * (2 * inter if m[3] == "gate_up_proj" else h)
        return f"{prefix}.experts.base.{m[3]}", 0, rows
    expert, part = int(m[4]), EXPERT_PARTS[m[5]]
    if expert >= config.num_experts:
        raise ValueError(f"unexpected tensor {m[0]!r} in checkpoint (expert {expert} of a model with "
                         f"{config.num_experts} experts)")
    if part == "down":
        return f"{prefix}.experts.base.down_proj", expert * h, (expert + 1) * h
    first = expert * 2 * inter + (inter if part == "up" else 0)
    return f"{prefix}.experts.base.gate_up_proj", first, first + inter


def _layer_tensors(config: ModelConfig, layer: int) -> set[tuple[str, str]]:
    """(weight or bias, projection or norm) of the tensors layer `layer` of the checkpoint holds
    besides a MoE layer's router and experts."""
    mlp = () if config.is_moe(layer) else ("gate_up", "down") if config.fused_projections else ("gate", "up", "down")
    projections = (*(("qkv",) if config.fused_projections else ("q", "k", "v")), "o", *mlp)
    tensors = {("weight", p) for p in (*projections, "input_layernorm", "post_attention_layernorm")}
    if config.sandwich_norms:
        tensors |= {("weight", "pre_feedforward_layernorm"), ("weight", "post_feedforward_layernorm")}
    if config.qkv_bias:
        tensors |= {("bias", "q"), ("bias", "k"), ("bias", "v")}
    if config.qk_norm:
        tensors |= {("weight", "q_norm"), ("weight", "k_norm")}
    return tensors


def _hf_layer_tensor(layer: int, kind: str, part: str) -> str:
    """The checkpoint name of one of a layer's tensors (`_layer_tensors`)."""
    if part.endswith("layernorm"):
        return f"model.layers.{layer}.{part}.{kind}"
    if part in ("gate", "up", "down", "gate_up"):
        return f"model.layers.{layer}.mlp.{part}_proj.{kind}"
    return f"model.layers.{layer}.self_attn.{part if part.endswith('norm') else part + '_proj'}.{kind}"


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in model directory {path}")
    return files


PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down", "qkv", "gate_up")


def load_hf_dir(path: str | Path, dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
                shard: ShardFn | None = None, quantization: str = "none") -> DecoderForCausalLM:
    """The model of a checkpoint directory; with `shard`, only that shard's slices are read. Its
    projections are fp8 where the checkpoint's are (as stored) or where `quantization` is "fp8"."""
    path = Path(path)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in model directory {path}")
    hf_config = json.loads(config_path.read_text())
    config = ModelConfig.from_hf_dict(hf_config)
    checkpoint = checkpoint_fp8(hf_config, config.num_layers)
    fmt = checkpoint.fmt if checkpoint is not None else _quantization_format(quantization)
    model, shards = _empty_model(config, dtype or default_dtype(device), device, shard, fmt)
    params = dict(model.named_parameters())
    filled: set[str] = set()
    moe_rows: dict[str, list[tuple[int, int]]] = {}  # MoE parameter -> the row ranges read into it
    for file in _safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if IGNORED_TENSORS.fullmatch(name) or (name == "lm_head.weight" and config.tie_word_embeddings):
                    continue
                kind = name.rsplit(".", 1)[-1]
                if checkpoint is not None and kind == INPUT_SCALE:  # activations get scales of their own
                    continue
                if checkpoint is not None and kind in checkpoint.scale_names:
                    _read_scale(f, name, kind, config, params, shards, fmt)
                    filled.add(f"{name[:-len(kind)]}weight_scale")
                    continue
                target, first, end = _place(config, name)
                param, scales = params[target], params.get(f"{target}_scale")
                where = shards.get(target, Shard.whole(param.shape))
                tensor = f.get_slice(name)
                shape, expected = tuple(tensor.get_shape()), (end - first, *where.full_shape[1:])
                stored_fp8 = tensor.get_dtype() == "F8_E4M3"
                if ".experts." in target and len(shape) == 3:  # fused experts, stored [E, rows, cols]
                    tensor = f.get_tensor(name).flatten(0, 1)
                    shape = tuple(tensor.shape)
                if shape != expected:
                    raise ValueError(f"{file.name}: tensor {name} has shape {shape}, the config implies {expected}")
                if stored_fp8 != (checkpoint is not None and scales is not None):
                    want = "F8_E4M3, as its quantization_config says" if not stored_fp8 else \
                        "not fp8 without a quantization_config in config.json"
                    raise ValueError(f"{file.name}: tensor {name} is stored as {tensor.get_dtype()}, expected {want}")
                for a, b, local in where.overlaps(first, end):
                    rows = slice(a - first, b - first)
                    if scales is not None and not stored_fp8:  # quantized from all the row's columns
                        _write_rows(param, scales, local, tensor[rows], where)
                        continue
                    part = tensor[rows] if where.cols is None else tensor[rows, where.cols[0]:where.cols[1]]
                    if config.norm_offset and target.endswith("norm.weight"):  # Gemma's 1 + w, in float32
                        part = part.float() + config.norm_offset
                    param.data[local:local + b - a].copy_(part)
                if target.startswith(tuple(f"layers.{i}.moe." for i in config.moe_layers)):
                    _cover_moe_rows(moe_rows, target, first, end, name)
                else:
                    filled.add(name)
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config.tie_word_embeddings:
        expected.add("lm_head.weight")
    for i in range(config.num_layers):
        for kind, part in _layer_tensors(config, i):
            expected.add(_hf_layer_tensor(i, kind, part))
            if checkpoint is not None and kind == "weight" and part in PROJECTIONS:
                expected.add(_hf_layer_tensor(i, "weight_scale", part))
    missing = sorted(expected - filled)
    for target, rows in _moe_rows(config).items():
        if sum(end - first for first, end in moe_rows.get(target, [])) != rows:
            missing.append(f"rows of {target} (of {rows})")
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    return model


def _moe_rows(config: ModelConfig) -> dict[str, int]:
    """The rows of every MoE parameter (punica.models.moe) a checkpoint must fill."""
    rows = {"router.weight": config.num_experts, "experts.base.gate_up_proj": config.num_experts * 2
            * config.moe_intermediate_size, "experts.base.down_proj": config.num_experts * config.hidden_size}
    return {f"layers.{i}.moe.{name}": n for i in config.moe_layers for name, n in rows.items()}


def _cover_moe_rows(moe_rows: dict[str, list[tuple[int, int]]], target: str, first: int, end: int,
                    name: str) -> None:
    """Record that tensor `name` filled rows [first, end) of MoE parameter `target`; a checkpoint that
    holds rows twice (both expert layouts) is refused."""
    covered = moe_rows.setdefault(target, [])
    if any(a < end and first < b for a, b in covered):
        raise ValueError(f"checkpoint tensor {name!r} fills rows of {target} that another tensor filled (a "
                         "checkpoint holds either the fused experts or one tensor per expert)")
    covered.append((first, end))


def _read_scale(f, name: str, kind: str, config: ModelConfig, params: dict[str, torch.Tensor],
                shards: dict[str, Shard], fmt: Fp8Format) -> None:
    """Copy a checkpoint's weight scales (`kind`) of one projection into its rows of the fused weight's scales."""
    target, first, end = _place(config, f"{name[:-len(kind)]}weight")
    weight, scales = params[target], params[f"{target}_scale"]
    in_features = shards.get(target, Shard.whole(weight.shape)).full_shape[1]
    values, scale_first = scale_rows(name, f.get_tensor(name), first, end, in_features, fmt)
    where = shards.get(f"{target}_scale", Shard.whole(scales.shape))
    for a, b, local in where.overlaps(scale_first, scale_first + values.shape[0]):
        scales.data[local:local + b - a].copy_(where.columns(values[a - scale_first:b - scale_first]))


def load_weights(source: str | Path | DummyWeights, dtype: torch.dtype | None = None,
                 device: torch.device | str = "cpu", shard: ShardFn | None = None,
                 quantization: str = "none") -> DecoderForCausalLM:
    """The model (or its shard) of a checkpoint directory or of DummyWeights, `quantization` as in load_hf_dir."""
    if isinstance(source, DummyWeights):
        return dummy_model(source.config, dtype, device, source.seed, shard, quantization)
    return load_hf_dir(source, dtype, device, shard, quantization)


def load_model(model: str | None = None, dtype: torch.dtype | None = None,
               device: torch.device | str = "cpu") -> tuple[DecoderForCausalLM, Path]:
    """(model, directory holding its tokenizer) for a path, a .gguf file, or None (the default)."""
    model_dir = resolve_model_dir(model)
    return load_hf_dir(model_dir, dtype, device), model_dir
