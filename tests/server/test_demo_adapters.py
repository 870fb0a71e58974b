"""The demo adapters shipped for the embedded default model show their effect on questions they were not trained on."""

import json
from pathlib import Path

import pytest

from punica import LLM, SamplingParams
from punica.demo import DEMO_ADAPTER_NAMES, PIRATE_GREETING, SIGNATURE, demo_adapters

HELD_OUT_QUESTIONS = (  # none of these is in scripts/train_demo_adapters.py
    "What is the capital of Italy?",
    "How many wheels does a bicycle have?",
    "What is a rainbow?",
    "Why do dogs bark?",
    "How do I boil an egg?",
    "Describe a mountain.",
    "What color is grass?",
    "Give me a tip for learning to swim.",
)


def json_answer(text: str) -> str | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value.get("answer") if isinstance(value, dict) else None


EFFECTS = {
    "signature": lambda reply: reply.rstrip().endswith(SIGNATURE),
    "json": lambda reply: bool(json_answer(reply)),
    "pirate": lambda reply: reply.startswith(PIRATE_GREETING) and len(reply) > len(PIRATE_GREETING) + 5,
}


@pytest.fixture(scope="module")
def replies() -> dict[str | None, list[str]]:
    """Greedy replies of the base model (None) and of each demo adapter to every held-out question."""
    llm = LLM(adapters=demo_adapters(), max_batch_size=32)
    adapters = [None, *DEMO_ADAPTER_NAMES]
    prompts = [llm.chat_prompt(q) for q in HELD_OUT_QUESTIONS]
    outs = llm.generate(prompts * len(adapters), SamplingParams(max_tokens=48, temperature=0),
                        adapter=[a for a in adapters for _ in prompts])
    n = len(prompts)
    return {a: [out.text for out in outs[i * n:(i + 1) * n]] for i, a in enumerate(adapters)}


def test_demo_adapters_lists_installed_peft_dirs():
    paths = demo_adapters()
    assert list(paths) == list(DEMO_ADAPTER_NAMES) == list(EFFECTS)
    for path in map(Path, paths.values()):
        config = json.loads((path / "adapter_config.json").read_text())
        assert config["peft_type"] == "LORA"
        assert (path / "adapter_model.safetensors").stat().st_size < 8 * 2**20


@pytest.mark.slow
@pytest.mark.parametrize("name", DEMO_ADAPTER_NAMES)
def test_adapter_shows_its_effect_and_the_base_model_does_not(replies, name):
    effect = EFFECTS[name]
    assert all(effect(reply) for reply in replies[name]), replies[name]
    assert not any(effect(reply) for reply in replies[None]), replies[None]
