"""Held-out structured outputs on the embedded model (SmolLM2-135M-Instruct): 200 requests over the
demo adapters and the base model, each with its own JSON schema, in mixed batches with unconstrained,
regex and choice requests and with preemptions (a small KV cache); every output parses and validates."""

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from punica import LLM, SamplingParams
from punica.demo import DEMO_ADAPTER_NAMES, demo_adapters
from punica.engine.sampling_params import StructuredOutputs

WORDS = ("name", "city", "color", "size", "count", "score", "kind", "level", "title", "code", "owner", "state")
ENUM_WORDS = ("red", "green", "blue", "small", "large", "yes", "no", "north", "south", "cat", "dog")
QUESTIONS = ("Describe a city.", "Tell me about a pet.", "Summarize a book.", "Give facts about the moon.",
             "Describe your favourite food.", "What is a river?")
REGEXES = (r"[A-Z][a-z]{2,6}", r"[0-9]{3}-[0-9]{4}", r"(yes|no), because [a-z ]{3,20}\.", r"#[0-9a-f]{6}")
ADAPTERS = (None, *DEMO_ADAPTER_NAMES)


def leaf_schema(rng: random.Random, i: int) -> dict:
    kind = rng.choice(("integer", "number", "enum", "string", "boolean"))
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 100)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice((1, 10, 1000))}
    if kind == "enum":
        return {"enum": [*rng.sample(ENUM_WORDS, rng.randint(1, 3)), f"v{i}"]}
    if kind == "string":
        return {"type": "string", "minLength": 1, "maxLength": rng.randint(3, 12)}
    return {"type": "boolean"}


def object_schema(rng: random.Random, i: int, depth: int) -> dict:
    names = rng.sample(WORDS, rng.randint(1, 3 if depth == 0 else 2))
    properties = {}
    for name in names:
        shape = rng.random()
        if depth == 0 and shape < 0.2:
            properties[name] = object_schema(rng, i, depth + 1)
        elif shape < 0.4:
            properties[name] = {"type": "array", "items": leaf_schema(rng, i), "minItems": 1,
                                "maxItems": rng.randint(1, 2)}
        else:
            properties[name] = leaf_schema(rng, i)
    return {"type": "object", "properties": properties, "required": names, "additionalProperties": False}


def schemas(n: int, seed: int = 0) -> list[dict]:
    """n distinct small schemas: objects of scalars, enums, bounded numbers, arrays and nested objects."""
    rng = random.Random(seed)
    out: list[dict] = []
    while len(out) < n:
        schema = object_schema(rng, len(out), 0)
        schema["title"] = f"record{len(out)}"
        out.append(schema)
    return out


@pytest.mark.slow
def test_every_constrained_output_validates_in_mixed_batches_with_preemption():
    llm = LLM(adapters=demo_adapters(), max_batch_size=32, kv_cache_tokens=1024)
    rng = random.Random(1)
    constraints = [("json", s) for s in schemas(200)]
    constraints += [("regex", r) for r in REGEXES * 4] + [("choice", rng.sample(ENUM_WORDS, 3)) for _ in range(16)]
    constraints += [("none", None)] * 24
    rng.shuffle(constraints)
    prompts, params = [], []
    for i, (kind, value) in enumerate(constraints):
        prompts.append(llm.chat_prompt(rng.choice(QUESTIONS) + (" Answer in JSON." if kind == "json" else "")))
        spec = None if kind == "none" else StructuredOutputs(**{kind: value})
        # JSON gets room for numbers written with many digits ("10.000000")
        params.append(SamplingParams(max_tokens=128 if kind == "json" else 48, temperature=rng.choice((0, 0.7)),
                                     seed=i, structured_outputs=spec))
    outs = llm.generate(prompts, params, adapter=[ADAPTERS[i % len(ADAPTERS)] for i in range(len(prompts))])
    for (kind, value), out in zip(constraints, outs):
        if kind == "none":
            continue
        assert out.finish_reason == "stop", (kind, value, out.text)
        if kind == "json":
            jsonschema.validate(json.loads(out.text), value)
        elif kind == "regex":
            assert re.fullmatch(value, out.text), (value, out.text)
        else:
            assert out.text in value
    assert llm.engine.stats().num_preemptions > 0
    assert llm.engine.stats().num_constrained_requests == len(constraints) - 24


@pytest.mark.slow
def test_cli_generate_with_a_json_schema(tmp_path):
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}},
              "required": ["capital"], "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    (tmp_path / "bad.json").write_text('{"type": "objectx"}')
    root = Path(__file__).parents[2]
    command = [sys.executable, "-m", "punica.cli", "generate", "--prompt", "What is the capital of France?",
               "--max-tokens", "32", "--json-schema"]
    result = subprocess.run(command + [str(tmp_path / "schema.json")], capture_output=True, text=True, timeout=300,
                            cwd=root)
    assert result.returncode == 0, result.stderr
    jsonschema.validate(json.loads(result.stdout), schema)
    bad = subprocess.run(command + [str(tmp_path / "bad.json")], capture_output=True, text=True, timeout=300, cwd=root)
    assert bad.returncode != 0 and "objectx" in bad.stderr
    missing = subprocess.run(command + [str(tmp_path / "none.json")], capture_output=True, text=True, timeout=60,
                             cwd=root)
    assert missing.returncode != 0 and "cannot read" in missing.stderr
