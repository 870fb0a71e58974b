"""Mixture-of-experts families (Qwen3-MoE, Mixtral) against transformers' own classes in fp32: the
engine's greedy tokens over mixed batches equal transformers' (+ PEFT's, one adapter at a time:
PEFT runs no mixed batches of adapters on experts)."""

import json
import random

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from punica.config import EngineConfig, ModelConfig, preset_config
from punica.factory import engine_on_model
from punica.families import UnsupportedModel
from punica.models.loader import dummy_model, load_hf_dir

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128, max_position_embeddings=256)
# name -> (model_type, config overrides): Qwen3-MoE with a dense first layer, top-k weights as routed
# (norm_topk_prob false), and Mixtral (renormalised top-k) on every layer
TINY_MOE = {
    "qwen3_moe": ("qwen3_moe", dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    norm_topk_prob=False, mlp_only_layers=[0])),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)),
}


def tiny_moe(name, seed=0):
    """A random tiny MoE model by transformers' class, fp32 eval; router weights of std 1 so that a
    token's experts are chosen by clear margins (near ties would turn on float noise), norms random."""
    model_type, overrides = TINY_MOE[name]
    config = AutoConfig.for_model(model_type, **(SHAPE | overrides))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if param_name.endswith("mlp.gate.weight"):
                    param.normal_(0.0, 1.0)
                elif "norm" in param_name:
                    param.add_(torch.randn_like(param) * 0.2)
    return model


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
                                         ("mixtral", "per_expert")])
def test_tiny_moe_matches_transformers(tmp_path, name, layout, run_all, greedy):
    """A batch of 6 requests through the engine (prefills fused with decodes): transformers' greedy tokens."""
    hf = tiny_moe(name, seed=1)
    if layout == "fused":
        save_fused(hf, tmp_path / "base")
    else:
        hf.save_pretrained(tmp_path / "base")
    keys = (tmp_path / "base" / "model.safetensors").read_bytes()[:20000]
    assert (b"experts.gate_up_proj" in keys) == (layout == "fused")
    model = load_hf_dir(tmp_path / "base", dtype=torch.float32)
    assert [layer.moe is not None for layer in model.layers] == [name == "mixtral", True]
    engine = engine_on_model(model, EngineConfig(max_batch_size=4, page_size=4, kv_cache_tokens=256))
    reqs = requests([None], 6, seed=0)
    for (prompt, _, max_tokens), out in zip(reqs, run_all(engine, reqs, greedy)):
        assert out.token_ids == greedy_tokens(hf, prompt, max_tokens), prompt


def test_moe_config_fields():
    c = ModelConfig.from_hf_dict(tiny_moe("qwen3_moe").config.to_dict())
    assert (c.family, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob,
            c.moe_layers, c.qk_norm) == ("qwen3_moe", 4, 2, 32, False, (1,), True)
    sparse_step = ModelConfig.from_hf_dict(tiny_moe("qwen3_moe").config.to_dict() | {
        "mlp_only_layers": [], "decoder_sparse_step": 2, "norm_topk_prob": True})
    assert (sparse_step.moe_layers, sparse_step.norm_topk_prob) == ((1,), True)
    m = ModelConfig.from_hf_dict(tiny_moe("mixtral").config.to_dict())
    assert (m.family, m.num_experts, m.moe_intermediate_size, m.norm_topk_prob, m.moe_layers) == (
        "mixtral", 4, 48, True, (0, 1))


@pytest.mark.parametrize("fields,message", [
    ({"num_experts_per_tok": 5}, r"num_experts_per_tok=5 of 4 experts"),
    ({"decoder_sparse_step": 0}, r"decoder_sparse_step=0"),
    ({"shared_expert_intermediate_size": 64}, r"a shared expert"),
])
def test_unsupported_moe_variants_are_refused_by_name(fields, message):
    with pytest.raises(UnsupportedModel, match=message):
        ModelConfig.from_hf_dict(tiny_moe("qwen3_moe").config.to_dict() | fields)


def test_a_checkpoint_with_both_expert_layouts_is_refused(tmp_path):
    hf = tiny_moe("mixtral")
    save_fused(hf, tmp_path / "base")
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    down = state["model.layers.0.mlp.experts.down_proj"]
    state["model.layers.0.block_sparse_moe.experts.1.w2.weight"] = down[1].clone()
    save_file(state, str(tmp_path / "base" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"fills rows of layers.0.moe.experts.base.down_proj that another tensor "
                                         r"filled \(a checkpoint holds either the fused experts or one tensor per"):
        load_hf_dir(tmp_path / "base", torch.float32)


def test_moe_presets_build_with_random_weights():
    for name, experts, top_k in (("qwen3-30b-a3b", 128, 8), ("mixtral-8x7b", 8, 2)):
        c = preset_config(name)
        assert (c.num_experts, c.num_experts_per_tok, len(c.moe_layers)) == (experts, top_k, c.num_layers)
    tiny = ModelConfig.from_hf_dict(tiny_moe("qwen3_moe").config.to_dict())
    model = dummy_model(tiny, torch.float32)
    assert model.layers[1].moe.experts.base.gate_up_weight().shape == (4, 64, 64)
    with pytest.raises(ValueError, match=r"fp8 weights of a mixture-of-experts model \(qwen3_moe\)"):
        dummy_model(tiny, torch.float32, quantization="fp8")
