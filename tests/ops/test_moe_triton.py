"""The experts' grouped GEMM (Triton, under the interpreter on CPU) against its reference, fp32."""

import pytest
import torch

from punica.ops.moe import grouped_matmul_ref, route
from punica.ops.moe_triton import align_blocks, align_blocks_ref, block_layout, grouped_matmul_triton


@pytest.mark.parametrize("num_tokens,num_experts,top_k,h_in,h_out", [
    (1, 8, 2, 64, 40),     # a decode step: 2 pairs
    (37, 8, 2, 72, 96),    # odd sizes, tiles cut by K and N
    (20, 16, 4, 32, 48),   # experts without pairs among them
])
def test_grouped_matmul_triton_matches_reference(num_tokens, num_experts, top_k, h_in, h_out):
    gen = torch.Generator().manual_seed(num_tokens)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    if num_experts == 16:
        logits[:, 8:] -= 100  # experts 8..15 get no token
    routing = route(logits, top_k, renormalize=True)
    rows = torch.randn(routing.num_pairs, h_in, generator=gen)
    weights = torch.randn(num_experts, h_out, h_in, generator=gen)
    expect = grouped_matmul_ref(rows, weights, routing)
    got = grouped_matmul_triton(rows, weights, routing)
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-4)


def test_align_blocks_gives_each_block_one_expert():
    routing = route(torch.tensor([[5.0, 0, 0, 1], [5, 0, 0, 1], [0, 0, 0, 5]]), top_k=1, renormalize=False)
    # experts 0 (pairs 0, 1) and 3 (pair 2), each padded to a block; 3 pairs of 4 experts: 4 blocks at most
    for block_rows, block_experts in (align_blocks_ref(routing.pair_experts, routing.expert_indptr, block_m=4),
                                      align_blocks(routing.expert_indptr, routing.num_pairs, block_m=4)):
        assert block_experts.tolist() == [0, 3, -1, -1]
        assert block_rows.tolist() == [0, 1, 3, 3, 2] + [3] * 11


@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m", [
    (1, 128, 8, 16),   # a decode step of Qwen3-30B-A3B's shape: 8 runs of one pair
    (32, 128, 8, 16),  # most experts with a few pairs
    (300, 8, 2, 64),   # runs longer than a block, cut by it
    (40, 60, 4, 16),   # experts not a power of two, some without pairs
])
def test_align_blocks_kernel_matches_reference(num_tokens, num_experts, top_k, block_m):
    gen = torch.Generator().manual_seed(num_tokens)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    logits[:, num_experts // 2:] -= 4 * (num_experts > 8)  # uneven runs, some empty
    routing = route(logits, top_k, renormalize=False)
    expect = align_blocks_ref(routing.pair_experts, routing.expert_indptr, block_m)
    got = align_blocks(routing.expert_indptr, routing.num_pairs, block_m)
    assert torch.equal(got[0], expect[0]) and torch.equal(got[1], expect[1])


def test_block_layout_is_made_once_per_routing_and_block_size():
    routing = route(torch.randn(5, 8, generator=torch.Generator().manual_seed(0)), 2, renormalize=True)
    first = block_layout(routing, 16)
    assert block_layout(routing, 16) is first and block_layout(routing, 64) is not first
