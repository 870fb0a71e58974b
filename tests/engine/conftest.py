"""Fixtures of the engine tests: a tiny Llama with three PEFT adapters on disk (`setup`), engines
over it and a mixed workload (greedy decoding by transformers + PEFT to compare with: tests/conftest.py)."""

import random

import pytest
import torch

from punica.config import EngineConfig
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


def make_engine(setup, device="cpu", dtype=torch.float32, **config):
    base, paths, _ = setup
    model = load_hf_dir(base, dtype=dtype, device=device)
    # steps overlap as on a GPU unless a test says otherwise (the CPU's default is not to): the
    # overlapped path, its tokens fed on the device, is the one these tests exercise
    return engine_on_model(model, EngineConfig(**({"overlap_steps": True} | config)), paths)


def workload(n, seed):
    rng = random.Random(seed)
    names = [None, "a", "b", "c"]
    return [([rng.randrange(3, 128) for _ in range(rng.randint(1, 40))], names[i % 4], rng.randint(1, 24))
            for i in range(n)]


@pytest.fixture(scope="session", name="make_engine")
def make_engine_fixture():
    """The function `make_engine(setup, device="cpu", dtype=torch.float32, **config) -> Engine`: an
    engine of `setup`'s model and adapters, `config` going to EngineConfig (overlap_steps True unless
    given)."""
    return make_engine


@pytest.fixture(scope="session", name="workload")
def workload_fixture():
    """The function `workload(n, seed)`: n (prompt, adapter, max_tokens) requests cycling through
    the base model and the adapters "a", "b", "c"."""
    return workload
