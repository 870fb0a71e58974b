"""Frozen configuration dataclasses; every invariant is asserted once, in __post_init__."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from punica.families import SUPPORTED_ROPE_TYPES, hf_model_fields
from punica.flags import described


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope scaling type {self.rope_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        if self.theta <= 0 or self.factor <= 0:
            raise ValueError("rope theta and scaling factor must be positive")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # the family's features (punica.families): the decoder implements each of them
    family: str = "llama"
    qkv_bias: bool = False   # biases on q, k and v (the LoRA delta adds to the biased projection)
    qk_norm: bool = False    # RMSNorm over each head of q and k before rotary
    qk_norm_whole: bool = False  # with qk_norm: over the whole q and k projections instead (OLMoE)
    layer_windows: tuple[int, ...] = ()  # each layer's sliding window in tokens, 0: full; (): all full
    hidden_act: str = "silu"  # the MLP's gate activation: silu (SwiGLU) or gelu_tanh (GeGLU)
    norm_offset: float = 0.0  # checkpoints store each RMSNorm weight less this (Gemma's 1 + w)
    embed_scale: bool = False  # embeddings times sqrt(hidden_size)
    sandwich_norms: bool = False  # RMSNorms on the attention and MLP outputs too, before their residual adds
    attn_softcap: float = 0.0  # attention scores s -> cap * tanh(s / cap); 0: none
    final_softcap: float = 0.0  # the same on the logits
    attn_scale: float = 0.0  # the attention's score scale; 0: head_dim ** -0.5
    local_rope: RopeConfig | None = None  # the rope of the sliding-window layers, where it is not `rope`
    fused_projections: bool = False  # checkpoint and adapters name the fused qkv_proj and gate_up_proj (Phi-3)
    # mixture of experts (punica.models.moe): on the layers `moe_layers` the MLP is num_experts SwiGLU
    # experts of moe_intermediate_size, num_experts_per_tok of them per token, their router weights
    # renormalised to sum 1 with norm_topk_prob; the other layers' MLP is dense (intermediate_size)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model config: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.layer_windows and (len(self.layer_windows) != self.num_layers or min(self.layer_windows) < 0):
            raise ValueError(f"model config: layer_windows {self.layer_windows} must hold one window >= 0 "
                             f"per layer ({self.num_layers})")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"model config: hidden_act {self.hidden_act!r} is not silu or gelu_tanh")
        if min(self.attn_softcap, self.final_softcap, self.attn_scale) < 0:
            raise ValueError("model config: softcaps and the attention scale must not be negative")
        if self.moe_layers and not (0 < self.num_experts_per_tok <= self.num_experts and self.moe_intermediate_size > 0
                                    and all(0 <= i < self.num_layers for i in self.moe_layers)):
            raise ValueError(f"model config: MoE layers {self.moe_layers} need 1 <= num_experts_per_tok "
                             f"({self.num_experts_per_tok}) <= num_experts ({self.num_experts}), a positive "
                             f"moe_intermediate_size ({self.moe_intermediate_size}) and layers below {self.num_layers}")

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window in tokens; 0: it attends to the whole context."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def is_moe(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is the mixture of experts."""
        return layer in self.moe_layers

    def layer_rope(self, layer: int) -> RopeConfig:
        """The rope of layer `layer`: `local_rope` on a sliding-window layer where there is one."""
        return self.local_rope if self.local_rope is not None and self.window(layer) else self.rope

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """(h_in, h_out) of each of the 7 LoRA-able projections of one layer."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q": (h, self.q_size), "k": (h, self.kv_size), "v": (h, self.kv_size),
            "o": (self.q_size, h), "gate": (h, i), "up": (h, i), "down": (i, h),
        }

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """The config of a transformers config.json; punica.families.UnsupportedModel (a ValueError)
        names anything in it that punica does not implement."""
        fields_ = hf_model_fields(d)
        local = fields_.get("local_rope")
        return cls(**(fields_ | {"rope": RopeConfig(**fields_["rope"]),
                                 "local_rope": None if local is None else RopeConfig(**local)}))

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        p = Path(path) / "config.json"
        if not p.is_file():
            raise FileNotFoundError(f"no config.json in model directory {path}")
        return cls.from_hf_dict(json.loads(p.read_text()))


PRESETS = {
    # name: (hidden, intermediate, layers, heads, kv_heads, vocab[, other ModelConfig fields])
    "llama-2-7b": (4096, 11008, 32, 32, 32, 32000),
    "llama-2-13b": (5120, 13824, 40, 40, 40, 32000),
    "llama-2-70b": (8192, 28672, 80, 64, 8, 32000),
    "llama-3-8b": (4096, 14336, 32, 32, 8, 128256),
    "qwen2.5-7b": (3584, 18944, 28, 28, 4, 152064,
                   {"family": "qwen2", "qkv_bias": True, "rms_norm_eps": 1e-6, "rope": RopeConfig(theta=1e6)}),
    "gemma-2-9b": (3584, 14336, 42, 16, 8, 256000,
                   {"family": "gemma2", "head_dim": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                    "layer_windows": (4096, 0) * 21, "hidden_act": "gelu_tanh", "norm_offset": 1.0,
                    "embed_scale": True, "sandwich_norms": True, "attn_softcap": 50.0, "final_softcap": 30.0,
                    "attn_scale": 256 ** -0.5, "max_position_embeddings": 8192}),
    "qwen3-30b-a3b": (2048, 6144, 48, 32, 4, 151936,
                      {"family": "qwen3_moe", "head_dim": 128, "qk_norm": True, "rms_norm_eps": 1e-6,
                       "rope": RopeConfig(theta=1e6), "num_experts": 128, "num_experts_per_tok": 8,
                       "moe_intermediate_size": 768, "norm_topk_prob": True, "moe_layers": tuple(range(48))}),
    "mixtral-8x7b": (4096, 14336, 32, 32, 8, 32000,
                     {"family": "mixtral", "rope": RopeConfig(theta=1e6), "num_experts": 8,
                      "num_experts_per_tok": 2, "moe_intermediate_size": 14336, "norm_topk_prob": True,
                      "moe_layers": tuple(range(32))}),
    "tiny": (128, 256, 2, 4, 2, 512),  # smoke-testing the benchmarks on a CPU
    "tiny-moe": (128, 256, 2, 4, 2, 512, {"family": "qwen3_moe", "head_dim": 32, "qk_norm": True, "num_experts": 8,
                                          "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                                          "norm_topk_prob": True, "moe_layers": (1,)}),
}


def preset_config(name: str) -> ModelConfig:
    """Config of a well-known model shape, for random-weight ("dummy") benchmarks."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    h, i, n, heads, kv, vocab, *other = PRESETS[name]
    fields_ = dict(head_dim=h // heads, max_position_embeddings=4096) | (other[0] if other else {})
    return ModelConfig(vocab_size=vocab, hidden_size=h, intermediate_size=i, num_layers=n,
                       num_heads=heads, num_kv_heads=kv, **fields_)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


KV_CACHE_DTYPES = ("auto", "fp8")
# a schema is read, canonicalized and written by recursive code (json's and ours): far below Python's
# recursion limit of 1000 frames
MAX_GRAMMAR_DEPTH = 256
SCHEDULINGS = ("fair", "fcfs")


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = described(32, "requests in the running batch at most")
    page_size: int = described(16, "tokens per KV-cache page")
    kv_cache_tokens: int | None = described(None, "KV-cache size in tokens (default: from --kv-cache-bytes)")
    kv_cache_bytes: int | None = described(
        None, "KV-cache size in bytes (default: --kv-cache-memory-fraction of free GPU memory; 1 GiB on CPU)")
    kv_cache_memory_fraction: float = described(0.85, "fraction of free GPU memory the KV cache takes")
    kv_cache_dtype: str = described(
        "auto", "fp8: store K and V as e4m3 with one fp32 scale per token and KV head (amax / 448, at write "
                "time), so the same bytes hold ~1.9x the tokens (auto: the activation dtype)",
        choices=KV_CACHE_DTYPES)
    max_num_batched_tokens: int = described(
        512, "tokens a step computes at most: running decodes first, then prompt chunks (without chunked "
             "prefill: prompt tokens admitted per step, one longer prompt runs alone)")
    chunked_prefill: bool = described(True, "prefill a long prompt over several steps, beside the running decodes")
    max_itl_ratio: float = described(
        2.0, "with chunked prefill and decodes running, a step's prompt chunk is sized so that the step's predicted "
             "time stays within this many times a decode-only step's (a cost model fitted to the steps the engine "
             "runs; --max-num-batched-tokens still caps it; 0: off, chunks fill the token budget)")
    prefix_caching: bool = described(True, "reuse the KV pages of prompt prefixes computed before under the "
                                           "same adapter (or base model)")
    scheduling: str = described(
        "fair", "fair: admit the waiting request of the tenant served least (tokens computed / weight), and "
                "preempt the newest of the tenant served most; a request's tenant is the server's tenant (or API "
                "key), else its adapter; fcfs: first come, first served", choices=SCHEDULINGS)
    max_model_len: int | None = described(None, "longest prompt + output (default: the model's context)")
    max_loras: int = described(8, "adapters on the GPU at once (slots of the adapter pool)")
    max_lora_bytes: int | None = described(
        None, "device bytes the adapter pool takes at most: its slots are the fewer of --max-loras and what fits "
              "(a slot holds an adapter of --max-lora-rank on every projection and, on a MoE model, every expert: "
              "~1.3 GB at rank 16 on Qwen3-30B-A3B in bf16)")
    max_lora_rank: int = described(16, "rank of every GPU adapter slot (raised to the largest adapter given at "
                                       "start); adapters of lower rank are zero-padded")
    lora_host_bytes: int | None = described(
        None, "host tier for adapters read from disk, in bytes, page-locked at start on CUDA (default: room for as "
              "many adapters as the GPU has slots, and at least 4 GiB, within a quarter of the host's memory "
              "shared by its GPUs)")
    enforce_eager: bool = described(False, "CUDA: run every step eagerly, not as captured CUDA graphs")
    overlap_steps: bool | None = described(
        None, "schedule step t+1 before step t's tokens reach the host (default: on a GPU, which computes a step "
              "while the host plans the next; off on the CPU, where a step's model runs inside it and overlap "
              "would only return each token a step later)")
    # no flag of its own: punica serve's --adapter-dir. An adapter inside one of these directories
    # reads only files inside it (punica.lora.adapter_files)
    adapter_dirs: tuple[str, ...] = ()
    max_grammar_compile_seconds: float = described(
        5.0, "a structured-output grammar (JSON schema, regex, choice, EBNF, required tool call) not compiled "
             "within this many seconds is refused (400); compiles run off the engine's thread")
    max_grammar_chars: int = described(1 << 16, "a structured-output constraint over this many characters (a JSON "
                                                "schema as JSON, a regex, an EBNF grammar, all choices together) is "
                                                "refused (400) before compiling")
    max_grammar_depth: int = described(64, "a JSON schema nesting objects and arrays deeper than this is refused "
                                           f"(400) before compiling (at most {MAX_GRAMMAR_DEPTH})")

    def __post_init__(self):
        object.__setattr__(self, "adapter_dirs", tuple(str(d) for d in self.adapter_dirs))
        for name in ("max_batch_size", "page_size", "max_num_batched_tokens", "max_loras", "max_lora_rank",
                     "max_grammar_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("kv_cache_tokens", "kv_cache_bytes", "max_model_len", "max_lora_bytes", "lora_host_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.chunked_prefill and self.max_num_batched_tokens <= self.max_batch_size:
            raise ValueError(f"with chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens}) must "
                             f"exceed max_batch_size ({self.max_batch_size}): a full batch of decodes leaves "
                             f"prompts no tokens otherwise")
        if not (self.max_itl_ratio == 0 or self.max_itl_ratio > 1):
            raise ValueError(f"max_itl_ratio must be 0 (off) or over 1, got {self.max_itl_ratio}")
        if self.scheduling not in SCHEDULINGS:
            raise ValueError(f"scheduling must be one of {', '.join(SCHEDULINGS)}, got {self.scheduling!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}")
        if not 1 <= self.max_grammar_depth <= MAX_GRAMMAR_DEPTH:
            raise ValueError(f"max_grammar_depth must be in [1, {MAX_GRAMMAR_DEPTH}], got {self.max_grammar_depth}")
        if not self.max_grammar_compile_seconds > 0:
            raise ValueError(f"max_grammar_compile_seconds must be > 0, got {self.max_grammar_compile_seconds}")

    def overlaps_steps_on(self, device_type: str) -> bool:
        """Whether steps overlap on a model of this device type ("cuda", "cpu"), when its executor can
        feed sampled tokens on the device: `overlap_steps`, or by default on a GPU only."""
        return self.overlap_steps if self.overlap_steps is not None else device_type == "cuda"


DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")
QUANTIZATIONS = ("none", "fp8")


@dataclass(frozen=True)
class EngineArgs(EngineConfig):
    """Everything that says how to build an engine: the model, where it runs, and its EngineConfig.
    punica.factory builds engines from it, and `add_arguments` makes the command-line flags of
    `punica serve`, `punica generate` and the benchmarks from its fields."""
    model: str | None = described(None, "HF model directory or .gguf file (default: the embedded "
                                        "SmolLM2-135M-Instruct); with --load-format dummy also a preset name")
    load_format: str = described("auto", "dummy: random weights of the model's shape (a preset or a model "
                                         "directory's config), for benchmarks", choices=LOAD_FORMATS)
    dtype: str = described("auto", "weights and activations (auto: bfloat16 on CUDA, float32 on CPU)",
                           choices=DTYPES)
    quantization: str = described("none", "fp8: quantize the 7 projections' weights to e4m3 at load, one scale per "
                                          "output channel (none: as the checkpoint stores them; fp8 checkpoints load "
                                          "as fp8 either way)", choices=QUANTIZATIONS)
    device: str | None = described(None, "cpu or cuda (default: cuda if available)")
    tensor_parallel_size: int = described(1, "shard the model over N devices (N processes; GPUs 0..N-1 on CUDA)")
    workers: int = described(0, "run N engine workers on Ray (one GPU each) behind the Punica cluster "
                                "scheduler; each shards the model over --tensor-parallel-size devices")

    def __post_init__(self):
        super().__post_init__()
        if self.tensor_parallel_size < 1 or self.workers < 0:
            raise ValueError(f"tensor_parallel_size must be >= 1 and workers >= 0, got {self.tensor_parallel_size} "
                             f"and {self.workers}")
        for name, allowed in (("dtype", DTYPES), ("load_format", LOAD_FORMATS), ("quantization", QUANTIZATIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.load_format == "dummy" and self.model is None:
            raise ValueError("load_format dummy needs a model: a preset name or a model directory")

    def engine_config(self) -> EngineConfig:
        return EngineConfig(**{f.name: getattr(self, f.name) for f in fields(EngineConfig)})
