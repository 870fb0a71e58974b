"""The router's top-k and the pairs sorted by expert, and the combine, in Triton (under the
interpreter on CPU, bf16 on CUDA) against the references: the same pairs in the same order, the
same indptr and token_pairs, the weights within float32 rounding; the combine within rounding."""

import pytest
import torch

from punica.ops.moe import combine_ref, route_ref
from punica.ops.moe_route_triton import combine_triton, route_triton


def assert_same_routing(got, expect, rtol=1e-5):
    assert torch.equal(got.pair_tokens, expect.pair_tokens)
    assert torch.equal(got.pair_experts, expect.pair_experts)
    assert torch.equal(got.expert_indptr, expect.expert_indptr)
    assert torch.equal(got.token_pairs, expect.token_pairs)
    assert got.pair_tokens.dtype == got.pair_experts.dtype == got.expert_indptr.dtype == torch.int64
    assert got.token_pairs.dtype == torch.int64
    assert got.pair_weights.dtype == torch.float32
    torch.testing.assert_close(got.pair_weights, expect.pair_weights, rtol=rtol, atol=1e-7)


@pytest.mark.parametrize("num_tokens,num_experts,top_k,renormalize", [
    (1, 128, 8, True),    # a decode step of Qwen3-30B-A3B's shape
    (37, 128, 8, True),   # 5 blocks of 8 tokens, the last partial
    (20, 8, 2, True),     # Mixtral's shape: blocks of 32 tokens
    (45, 60, 4, False),   # experts not a power of two; weights not renormalised
    (3, 5, 5, False),     # every expert chosen: the weights are the whole softmax
    (2, 4, 3, True),      # top_k not a power of two
])
def test_route_triton_matches_reference(num_tokens, num_experts, top_k, renormalize):
    gen = torch.Generator().manual_seed(num_tokens)
    logits = torch.randn(num_tokens, num_experts, generator=gen) * 3
    assert_same_routing(route_triton(logits, top_k, renormalize), route_ref(logits, top_k, renormalize))


def test_route_triton_keeps_token_order_within_a_crowded_expert():
    """Many tokens share their top expert across blocks: within it the pairs are in token order."""
    logits = torch.randn(70, 16, generator=torch.Generator().manual_seed(1))
    logits[:, 3] += 10
    got = route_triton(logits, 2, True)
    assert_same_routing(got, route_ref(logits, 2, True))
    lo, hi = got.expert_indptr[3:5].tolist()
    assert got.pair_tokens[lo:hi].tolist() == list(range(70))


def test_route_triton_breaks_ties_to_the_lower_expert():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    routing = route_triton(logits, 2, True)
    assert_same_routing(routing, route_ref(logits, 2, True))
    assert routing.pair_experts[routing.token_pairs].tolist() == [1, 2, 0, 1]


def test_route_triton_reads_strided_bf16_logits_and_no_tokens():
    logits = torch.randn(9, 40, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    wide = torch.zeros(9, 64, dtype=torch.bfloat16)
    wide[:, :40] = logits
    assert_same_routing(route_triton(wide[:, :40], 4, True), route_ref(logits, 4, True))
    empty = route_triton(logits[:0], 4, True)
    assert empty.num_pairs == 0 and empty.expert_indptr.tolist() == [0] * 41


def test_token_pairs_point_at_each_tokens_pairs_in_rank_order():
    logits = torch.randn(6, 10, generator=torch.Generator().manual_seed(3))
    routing = route_triton(logits, 3, False)
    ranked = torch.topk(torch.softmax(logits, -1), 3).indices.reshape(-1)
    assert torch.equal(routing.pair_experts[routing.token_pairs], ranked)
    assert torch.equal(routing.pair_tokens[routing.token_pairs], torch.arange(6).repeat_interleave(3))


@pytest.mark.parametrize("num_tokens,top_k,hidden", [(1, 8, 64), (13, 2, 700), (7, 3, 512)])
def test_combine_triton_matches_reference(num_tokens, top_k, hidden):
    gen = torch.Generator().manual_seed(hidden)
    routing = route_ref(torch.randn(num_tokens, 16, generator=gen), top_k, True)
    down = torch.randn(routing.num_pairs, hidden, generator=gen)
    torch.testing.assert_close(combine_triton(down, routing, num_tokens), combine_ref(down, routing, num_tokens),
                               rtol=1e-6, atol=1e-6)
    no_tokens = route_ref(torch.zeros(0, 16), top_k, True)
    assert combine_triton(down[:0], no_tokens, 0).shape == combine_ref(down[:0], no_tokens, 0).shape == (0, hidden)


@pytest.mark.cuda
@pytest.mark.parametrize("num_tokens", [1, 32, 512])
def test_route_and_combine_triton_match_reference_on_cuda(num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    logits = torch.randn(num_tokens, 128, generator=gen).to("cuda", torch.bfloat16)
    routing = route_triton(logits, 8, True)
    assert_same_routing(routing, route_ref(logits, 8, True))
    down = torch.randn(routing.num_pairs, 2048, generator=gen).to("cuda", torch.bfloat16)
    torch.testing.assert_close(combine_triton(down, routing, num_tokens), combine_ref(down, routing, num_tokens),
                               rtol=1.6e-2, atol=1e-2)
