"""config.json -> ModelConfig per family: what each family turns on, and everything that punica does
not implement refused by name (never served as something else)."""

import pytest
import torch

from punica.config import ModelConfig, preset_config
from punica.families import UnsupportedModel
from punica.models.loader import load_hf_dir

SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2)


def config(model_type, architecture, **fields):
    return ModelConfig.from_hf_dict({"model_type": model_type, "architectures": [architecture]} | SHAPE | fields)


def test_each_family_turns_on_its_features(punica_config, tiny_family_model):
    features = {family: (c.family, c.qkv_bias, c.qk_norm, c.layer_windows, c.tie_word_embeddings)
                for family in ("llama", "qwen2", "qwen2-sliding", "qwen3", "mistral", "ministral", "gemma2", "gemma3",
                               "phi3")
                for c in [punica_config(tiny_family_model(family))]}
    assert features == {
        "llama": ("llama", False, False, (), False),
        "qwen2": ("qwen2", True, False, (), True),
        "qwen2-sliding": ("qwen2", True, False, (0, 8), False),  # layers from max_window_layers=1 on
        "qwen3": ("qwen3", False, True, (), False),
        "mistral": ("mistral", False, False, (8, 8), False),
        "ministral": ("ministral", False, False, (8, 0), False),
        "gemma2": ("gemma2", False, False, (8, 0), True),
        "gemma3": ("gemma3_text", False, True, (8, 0), True),
        "phi3": ("phi3", False, False, (8, 8), True),
    }
    assert [punica_config(tiny_family_model(f)).fused_projections for f in ("llama", "phi3")] == [False, True]


def test_gemma_features(punica_config, tiny_family_model):
    g2, g3 = (punica_config(tiny_family_model(f)) for f in ("gemma2", "gemma3"))
    assert (g2.hidden_act, g2.norm_offset, g2.embed_scale, g2.sandwich_norms) == ("gelu_tanh", 1.0, True, True)
    assert (g2.attn_softcap, g2.final_softcap, g2.attn_scale, g2.local_rope) == (1.0, 5.0, 24 ** -0.5, None)
    assert (g3.attn_softcap, g3.final_softcap) == (0.0, 0.0)
    assert (g3.rope.rope_type, g3.rope.factor, g3.rope.theta, g3.local_rope.theta) == ("linear", 4.0, 1e6, 1e4)
    assert g3.layer_rope(0) == g3.local_rope and g3.layer_rope(1) == g3.rope
    # a Gemma 2 config.json of the hub: no layer_types, every other layer local
    hub = config("gemma2", "Gemma2ForCausalLM", hidden_activation="gelu_pytorch_tanh", sliding_window=4096,
                 attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=256)
    assert hub.layer_windows == (4096, 0, 4096, 0) and hub.attn_scale == 1 / 16
    # a Gemma 3 one of transformers 4: rope_local_base_freq and rope_scaling for the global layers
    old = config("gemma3_text", "Gemma3ForCausalLM", hidden_activation="gelu_pytorch_tanh", sliding_window=512,
                 sliding_window_pattern=2, rope_theta=1e6, rope_local_base_freq=1e4,
                 rope_scaling={"rope_type": "linear", "factor": 8.0})
    assert old.layer_windows == (512, 0, 512, 0) and old.local_rope.theta == 1e4
    assert (old.rope.theta, old.rope.factor, old.local_rope.rope_type) == (1e6, 8.0, "default")


def test_qwen_windows_follow_use_sliding_window_and_max_window_layers():
    # a Qwen2.5 config.json as published: a window that use_sliding_window leaves off
    published = config("qwen2", "Qwen2ForCausalLM", use_sliding_window=False, sliding_window=131072,
                       max_window_layers=28, rope_theta=1e6)
    assert published.layer_windows == () and published.rope.theta == 1e6
    on = config("qwen2", "Qwen2ForCausalLM", use_sliding_window=True, sliding_window=16, max_window_layers=2)
    assert on.layer_windows == (0, 0, 16, 16)
    types = ["sliding_attention", "full_attention"] * 2
    assert config("qwen3", "Qwen3ForCausalLM", use_sliding_window=True, sliding_window=16,
                  layer_types=types).layer_windows == (16, 0, 16, 0)
    assert config("mistral", "MistralForCausalLM", sliding_window=None).layer_windows == ()
    assert config("mistral", "MistralForCausalLM", sliding_window=32).window(3) == 32


def test_old_configs_without_model_type_are_read_by_architecture():
    assert ModelConfig.from_hf_dict(SHAPE).family == "llama"
    assert ModelConfig.from_hf_dict(SHAPE | {"architectures": ["Qwen2ForCausalLM"]}).qkv_bias


