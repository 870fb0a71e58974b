"""FP8 base weights at load: `quantization="fp8"` on a full-precision checkpoint or random weights, and
pre-quantized checkpoints in each format punica reads, written here by the test as each format's
spec has it (punica.models.fp8_checkpoint cites them). Each gives exactly the logits of a plain model
whose weights are the same dequantized values (on CPU the fp8 path is: dequantize, then the matmul);
per-channel checkpoints also exactly those of quantizing the original at load."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from punica.config import EngineConfig
from punica.factory import engine_on_model
from punica.lora.batch import LoraBatch
from punica.models.forward_batch import ForwardBatch
from punica.models.fp8_checkpoint import checkpoint_fp8
from punica.models.loader import dummy_model, load_hf_dir
from punica.models.quantized import Fp8Linear
from punica.ops.attention import AttnBatch
from punica.ops.fp8 import FP8_DTYPE, FP8_MAX, dequantize, quantize_per_channel

PAGE_SIZE = 4
PROMPTS = [[5, 9, 17, 3, 44, 2, 8], [100, 7, 7, 1], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def prefill_logits(model, prompts=PROMPTS):
    """Logits [sum of lengths, V] of every position of one prefill batch of the prompts, no LoRA."""
    lens = [len(p) for p in prompts]
    tables, first = [], 0
    for n in lens:
        tables.append(list(range(first, first + math.ceil(n / PAGE_SIZE))))
        first += len(tables[-1])
    device = model.embed.weight.device
    attn = AttnBatch.build(lens, lens, tables, PAGE_SIZE, len(prompts), device, all_logits=True)
    batch = ForwardBatch(attn, LoraBatch.build([-1] * len(prompts), lens, device), model.new_kv_cache(first, PAGE_SIZE))
    return model(torch.tensor(sum(prompts, []), device=device), batch)


# each format's quantizer as its spec writes it: (weight e4m3, the stored scale tensor)
def compressed_tensors_channel(w):  # strategy "channel": weight_scale [N, 1] = amax / 448, weight = w / scale
    scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def compressed_tensors_tensor(w):  # strategy "tensor": weight_scale [1]
    scale = (w.abs().amax() / FP8_MAX).reshape(1)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def hf_block(b0, b1):  # transformers' Fp8Quantize: scales 448 / tile amax, weight_scale_inv = 1 / scales
    def quantize(w):
        n, k = w.shape
        tiles = w.reshape(n // b0, b0, k // b1, b1)
        scales = FP8_MAX / tiles.abs().amax(dim=(1, 3))
        q = (tiles * scales[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).reshape(n, k)
        return q, 1.0 / scales
    return quantize


def vllm_tensor(w):  # quant_method fp8 without weight_block_size: weight_scale [] per tensor
    scale = w.abs().amax() / FP8_MAX
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def spec_dequantize(q, scale):
    """float32(weight) times its scale: per tensor ([] or [1]), per row ([N, 1]) or per block."""
    n, k = q.shape
    scale = scale.float()
    if scale.dim() == 2 and scale.shape[1] > 1:
        scale = scale.repeat_interleave(n // scale.shape[0], 0).repeat_interleave(k // scale.shape[1], 1)
    return q.float() * scale


FORMATS = {
    "compressed-tensors-channel": (
        {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
         "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
             "num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False},
             "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}},
         "ignore": ["lm_head"]}, compressed_tensors_channel, "weight_scale", {}),
    "compressed-tensors-tensor": (
        {"quant_method": "compressed-tensors", "format": "float-quantized",
         "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
             "num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor"},
             "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}},
        compressed_tensors_tensor, "weight_scale", {"input_scale": torch.tensor([0.05])}),
    "hf-fp8-block": ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                      "modules_to_not_convert": None}, hf_block(32, 32), "weight_scale_inv", {}),
    "hf-fp8-tensor": ({"quant_method": "fp8", "activation_scheme": "static"}, vllm_tensor, "weight_scale",
                      {"input_scale": torch.tensor(0.05)}),
}


def write_checkpoints(original, fp8_dir, dequantized_dir, quantization_config, quantize, scale_name, extra):
    """From the full-precision checkpoint directory `original`: the pre-quantized checkpoint (fp8_dir)
    and a plain one holding the same weights dequantized by the spec (dequantized_dir)."""
    tensors = load_file(original / "model.safetensors")
    config = json.loads((original / "config.json").read_text())
    quantized, dequantized = dict(tensors), dict(tensors)
    for name, w in tensors.items():
        if name.rsplit(".", 2)[-2] in PROJECTIONS:
            q, scale = quantize(w.float())
            prefix = name[:-len("weight")]
            quantized[name], quantized[prefix + scale_name] = q, scale
            quantized |= {prefix + key: value.clone() for key, value in extra.items()}
            dequantized[name] = spec_dequantize(q, scale)
    for path, state, qc in ((fp8_dir, quantized, quantization_config), (dequantized_dir, dequantized, None)):
        path.mkdir()
        save_file(state, str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps(config | ({"quantization_config": qc} if qc else {})))


@pytest.fixture(scope="module")
def original(tmp_path_factory, tiny_llama):
    path = tmp_path_factory.mktemp("fp8") / "original"
    tiny_llama(seed=3).save_pretrained(path)
    return path


def test_quantize_at_load_equals_its_dequantized_weights(original):
    model = load_hf_dir(original, torch.float32, quantization="fp8")
    plain = load_hf_dir(original, torch.float32)
    full = prefill_logits(plain)
    assert all(isinstance(getattr(layer, f"{g}_proj").base, Fp8Linear) for layer in model.layers
               for g in ("qkv", "o", "gate_up", "down"))
    for layer in plain.layers:  # the same model with the fp8 weights' values
        for group in ("qkv", "o", "gate_up", "down"):
            w = model.group_weight(layer.index, group)
            assert w.dtype == torch.float32
            getattr(layer, f"{group}_proj").base.weight.data.copy_(w)
    logits = prefill_logits(model)
    assert torch.equal(logits, prefill_logits(plain))
    assert not torch.equal(logits, full)
    assert (logits.argmax(-1) == full.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("fmt", FORMATS)
def test_pre_quantized_checkpoint_loads_its_weights_as_stored(tmp_path, original, fmt):
    quantization_config, quantize, scale_name, extra = FORMATS[fmt]
    write_checkpoints(original, tmp_path / "fp8", tmp_path / "dequantized", quantization_config, quantize,
                      scale_name, extra)
    model = load_hf_dir(tmp_path / "fp8", torch.float32)  # no flag needed: the config says fp8
    assert isinstance(model.layers[0].qkv_proj.base, Fp8Linear)
    assert model.layers[0].qkv_proj.base.block_size == (quantization_config.get("weight_block_size") and (32, 32))
    logits = prefill_logits(model)
    assert torch.equal(logits, prefill_logits(load_hf_dir(tmp_path / "dequantized", torch.float32)))
    if fmt == "compressed-tensors-channel":  # the same weights as quantizing the original at load
        assert torch.equal(logits, prefill_logits(load_hf_dir(original, torch.float32, quantization="fp8")))


def test_checkpoint_without_scales_or_config_is_refused(tmp_path, original):
    quantization_config, quantize, _, _ = FORMATS["compressed-tensors-channel"]
    write_checkpoints(original, tmp_path / "fp8", tmp_path / "dequantized", quantization_config, quantize,
                      "weight_scale", {})
    state = load_file(tmp_path / "fp8" / "model.safetensors")
    save_file({k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight_scale"},
              str(tmp_path / "fp8" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks 1 tensors, e.g. \['model.layers.1.mlp.up_proj.weight_scale'\]"):
        load_hf_dir(tmp_path / "fp8", torch.float32)
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"_proj.weight is stored as F8_E4M3, expected not fp8 without a "
                                         r"quantization_config"):
        load_hf_dir(tmp_path / "fp8", torch.float32)


def test_block_scales_must_not_straddle_fused_projections(tmp_path, original):
    write_checkpoints(original, tmp_path / "fp8", tmp_path / "dequantized",
                      {"quant_method": "fp8", "weight_block_size": [64, 32]}, hf_block(32, 32), "weight_scale_inv", {})
    with pytest.raises(ValueError, match=r"kv_size \(32\) is not a multiple of 64"):
        load_hf_dir(tmp_path / "fp8", torch.float32)


CT_GROUP = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}


@pytest.mark.parametrize("quantization_config,message", [
    ({"quant_method": "gptq", "bits": 4}, r"quant_method = 'gptq'"),
    ({"quant_method": "fp8", "activation_scheme": "per-tensor-static"}, r"activation_scheme = 'per-tensor-static'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size = \[128\]"),
    ({"quant_method": "fp8", "modules_to_not_convert": ["lm_head", "mlp.down_proj"]},
     r"modules_to_not_convert = .*entry 'mlp.down_proj' leaves projections unquantized"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": CT_GROUP}},
     r"format = 'pack-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        **CT_GROUP, "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}},
     r"config_groups.g.weights.type = 'int'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        **CT_GROUP, "weights": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128}}}},
     r"config_groups.g.weights.strategy = 'group'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": CT_GROUP},
      "ignore": ["lm_head", "re:.*layers\\.1\\.self_attn\\.q_proj"]}, r"ignore = .*leaves projections unquantized"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": CT_GROUP},
      "kv_cache_scheme": {"num_bits": 8, "type": "float"}}, r"kv_cache_scheme = "),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        **CT_GROUP, "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}}},
     r"config_groups.g.input_activations.type = 'int'"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_unsupported_quantization_configs_are_refused_by_field(quantization_config, message):
    with pytest.raises(ValueError, match=r"quantization_config\." + message):
        checkpoint_fp8({"quantization_config": quantization_config}, num_layers=2)


def test_dummy_fp8_quantizes_the_same_random_values(punica_config, tiny_llama):
    config = punica_config(tiny_llama())
    fp8 = dummy_model(config, torch.float32, seed=4, quantization="fp8")
    plain = dummy_model(config, torch.float32, seed=4)
    for group in ("qkv", "o", "gate_up", "down"):
        weight, scales = quantize_per_channel(plain.group_weight(1, group))
        linear = getattr(fp8.layers[1], f"{group}_proj").base
        assert torch.equal(linear.weight.view(torch.uint8), weight.view(torch.uint8))
        assert torch.equal(linear.weight_scale, scales)
        assert torch.equal(fp8.group_weight(1, group), dequantize(weight, scales, None, torch.float32))
    assert torch.equal(fp8.embed.weight, plain.embed.weight) and fp8.lm_head.weight.dtype == torch.float32


def test_lora_and_dora_on_fp8_weights_equal_them_on_the_dequantized_weights(original, tmp_path, tiny_llama,
                                                                            make_peft_adapter, run_all, greedy):
    """The LoRA delta adds to the fp8 projection's output exactly as to a plain one's, and DoRA's norms
    read the dequantized weights: an fp8 engine's greedy tokens are those of the plain model holding them."""
    hf = tiny_llama(seed=3)
    paths = {"lora": str(make_peft_adapter(hf, tmp_path / "lora", r=8, alpha=16, seed=1)),
             "dora": str(make_peft_adapter(hf, tmp_path / "dora", r=4, alpha=8, seed=2, use_dora=True))}
    model = load_hf_dir(original, torch.float32, quantization="fp8")
    plain = load_hf_dir(original, torch.float32)
    for layer in plain.layers:
        for group in ("qkv", "o", "gate_up", "down"):
            getattr(layer, f"{group}_proj").base.weight.data.copy_(model.group_weight(layer.index, group))
    requests = [(p, name, 6) for p in PROMPTS for name in (None, "lora", "dora")]
    outputs = [[o.token_ids for o in run_all(engine_on_model(m, EngineConfig(max_batch_size=9, page_size=4), paths),
                                             requests, greedy)] for m in (model, plain)]
    assert outputs[0] == outputs[1]
    assert len({tuple(t) for t in outputs[0][:3]}) > 1  # the adapters change the tokens


