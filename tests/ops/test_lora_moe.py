"""The experts' LoRA delta: the reference against a per-pair loop, the Triton kernels (under the
interpreter on CPU) against the reference: fp32 and fp16 on CPU, bf16 at a decode layer's size on CUDA."""

import pytest
import torch

from punica.ops.lora_moe import add_expert_lora_ref
from punica.ops.lora_moe_triton import add_expert_lora_triton

NUM_SLOTS, NUM_EXPERTS = 3, 4


def case(num_pairs, h_in, h_out, seed, rank=16, num_slots=NUM_SLOTS, num_experts=NUM_EXPERTS, dtype=torch.float32,
         device="cpu"):
    """Pairs of random tokens sorted by expert, as punica.ops.moe.route makes them; each token's slot
    in -1..num_slots-1; weights small enough that a delta is about as large as y."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens = max(1, num_pairs // 2)

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen) * std).to(device, dtype)

    rows = randn(num_pairs, h_in)
    y = randn(num_pairs, h_out)
    lora_a = randn(num_slots, num_experts, rank, h_in, std=h_in ** -0.5)
    lora_b = randn(num_slots, num_experts, h_out, rank, std=rank ** -0.5)
    pair_tokens = torch.randint(0, num_tokens, (num_pairs,), generator=gen).to(device)
    pair_experts = torch.sort(torch.randint(0, num_experts, (num_pairs,), generator=gen)).values.to(device)
    token_slots = torch.randint(-1, num_slots, (num_tokens,), generator=gen, dtype=torch.int32).to(device)
    token_scales = torch.rand(num_tokens, generator=gen).to(device)
    slot_scales = (torch.rand(num_slots, generator=gen) + 0.5).to(device)
    return y, rows, lora_a, lora_b, pair_tokens, pair_experts, token_slots, token_scales, slot_scales


def test_reference_adds_each_pairs_delta():
    y, rows, lora_a, lora_b, tokens, experts, slots, scales, slot_scales = args = case(23, 40, 24, seed=0)
    expect = y.clone()
    for p in range(23):
        t = int(tokens[p])
        if slots[t] >= 0:
            s, e = int(slots[t]), int(experts[p])
            expect[p] += scales[t] * slot_scales[s] * (rows[p] @ lora_a[s, e].T) @ lora_b[s, e].T
    assert (slots[tokens] < 0).any() and (slots[tokens] >= 0).any()
    add_expert_lora_ref(*args)
    torch.testing.assert_close(y, expect, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("num_pairs,h_in,h_out,rank", [
    (1, 64, 32, 16), (29, 72, 96, 16), (16, 100, 48, 16),  # h_in, h_out under one block
    (21, 1100, 300, 16),  # 3 shrink parts (BLOCK_K 512), the last partial; 3 expand blocks, the last partial
    (12, 600, 130, 8),  # rank under BLOCK_R
    (9, 300, 140, 64),  # BLOCK_R 64: BLOCK_K 128, 3 shrink parts
])
def test_triton_matches_reference(num_pairs, h_in, h_out, rank):
    y, *args = case(num_pairs, h_in, h_out, seed=num_pairs, rank=rank)
    expect = y.clone()
    add_expert_lora_ref(expect, *args)
    add_expert_lora_triton(y, *args)
    torch.testing.assert_close(y, expect, rtol=1e-5, atol=1e-4)


def test_triton_fp16_rounds_y_plus_delta():
    """fp16 operands: the float32 sum y + delta rounded once (the reference rounds the delta, then the
    sum: at most an ulp apart)."""
    y, *args = case(17, 200, 150, seed=5, dtype=torch.float16)
    expect = y.clone()
    add_expert_lora_ref(expect, *args)
    add_expert_lora_triton(y, *args)
    torch.testing.assert_close(y, expect, rtol=2e-3, atol=2e-3)


def test_triton_leaves_pairs_without_adapter_and_no_pairs_alone():
    y, rows, lora_a, lora_b, _, experts, _, scales, slot_scales = case(10, 72, 140, seed=7)
    tokens, slots = torch.arange(10) % 5, torch.tensor([-1, 2, -1, 0, 1], dtype=torch.int32)
    before = y.clone()
    add_expert_lora_triton(y, rows, lora_a, lora_b, tokens, experts, torch.full_like(slots, -1), scales, slot_scales)
    assert torch.equal(y, before)
    add_expert_lora_triton(y[:0], rows[:0], lora_a, lora_b, tokens[:0], experts[:0], slots, scales, slot_scales)
    add_expert_lora_triton(y, rows, lora_a, lora_b, tokens, experts, slots, scales, slot_scales)
    adapted = slots[tokens] >= 0
    assert torch.equal(y[~adapted], before[~adapted]) and not torch.equal(y[adapted], before[adapted])


@pytest.mark.cuda
@pytest.mark.parametrize("num_pairs", [8, 256])
def test_triton_matches_reference_bf16_on_cuda(num_pairs):
    """A Qwen3-30B-A3B layer's gate_up and down at decode (T = 1 and 32, top-8): bf16 within an ulp of y."""
    for h_in, h_out in ((2048, 1536), (768, 2048)):
        y, *args = case(num_pairs, h_in, h_out, seed=num_pairs, num_slots=8, num_experts=16, dtype=torch.bfloat16,
                        device="cuda")
        expect = y.clone()
        add_expert_lora_ref(expect, *args)
        add_expert_lora_triton(y, *args)
        torch.testing.assert_close(y, expect, rtol=1.6e-2, atol=1e-2)
