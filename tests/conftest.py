"""Fixtures of every test directory: tiny random models of each family served (transformers' own
classes), real PEFT LoRA adapters made by `peft` itself, and greedy decoding by both to compare.

Each fixture returns a function (tests call it with the arguments they need); test modules never
import this file.
"""

from __future__ import annotations

import copy
import itertools
import os
import threading
from pathlib import Path

import pytest
import torch

# Triton kernels run under the interpreter on machines without a GPU; this must be set
# before any @triton.jit function is defined, triton's own included: before the imports
# below, which import triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist's workers share the machine's cores: each takes its share of torch's threads (more
# OpenMP threads than cores spin against each other and slow every worker).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, torch.get_num_threads() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402

from punica.config import ModelConfig  # noqa: E402
from punica.engine.sampling_params import SamplingParams  # noqa: E402

HF_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def pytest_generate_tests(metafunc):
    """A test taking `family` runs once for each tiny model family of TINY_FAMILIES."""
    if "family" in metafunc.fixturenames:
        metafunc.parametrize("family", list(TINY_FAMILIES))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def tiny_llama_config(**overrides) -> LlamaConfig:
    """A 2-layer GQA Llama: hidden 64, intermediate 96, 4 heads, 2 kv heads, vocab 128."""
    kw = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
    return LlamaConfig(**(kw | overrides))


def tiny_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A randomly initialised tiny Llama in fp32 eval mode (global RNG left untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(tiny_llama_config(**overrides)).eval()


# tiny model of each family: (model_type, config overrides on top of tiny_llama_config's shape);
# sliding windows of 8 tokens, shorter than the test prompts plus their outputs
TINY_FAMILIES = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
    "qwen2-sliding": ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    "qwen3": ("qwen3", {"head_dim": 16}),
    "mistral": ("mistral", {"sliding_window": 8, "head_dim": 16}),
    "ministral": ("ministral", {"sliding_window": 8, "head_dim": 16,
                                "layer_types": ["sliding_attention", "full_attention"]}),
    # local and global layers alternate; weights of std 0.2 make scores the attention softcap saturates and
    # logits in the final softcap's curved range (a cap of 1 would bring the top logits within 1e-5 of
    # each other, under the fp32 noise between two machines)
    "gemma2": ("gemma2", {"sliding_window": 8, "head_dim": 16, "query_pre_attn_scalar": 24, "initializer_range": 0.2,
                          "attn_logit_softcapping": 1.0, "final_logit_softcapping": 5.0}),
    "gemma3": ("gemma3_text", {"sliding_window": 8, "head_dim": 16, "query_pre_attn_scalar": 24,
                               "layer_types": ["sliding_attention", "full_attention"],
                               "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                      "rope_theta": 1e6},
                                                   "sliding_attention": {"rope_type": "default",
                                                                         "rope_theta": 1e4}}}),
    "phi3": ("phi3", {"sliding_window": 8, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
                      "tie_word_embeddings": True}),
}
# the fused modules of some families (Phi-3) that stand for the separate ones of the others
FUSED_MODULES = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
                 "up_proj": "gate_up_proj"}


def tiny_family_model(family: str, seed: int = 0, **overrides):
    """A randomly initialised tiny model of a TINY_FAMILIES family, made by transformers' class for
    it, in fp32 eval mode; its biases and norm weights random too (transformers initialises them
    to 0 and 1, which would hide a bias or a norm the decoder forgot)."""
    model_type, family_overrides = TINY_FAMILIES[family]
    return random_tiny_model(model_type, family_overrides | overrides, seed,
                             lambda name: name.endswith(".bias"), lambda param: param.normal_(0.0, 0.5))


# every tiny test model's shape, under its family's overrides
TINY_SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)


def random_tiny_model(model_type: str, overrides: dict, seed: int, special, set_special):
    """transformers' model of `model_type` in TINY_SHAPE with `overrides`, fp32 eval, seeded: the
    parameters whose names `special` picks set by `set_special`, norm weights perturbed."""
    config = AutoConfig.for_model(model_type, **(TINY_SHAPE | overrides))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # eager attention, the reference math, whatever a transformers version picks by default: SDPA has
        # no attention softcap (Gemma 2)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if special(name):
                    set_special(param)
                elif "norm" in name:
                    param.add_(torch.randn_like(param) * 0.2)
    return model


