"""LoraLinear: its base linear's output plus each token's delta from its group's part of the pool,
whichever base it wraps; and the model runs its LoRA only through it, once per projection group."""

import pytest
import torch

import punica.lora.layers as layers
from punica.lora.adapter import LoraAdapter
from punica.lora.batch import LoraBatch
from punica.lora.layers import LoraLinear, attach_pool
from punica.lora.pool import GROUPS, LoraPool
from punica.models.decoder import DecoderForCausalLM
from punica.models.forward_batch import ForwardBatch
from punica.models.quantized import Fp8Format, Fp8Linear, Linear
from punica.ops import fp8
from punica.ops.attention import AttnBatch
from punica.ops.fp8 import quantize_per_channel

PROJECTIONS = tuple(p for projections in GROUPS.values() for p in projections)
LAYER = 1
# requests' slots, token counts and lora_scales: two prefills, then decodes; slot -1 among them
SLOTS, LENS, SCALES = [0, 2, -1, 1, 2], [3, 2, 1, 1, 1], [1.0, 0.5, 1.0, 0.25, 1.0]


def random_adapter(config, rank, seed, scale):
    gen = torch.Generator().manual_seed(seed)
    shapes, num_layers = config.projection_shapes(), config.num_layers
    return LoraAdapter(name=f"a{seed}", rank=rank, scale=scale,
                       lora_a={p: torch.randn(num_layers, rank, shapes[p][0], generator=gen) for p in PROJECTIONS},
                       lora_b={p: torch.randn(num_layers, shapes[p][1], rank, generator=gen) for p in PROJECTIONS})


def filled_pool(config, num_slots=3):
    """A pool with an adapter of its own rank and scale in every slot; slot 2 DoRA (random out_scales)."""
    pool = LoraPool(config, max_loras=num_slots, max_rank=8, dtype=torch.float32, device="cpu")
    for slot in range(num_slots):
        pool.write(slot, random_adapter(config, rank=4 + 2 * slot, seed=slot, scale=0.5 + slot))
    pool.dora_slots[2] = 1
    for out_scales in pool.out_scales.values():
        out_scales[:, 2].uniform_(0.5, 1.5)
    return pool


def expected(base_out, x, weights, batch):
    """base_out plus each token's delta, slice by slice, then DoRA's out_scales, in float64."""
    out, bounds = base_out.double(), weights.slice_bounds
    rank = weights.lora_a.shape[1] // (len(bounds) - 1)
    for t, slot in enumerate(batch.token_slots.tolist()):
        if slot < 0:
            continue
        for j, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            v = x[t].double() @ weights.lora_a[slot, j * rank:(j + 1) * rank].double().T
            scale = float(weights.scales[slot]) * float(batch.token_scales[t])
            out[t, lo:hi] += scale * (v @ weights.lora_b[slot, lo:hi].double().T)
        if weights.dora_slots[slot]:
            out[t] *= weights.out_scales[slot].double()
    return out


def base_linear(config, group, fp8=False):
    h_in, _ = config.projection_shapes()[GROUPS[group][0]]
    h_out = sum(config.projection_shapes()[p][1] for p in GROUPS[group])
    gen = torch.Generator().manual_seed(7)
    weight, bias = torch.randn(h_out, h_in, generator=gen) * 0.1, torch.randn(h_out, generator=gen)
    if not fp8:
        linear = Linear(h_in, h_out, bias=True)
        linear.weight.data.copy_(weight)
    else:
        linear = Fp8Linear(h_in, h_out, True, Fp8Format(), torch.float32, "cpu")
        linear.weight.data, linear.weight_scale.data = quantize_per_channel(weight)
    linear.bias.data.copy_(bias)
    return linear


@pytest.mark.parametrize("kernel,num_prefills", [("auto", None), ("sgmv", 2), ("bgmv", None)],
                         ids=["sgmv", "sgmv-prefills-bgmv-decodes", "bgmv"])
@pytest.mark.parametrize("group", list(GROUPS))
@pytest.mark.parametrize("fp8", [False, True], ids=["linear", "fp8-linear"])
def test_lora_linear_adds_each_tokens_delta_to_its_base(punica_config, tiny_llama, kernel, num_prefills, group, fp8):
    config = punica_config(tiny_llama())
    pool = filled_pool(config)
    base = base_linear(config, group, fp8)
    layer = LoraLinear(base, LAYER, group)
    attach_pool(layer, pool)
    batch = LoraBatch.build(SLOTS, LENS, kernel=kernel, num_prefills=num_prefills, request_scales=SCALES)
    x = torch.randn(sum(LENS), base.in_features, generator=torch.Generator().manual_seed(8))
    got = layer(x, batch)
    torch.testing.assert_close(got.double(), expected(base(x), x, pool.group_weights(LAYER, group), batch),
                               rtol=1e-4, atol=1e-4)
    assert not torch.allclose(got, base(x), atol=1e-3)


