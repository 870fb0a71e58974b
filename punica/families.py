"""The model families punica serves, read from a checkpoint's config.json.

One decoder (punica.models.decoder) serves every family: a family is the set of features its
config turns on (biased q/k/v, per-head q/k RMSNorm, sliding-window layers, Gemma's GeGLU,
(1 + w) norms, scaled embeddings, norms after attention and MLP, softcapping, query scale and
a rope of its own for the local layers), and `hf_model_fields` turns a config.json into the
fields of punica.config.ModelConfig. Whatever a config asks for that the decoder does not
implement is refused with UnsupportedModel naming it: a checkpoint is served with the math
transformers runs for it, or not at all.

    family      transformers class    q/k/v bias  q/k norm  sliding window
    llama       LlamaForCausalLM      no          no        refused
    mistral     MistralForCausalLM    no          no        every layer (sliding_window)
    ministral   MinistralForCausalLM  no          no        the layers layer_types names
    qwen2       Qwen2ForCausalLM      yes         no        with use_sliding_window: the layers
    qwen3       Qwen3ForCausalLM      no          yes         layer_types (or max_window_layers) names
    gemma2      Gemma2ForCausalLM     no          no        the layers layer_types names (else every
    gemma3_text Gemma3ForCausalLM     no          yes         other one; Gemma 3: 5 of each 6)
    phi3        Phi3ForCausalLM       no          no        every layer (sliding_window); fused
                                                            qkv_proj and gate_up_proj
    qwen3_moe   Qwen3MoeForCausalLM   no          yes       as qwen3; mixture-of-experts MLPs
    mixtral     MixtralForCausalLM    no          no        every layer (sliding_window); mixture-of-
                                                            experts MLPs
    olmoe       OlmoeForCausalLM      no          yes (*)   refused; mixture-of-experts MLPs
                                                            (*) over the whole q and k, not each head

A mixture-of-experts family (`moe`) routes each token to num_experts_per_tok of num_experts
SwiGLU experts (punica.models.moe): Mixtral on every layer with the top-k weights renormalised,
OLMoE on every layer, Qwen3-MoE on the layers decoder_sparse_step and mlp_only_layers leave sparse
(the others a dense MLP of intermediate_size), those two renormalised where norm_topk_prob says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModel(ValueError):
    """A config.json that asks for something punica does not implement; the message names it."""


@dataclass(frozen=True)
class Family:
    name: str              # config.json's model_type
    architecture: str      # the transformers class its checkpoints name in `architectures`
    qkv_bias: bool = False
    qk_norm: bool = False
    windows: str = "none"  # "none" (refused), "all" (every layer), "layer_types", "qwen" (use_sliding_window)
    gemma: bool = False    # GeGLU, (1 + w) norms, sqrt(hidden) embedding scale, sandwich norms, softcaps
    window_pattern: int = 0  # without layer_types: every window_pattern-th layer is global, the others local
    fused: bool = False    # checkpoints and adapters hold qkv_proj and gate_up_proj
    moe: str = ""          # a mixture-of-experts family: "qwen3_moe", "mixtral" or "olmoe" (its config fields)
    qk_norm_whole: bool = False  # the q/k norms span the whole projection (all heads), not each head


FAMILIES = {f.name: f for f in (
    Family("llama", "LlamaForCausalLM"),
    Family("mistral", "MistralForCausalLM", windows="all"),
    Family("ministral", "MinistralForCausalLM", windows="layer_types"),
    Family("qwen2", "Qwen2ForCausalLM", qkv_bias=True, windows="qwen"),
    Family("qwen3", "Qwen3ForCausalLM", qk_norm=True, windows="qwen"),
    Family("gemma2", "Gemma2ForCausalLM", windows="layer_types", gemma=True, window_pattern=2),
    Family("gemma3_text", "Gemma3ForCausalLM", qk_norm=True, windows="layer_types", gemma=True, window_pattern=6),
    Family("phi3", "Phi3ForCausalLM", windows="all", fused=True),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", qk_norm=True, windows="qwen", moe="qwen3_moe"),
    Family("mixtral", "MixtralForCausalLM", windows="all", moe="mixtral"),
    Family("olmoe", "OlmoeForCausalLM", qk_norm=True, qk_norm_whole=True, moe="olmoe"),
)}
GEMMA_OPTIONS = ("attn_logit_softcapping", "final_logit_softcapping")  # implemented for the Gemma families
BY_ARCHITECTURE = {f.architecture: f for f in FAMILIES.values()}
# options of some transformers configs that change the math and that the decoder does not implement
UNSUPPORTED_OPTIONS = {
    "mlp_bias": "biases on the MLP projections (mlp_bias)",
    "attn_logit_softcapping": "attention-logit softcapping (attn_logit_softcapping)",
    "final_logit_softcapping": "final-logit softcapping (final_logit_softcapping)",
    "use_qk_norm": "q/k norms (use_qk_norm)",
    "no_rope_layers": "layers without rotary embedding (no_rope_layers)",
}


def family_of(d: dict[str, Any]) -> Family:
    """The family of a config.json: by model_type, else by architectures; Llama when it names neither."""
    archs = d.get("architectures") or []
    model_type = d.get("model_type")
    if model_type is None:
        known = [BY_ARCHITECTURE[a] for a in archs if a in BY_ARCHITECTURE]
        if archs and not known:
            raise UnsupportedModel(f"architectures {archs} are not supported; punica serves {_served()}")
        return known[0] if known else FAMILIES["llama"]
    family = FAMILIES.get(model_type)
    if family is None:
        raise UnsupportedModel(f"model_type {model_type!r} ({', '.join(archs) or 'no architectures'}) is not "
                               f"supported; punica serves {_served()}")
    if archs and family.architecture not in archs:
        raise UnsupportedModel(f"architectures {archs} of model_type {model_type!r} are not supported; punica "
                               f"serves the causal LM {family.architecture}")
    return family


FP8_QUANT_METHODS = ("fp8", "compressed-tensors")  # quantization_configs of the fp8 checkpoints punica loads


def _served() -> str:
    return ", ".join(f"{f.name} ({f.architecture})" for f in FAMILIES.values())


def hf_model_fields(d: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of a transformers config.json (`rope` as a dict of RopeConfig
    fields), or UnsupportedModel naming the first thing it asks for that punica lacks."""
    family = family_of(d)

    def refuse(what: str, hint: str = "") -> UnsupportedModel:
        return UnsupportedModel(f"{family.architecture} config: {what} is not supported{hint}")

    for option, what in UNSUPPORTED_OPTIONS.items():
        if d.get(option) and not (family.gemma and option in GEMMA_OPTIONS):
            raise refuse(what)
    method = (d.get("quantization_config") or {}).get("quant_method", "none")
    if d.get("quantization_config") and method not in FP8_QUANT_METHODS:  # their fields: punica.models.fp8_checkpoint
        raise refuse(f"quantized weights (quantization_config.quant_method = {method!r})",
                     f"; punica reads {' and '.join(FP8_QUANT_METHODS)} float8 checkpoints")
    if d.get("attention_bias"):  # Llama's, Qwen3's and Gemma's also put a bias on o_proj
        raise refuse("attention_bias=true (biases on the attention projections)")
    act_key, act = "hidden_act", d.get("hidden_act", "silu")
    if family.gemma:
        act_key, act = "hidden_activation", d.get("hidden_activation") or d.get("hidden_act")
    expected_act = "gelu_pytorch_tanh" if family.gemma else "silu"
    if act != expected_act:
        raise refuse(f"{act_key} {act!r} (only {expected_act})")
    num_layers = d["num_hidden_layers"]
    num_heads = d["num_attention_heads"]
    layer_windows = _layer_windows(d, family, num_layers, refuse)
    rope, local_rope = _ropes(d, family, refuse)
    eos = d.get("eos_token_id")
    gemma = {}
    if family.gemma:
        gemma = dict(hidden_act="gelu_tanh", norm_offset=1.0, embed_scale=True, sandwich_norms=True,
                     attn_softcap=float(d.get("attn_logit_softcapping") or 0.0),
                     final_softcap=float(d.get("final_logit_softcapping") or 0.0),
                     attn_scale=float(d.get("query_pre_attn_scalar", 256)) ** -0.5, local_rope=local_rope)
    return gemma | _moe_fields(d, family, num_layers, refuse) | dict(
        family=family.name,
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=d.get("num_key_value_heads") or num_heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
        rope=rope,
        max_position_embeddings=d.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        qkv_bias=family.qkv_bias,
        qk_norm=family.qk_norm,
        qk_norm_whole=family.qk_norm_whole,
        layer_windows=layer_windows,
        fused_projections=family.fused,
    )


