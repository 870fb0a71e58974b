"""The offline API and `punica generate` on the embedded default model."""

import subprocess
import sys

import pytest

from punica import LLM, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm():
    return LLM(max_batch_size=8)


def test_generate_strings_token_ids_and_per_prompt_params(llm):
    prompts = [llm.chat_prompt("What is the capital of France?"), llm.tokenizer.encode("1, 2, 3, 4,")]
    params = [SamplingParams(max_tokens=12, temperature=0),
              SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)]
    outs = llm.generate(prompts, params)
    assert "Paris" in outs[0].text
    assert len(outs[1].token_ids) == 5 and outs[1].finish_reason == "length"
    for out in outs:
        assert out.time_to_first_token > 0 and out.finished
    assert outs[1].time_per_output_token > 0
    assert llm.generate(prompts[0], params[0])[0].token_ids == outs[0].token_ids  # batch-independent


def test_generate_rejects_bad_prompt_and_keeps_working(llm):
    with pytest.raises(ValueError, match="prompt 1: the prompt is empty"):
        llm.generate(["fine", []], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished()
    assert llm.generate("fine", SamplingParams(max_tokens=2, temperature=0))[0].token_ids


def test_generate_with_adapters(tmp_path, make_peft_adapter):
    from transformers import LlamaForCausalLM

    from punica.models.sources import resolve_model_dir

    hf = LlamaForCausalLM.from_pretrained(resolve_model_dir(None))
    path = make_peft_adapter(hf, tmp_path / "ad", r=8, alpha=64, targets=("q_proj", "v_proj", "down_proj"), seed=3)
    llm = LLM(adapters={"ad": str(path)}, max_batch_size=4)
    prompt = llm.chat_prompt("Name a color.")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    base, adapted, base_again = llm.generate([prompt] * 3, params, adapter=[None, "ad", None])
    assert base.token_ids == base_again.token_ids and base.token_ids != adapted.token_ids
    assert adapted.adapter == "ad"


def test_cli_generate_prints_sensible_text():
    result = subprocess.run([sys.executable, "-m", "punica.cli", "generate", "--prompt",
                             "What is the capital of France?", "--max-tokens", "16"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_cli_reports_bad_arguments():
    result = subprocess.run([sys.executable, "-m", "punica.cli", "generate", "--prompt", "x", "--adapter", "oops"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "NAME=PATH" in result.stderr