def test_lora_linear_is_its_base_without_a_pool_or_an_adapter_in_the_batch(punica_config, tiny_llama):
    config = punica_config(tiny_llama())
    base = base_linear(config, "gate_up")
    layer = LoraLinear(base, LAYER, "gate_up")
    x = torch.randn(sum(LENS), base.in_features)
    assert torch.equal(layer(x, LoraBatch.build(SLOTS, LENS)), base(x))  # no pool attached
    attach_pool(layer, filled_pool(config))
    assert torch.equal(layer(x, LoraBatch.build([-1] * len(LENS), LENS)), base(x))


def test_adapters_written_after_attaching_the_pool_are_served(punica_config, tiny_llama):
    """The LoraLinear holds views of the pool: loading an adapter later needs no re-attaching."""
    config = punica_config(tiny_llama())
    pool = LoraPool(config, max_loras=2, max_rank=8, dtype=torch.float32, device="cpu")
    base = base_linear(config, "qkv")
    layer = LoraLinear(base, LAYER, "qkv")
    attach_pool(layer, pool)
    batch, x = LoraBatch.build([1], [4]), torch.randn(4, base.in_features)
    assert torch.equal(layer(x, batch), base(x))  # an empty slot adds nothing
    pool.write(1, random_adapter(config, rank=8, seed=3, scale=2.0))
    torch.testing.assert_close(layer(x, batch).double(), expected(base(x), x, pool.group_weights(LAYER, "qkv"), batch),
                               rtol=1e-4, atol=1e-4)


def test_model_adds_lora_once_per_group(monkeypatch, punica_config, tiny_llama):
    """q/k/v, o, gate/up and down: four shrink + expand pairs (8 kernels) per layer, each expand
    on the whole fused output with the pool's slice bounds; none when no token has an adapter."""
    hf = tiny_llama(seed=4)
    model = DecoderForCausalLM(punica_config(hf))
    pool = LoraPool(model.config, max_loras=1, max_rank=4, dtype=torch.float32, device="cpu")
    pool.write(0, random_adapter(model.config, 4, seed=3, scale=0.5))
    attach_pool(model, pool)
    calls = []
    shrinks = []
    # the references' pair, or on the CPU the grouped one (punica.ops.lora_cpu), whose expand takes
    # the slice bounds one argument later, or segment_lora, both in one call
    for shrink, expand, bounds_at in (("lora_shrink", "lora_expand", 4), ("grouped_shrink", "grouped_expand", 5)):
        real_shrink, real_expand = getattr(layers, shrink), getattr(layers, expand)
        monkeypatch.setattr(layers, shrink, lambda x, *args, real=real_shrink: shrinks.append(x.shape[1])
                            or real(x, *args))
        monkeypatch.setattr(layers, expand, lambda y, *args, real=real_expand, at=bounds_at:
                            calls.append((y.shape[1], args[at])) or real(y, *args))
    real_segments = layers.segment_lora
    monkeypatch.setattr(layers, "segment_lora", lambda y, x, *args: shrinks.append(x.shape[1])
                        or calls.append((y.shape[1], args[6])) or real_segments(y, x, *args))
    attn = AttnBatch.build([3], [3], [[0]], 4, 1)
    model(torch.tensor([5, 6, 7]), ForwardBatch(attn, LoraBatch.build([0], [3]), model.new_kv_cache(2, 4)))
    c = model.config
    per_layer = [(c.q_size + 2 * c.kv_size, (0, c.q_size, c.q_size + c.kv_size, c.q_size + 2 * c.kv_size)),
                 (c.hidden_size, (0, c.hidden_size)),
                 (2 * c.intermediate_size, (0, c.intermediate_size, 2 * c.intermediate_size)),
                 (c.hidden_size, (0, c.hidden_size))]
    assert calls == per_layer * c.num_layers
    assert shrinks == [c.hidden_size, c.q_size, c.hidden_size, c.intermediate_size] * c.num_layers
    calls.clear()
    model(torch.tensor([5, 6, 7]), ForwardBatch(attn, LoraBatch.build([-1], [3]), model.new_kv_cache(2, 4)))
    assert calls == [] and len(shrinks) == 4 * c.num_layers


