"""LoraPool layout: per-group stacked weights, per-projection views into them, one packed copy."""

import pytest
import torch

from punica.config import preset_config
from punica.lora.adapter import AdapterWeights, LoraAdapter
from punica.lora.pool import GROUPS, LoraPool, pool_slots, slot_bytes


def random_adapter(config, rank, targets, seed):
    gen = torch.Generator().manual_seed(seed)
    shapes = config.projection_shapes()
    L = config.num_layers
    lora_a = {p: torch.randn(L, rank, shapes[p][0], generator=gen) for p in targets}
    lora_b = {p: torch.randn(L, shapes[p][1], rank, generator=gen) for p in targets}
    return LoraAdapter(name=f"a{seed}", rank=rank, scale=0.5, lora_a=lora_a, lora_b=lora_b)


def test_group_weights_stack_the_projections_of_each_group(punica_config, tiny_llama):
    config = punica_config(tiny_llama())  # GQA: q 64, k = v 32, intermediate 96
    pool = LoraPool(config, max_loras=3, max_rank=8, dtype=torch.float32, device="cpu")
    adapter = random_adapter(config, 5, ("q", "v", "o", "up", "down"), seed=1)  # no k, no gate
    pool.write(1, adapter)
    shapes, R = config.projection_shapes(), 8
    for layer in range(config.num_layers):
        for group, projections in GROUPS.items():
            weights = pool.group_weights(layer, group)
            lora_a, lora_b, bounds = weights.lora_a, weights.lora_b, weights.slice_bounds
            h_in = shapes[projections[0]][0]
            assert lora_a.shape == (3, len(projections) * R, h_in)
            assert lora_b.shape == (3, bounds[-1], R)
            assert bounds == tuple([0] + [sum(shapes[p][1] for p in projections[:i + 1])
                                          for i in range(len(projections))])
            for i, p in enumerate(projections):
                a_p = lora_a[1, i * R:(i + 1) * R]
                b_p = lora_b[1, bounds[i]:bounds[i + 1]]
                assert a_p.data_ptr() == pool.a[p][layer, 1].data_ptr()  # views, not copies
                assert b_p.data_ptr() == pool.b[p][layer, 1].data_ptr()
                if p in adapter.lora_a:
                    assert torch.equal(a_p[:5], adapter.lora_a[p][layer])
                    assert torch.equal(b_p[:, :5], adapter.lora_b[p][layer])
                assert not a_p[5 if p in adapter.lora_a else 0:].any()  # padding, untargeted
                assert not b_p[:, 5 if p in adapter.lora_b else 0:].any()
            assert not lora_a[[0, 2]].any() and not lora_b[[0, 2]].any()  # other slots untouched
    assert pool.scales.tolist() == [0.0, 0.5, 0.0]


def test_packed_slot_is_the_slot_contents(punica_config, tiny_llama):
    config = punica_config(tiny_llama())
    pool = LoraPool(config, max_loras=2, max_rank=4, dtype=torch.float32, device="cpu")
    adapter = random_adapter(config, 4, ("k", "gate", "down"), seed=2)
    packed = pool.pack(adapter)
    assert packed.shape == (pool.slot_numel,)
    pool.write_packed(0, packed, adapter.scale)
    assert torch.equal(pool.buffer[0], packed) and not pool.buffer[1].any()
    assert torch.equal(pool.b["gate"][1, 0, :, :4], adapter.lora_b["gate"][1])
    assert pool.slot_numel == sum(config.num_layers * (4 * (h_in + h_out) + h_out)  # A, B, DoRA's magnitudes
                                  for h_in, h_out in config.projection_shapes().values())


def test_pack_writes_every_element_of_the_slot(monkeypatch, punica_config, tiny_llama):
    config = punica_config(tiny_llama())
    pool = LoraPool(config, max_loras=1, max_rank=8, dtype=torch.float32, device="cpu")
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *args, **kw: empty(*args, **kw).fill_(float("nan")))
    adapter = random_adapter(config, 5, ("q", "down"), seed=3)  # rank padding, untargeted projections
    packed = pool.pack(adapter)
    assert not packed.isnan().any()
    pool.write_packed(0, packed, adapter.scale)
    assert torch.equal(pool.a["q"][:, 0, :5], adapter.lora_a["q"]) and not pool.a["q"][:, 0, 5:].any()
    assert not pool.b["k"].any() and not pool.a["gate"].any()


