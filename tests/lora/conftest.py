"""Fixtures of the on-demand adapter tests: a tiny Llama saved as the base model, and real PEFT
adapters for it."""

import pytest

BASE_SEED = 11


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, tiny_llama):
    tmp = tmp_path_factory.mktemp("manager")
    tiny_llama(seed=BASE_SEED).save_pretrained(tmp / "base")
    return tmp


@pytest.fixture(scope="module")
def peft_adapter(tiny_llama, make_peft_adapter):
    """The function `peft_adapter(path, r=8, alpha=64, seed=0)`: a real PEFT adapter for the base
    model (alpha 64: strong enough to change greedy outputs)."""
    base_model = tiny_llama(seed=BASE_SEED)

    def peft_adapter(path, r=8, alpha=64, seed=0):
        return make_peft_adapter(base_model, path, r=r, alpha=alpha, seed=seed)

    return peft_adapter