@pytest.mark.cuda
def test_fp8_base_beside_adapters_is_told_so(monkeypatch, punica_config, tiny_llama):
    """On CUDA the base GEMM runs beside the side stream and is told so: 24 decode tokens with
    adapters run the fp8 base on the W8A8 GEMM (punica.ops.fp8.WEIGHT_ONLY_MAX_TOKENS_BESIDE_LORA),
    the same tokens without adapters on the weight-only GEMM; the output is that base's plus each
    token's delta."""
    config = punica_config(tiny_llama())
    pool = LoraPool(config, max_loras=2, max_rank=8, dtype=torch.bfloat16, device="cuda")
    for slot in range(2):
        pool.write(slot, random_adapter(config, rank=8, seed=slot, scale=0.5))
    h_in, _ = config.projection_shapes()["gate"]
    h_out = sum(config.projection_shapes()[p][1] for p in GROUPS["gate_up"])
    gen = torch.Generator().manual_seed(9)
    base = Fp8Linear(h_in, h_out, False, Fp8Format(), torch.bfloat16, "cuda")
    weight, scales = quantize_per_channel(torch.randn(h_out, h_in, generator=gen) * 0.1)
    base.weight.data, base.weight_scale.data = weight.cuda(), scales.cuda()
    layer = LoraLinear(base, LAYER, "gate_up")
    attach_pool(layer, pool)
    x = torch.randn(24, h_in, generator=gen).to("cuda", torch.bfloat16)
    paths = []
    gemm_path = fp8.gemm_path
    monkeypatch.setattr(fp8, "gemm_path", lambda *args: paths.append(gemm_path(*args)) or paths[-1])
    slots = [0, 1, -1] * 8
    got = layer(x, LoraBatch.build(slots, [1] * 24, device="cuda"))
    assert paths == ["w8a8"]
    assert torch.equal(layer(x, LoraBatch.build([-1] * 24, [1] * 24, device="cuda")), base(x))
    assert paths == ["w8a8", "weight_only", "weight_only"]
    want = expected(base(x, beside_lora=True), x, pool.group_weights(LAYER, "gate_up"),
                    LoraBatch.build(slots, [1] * 24, device="cuda"))
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.cuda
def test_deferred_deltas_are_added_by_the_op_after_them_bit_for_bit(monkeypatch, punica_config, tiny_llama):
    """On CUDA a BGMV batch's deltas are added by the op that reads each projection's output next
    (rotary + KV append, the norms, SiLU-and-mul; no add_delta launched by a layer), DoRA slot
    included, and the logits are bit for bit those of adding each delta at once."""
    config = punica_config(tiny_llama())
    model = DecoderForCausalLM(config, torch.bfloat16, "cuda")
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.data.copy_((torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if p.dim() == 1 else 0.0)).to(p.dtype))
    pool = LoraPool(config, max_loras=3, max_rank=8, dtype=torch.bfloat16, device="cuda")
    for slot in range(3):
        pool.write(slot, random_adapter(config, rank=4 + 2 * slot, seed=slot, scale=0.5))
    pool.dora_slots[2] = 1
    for out_scales in pool.out_scales.values():
        out_scales[:, 2].uniform_(0.5, 1.5)
    attach_pool(model, pool)
    slots, tokens = [0, 2, -1, 1, 2], torch.tensor([5, 6, 7, 8, 9], device="cuda")

    def logits(slots):
        attn = AttnBatch.build([1] * 5, [1] * 5, [[i] for i in range(5)], 4, 0, device="cuda")
        lora = LoraBatch.build(slots, [1] * 5, device="cuda", kernel="bgmv")
        return model(tokens, ForwardBatch(attn, lora, model.new_kv_cache(5, 4)))

    adds = []
    real_add = layers.add_delta
    monkeypatch.setattr(layers, "add_delta", lambda *args: adds.append(1) or real_add(*args))
    got = logits(slots)
    assert adds == []
    monkeypatch.setattr(LoraLinear, "forward_deferred", lambda self, x, lora: (self.forward(x, lora), None))
    adds.clear()
    assert torch.equal(got, logits(slots))
    assert len(adds) == 4 * config.num_layers
    assert not torch.equal(got, logits([-1] * 5))
