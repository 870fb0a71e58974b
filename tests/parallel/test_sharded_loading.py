"""Each rank builds only its shard: random weights and checkpoint slices equal the full model's slices."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from punica.lora.adapter import read_adapter
from punica.lora.dummy import save_random_adapter
from punica.lora.pool import LoraPool
from punica.models import loader
from punica.models.loader import dummy_model, load_hf_dir
from punica.parallel.executor import ShardingPool
from punica.parallel.tensor_parallel import split_model_

WORLD_SIZE = 2


def split_on_meta(rank):
    """split_model_ as a loader ShardFn, checking that the model it gets is not allocated yet."""
    def shard(model):
        assert {p.device.type for p in model.parameters()} == {"meta"}
        return split_model_(model, rank, WORLD_SIZE)
    return shard


def assert_shard_of(shard, full, rank):
    """Every parameter of `shard` is rank r's slice of `full`'s (split like tensor_parallel_)."""
    expect = {name: p.detach().clone() for name, p in full.named_parameters()}
    split_model_(full, rank, WORLD_SIZE)  # slices real tensors
    got = dict(shard.named_parameters())
    assert got.keys() == dict(full.named_parameters()).keys()
    for name, param in full.named_parameters():
        assert got[name].device.type == "cpu"
        assert torch.equal(got[name], param), name
    assert shard.config == full.config
    for layer, full_layer in zip(shard.layers, full.layers):
        assert (layer.num_heads, layer.num_kv_heads, layer.qkv_slices, layer.gate_up_slices) == (
            full_layer.num_heads, full_layer.num_kv_heads, full_layer.qkv_slices, full_layer.gate_up_slices)
    return expect


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
@pytest.mark.parametrize("chunk_numel", [1 << 24, 200])  # one chunk per matrix; chunks across shard bounds
def test_dummy_shard_is_the_slice_of_the_full_random_model(monkeypatch, rank, chunk_numel, punica_config, tiny_llama):
    monkeypatch.setattr(loader, "DUMMY_CHUNK_NUMEL", chunk_numel)
    config = punica_config(tiny_llama())  # 4 heads, 2 kv heads, intermediate 96
    full = dummy_model(config, torch.float32, seed=3)
    weights = assert_shard_of(dummy_model(config, torch.float32, seed=3, shard=split_on_meta(rank)),
                              dummy_model(config, torch.float32, seed=3), rank)
    qkv = weights["layers.0.qkv_proj.base.weight"]
    assert abs(qkv.std().item() - 0.02) < 0.002 and abs(qkv.mean().item()) < 0.002
    assert not torch.equal(qkv[:64], weights["layers.1.qkv_proj.base.weight"][:64])  # each matrix its own values
    assert torch.equal(weights["layers.0.input_norm.weight"], torch.ones(64))
    other = dict(dummy_model(config, torch.float32, seed=4).named_parameters())
    qkv_name = "layers.0.qkv_proj.base.weight"
    assert not torch.equal(other[qkv_name], dict(full.named_parameters())[qkv_name])


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
def test_dummy_shard_splits_the_qkv_bias(rank, punica_config, tiny_family_model):
    config = punica_config(tiny_family_model("qwen2"))
    weights = assert_shard_of(dummy_model(config, torch.float32, seed=3, shard=split_on_meta(rank)),
                              dummy_model(config, torch.float32, seed=3), rank)
    bias = weights["layers.0.qkv_proj.base.bias"]
    assert bias.shape == (config.q_size + 2 * config.kv_size,) and abs(bias.std().item() - 0.02) < 0.01


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
@pytest.mark.parametrize("shard_family", ["llama", "qwen2", "qwen3", "phi3"])  # biases split, q/k norms replicated
def test_checkpoint_shard_reads_the_slice_of_the_full_model(tmp_path, rank, tiny_family_model, shard_family):
    tiny_family_model(shard_family, seed=5).save_pretrained(tmp_path)
    assert_shard_of(load_hf_dir(tmp_path, torch.float32, shard=split_on_meta(rank)),
                    load_hf_dir(tmp_path, torch.float32), rank)


def same(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == torch.float8_e4m3fn else \
        torch.equal(a, b)


def assert_fp8_shard_of(shard, full, rank):
    """As assert_shard_of, for models with fp8 weights (compared bit for bit) and their scales."""
    split_model_(full, rank, WORLD_SIZE)
    got, expect = dict(shard.named_parameters()), dict(full.named_parameters())
    assert got.keys() == expect.keys() and "layers.0.qkv_proj.base.weight_scale" in got
    for name, param in expect.items():
        assert got[name].shape == param.shape and same(got[name], param), name
    return got


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
def test_fp8_dummy_shard_is_the_slice_of_the_full_fp8_model(rank, punica_config, tiny_llama):
    """Column-parallel shards split the per-channel scales with the rows; row-parallel ones keep them all."""
    config = punica_config(tiny_llama())
    got = assert_fp8_shard_of(dummy_model(config, torch.float32, seed=3, shard=split_on_meta(rank), quantization="fp8"),
                              dummy_model(config, torch.float32, seed=3, quantization="fp8"), rank)
    assert got["layers.0.qkv_proj.base.weight_scale"].shape == ((config.q_size + 2 * config.kv_size) // 2,)
    assert got["layers.0.o_proj.base.weight_scale"].shape == (config.hidden_size,)


def write_block_fp8(path, tiny_llama, block):
    """A tiny Llama with random e4m3 weights and random block scales (HF's fine-grained fp8 layout)."""
    tiny_llama(seed=5).save_pretrained(path)
    state = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for name in [n for n in state if n.endswith("_proj.weight")]:
        n, k = state[name].shape
        state[name] = (state[name] * 3e4).clamp(-448, 448).to(torch.float8_e4m3fn)
        state[name[:-len("weight")] + "weight_scale_inv"] = torch.rand(-(-n // block), -(-k // block), generator=gen)
    save_file(state, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [block, block]}
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
def test_fp8_block_checkpoint_shard_reads_whole_blocks(tmp_path, rank, tiny_llama):
    write_block_fp8(tmp_path, tiny_llama, 16)
    got = assert_fp8_shard_of(load_hf_dir(tmp_path, torch.float32, shard=split_on_meta(rank)),
                              load_hf_dir(tmp_path, torch.float32), rank)
    assert got["layers.0.qkv_proj.base.weight_scale"].shape == (4, 4)  # 32 q + 16 k + 16 v rows of 64 columns
    assert got["layers.0.down_proj.base.weight_scale"].shape == (4, 3)  # 48 of the 96 columns


def test_fp8_blocks_across_shard_bounds_are_refused(tmp_path, tiny_llama):
    write_block_fp8(tmp_path, tiny_llama, 32)  # a rank holds one kv head of 16 rows
    with pytest.raises(ValueError, match=r"the 32 x 32 fp8 weight blocks of layers.0.qkv_proj.base.weight do not "
                                         r"split at this rank's shard bounds"):
        load_hf_dir(tmp_path, torch.float32, shard=split_on_meta(0))


def test_checkpoint_of_another_shape_is_refused(tmp_path, tiny_llama):
    tiny_llama(seed=5).save_pretrained(tmp_path)
    config = (tmp_path / "config.json").read_text().replace('"intermediate_size": 96', '"intermediate_size": 128')
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(ValueError, match=r"tensor model\.layers\.0\.mlp\.\w+_proj\.weight has shape "
                       r"\((96, 64|64, 96)\), the config implies \((128, 64|64, 128)\)"):
        load_hf_dir(tmp_path, torch.float32, shard=split_on_meta(0))


def test_a_dora_adapter_is_refused_by_name_under_tensor_parallelism(tmp_path, punica_config, tiny_llama):
    config = punica_config(tiny_llama())
    path = save_random_adapter(tmp_path / "dora", config, rank=4, seed=0, dora=True, dtype=torch.float32)
    sharding = ShardingPool(LoraPool(config, 2, 4, torch.float32, "cpu"), workers=None, full_config=config)
    with pytest.raises(ValueError, match="'dora' is a DoRA adapter, which punica does not serve under tensor "
                                         "parallelism"):
        sharding.pack(read_adapter(path, config))
