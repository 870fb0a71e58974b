"""LLM(tensor_parallel_size=2) works whatever the parent's __main__ is: a script read from stdin, a
`python -c` program, a notebook's interactive namespace, and a script without a main guard. The
ranks (multiprocessing spawn) do not run the parent's main again."""

import subprocess
import sys

import pytest

from punica import LLM, SamplingParams

pytestmark = pytest.mark.slow

SCRIPT = """
from punica import LLM, SamplingParams
llm = LLM({model!r}, tensor_parallel_size=2, device="cpu", dtype="float32")
print(llm.generate([3, 4, 5], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].token_ids)
llm.close()
"""
# a notebook's kernel (IPython) runs each cell in its user module, installed as __main__: a module
# with no file and no spec
NOTEBOOK = """
import sys, types
main = types.ModuleType("__main__")
sys.modules["__main__"] = main
exec({cell!r}, main.__dict__)
"""


@pytest.fixture(scope="module")
def model_and_tokens(tmp_path_factory, tiny_llama):
    """A tiny checkpoint directory and the token ids one process generates on it."""
    path = tmp_path_factory.mktemp("parent_main") / "base"
    tiny_llama(seed=5).save_pretrained(path)
    llm = LLM(str(path), device="cpu", dtype="float32")
    tokens = llm.generate([3, 4, 5], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].token_ids
    return path, tokens


@pytest.mark.parametrize("way", ["stdin", "python -c", "notebook", "script without a main guard"])
def test_tensor_parallel_from_any_main(model_and_tokens, tmp_path, way):
    model, tokens = model_and_tokens
    script = SCRIPT.format(model=str(model))
    command, stdin = [sys.executable, "-c", script], None
    if way == "stdin":
        command, stdin = [sys.executable, "-"], script
    elif way == "notebook":
        command = [sys.executable, "-c", NOTEBOOK.format(cell=script)]
    elif way == "script without a main guard":
        (tmp_path / "script.py").write_text(script)
        command = [sys.executable, str(tmp_path / "script.py")]
    result = subprocess.run(command, input=stdin, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(tokens)
