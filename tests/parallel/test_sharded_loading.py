"""Each rank builds only its shard: random weights and checkpoint slices equal the full model's slices."""

import pytest
import torch

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
    qkv = weights["layers.0.qkv_proj.weight"]
    assert abs(qkv.std().item() - 0.02) < 0.002 and abs(qkv.mean().item()) < 0.002
    assert not torch.equal(qkv[:64], weights["layers.1.qkv_proj.weight"][:64])  # each matrix its own values
    assert torch.equal(weights["layers.0.input_norm.weight"], torch.ones(64))
    other = dict(dummy_model(config, torch.float32, seed=4).named_parameters())
    assert not torch.equal(other["layers.0.qkv_proj.weight"], dict(full.named_parameters())["layers.0.qkv_proj.weight"])


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
def test_dummy_shard_splits_the_qkv_bias(rank, punica_config, tiny_family_model):
    config = punica_config(tiny_family_model("qwen2"))
    weights = assert_shard_of(dummy_model(config, torch.float32, seed=3, shard=split_on_meta(rank)),
                              dummy_model(config, torch.float32, seed=3), rank)
    bias = weights["layers.0.qkv_proj.bias"]
    assert bias.shape == (config.q_size + 2 * config.kv_size,) and abs(bias.std().item() - 0.02) < 0.01


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
@pytest.mark.parametrize("shard_family", ["llama", "qwen2", "qwen3", "phi3"])  # biases split, q/k norms replicated
def test_checkpoint_shard_reads_the_slice_of_the_full_model(tmp_path, rank, tiny_family_model, shard_family):
    tiny_family_model(shard_family, seed=5).save_pretrained(tmp_path)
    assert_shard_of(load_hf_dir(tmp_path, torch.float32, shard=split_on_meta(rank)),
                    load_hf_dir(tmp_path, torch.float32), rank)


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
