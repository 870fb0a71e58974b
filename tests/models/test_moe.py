"""Mixture-of-experts families (Qwen3-MoE, Mixtral) against transformers' own classes in fp32: the
engine's greedy tokens over mixed batches equal transformers' (+ PEFT's, one adapter at a time:
PEFT runs no mixed batches of adapters on experts)."""

import copy
import dataclasses
import json
import random
import re

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file

from punica.config import EngineConfig, ModelConfig, preset_config
from punica.factory import engine_on_model
from punica.families import UnsupportedModel
from punica.lora.adapter import load_adapter
from punica.lora.adapter_config import AdapterError
from punica.lora.dummy import save_random_adapter
from punica.lora.gains import MAX_LORA_GAIN, lora_gain
from punica.lora.pool import LoraPool
from punica.models.loader import dummy_model, load_hf_dir
from punica.parallel.tensor_parallel import rank_config

MOE_FAMILIES = ["qwen3_moe", "mixtral", "olmoe"]  # tests/conftest.py TINY_MOE_FAMILIES


def save_fused(model, path):
    """The checkpoint as transformers 5 holds it in memory: experts as fused 3-D gate_up_proj/down_proj
    (save_pretrained writes one tensor per expert, the older layout)."""
    path.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(model.config.to_dict()))


def greedy_tokens(model, prompt, steps):
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


def requests(names, n, seed):
    """n (prompt, adapter, max_tokens) requests cycling through `names`, prompts of 1-20 tokens."""
    rng = random.Random(seed)
    return [([rng.randrange(3, 128) for _ in range(rng.randint(1, 20))], names[i % len(names)], rng.randint(4, 10))
            for i in range(n)]


@pytest.mark.parametrize("name,layout", [("qwen3_moe", "per_expert"), ("qwen3_moe", "fused"),
                                         ("mixtral", "per_expert"), ("olmoe", "per_expert")])
def test_tiny_moe_matches_transformers(tmp_path, name, layout, run_all, greedy, tiny_moe_model):
    """A batch of 6 requests through the engine (prefills fused with decodes): transformers' greedy tokens."""
    hf = tiny_moe_model(name, seed=1)
    if layout == "fused":
        save_fused(hf, tmp_path / "base")
    else:
        hf.save_pretrained(tmp_path / "base")
    keys = (tmp_path / "base" / "model.safetensors").read_bytes()[:20000]
    assert (b"experts.gate_up_proj" in keys) == (layout == "fused")
    model = load_hf_dir(tmp_path / "base", dtype=torch.float32)
    assert [layer.moe is not None for layer in model.layers] == [name != "qwen3_moe", True]
    engine = engine_on_model(model, EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=256))
    reqs = requests([None], 6, seed=0)
    for (prompt, _, max_tokens), out in zip(reqs, run_all(engine, reqs, greedy)):
        assert out.token_ids == greedy_tokens(hf, prompt, max_tokens), prompt


def test_moe_config_fields(tiny_moe_model):
    c = ModelConfig.from_hf_dict(tiny_moe_model("qwen3_moe").config.to_dict())
    assert (c.family, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob,
            c.moe_layers, c.qk_norm) == ("qwen3_moe", 4, 2, 32, False, (1,), True)
    sparse_step = ModelConfig.from_hf_dict(tiny_moe_model("qwen3_moe").config.to_dict() | {
        "mlp_only_layers": [], "decoder_sparse_step": 2, "norm_topk_prob": True})
    assert (sparse_step.moe_layers, sparse_step.norm_topk_prob) == ((1,), True)
    m = ModelConfig.from_hf_dict(tiny_moe_model("mixtral").config.to_dict())
    assert (m.family, m.num_experts, m.moe_intermediate_size, m.norm_topk_prob, m.moe_layers) == (
        "mixtral", 4, 48, True, (0, 1))
    o = ModelConfig.from_hf_dict(tiny_moe_model("olmoe").config.to_dict())
    assert (o.family, o.num_experts, o.moe_intermediate_size, o.norm_topk_prob, o.moe_layers, o.qk_norm_whole) == (
        "olmoe", 4, 32, True, (0, 1), True)
    with pytest.raises(UnsupportedModel, match=r"clipped q/k/v \(clip_qkv=8.0\)"):
        ModelConfig.from_hf_dict(tiny_moe_model("olmoe").config.to_dict() | {"clip_qkv": 8.0})
    with pytest.raises(ValueError, match=r"tensor parallelism of olmoe: its q/k norms span every head"):
        rank_config(o, 2)