def _moe_fields(d: dict[str, Any], family: Family, num_layers: int, refuse) -> dict[str, Any]:
    """The ModelConfig fields of a mixture-of-experts family's experts and router ({} for the others)."""
    if not family.moe:
        return {}
    if family.moe == "mixtral":
        num_experts, inter, normalize = d["num_local_experts"], d["intermediate_size"], True
        moe_layers = tuple(range(num_layers))
    elif family.moe == "olmoe":
        if d.get("clip_qkv") is not None:
            raise refuse(f"clipped q/k/v (clip_qkv={d['clip_qkv']})")
        num_experts, inter = d.get("num_experts", d.get("num_local_experts")), d["intermediate_size"]
        normalize, moe_layers = bool(d.get("norm_topk_prob", False)), tuple(range(num_layers))
    else:
        num_experts, inter = d.get("num_experts", d.get("num_local_experts")), d["moe_intermediate_size"]
        normalize = bool(d.get("norm_topk_prob", False))
        if d.get("use_sliding_window"):  # transformers' Qwen3-MoE then slides on every layer, unlike Qwen3's
            raise refuse("use_sliding_window (sliding-window attention) on qwen3_moe")
        step, dense = d.get("decoder_sparse_step", 1), set(d.get("mlp_only_layers") or ())
        if not isinstance(step, int) or step < 1:
            raise refuse(f"decoder_sparse_step={step!r} (a positive number of layers)")
        moe_layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    top_k = d.get("num_experts_per_tok")
    if not (isinstance(num_experts, int) and isinstance(top_k, int) and 1 <= top_k <= num_experts):
        raise refuse(f"num_experts_per_tok={top_k!r} of {num_experts!r} experts")
    if d.get("shared_expert_intermediate_size"):
        raise refuse("a shared expert (shared_expert_intermediate_size)")
    return dict(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=inter,
                norm_topk_prob=normalize, moe_layers=moe_layers)


