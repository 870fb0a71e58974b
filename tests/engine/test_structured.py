"""Structured outputs, logit bias and top logprobs in the engine: constraints are checked before
anything is queued, grammar masks touch only their rows, and top logprobs are the model's."""

import pytest
import torch

from punica.engine.constraint import GrammarError
from punica.engine.request import Request
from punica.engine.sampler import apply_logit_bias, sample
from punica.engine.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputs
from punica.engine.structured import apply_bitmasks, check_grammar

# bf16 logits of the tiny model (|logit| < 1) against fp32 ones: a few bf16 ulps at most
BF16_LOGPROB_TOL = 0.02


@pytest.mark.parametrize("kwargs", [{}, {"json": {}, "regex": "a"}, {"json_object": False}, {"json": "{"},
                                    {"json": "[1]"}, {"choice": []}, {"choice": ["a", 3]}, {"regex": ""},
                                    {"grammar": 5}, {"json_object": 1}])
def test_malformed_constraints_name_structured_outputs(kwargs):
    with pytest.raises(SamplingParamsError) as e:
        StructuredOutputs(**kwargs)
    assert e.value.field == "structured_outputs"


@pytest.mark.parametrize("kwargs, field", [({"top_logprobs": 21}, "top_logprobs"),
                                           ({"top_logprobs": -1}, "top_logprobs"),
                                           ({"logit_bias": {3: 101}}, "logit_bias"),
                                           ({"logit_bias": {-1: 1}}, "logit_bias"),
                                           ({"logit_bias": {"3": 1}}, "logit_bias"),
                                           ({"structured_outputs": {"json": {}}}, "structured_outputs")])
def test_out_of_range_params_name_their_field(kwargs, field):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field


@pytest.mark.parametrize("spec, fragment", [(StructuredOutputs(json={"type": "objectx"}), 'Unsupported type "objectx"'),
                                            (StructuredOutputs(regex="(a"), "parenthesis"),
                                            (StructuredOutputs(grammar="root ::= missing"), "missing")])
def test_check_grammar_rejects_without_a_tokenizer_what_compiling_rejects(spec, fragment):
    with pytest.raises(GrammarError, match=fragment) as e:
        check_grammar(spec)
    assert e.value.kind == spec.kind and str(e.value).startswith(f"structured_outputs.{spec.kind} is not accepted")


def test_check_grammar_accepts_every_kind_of_valid_constraint():
    for spec in (StructuredOutputs(json={"type": "object"}), StructuredOutputs(json_object=True),
                 StructuredOutputs(regex="[a-f]+"), StructuredOutputs(choice=["yes", "no"]),
                 StructuredOutputs(grammar='root ::= "a" | "b"')):
        assert check_grammar(spec) is None


def test_schema_text_keeps_property_order():
    spec = StructuredOutputs(json={"properties": {"b": {}, "a": {}}})
    assert spec.json == '{"properties": {"b": {}, "a": {}}}' and spec.kind == "json"
    assert SamplingParams(logit_bias={5: 1.5, 2: -3}).logit_bias == ((2, -3), (5, 1.5))