@pytest.mark.parametrize("fields,message", [
    ({"num_experts_per_tok": 5}, r"num_experts_per_tok=5 of 4 experts"),
    ({"decoder_sparse_step": 0}, r"decoder_sparse_step=0"),
    ({"shared_expert_intermediate_size": 64}, r"a shared expert"),
    ({"use_sliding_window": True, "sliding_window": 8}, r"use_sliding_window \(sliding-window attention\) on qwen3"),
])
def test_unsupported_moe_variants_are_refused_by_name(fields, message, tiny_moe_model):
    with pytest.raises(UnsupportedModel, match=message):
        ModelConfig.from_hf_dict(tiny_moe_model("qwen3_moe").config.to_dict() | fields)


def test_a_checkpoint_with_both_expert_layouts_is_refused(tmp_path, tiny_moe_model):
    hf = tiny_moe_model("mixtral")
    save_fused(hf, tmp_path / "base")
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    down = state["model.layers.0.mlp.experts.down_proj"]
    state["model.layers.0.block_sparse_moe.experts.1.w2.weight"] = down[1].clone()
    save_file(state, str(tmp_path / "base" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"fills rows of layers.0.moe.experts.base.down_proj that another tensor "
                                         r"filled \(a checkpoint holds either the fused experts or one tensor per"):
        load_hf_dir(tmp_path / "base", torch.float32)


def test_moe_presets_build_with_random_weights(tiny_moe_model):
    for name, experts, top_k in (("qwen3-30b-a3b", 128, 8), ("mixtral-8x7b", 8, 2)):
        c = preset_config(name)
        assert (c.num_experts, c.num_experts_per_tok, len(c.moe_layers)) == (experts, top_k, c.num_layers)
    tiny = ModelConfig.from_hf_dict(tiny_moe_model("qwen3_moe").config.to_dict())
    model = dummy_model(tiny, torch.float32)
    assert model.layers[1].moe.experts.base.gate_up_weight().shape == (4, 64, 64)
    with pytest.raises(ValueError, match=r"fp8 weights of a mixture-of-experts model \(qwen3_moe\)"):
        dummy_model(tiny, torch.float32, quantization="fp8")


# name -> (rank, alpha, use_rslora, target_modules, target_parameters): attention and experts, the
# experts alone (one of their two parameters), attention alone
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ADAPTERS = {
    "both": (8, 16, False, ["q_proj", "v_proj", "o_proj"], EXPERTS),
    "experts": (4, 8, True, None, ["mlp.experts.down_proj"]),
    "attn": (16, 8, False, ["q_proj", "k_proj", "v_proj", "o_proj"], None),
}


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_tiny_moe_with_expert_adapters_matches_transformers_peft(tmp_path, name, run_all, greedy, tiny_moe_model,
                                                                  make_moe_adapter):
    """12 requests over the base model and three adapters (attention + experts, experts only, attention
    only) in mixed batches: each request's greedy tokens are transformers + PEFT's with its adapter."""
    hf = tiny_moe_model(name, seed=2)
    hf.save_pretrained(tmp_path / "base")
    paths = {a: make_moe_adapter(hf, tmp_path / a, *spec, seed=i + 1) for i, (a, spec) in enumerate(ADAPTERS.items())}
    model = load_hf_dir(tmp_path / "base", dtype=torch.float32)
    engine = engine_on_model(model, EngineConfig(max_batch_size=6, page_size=4, kv_cache_tokens=256, max_loras=3,
                                                 max_lora_rank=16), {a: str(p) for a, p in paths.items()})
    reqs = requests([None, *ADAPTERS], 12, seed=3)
    outs = run_all(engine, reqs, greedy)
    references = {None: hf} | {a: PeftModel.from_pretrained(copy.deepcopy(hf), str(p)).eval() for a, p in paths.items()}
    for prompt, adapter, _ in reqs[:4]:  # the adapters change the tokens
        if adapter is not None:
            assert greedy_tokens(references[adapter], prompt, 8) != greedy_tokens(hf, prompt, 8), adapter
    for (prompt, adapter, max_tokens), out in zip(reqs, outs):
        assert out.token_ids == greedy_tokens(references[adapter], prompt, max_tokens), (adapter, prompt)


def rewrite_adapter(path, config_fields=None, rename=None):
    """Change an adapter directory's config fields and rename its tensors (rename(key) -> new key)."""
    config = json.loads((path / "adapter_config.json").read_text()) | (config_fields or {})
    (path / "adapter_config.json").write_text(json.dumps(config))
    if rename is not None:
        tensors = load_file(str(path / "adapter_model.safetensors"))
        save_file({rename(k): v for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))


@pytest.mark.parametrize("config_fields,rename,message", [
    ({"target_parameters": ["mlp.gate.weight"]}, None,
     r"target_parameters names 'mlp.gate.weight'; punica adapts only the MoE experts' gate_up_proj and down_proj"),
    (None, lambda k: k.replace("experts.lora_", "experts.0.down_proj.lora_"),
     r"experts.0.down_proj.lora_A.weight adapts one expert's module; punica serves LoRA on the fused experts"),
    (None, lambda k: k.replace("layers.1.mlp.experts", "layers.0.mlp.experts"),
     r"adapts experts, but layer 0 of the base model has none"),
    ({"use_dora": True}, None, r"DoRA on a mixture-of-experts model \(qwen3_moe\) is not supported"),
    (None, lambda k: k.replace("experts.base_layer.lora_B", "experts.base_layer.lora_X"),
     r"experts.base_layer.lora_A.weight has no lora_B beside it"),
])
def test_expert_adapters_that_cannot_be_served_are_refused_by_name(tmp_path, config_fields, rename, message,
                                                                   tiny_moe_model, make_moe_adapter):
    hf = tiny_moe_model("qwen3_moe")
    path = make_moe_adapter(hf, tmp_path / "both", *ADAPTERS["both"], seed=1)
    rewrite_adapter(path, config_fields, rename)
    with pytest.raises(AdapterError, match=message):
        load_adapter(path, ModelConfig.from_hf_dict(hf.config.to_dict()))


def test_expert_adapter_layout_and_bytes(tmp_path, tiny_moe_model, make_moe_adapter):
    """PEFT's fused expert LoRA (lora_A rows expert-major, lora_B columns expert-minor) as per-expert
    (A, B), and the pool's slot holding them."""
    hf = tiny_moe_model("mixtral")
    path = make_moe_adapter(hf, tmp_path / "both", *ADAPTERS["both"], seed=1)
    config = ModelConfig.from_hf_dict(hf.config.to_dict())
    adapter = load_adapter(path, config)
    tensors = load_file(str(path / "adapter_model.safetensors"))
    a = tensors["base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight"]  # gate_up: [E * r, H]
    b = tensors["base_model.model.model.layers.1.mlp.experts.base_layer.lora_B.weight"]  # [2I, E * r]
    got_a, got_b = adapter.experts["gate_up", 1]
    torch.testing.assert_close(got_a[2], a[2 * 8:3 * 8])
    torch.testing.assert_close(got_b[2], b[:, 2::4])
    assert set(adapter.experts) == {("gate_up", 0), ("gate_up", 1), ("down", 0), ("down", 1)}
    expert_bytes = 4 * 2 * 4 * 8 * ((64 + 96) + (48 + 64))  # fp32, 2 layers, 4 experts, rank 8
    assert adapter.num_bytes == expert_bytes + 4 * 2 * 8 * ((64 + 64) + (64 + 32) + (64 + 64))  # q, v, o
    pool = LoraPool(config, max_loras=2, max_rank=16, dtype=torch.float32, device="cpu")
    pool.write(1, adapter)
    w = pool.expert_weights(1)
    torch.testing.assert_close(w.gate_up_a[1, 2, :8], got_a[2])
    assert w.gate_up_a[1, :, 8:].abs().sum() == 0 and w.down_b[0].abs().sum() == 0


@pytest.mark.cuda
@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_cuda_graph_moe_engine_matches_eager_and_transformers_peft(tmp_path, name, run_all, greedy, tiny_moe_model,
                                                                   make_moe_adapter):
    """On the GPU in fp32 (the grouped GEMM and expert LoRA kernels): an engine replaying CUDA graphs
    and an eager one both give transformers + PEFT's tokens over mixed adapters."""
    hf = tiny_moe_model(name, seed=2)
    hf.save_pretrained(tmp_path / "base")
    paths = {a: make_moe_adapter(hf, tmp_path / a, *spec, seed=i + 1) for i, (a, spec) in enumerate(ADAPTERS.items())}
    references = {None: hf} | {a: PeftModel.from_pretrained(copy.deepcopy(hf), str(p)).eval() for a, p in paths.items()}
    reqs = requests([None, *ADAPTERS], 16, seed=4)
    outputs = {}
    for eager in (True, False):
        model = load_hf_dir(tmp_path / "base", dtype=torch.float32, device="cuda")
        engine = engine_on_model(model, EngineConfig(max_batch_size=8, page_size=4, kv_cache_tokens=512, max_loras=3,
                                                     max_lora_rank=16, enforce_eager=eager),
                                 {a: str(p) for a, p in paths.items()})
        assert engine.executor.worker.uses_cuda_graphs != eager
        outputs[eager] = [out.token_ids for out in run_all(engine, reqs, greedy)]
    for (prompt, adapter, max_tokens), tokens in zip(reqs, outputs[True]):
        assert tokens == greedy_tokens(references[adapter], prompt, max_tokens), (adapter, prompt)
    assert outputs[False] == outputs[True]


def test_adapter_listing_reports_each_adapters_bytes(tmp_path, run_all, greedy, tiny_moe_model, make_moe_adapter):
    """The engine's adapter snapshot (GET /v1/adapters) gives each adapter's bytes once read: experts
    included, in the pool's dtype."""
    hf = tiny_moe_model("mixtral")
    hf.save_pretrained(tmp_path / "base")
    paths = {a: str(make_moe_adapter(hf, tmp_path / a, *spec, seed=i + 1))
             for i, (a, spec) in enumerate(ADAPTERS.items())}
    model = load_hf_dir(tmp_path / "base", dtype=torch.float32)
    engine = engine_on_model(model, EngineConfig(max_batch_size=2, page_size=4, kv_cache_tokens=64, max_loras=3,
                                                 max_lora_rank=16), paths)
    assert engine.adapter_snapshot()["adapters"]["experts"]["bytes"] is None  # not read yet
    run_all(engine, [([5, 6], name, 1) for name in ADAPTERS], greedy)
    listing = engine.adapter_snapshot()["adapters"]
    for name, path in paths.items():
        assert listing[name]["bytes"] == load_adapter(path, model.config).num_bytes > 0
    assert listing["experts"]["bytes"] == 4 * 2 * 4 * 4 * (48 + 64)  # fp32, 2 layers, 4 experts, rank 4: down only


def test_random_adapters_of_a_moe_model_adapt_its_experts(tmp_path, tiny_moe_model):
    """The benchmarks' random adapters: on MoE layers gate/up/down become the experts' LoRA."""
    config = ModelConfig.from_hf_dict(tiny_moe_model("qwen3_moe").config.to_dict())  # layer 0 dense
    adapter = load_adapter(save_random_adapter(tmp_path / "all", config, rank=4, seed=0), config)
    assert set(adapter.lora_a) == {"q", "k", "v", "o", "gate", "up", "down"}
    assert adapter.lora_a["down"][1].abs().sum() == 0 < adapter.lora_a["down"][0].abs().sum()
    assert set(adapter.experts) == {("gate_up", 1), ("down", 1)}
    down_only = load_adapter(save_random_adapter(tmp_path / "down", config, rank=4, seed=0, projections=("down",)),
                             config)
    assert set(down_only.experts) == {("down", 1)} and down_only.experts["down", 1][0].shape == (4, 4, 32)


def test_random_adapters_of_a_model_whose_every_layer_is_moe_name_no_dense_mlp_module(tmp_path):
    """As qwen3-30b-a3b: no layer has a dense MLP, so the adapter targets gate/up/down only as experts
    (target_modules naming gate_proj without its tensors is refused when read)."""
    config = dataclasses.replace(preset_config("tiny-moe"), moe_layers=(0, 1))
    path = save_random_adapter(tmp_path / "all", config, rank=4, seed=0)
    assert json.loads((path / "adapter_config.json").read_text())["target_modules"] == [
        "q_proj", "k_proj", "v_proj", "o_proj"]
    adapter = load_adapter(path, config)
    assert set(adapter.lora_a) == {"q", "k", "v", "o"}
    assert set(adapter.experts) == {("gate_up", 0), ("down", 0), ("gate_up", 1), ("down", 1)}


@pytest.mark.parametrize("side, expert, value, zero_other, message", [
    ("A", 2, float("nan"), False, r"tensor .*layers\.1\.mlp\.experts\.lora_A\.weight has non-finite values"),
    ("B", 6, float("-inf"), False, r"tensor .*layers\.1\.mlp\.experts\.lora_B\.weight has non-finite values"),
    # inf times the other side's zero norm: a NaN bound, still caught
    ("A", 1, float("inf"), True, r"tensor .*layers\.1\.mlp\.experts\.lora_A\.weight has non-finite values"),
    # finite, but the squares overflow the norm: no finiteness error, the exact gain refuses it
    ("B", 4, 1e30, False, r"layer 1 expert 4 down projection .*the delta's gain"),
])
def test_an_experts_non_finite_weights_are_refused_by_tensor(tmp_path, side, expert, value, zero_other, message):
    """The experts' NaN and inf are found by the gain screen's norms (no pass of their own) and
    named by tensor, as a dense projection's are; a finite overflow goes to the exact gain."""
    config = dataclasses.replace(preset_config("tiny-moe"), moe_layers=(0, 1))
    path = save_random_adapter(tmp_path / "ad", config, rank=4, seed=0, dtype=torch.float32)
    key = f"base_model.model.model.layers.1.mlp.experts.lora_{side}.weight"  # down_proj
    other = key.replace(f"lora_{side}", "lora_B" if side == "A" else "lora_A")
    tensors = load_file(str(path / "adapter_model.safetensors"))
    if side == "A":  # rows e * r .. (e + 1) * r
        tensors[key][expert * 4 + 1, 3] = value
        if zero_other:
            tensors[other][:, expert::8] = 0
    else:  # columns e, e + E, ...
        tensors[key][5, expert + 8] = value
    save_file(tensors, str(path / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match=message):
        load_adapter(path, config)


def test_an_expert_whose_gain_is_over_the_limit_is_refused_by_name_among_fine_ones(tmp_path):
    """The gains of a layer's experts are checked in one batch; the first expert over the limit is
    named with its gain, as checking them one by one would."""
    config = dataclasses.replace(preset_config("tiny-moe"), moe_layers=(0, 1))
    path = save_random_adapter(tmp_path / "ad", config, rank=4, seed=0, dtype=torch.float32)
    key = "base_model.model.model.layers.1.mlp.experts.lora_B.weight"  # down_proj: [H, E * r]
    tensors = load_file(str(path / "adapter_model.safetensors"))
    assert tensors[key].shape == (128, 8 * 4)
    for expert in (5, 3):  # columns e, e + E, ...
        tensors[key][:, expert::8] *= 1e6
    save_file(tensors, str(path / "adapter_model.safetensors"))
    a = tensors[key.replace("lora_B", "lora_A")].view(8, 4, -1)
    b = tensors[key].view(128, 4, 8).permute(2, 0, 1)
    scale = json.loads((path / "adapter_config.json").read_text())["lora_alpha"] / 4
    gains = [lora_gain(a[e], b[e], scale) for e in range(8)]
    assert [e for e in range(8) if gains[e] > MAX_LORA_GAIN] == [3, 5]
    gain = re.escape(f"{gains[3]:.3g}")
    with pytest.raises(AdapterError, match=rf"layer 1 expert 3 down projection \(.*\): the delta's gain \|scale\| "
                                           rf"\* \|\|B @ A\|\|_2 is {gain}, over the limit of 1000$"):
        load_adapter(path, config)
    tensors[key][:, 3::8] /= 1e6
    tensors[key][:, 5::8] /= 1e6
    save_file(tensors, str(path / "adapter_model.safetensors"))
    assert load_adapter(path, config).experts["down", 1][1].shape == (8, 128, 4)