def _ropes(d: dict[str, Any], family: Family, refuse) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the rope of the global layers, that of the local ones where the family has one of its own)."""
    params = dict(d.get("rope_parameters") or {})
    if family.name != "gemma3_text":
        return _rope(d, params, refuse), None
    if FULL_ATTENTION in params:  # transformers 5: one rope per layer type
        return (_rope(d, dict(params[FULL_ATTENTION]), refuse),
                _rope({}, dict(params.get(SLIDING_ATTENTION) or {"rope_theta": 10000.0}), refuse))
    local = {"rope_theta": d.get("rope_local_base_freq", 10000.0)}
    return _rope(d, params, refuse), _rope({}, local, refuse)


def _rope(d: dict[str, Any], params: dict[str, Any], refuse) -> dict[str, Any]:
    params.update(d.get("rope_scaling") or {})
    partial = params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise refuse(f"partial rotary embedding (partial_rotary_factor={partial})")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise refuse(f"rope scaling type {rope_type!r}", f" (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    return dict(
        theta=float(params.get("rope_theta", d.get("rope_theta", 10000.0))),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _layer_windows(d: dict[str, Any], family: Family, num_layers: int, refuse) -> tuple[int, ...]:
    """Each layer's sliding window in tokens (0: full attention), as transformers applies them;
    () when every layer attends fully."""
    window = d.get("sliding_window")
    if family.windows == "qwen" and not d.get("use_sliding_window", False):
        window = None  # transformers' Qwen configs drop the window unless use_sliding_window is set
    layer_types = d.get("layer_types")
    if family.windows == "none":
        if window is not None or (layer_types and SLIDING_ATTENTION in layer_types):
            raise refuse(f"sliding-window attention (sliding_window={window}) on {family.name}")
        return ()
    if family.windows == "all":
        if layer_types is not None:
            raise refuse(f"layer_types on {family.name} (transformers' Mistral ignores them; alternating "
                         "attention is model_type ministral)")
        layer_types = [SLIDING_ATTENTION] * num_layers
    elif layer_types is None and family.window_pattern:
        pattern = d.get("sliding_window_pattern", family.window_pattern)
        layer_types = [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(num_layers)]
    elif layer_types is None:
        first_sliding = d.get("max_window_layers", num_layers) if family.windows == "qwen" else 0
        layer_types = [SLIDING_ATTENTION if i >= first_sliding else FULL_ATTENTION for i in range(num_layers)]
    if len(layer_types) != num_layers:
        raise refuse(f"layer_types of {len(layer_types)} layers for num_hidden_layers={num_layers}")
    unknown = sorted(set(layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
    if unknown:
        raise refuse(f"layer_types {unknown}")
    if window is None:
        if family.name == "gemma3_text" and SLIDING_ATTENTION in layer_types:
            raise refuse("local layers without a sliding_window (they would still take the local rope)")
        return ()
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise refuse(f"sliding_window={window!r} (a positive number of tokens)")
    windows = tuple(window if t == SLIDING_ATTENTION else 0 for t in layer_types)
    return windows if any(windows) else ()