def test_bitmasks_mask_only_their_rows():
    torch.manual_seed(0)
    logits = torch.randn(4, 70)
    bitmask = torch.randint(-(1 << 31), 1 << 31, (2, 3), dtype=torch.int32)
    out = apply_bitmasks(logits, torch.tensor([2, 0]), bitmask)
    for row, bits in ((2, bitmask[0]), (0, bitmask[1])):
        allowed = torch.tensor([bool((int(bits[t // 32]) >> (t % 32)) & 1) for t in range(70)])
        assert torch.equal(out[row][allowed], logits[row][allowed])
        assert (out[row][~allowed] == float("-inf")).all()
    assert torch.equal(out[[1, 3]], logits[[1, 3]])


def test_logit_bias_is_read_into_tensors_once_per_request():
    """Each row gets its request's biases; a request's are made into tensors at its first step and
    reused at the next (not read from its Python tuples at every step)."""
    logits = torch.randn(3, 50)
    requests = [Request("a", [1], SamplingParams(logit_bias={3: 2.0, 7: -1.5})), Request("b", [1], SamplingParams()),
                Request("c", [1], SamplingParams(logit_bias={3: 1.0}))]
    expected = logits.clone()
    expected[0, 3] += 2.0
    expected[0, 7] -= 1.5
    expected[2, 3] += 1.0
    assert torch.equal(apply_logit_bias(logits, requests), expected)
    made = requests[0].logit_bias_tensors
    assert made is not None and requests[1].logit_bias_tensors is None
    assert torch.equal(apply_logit_bias(logits, requests), expected) and requests[0].logit_bias_tensors is made


def test_top_logprobs_are_a_reference_softmax_of_the_logits():
    torch.manual_seed(1)
    logits = torch.randn(3, 50) * 5
    requests = [Request("a", [1], SamplingParams(temperature=0, top_logprobs=5)),
                Request("b", [1], SamplingParams(temperature=0.7, seed=3, logprobs=True, logit_bias={7: 50})),
                Request("c", [1], SamplingParams(temperature=0))]
    s = sample(logits, requests)
    reference = torch.log_softmax(logits, -1)
    assert s.tokens[1] == 7  # the bias decides the token, not the logprobs
    assert torch.equal(s.logprobs[:, 0], reference.gather(1, s.tokens[:, None])[:, 0])
    top = reference.topk(5)
    assert torch.equal(s.top_ids, top.indices) and torch.equal(s.logprobs[:, 1:], top.values)


def test_engine_rejects_bad_constraints_before_queueing(setup, make_engine):
    engine = make_engine(setup)  # a tiny model without a tokenizer
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add_request([1, 2], SamplingParams(structured_outputs=StructuredOutputs(json_object=True)))
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request([1, 2], SamplingParams(logit_bias={engine.vocab_size: 1}))
    assert not engine.has_unfinished() and not engine.requests


def test_logit_bias_and_top_logprobs_in_a_mixed_batch(setup, make_engine, workload, hf_greedy):
    """Greedy top-5 logprobs of each adapter's rows match transformers + PEFT's logits; a +100 bias
    picks its token in every row that has it, whatever the adapter."""
    engine = make_engine(setup, max_batch_size=8)
    _, _, peft_model = setup
    requests = workload(8, seed=3)
    ids = []
    for i, (prompt, adapter, _) in enumerate(requests):
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, top_logprobs=5,
                                logit_bias={9: 100.0} if i % 2 else {})
        ids.append(engine.add_request(prompt, params, adapter))
    outs = {o.request_id: o for step in engine.steps() for o in step if o.finished}
    for i, ((prompt, adapter, _), rid) in enumerate(zip(requests, ids)):
        out = outs[rid]
        if i % 2:
            assert out.token_ids == [9] * 4
        tokens = list(prompt)
        for token, top in zip(out.token_ids, out.top_logprobs):
            with torch.no_grad():
                logits = peft_model(torch.tensor([tokens]), adapter_names=[adapter or "__base__"]).logits[0, -1]
            reference = torch.log_softmax(logits.float(), -1).topk(5)
            assert [t for t, _ in top] == reference.indices.tolist()
            assert [lp for _, lp in top] == pytest.approx(reference.values.tolist(), abs=1e-4)
            tokens.append(token)



@pytest.mark.cuda
def test_top_logprobs_in_bf16_through_cuda_graphs_are_a_reference_softmax(setup, make_engine, workload):
    """On the GPU in bf16, replaying CUDA graphs: each row's top-5 logprobs are transformers + PEFT's fp32
    log-softmax at the same ids, within bf16's error, and they are the reference's top 5 up to ties
    within that error; the greedy token is the first of them."""
    engine = make_engine(setup, device="cuda", dtype=torch.bfloat16, max_batch_size=8)
    assert engine.executor.worker.uses_cuda_graphs
    _, _, peft_model = setup
    requests = workload(8, seed=4)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, top_logprobs=5)
    ids = [engine.add_request(prompt, params, adapter) for prompt, adapter, _ in requests]
    outs = {o.request_id: o for step in engine.steps() for o in step if o.finished}
    for (prompt, adapter, _), rid in zip(requests, ids):
        tokens = list(prompt)
        for token, top in zip(outs[rid].token_ids, outs[rid].top_logprobs):
            with torch.no_grad():
                logits = peft_model(torch.tensor([tokens]), adapter_names=[adapter or "__base__"]).logits[0, -1]
            reference = torch.log_softmax(logits.float(), -1)
            top_ids = [t for t, _ in top]
            assert [lp for _, lp in top] == pytest.approx(reference[top_ids].tolist(), abs=BF16_LOGPROB_TOL)
            assert reference[top_ids].sort(descending=True).values.tolist() == pytest.approx(
                reference.topk(5).values.tolist(), abs=2 * BF16_LOGPROB_TOL)
            assert token == top_ids[0]
            tokens.append(token)

@pytest.fixture(scope="module")
def grammar_setup(tmp_path_factory, tiny_llama, make_peft_adapter):
    """A tiny Llama whose 300 tokens are the first 300 of SmolLM2's vocabulary (single bytes and
    some merges: enough to write any JSON), two adapters, and SmolLM2's tokenizer."""
    from transformers import AutoTokenizer

    from punica.models.sources import resolve_model_dir

    tmp = tmp_path_factory.mktemp("grammar")
    hf = tiny_llama(seed=7, vocab_size=300)
    hf.save_pretrained(tmp / "base")
    paths = {n: str(make_peft_adapter(hf, tmp / n, r=8, alpha=16, seed=i)) for i, n in enumerate(("a", "b"))}
    return tmp / "base", paths, AutoTokenizer.from_pretrained(str(resolve_model_dir(None)))


def grammar_engine(grammar_setup, **config):
    from punica.config import EngineConfig
    from punica.factory import engine_on_model
    from punica.models.loader import load_hf_dir

    base, paths, tokenizer = grammar_setup
    return engine_on_model(load_hf_dir(base, dtype=torch.float32), EngineConfig(**config), paths, tokenizer,
                           eos_token_ids=(tokenizer.eos_token_id,))


GRAMMAR_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                                   "tag": {"enum": ["x", "yz"]},
                                                   "list": {"type": "array", "items": {"type": "boolean"},
                                                            "maxItems": 2}},
                  "required": ["n", "tag", "list"], "additionalProperties": False}
CONSTRAINTS = [StructuredOutputs(json=GRAMMAR_SCHEMA), StructuredOutputs(regex=r"[a-f]{2,5}-[0-9]+"),
               StructuredOutputs(choice=["left", "right", "up"]), None,
               StructuredOutputs(grammar='root ::= "(" [a-c]* ")"'), StructuredOutputs(json_object=True)]


def run_constrained(engine, n: int):
    """n requests cycling through CONSTRAINTS, the base model and the two adapters, greedy and seeded."""
    ids = []
    for i in range(n):
        params = SamplingParams(max_tokens=48, temperature=0 if i % 2 else 0.9, seed=i,
                                structured_outputs=CONSTRAINTS[i % len(CONSTRAINTS)])
        ids.append(engine.add_request(list(range(17, 17 + 5 + i % 7)), params, (None, "a", "b")[i % 3]))
    outs = {o.request_id: o for step in engine.steps() for o in step if o.finished}
    return [outs[i] for i in ids]


@pytest.mark.slow
def test_constrained_outputs_match_and_are_the_same_with_overlap_and_preemption(grammar_setup):
    """Every constrained output that finished matches its constraint; overlapped steps, and a KV
    cache small enough to preempt, give the same tokens as plain steps with room for all."""
    import json
    import re

    import jsonschema

    plain = run_constrained(grammar_engine(grammar_setup, overlap_steps=False), 24)
    tight = grammar_engine(grammar_setup, kv_cache_tokens=256, page_size=16, overlap_steps=True)
    overlapped = run_constrained(tight, 24)
    assert tight.overlaps_steps and tight.stats().num_preemptions > 0
    assert [o.token_ids for o in overlapped] == [o.token_ids for o in plain]
    finished = 0
    for i, out in enumerate(plain):
        spec = CONSTRAINTS[i % len(CONSTRAINTS)]
        if spec is None or out.finish_reason != "stop":
            continue
        finished += 1
        if spec.kind == "json":
            jsonschema.validate(json.loads(out.text), GRAMMAR_SCHEMA)
        elif spec.kind == "json_object":
            assert isinstance(json.loads(out.text), dict)
        elif spec.kind == "regex":
            assert re.fullmatch(spec.regex, out.text), out.text
        elif spec.kind == "choice":
            assert out.text in spec.choice
        else:
            assert re.fullmatch(r"\([a-c]*\)", out.text), out.text
    assert finished >= 12


def test_invalid_grammar_is_rejected_before_queueing(grammar_setup):
    engine = grammar_engine(grammar_setup)
    for spec, fragment in ((StructuredOutputs(json={"type": "objectx"}), "objectx"),
                           (StructuredOutputs(regex="(a"), "parenthesis"),
                           (StructuredOutputs(grammar="root ::= missing"), "missing")):
        with pytest.raises(ValueError, match=fragment):
            engine.add_request([17, 18], SamplingParams(structured_outputs=spec))
    assert not engine.requests and not engine.has_unfinished()
    assert engine.stats().num_constrained_requests == 0 and engine.stats().grammar_compile_seconds > 0


@pytest.mark.slow
def test_migrated_request_resumes_its_grammar(grammar_setup):
    """A request added with output tokens it generated elsewhere continues the same constrained
    output; tokens that do not match its constraint are refused."""
    spec = StructuredOutputs(regex=r"[a-f]{8}")
    params = SamplingParams(max_tokens=20, temperature=0, structured_outputs=spec)
    whole = run_one(grammar_engine(grammar_setup), params)
    resumed_engine = grammar_engine(grammar_setup)
    resumed_engine.add_request([17, 18, 19], params, output_token_ids=whole.token_ids[:3])
    resumed = [o for step in resumed_engine.steps() for o in step if o.finished][0]
    assert whole.token_ids[:3] + resumed.token_ids[3:] == whole.token_ids and len(whole.text) == 8
    with pytest.raises(ValueError, match="do not match"):
        grammar_engine(grammar_setup).add_request([17], params, output_token_ids=[42])  # "9"


def run_one(engine, params):
    engine.add_request([17, 18, 19], params)
    return [o for step in engine.steps() for o in step if o.finished][0]