def test_pack_reads_the_layers_of_a_peft_adapter_straight_into_the_slot(tmp_path, monkeypatch, make_peft_adapter,
                                                                        punica_config, tiny_llama):
    """pack(read_adapter(...)) (the manager's path, no stacked copy) equals pack(load_adapter(...)),
    for an adapter of a few layers and projections below the pool's rank, every element written."""
    from punica.lora.adapter import load_adapter, read_adapter

    hf = tiny_llama(seed=5)
    config = punica_config(hf)
    path = make_peft_adapter(hf, tmp_path / "ad", r=3, alpha=6, targets=("k_proj", "up_proj", "o_proj"),
                             layers_to_transform=[1], seed=4)
    pool = LoraPool(config, max_loras=1, max_rank=8, dtype=torch.float32, device="cpu")
    weights = read_adapter(path, config)
    assert sorted(weights.pairs) == [("k", 1), ("o", 1), ("up", 1)]
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *args, **kw: empty(*args, **kw).fill_(float("nan")))
    packed = pool.pack(weights)
    assert not packed.isnan().any()
    assert torch.equal(packed, pool.pack(load_adapter(path, config)))
    pool.write_packed(0, packed, weights.scale)
    assert torch.equal(pool.a["k"][1, 0, :3], weights.pairs["k", 1][0]) and pool.a["k"][1, 0, :3].any()
    assert not pool.a["k"][0].any() and not pool.b["up"][0].any() and not pool.a["q"].any()


@pytest.mark.parametrize("moe", [False, True])
def test_slot_bytes_are_what_each_slot_allocates(punica_config, tiny_llama, tiny_moe_model, moe):
    config = punica_config(tiny_moe_model("qwen3_moe") if moe else tiny_llama())
    pools = [LoraPool(config, max_loras=n, max_rank=8, dtype=torch.bfloat16, device="cpu") for n in (1, 3)]
    allocated = [p.buffer.nbytes + p.scales.nbytes + p.dora_slots.nbytes
                 + 4 * sum(v.numel() for v in p.out_scales.values()) for p in pools]
    assert allocated[1] - allocated[0] == 2 * slot_bytes(config, 8, torch.bfloat16) and allocated[0] == slot_bytes(
        config, 8, torch.bfloat16)
    assert bool(config.moe_layers) == moe and (pools[0].expert_numel > 0) == moe


def test_pool_slots_are_the_fewer_of_max_loras_and_what_the_bytes_hold():
    config = preset_config("qwen3-30b-a3b")
    one = slot_bytes(config, 16, torch.bfloat16)
    assert 1.2e9 < one < 1.4e9  # rank 16 on 128 experts x 48 layers, as the flag's help says
    assert pool_slots(config, 96, 16, torch.bfloat16, None) == 96
    assert pool_slots(config, 96, 16, torch.bfloat16, 48 << 30) == (48 << 30) // one == 38
    assert pool_slots(config, 8, 16, torch.bfloat16, 48 << 30) == 8
    assert pool_slots(config, 8, 16, torch.bfloat16, one) == 1
    with pytest.raises(ValueError, match=f"does not hold one adapter slot: a slot of rank 16 takes {one} bytes"):
        pool_slots(config, 8, 16, torch.bfloat16, one - 1)


def test_pack_writes_every_expert_element_the_adapters_or_zero():
    """Into a row of garbage: the adapter's experts where it has them (rank 4 of the pool's 8; B as a
    strided view, as read_adapter hands it on), zero in the ranks above and for the (projection,
    layer)s it lacks."""
    config = preset_config("tiny-moe")
    pool = LoraPool(config, max_loras=1, max_rank=8, dtype=torch.float32, device="cpu")
    gen = torch.Generator().manual_seed(0)
    first, last = config.moe_layers[0], config.moe_layers[-1]
    experts = {}
    for param, layer in (("gate_up", first), ("down", first), ("down", last)):
        h_in, h_out = pool.expert_shapes[param]
        b = torch.randn(h_out, config.num_experts, 4, generator=gen)
        experts[param, layer] = (torch.randn(config.num_experts, 4, h_in, generator=gen), b.transpose(0, 1))
    weights = AdapterWeights(name="x", rank=4, scale=1.0, pairs={}, experts=experts)
    out = torch.full(pool.packed_shape, float("nan"))
    pool.pack(weights, out=out)
    a_views, b_views = pool._expert_views(out.view(1, -1))
    for param in a_views:
        for i, layer in enumerate(config.moe_layers):
            a, b = a_views[param][i, 0], b_views[param][i, 0]
            if (param, layer) in experts:
                lora_a, lora_b = experts[param, layer]
                assert torch.equal(a[:, :4], lora_a) and torch.equal(b[:, :, :4], lora_b)
                assert not a[:, 4:].any() and not b[:, :, 4:].any()
            else:
                assert not a.any() and not b.any()
    assert not out.isnan().any()
