"""Pre-quantized fp8 checkpoints: what config.json's `quantization_config` says, and what punica takes.

Two formats load as they are (their e4m3 weights and scales copied, never requantized):

  * HF's fine-grained fp8 (transformers' FineGrainedFP8Config, src/transformers/integrations/
    finegrained_fp8.py, and vLLM's fp8 checkpoints): {"quant_method": "fp8", "activation_scheme":
    "dynamic" | "static", "weight_block_size": [B0, B1] | absent | null, "modules_to_not_convert"
    (or "ignored_layers")}. Tensors `*.weight` float8_e4m3fn and `*.weight_scale_inv` (or
    `*.weight_scale`), multiplied to dequantize: [ceil(N / B0), ceil(K / B1)] with a block size,
    else one per tensor (or one per row).
  * compressed-tensors' float format, as llm-compressor writes it (neuralmagic/compressed-tensors:
    src/compressed_tensors/quantization/quant_config.py, quant_scheme.py, quant_args.py,
    lifecycle/initialize.py for the scale shapes): {"quant_method": "compressed-tensors", "format":
    "float-quantized", "config_groups": {name: {"targets": ["Linear"], "weights": {"num_bits": 8,
    "type": "float", "symmetric": true, "strategy": "tensor" | "channel" | "block",
    "block_structure": [B0, B1]}, "input_activations": ...}}, "ignore": [...]}. Tensors `*.weight`
    float8_e4m3fn and `*.weight_scale`: [1] (tensor), [N, 1] (channel) or [ceil(N / B0), ceil(K / B1)]
    (block), in any float dtype (llm-compressor writes the model's).

Activations: punica quantizes them itself (per token, dynamically) or not at all (the weight-only
GEMM), so any 8-bit float activation scheme of these formats is served, and `*.input_scale`
tensors (static schemes) are read past. Anything else is refused by name: another quant_method,
integer or non-8-bit weights, asymmetric or grouped weights, output activation or KV-cache
quantization, a group format other than float-quantized, and an ignore list that leaves any of
the 7 projections unquantized (lm_head, which stays unquantized anyway, may be on it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from punica.config import ModelConfig, ceil_div
from punica.models.quantized import Fp8Format

SCALE_TENSORS = ("weight_scale", "weight_scale_inv")
INPUT_SCALE = "input_scale"
PROJECTION_MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                      "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "self_attn.qkv_proj", "mlp.gate_up_proj")


@dataclass(frozen=True)
class Fp8Checkpoint:
    """How a pre-quantized checkpoint stores its projections: the model's format and the name of
    the weight scale tensors (`*.{scale_name}`)."""
    fmt: Fp8Format
    scale_names: tuple[str, ...]


def _refuse(field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"quantization_config.{field} = {value!r}: {why}")


def _block_size(field: str, value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value)):
        raise _refuse(field, value, "a weight block size must be two positive integers")
    return tuple(value)


def _check_ignored(field: str, entries: list[str] | None, matches, num_layers: int) -> None:
    """Refuse an ignore list with an entry that matches one of the 7 projections of some layer."""
    for entry in entries or ():
        if any(matches(entry, f"model.layers.{i}.{module}")
               for i in range(num_layers) for module in PROJECTION_MODULES):
            raise _refuse(field, entries, f"entry {entry!r} leaves projections unquantized, which punica does not "
                                          "serve (it quantizes all 7 projections or none)")


def _hf_substring_match(entry: str, module: str) -> bool:
    # transformers' replace_with_fp8_linear: the entry is a substring of the name with layer numbers as *
    return entry in module or entry in re.sub(r"\d+", "*", module)


def _compressed_tensors_match(entry: str, module: str) -> bool:
    # compressed_tensors.utils.match._match_name: "re:" regexes match from the start, else exact names
    return re.match(entry[3:], module) is not None if entry.startswith("re:") else entry == module


def _hf_fp8(q: dict[str, Any], num_layers: int) -> Fp8Checkpoint:
    scheme = q.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise _refuse("activation_scheme", scheme, "punica serves dynamic (or static, scales ignored) activations")
    if q.get("scale_fmt", "float") != "float":
        raise _refuse("scale_fmt", q["scale_fmt"], "punica reads float scales only")
    if q.get("fmt", "e4m3") != "e4m3":
        raise _refuse("fmt", q["fmt"], "punica reads e4m3 weights only")
    for field in ("modules_to_not_convert", "ignored_layers"):
        _check_ignored(field, q.get(field), _hf_substring_match, num_layers)
    return Fp8Checkpoint(Fp8Format(_block_size("weight_block_size", q.get("weight_block_size"))), SCALE_TENSORS)


def _check_float8(field: str, args: dict[str, Any]) -> None:
    for key, want in (("num_bits", 8), ("type", "float")):
        if args.get(key) != want:
            raise _refuse(f"{field}.{key}", args.get(key), f"punica serves {want} here")


def _compressed_tensors(q: dict[str, Any], num_layers: int) -> Fp8Checkpoint:
    if q.get("format") != "float-quantized":
        raise _refuse("format", q.get("format"), "punica reads the float-quantized format only")
    if q.get("kv_cache_scheme") is not None:
        raise _refuse("kv_cache_scheme", q["kv_cache_scheme"],
                      "a checkpoint's KV-cache scales are not loaded (--kv-cache-dtype fp8 computes its own)")
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        raise _refuse("config_groups", sorted(groups), "punica reads one quantization group (all Linear layers)")
    (name, group), = groups.items()
    field = f"config_groups.{name}"
    if group.get("targets") != ["Linear"]:
        raise _refuse(f"{field}.targets", group.get("targets"), "punica reads groups that target every Linear layer")
    if group.get("format", "float-quantized") != "float-quantized":
        raise _refuse(f"{field}.format", group["format"], "punica reads the float-quantized format only")
    weights = group.get("weights") or {}
    _check_float8(f"{field}.weights", weights)
    if not weights.get("symmetric", True):
        raise _refuse(f"{field}.weights.symmetric", False, "punica reads symmetric weights (no zero points)")
    strategy = weights.get("strategy") or "tensor"
    if strategy not in ("tensor", "channel", "block"):
        raise _refuse(f"{field}.weights.strategy", strategy, "punica reads tensor, channel or block scales")
    if group.get("output_activations") is not None:
        raise _refuse(f"{field}.output_activations", group["output_activations"], "output quantization is not "
                                                                                  "supported")
    if group.get("input_activations") is not None:
        _check_float8(f"{field}.input_activations", group["input_activations"])
    _check_ignored("ignore", q.get("ignore"), _compressed_tensors_match, num_layers)
    block = _block_size(f"{field}.weights.block_structure", weights.get("block_structure")) \
        if strategy == "block" else None
    if strategy == "block" and block is None:
        raise _refuse(f"{field}.weights.block_structure", None, "the block strategy needs a block structure")
    return Fp8Checkpoint(Fp8Format(block), ("weight_scale",))


def checkpoint_fp8(hf_config: dict[str, Any], num_layers: int) -> Fp8Checkpoint | None:
    """The fp8 format of a checkpoint's config.json (None: not quantized) of a model of `num_layers`
    layers; a ValueError names any field of its quantization_config that punica does not serve."""
    q = hf_config.get("quantization_config")
    if q is None:
        return None
    method = q.get("quant_method")
    if method == "fp8":
        return _hf_fp8(q, num_layers)
    if method == "compressed-tensors":
        return _compressed_tensors(q, num_layers)
    raise _refuse("quant_method", method, "punica loads fp8 and compressed-tensors (float-quantized) checkpoints")


def check_fused_blocks(config: ModelConfig, fmt: Fp8Format) -> None:
    """Block scales of a fused weight are its parts' block scales stacked: every part but the last
    (q, k of qkv; gate of gate_up) must fill whole blocks of rows."""
    if fmt.block_size is None:
        return
    b0 = fmt.block_size[0]
    for name, rows in (("q_size", config.q_size), ("kv_size", config.kv_size),
                       ("intermediate_size", config.intermediate_size)):
        if rows % b0:
            raise ValueError(f"fp8 block scales of {b0} rows: the model's {name} ({rows}) is not a multiple of {b0}, "
                             "so its blocks would straddle the fused projections (qkv, gate_up)")


def scale_rows(name: str, values: torch.Tensor, first: int, end: int, in_features: int, fmt: Fp8Format
               ) -> tuple[torch.Tensor, int]:
    """(float32 scales of one checkpoint part as rows of the fused weight's scales, the first of those
    rows) for the part's rows first:end: a per-tensor scale repeated over them, per-channel scales
    as they are, block scales ([ceil(rows / B0), ceil(K / B1)]) from row first / B0."""
    rows, shape = end - first, tuple(values.shape)
    values = values.float()
    if fmt.block_size is None:
        if values.numel() == 1:
            return values.reshape(1).expand(rows), first
        if shape in ((rows,), (rows, 1)):
            return values.reshape(rows), first
        raise ValueError(f"tensor {name} has shape {shape}: per-tensor ([1]) or per-channel ([{rows}, 1]) scales "
                         f"were expected")
    b0, b1 = fmt.block_size
    expect = (ceil_div(rows, b0), ceil_div(in_features, b1))
    if shape != expect:
        raise ValueError(f"tensor {name} has shape {shape}: {b0} x {b1} block scales of a [{rows}, {in_features}] "
                         f"weight are {expect}")
    return values, first // b0