@pytest.mark.parametrize("model_type,architecture,fields,message", [
    ("gpt_neox", "GPTNeoXForCausalLM", {}, r"model_type 'gpt_neox' \(GPTNeoXForCausalLM\) is not supported; "
                                          r"punica serves llama \(LlamaForCausalLM\), mistral"),
    ("phi3", "Phi3ForCausalLM", {"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 8}},
     r"Phi3ForCausalLM config: rope scaling type 'longrope' is not supported"),
    ("phi3", "Phi3ForCausalLM", {"rope_scaling": {"type": "su"}}, r"rope scaling type 'su'"),
    ("phi3", "Phi3ForCausalLM", {"partial_rotary_factor": 0.75}, r"partial_rotary_factor=0.75"),  # Phi-4-mini
    ("gemma2", "Gemma2ForCausalLM", {"hidden_activation": "gelu"}, r"hidden_activation 'gelu' \(only gelu_pytorch"),
    ("gemma3_text", "Gemma3ForCausalLM", {"hidden_activation": "gelu_pytorch_tanh", "sliding_window": None},
     r"local layers without a sliding_window"),
    (None, "FalconForCausalLM", {}, r"architectures \['FalconForCausalLM'\] are not supported"),
    ("qwen2", "Qwen2ForSequenceClassification", {}, r"serves the causal LM Qwen2ForCausalLM"),
    ("llama", "LlamaForCausalLM", {"sliding_window": 64}, r"sliding-window attention \(sliding_window=64\)"),
    ("llama", "LlamaForCausalLM", {"attention_bias": True}, r"attention_bias=true"),
    ("qwen3", "Qwen3ForCausalLM", {"attention_bias": True}, r"attention_bias=true"),
    ("llama", "LlamaForCausalLM", {"mlp_bias": True}, r"biases on the MLP projections \(mlp_bias\)"),
    ("mistral", "MistralForCausalLM", {"hidden_act": "gelu"}, r"hidden_act 'gelu' \(only silu\)"),
    ("qwen2", "Qwen2ForCausalLM", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     r"rope scaling type 'yarn' is not supported"),
    ("llama", "LlamaForCausalLM", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}},
     r"rope scaling type 'dynamic'"),
    ("llama", "LlamaForCausalLM", {"partial_rotary_factor": 0.5}, r"partial rotary embedding"),
    ("mistral", "MistralForCausalLM", {"layer_types": ["full_attention"] * 4}, r"layer_types on mistral"),
    ("ministral", "MinistralForCausalLM", {"sliding_window": 8, "layer_types": ["chunked_attention"] * 4},
     r"layer_types \['chunked_attention'\]"),
    ("ministral", "MinistralForCausalLM", {"sliding_window": 8, "layer_types": ["full_attention"]},
     r"layer_types of 1 layers for num_hidden_layers=4"),
    ("mistral", "MistralForCausalLM", {"sliding_window": 0}, r"sliding_window=0"),
    ("qwen2", "Qwen2ForCausalLM", {"quantization_config": {"quant_method": "awq"}},
     r"quantized weights \(quantization_config.quant_method = 'awq'\) is not supported; punica reads fp8"),
    ("llama", "LlamaForCausalLM", {"final_logit_softcapping": 30.0}, r"final-logit softcapping"),
])
def test_what_punica_does_not_implement_is_refused_by_name(model_type, architecture, fields, message):
    d = ({"model_type": model_type} if model_type else {}) | {"architectures": [architecture]} | SHAPE | fields
    with pytest.raises(UnsupportedModel, match=message):
        ModelConfig.from_hf_dict(d)


def test_a_checkpoint_tensor_the_family_lacks_is_refused(tmp_path, tiny_family_model):
    """A Qwen2 checkpoint relabelled Llama: its q/k/v biases are not dropped."""
    tiny_family_model("qwen2").save_pretrained(tmp_path)
    text = (tmp_path / "config.json").read_text()
    text = text.replace('"qwen2"', '"llama"').replace("Qwen2ForCausalLM", "LlamaForCausalLM")
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.\w_proj\.bias' in "
                                         r"checkpoint \(for a llama model\)"):
        load_hf_dir(tmp_path, torch.float32)


def test_family_presets():
    c = preset_config("qwen2.5-7b")
    assert (c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim,
            c.vocab_size, c.qkv_bias, c.family) == (3584, 18944, 28, 28, 4, 128, 152064, True, "qwen2")
    g = preset_config("gemma-2-9b")
    assert (g.hidden_size, g.num_layers, g.num_heads, g.num_kv_heads, g.head_dim, g.q_size, g.vocab_size,
            g.window(0), g.window(1)) == (3584, 42, 16, 8, 256, 4096, 256000, 4096, 0)