@pytest.mark.cuda
def test_cuda_fp8_model_follows_its_dequantized_weights(original):
    """On the GPU in bf16 both GEMM paths (weight-only up to 64 tokens, torch._scaled_mm above) give
    the logits of the bf16 model holding the dequantized weights, within bf16 and e4m3-activation noise."""
    model = load_hf_dir(original, torch.bfloat16, "cuda", quantization="fp8")
    plain = load_hf_dir(original, torch.bfloat16, "cuda")
    for layer in plain.layers:
        for group in ("qkv", "o", "gate_up", "down"):
            getattr(layer, f"{group}_proj").base.weight.data.copy_(model.group_weight(layer.index, group))
    with torch.inference_mode():
        for prompts in (PROMPTS, [list(range(3, 123))]):  # 22 tokens: weight-only; 120 tokens: _scaled_mm
            got, expect = (prefill_logits(m, prompts) for m in (model, plain))
            assert ((got - expect).norm() / expect.norm()).item() < 5e-2


@pytest.mark.cuda
def test_cuda_graph_fp8_engine_generates_what_eager_engine_does(original, tmp_path, tiny_llama, make_peft_adapter,
                                                                  run_all, greedy):
    hf = tiny_llama(seed=3)
    paths = {"lora": str(make_peft_adapter(hf, tmp_path / "lora", r=8, alpha=16, seed=1))}
    requests = [(p * 3, name, 12) for p in PROMPTS for name in (None, "lora")]
    outputs = {}
    for eager in (False, True):
        engine = engine_on_model(load_hf_dir(original, torch.float32, "cuda", quantization="fp8"),
                                 EngineConfig(max_batch_size=6, page_size=4, enforce_eager=eager), paths)
        assert engine.executor.worker.uses_cuda_graphs != eager
        outputs[eager] = [o.token_ids for o in run_all(engine, requests, greedy)]
    assert outputs[False] == outputs[True]