# tiny mixture-of-experts models: (model_type, config overrides on top of tiny_family_model's shape):
# Qwen3-MoE with a dense first layer and its top-k weights as routed (norm_topk_prob false), Mixtral
# (renormalised top-k) and OLMoE (norm_topk_prob true, q/k norms over all heads) on every layer; 4
# experts, 2 per token
TINY_MOE_FAMILIES = {
    "qwen3_moe": ("qwen3_moe", dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    norm_topk_prob=False, mlp_only_layers=[0])),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)),
    "olmoe": ("olmoe", dict(num_experts=4, num_experts_per_tok=2, intermediate_size=32, norm_topk_prob=True)),
}


def tiny_moe_model(family: str, seed: int = 0):
    """A random tiny MoE model of a TINY_MOE_FAMILIES family by transformers' class, fp32 eval; router
    weights of std 1 so that a token's experts are chosen by clear margins (near ties would turn on
    float noise), norm weights random."""
    model_type, overrides = TINY_MOE_FAMILIES[family]
    return random_tiny_model(model_type, overrides, seed, lambda name: name.endswith("mlp.gate.weight"),
                             lambda param: param.normal_(0.0, 1.0))


def make_moe_adapter(base_model, path: str | Path, r: int, alpha: float, use_rslora: bool,
                     target_modules: list[str] | None, target_parameters: list[str] | None, seed: int = 0) -> Path:
    """Save a PEFT LoRA adapter of random non-zero A and B (init_lora_weights=False) to `path`, on
    modules (target_modules) and on a MoE model's fused experts (target_parameters, e.g.
    "mlp.experts.down_proj"); `base_model` is not modified."""
    config = LoraConfig(r=r, lora_alpha=alpha, use_rslora=use_rslora, target_modules=target_modules,
                        target_parameters=target_parameters, init_lora_weights=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = get_peft_model(copy.deepcopy(base_model), config)
    peft_model.save_pretrained(str(path))
    return Path(path)


def capture_graph(fn):
    """Run fn once eagerly (its kernels compile outside the capture), then capture one call of it
    in a CUDA graph: (graph, what the captured call returned)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def punica_config(model) -> ModelConfig:
    """The punica ModelConfig of a transformers model."""
    return ModelConfig.from_hf_dict(model.config.to_dict())


def make_peft_adapter(base_model: LlamaForCausalLM, path: str | Path, r: int, alpha: float,
                      targets: tuple[str, ...] | list[str] = HF_MODULES, use_rslora: bool = False,
                      seed: int = 0, safe_serialization: bool = True, **kw) -> Path:
    """Save a PEFT LoRA adapter with random non-zero A and B (init_lora_weights=False) to `path`.

    `base_model` is not modified; `kw` goes to LoraConfig (e.g. layers_to_transform). On a model
    with fused projections (Phi-3) the targets q/k/v and gate/up name its qkv_proj and gate_up_proj.
    """
    if any(name.endswith("qkv_proj") for name, _ in base_model.named_modules()):
        targets = sorted({FUSED_MODULES.get(t, t) for t in targets})
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora,
                        init_lora_weights=False, **kw)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = get_peft_model(copy.deepcopy(base_model), config)
    peft_model.save_pretrained(str(path), safe_serialization=safe_serialization)
    return Path(path)


def load_peft_model(base_model: LlamaForCausalLM, paths: dict[str, str | Path]) -> PeftModel:
    """A PeftModel (on a copy of `base_model`) holding each adapter of `paths` under its name."""
    (first, first_path), *rest = paths.items()
    model = PeftModel.from_pretrained(copy.deepcopy(base_model), str(first_path), adapter_name=first)
    for name, path in rest:
        model.load_adapter(str(path), adapter_name=name)
    return model.eval()


@pytest.fixture(autouse=True)
def step_counter_clock(monkeypatch):
    """Every step the engine times takes one tick: the latency budget's cost model (punica.engine.
    step_cost) sees steps of equal time, so where a prompt's chunks end never depends on how fast the
    machine ran (chunk boundaries change fp32 rounding, and so could change greedy tokens). Its own
    tests give it step times. No start-up calibration step runs (punica.engine.calibration): timed
    by ticks, it would differ from the served steps only in how many ticks each takes."""
    ticks = itertools.count()
    monkeypatch.setattr("punica.engine.core.step_clock", lambda: float(next(ticks)))
    monkeypatch.setattr("punica.engine.calibration.CALIBRATION_S", 0.0)


@pytest.fixture(scope="session", name="tiny_llama_config")
def tiny_llama_config_fixture():
    """The function `tiny_llama_config(**overrides) -> LlamaConfig`."""
    return tiny_llama_config


@pytest.fixture(scope="session", name="tiny_family_model")
def tiny_family_model_fixture():
    """The function `tiny_family_model(family, seed=0, **overrides)`: a tiny model of a TINY_FAMILIES family."""
    return tiny_family_model


@pytest.fixture(scope="session", name="tiny_moe_model")
def tiny_moe_model_fixture():
    """The function `tiny_moe_model(family, seed=0)`: a tiny model of a TINY_MOE_FAMILIES family."""
    return tiny_moe_model


@pytest.fixture(scope="session", name="make_moe_adapter")
def make_moe_adapter_fixture():
    """The function `make_moe_adapter(base_model, path, r, alpha, use_rslora, target_modules,
    target_parameters, seed=0) -> Path`."""
    return make_moe_adapter


@pytest.fixture(scope="session", name="tiny_llama")
def tiny_llama_fixture():
    """The function `tiny_llama(seed=0, **overrides) -> LlamaForCausalLM`."""
    return tiny_llama


@pytest.fixture(scope="session", name="capture_graph")
def capture_graph_fixture():
    """The function `capture_graph(fn) -> (graph, out)`."""
    return capture_graph


@pytest.fixture(scope="session", name="punica_config")
def punica_config_fixture():
    """The function `punica_config(model) -> ModelConfig`."""
    return punica_config


@pytest.fixture(scope="session", name="make_peft_adapter")
def make_peft_adapter_fixture():
    """The function `make_peft_adapter(base_model, path, r, alpha, targets=HF_MODULES, ...) -> Path`."""
    return make_peft_adapter


@pytest.fixture(scope="session", name="load_peft_model")
def load_peft_model_fixture():
    """The function `load_peft_model(base_model, paths) -> PeftModel`."""
    return load_peft_model


def load_adapters(engine, names):
    """Make every adapter of `names` resident in the engine's pool before a test's steps: each read
    (on a worker thread) is waited for, so which steps the adapters' requests join never depends on
    how fast the reads ran beside them."""
    manager = engine.adapters
    manager.poll(list(names))  # starts the reads
    for future, _ in list(manager.reads.values()):
        future.result()
    manager.poll(list(names))  # takes them into the host tier and starts the copies into slots
    if manager.device.type == "cuda":
        torch.cuda.synchronize(manager.device)
    manager.poll(list(names))  # the copies done: resident
    tiers = {name: manager.snapshot()["adapters"][name]["tier"] for name in names}
    assert set(tiers.values()) == {"gpu"}, f"adapters not resident after their reads: {tiers}"


@pytest.fixture(scope="session", name="load_adapters")
def load_adapters_fixture():
    """The function `load_adapters(engine, names)`: the adapters resident, their reads waited for."""
    return load_adapters


def run_all(engine, requests, params_for):
    ids = [engine.add_request(prompt, params_for(max_tokens), adapter) for prompt, adapter, max_tokens in requests]
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    return [outs[i] for i in ids]


def greedy(max_tokens):
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def hf_greedy(peft_model, prompt, adapter, steps):
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = peft_model(torch.tensor([tokens]), adapter_names=[adapter or "__base__"]).logits[0, -1]
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


@pytest.fixture(scope="session", name="run_all")
def run_all_fixture():
    """The function `run_all(engine, requests, params_for)`: the final output of every
    (prompt, adapter, max_tokens) request, in order, with SamplingParams `params_for(max_tokens)`."""
    return run_all


@pytest.fixture(scope="session", name="greedy")
def greedy_fixture():
    """The function `greedy(max_tokens) -> SamplingParams`: greedy decoding that ignores EOS."""
    return greedy


@pytest.fixture(scope="session", name="hf_greedy")
def hf_greedy_fixture():
    """The function `hf_greedy(peft_model, prompt, adapter, steps)`: the tokens transformers + PEFT
    generate greedily (adapter None: the base model)."""
    return hf_greedy


class HeldCompiles:
    """xgrammar's regex compile, made to wait for `go` (at most 60 s) when the regex holds "HOLD";
    `started` and `ended` say where such a compile is."""

    def __init__(self, compile_regex):
        self.compile_regex = compile_regex
        self.started, self.ended, self.go = threading.Event(), threading.Event(), threading.Event()

    def __call__(self, compiler, regex: str):
        if "HOLD" in regex:
            self.started.set()
            self.go.wait(60)
        try:
            return self.compile_regex(compiler, regex)
        finally:
            if "HOLD" in regex:
                self.ended.set()


@pytest.fixture()
def held(monkeypatch):
    """A HeldCompiles in place of xgrammar's regex compile for the test (let go at its end)."""
    import xgrammar as xgr

    hold = HeldCompiles(xgr.GrammarCompiler.compile_regex)
    monkeypatch.setattr(xgr.GrammarCompiler, "compile_regex", lambda compiler, regex: hold(compiler, regex))
    yield hold
    hold.go.set()
