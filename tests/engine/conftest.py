"""Fixtures of the engine tests: a tiny Llama with three PEFT adapters on disk (`setup`), engines
over it, a mixed workload, and greedy decoding by transformers + PEFT to compare with."""

import random

import pytest
import torch

from punica.config import EngineConfig
from punica.engine.sampling_params import SamplingParams
from punica.factory import engine_on_model
from punica.models.loader import load_hf_dir

# name -> (rank, alpha, targets)
ADAPTERS = {"a": (8, 16, ("q_proj", "v_proj", "down_proj")), "b": (4, 4, ("k_proj", "o_proj", "up_proj")),
            "c": (16, 32, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_llama, make_peft_adapter, load_peft_model):
    """(base model directory, adapter name -> directory, a PeftModel holding every adapter) of a
    tiny Llama (seed 5) with the adapters "a", "b" and "c"; one per test module."""
    tmp = tmp_path_factory.mktemp("engine")
    hf = tiny_llama(seed=5)
    hf.save_pretrained(tmp / "base")
    paths = {n: str(make_peft_adapter(hf, tmp / n, r=r, alpha=a, targets=t, seed=i))
             for i, (n, (r, a, t)) in enumerate(ADAPTERS.items())}
    return tmp / "base", paths, load_peft_model(hf, paths)


def make_engine(setup, **config):
    base, paths, _ = setup
    model = load_hf_dir(base, dtype=torch.float32)
    return engine_on_model(model, EngineConfig(**config), paths)


def workload(n, seed):
    rng = random.Random(seed)
    names = [None, "a", "b", "c"]
    return [([rng.randrange(3, 128) for _ in range(rng.randint(1, 40))], names[i % 4], rng.randint(1, 24))
            for i in range(n)]


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


@pytest.fixture(scope="session", name="make_engine")
def make_engine_fixture():
    """The function `make_engine(setup, **config) -> Engine`: an fp32 CPU engine of `setup`'s model
    and adapters, `config` going to EngineConfig."""
    return make_engine


@pytest.fixture(scope="session", name="workload")
def workload_fixture():
    """The function `workload(n, seed)`: n (prompt, adapter, max_tokens) requests cycling through
    the base model and the adapters "a", "b", "c"."""
    return workload


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
