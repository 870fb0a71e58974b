"""The experts' LoRA delta: the reference against a per-pair loop, the Triton kernel (under the
interpreter on CPU) against the reference, fp32."""

import pytest
import torch

from punica.ops.lora_moe import add_expert_lora_ref
from punica.ops.lora_moe_triton import add_expert_lora_triton

NUM_SLOTS, NUM_EXPERTS, MAX_RANK = 3, 4, 16


def case(num_pairs, h_in, h_out, seed):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(num_pairs, h_in, generator=gen)
    y = torch.randn(num_pairs, h_out, generator=gen)
    lora_a = torch.randn(NUM_SLOTS, NUM_EXPERTS, MAX_RANK, h_in, generator=gen)
    lora_b = torch.randn(NUM_SLOTS, NUM_EXPERTS, h_out, MAX_RANK, generator=gen)
    experts = torch.sort(torch.randint(0, NUM_EXPERTS, (num_pairs,), generator=gen)).values
    slots = torch.randint(-1, NUM_SLOTS, (num_pairs,), generator=gen, dtype=torch.int32)
    scales = torch.rand(num_pairs, generator=gen)
    return y, rows, lora_a, lora_b, slots, experts, scales


def test_reference_adds_each_pairs_delta():
    y, rows, lora_a, lora_b, slots, experts, scales = case(23, 40, 24, seed=0)
    expect = y.clone()
    for p in range(23):
        if slots[p] >= 0:
            s, e = int(slots[p]), int(experts[p])
            expect[p] += scales[p] * (rows[p] @ lora_a[s, e].T) @ lora_b[s, e].T
    add_expert_lora_ref(y, rows, lora_a, lora_b, slots, experts, scales)
    torch.testing.assert_close(y, expect, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("num_pairs,h_in,h_out", [(1, 64, 32), (29, 72, 96), (16, 100, 48)])
def test_triton_matches_reference(num_pairs, h_in, h_out):
    y, rows, lora_a, lora_b, slots, experts, scales = case(num_pairs, h_in, h_out, seed=num_pairs)
    expect = y.clone()
    add_expert_lora_ref(expect, rows, lora_a, lora_b, slots, experts, scales)
    add_expert_lora_triton(y, rows, lora_a, lora_b, slots, experts, scales)
    torch.testing.assert_close(y, expect, rtol=1e-5, atol=1e-4)
