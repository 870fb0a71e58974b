"""The Triton LoRA kernels at real shapes on the GPU (marked `cuda`; skipped on a machine without
one): against the references, through the public ops, and under CUDA-graph replay. Helpers:
test_lora_triton, beside this file, whose interpreter tests cover the same kernels at small
shapes."""

import random

import pytest
import torch
from test_lora_triton import (
    DEVICE,
    DTYPES,
    Y_TOL,
    check_all_kernels,
    check_group_kernels,
    make_group_pool,
    make_pool,
    make_requests,
)

from punica.lora.batch import LoraBatch
from punica.ops import lora as ops
from punica.ops import lora_triton as kernels
from punica.workloads import WORKLOADS

REAL_SHAPES = [(2048, 8), (4096, 16), (5120, 32), (11008, 64), (13824, 128)]


@pytest.mark.cuda
@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("hidden,rank", REAL_SHAPES)
def test_real_shapes(hidden, rank, workload):
    rng = random.Random(f"{hidden}{rank}{workload}")
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    dtype = torch.bfloat16
    for num_requests, max_len in ((64, 1), (15, 4096 // 15)):
        slots, lens = make_requests(workload, num_requests, max_len, rng)
        num_slots = max(slots) + 1
        ranks = [rng.randint(1, rank) for _ in range(num_slots)]
        ranks[0] = rank
        # h_in = hidden with h_out = 4096 (down-like) and the reverse (up-like)
        for h_in, h_out in ((hidden, 4096), (4096, hidden)):
            a, b, scales = make_pool(num_slots, ranks, h_in, h_out, dtype, gen)
            batch = LoraBatch.build(slots, lens, device=DEVICE, kernel="sgmv")
            x = torch.randn(sum(lens), h_in, generator=gen).to(dtype).to(DEVICE)
            y0 = torch.randn(sum(lens), h_out, generator=gen).to(dtype).to(DEVICE)
            check_all_kernels(x, y0, a, b, scales, batch, Y_TOL[dtype], block_ms=(None, 1, 64), delta=True)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_real_shapes_dtypes_through_public_ops(dtype):
    """The public ops dispatch to Triton on CUDA; add_lora equals the references."""
    rng = random.Random(str(dtype))
    gen = torch.Generator().manual_seed(11)
    slots, lens = make_requests("skewed", 40, 100, rng)
    a, b, scales = make_pool(max(slots) + 1, [16] * (max(slots) + 1), 4096, 11008, dtype, gen)
    x = torch.randn(sum(lens), 4096, generator=gen).to(dtype).to(DEVICE)
    y0 = torch.randn(sum(lens), 11008, generator=gen).to(dtype).to(DEVICE)
    segments = LoraBatch.build(slots, lens, device=DEVICE, kernel="sgmv")
    for kernel, num_prefills in (("sgmv", None), ("bgmv", None), ("auto", 12)):  # ("auto", 12): SGMV + BGMV
        batch = LoraBatch.build(slots, lens, device=DEVICE, kernel=kernel, num_prefills=num_prefills)
        assert num_prefills is None or 0 < batch.sgmv_tokens < x.shape[0]
        y, y_ref = y0.clone(), y0.clone()
        ops.add_lora(y, x, a, b, scales, batch)
        v_ref = ops.sgmv_shrink_ref(x, a, segments.seg_indptr, segments.seg_slots)
        ops.sgmv_expand_ref(y_ref, v_ref, b, segments.seg_indptr, segments.seg_slots, scales)
        torch.testing.assert_close(y, y_ref, rtol=Y_TOL[dtype][0], atol=Y_TOL[dtype][1])


# (h_in, slice_bounds) of projection groups at real shapes: 7B q/k/v, GQA q/k/v, 7B gate/up
GROUP_REAL_SHAPES = {"qkv_7b": (4096, (0, 4096, 8192, 12288)), "qkv_gqa": (4096, (0, 4096, 5120, 6144)),
                     "gate_up_7b": (4096, (0, 11008, 22016))}


@pytest.mark.cuda
@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("rank", [16, 128])
@pytest.mark.parametrize("group", GROUP_REAL_SHAPES)
def test_group_real_shapes(group, rank, workload):
    """One shrink over a group's stacked A (n*R up to 384 ranks), one sliced expand."""
    rng = random.Random(f"{group}{rank}{workload}")
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    dtype = torch.bfloat16
    h_in, bounds = GROUP_REAL_SHAPES[group]
    for num_requests, max_len in ((64, 1), (15, 4096 // 15)):
        slots, lens = make_requests(workload, num_requests, max_len, rng)
        check_group_kernels(slots, lens, max(slots) + 1, rank, h_in, bounds, dtype, rng, gen,
                            block_ms=(None, 1, 64))


@pytest.mark.cuda
@pytest.mark.parametrize("group", GROUP_REAL_SHAPES)
def test_group_real_shapes_through_add_lora(group):
    """add_lora on a group (Triton on CUDA) equals one reference add_lora per projection."""
    rng = random.Random(group)
    gen = torch.Generator().manual_seed(13)
    h_in, bounds = GROUP_REAL_SHAPES[group]
    slots, lens = make_requests("skewed", 40, 100, rng)
    num_slots = max(slots) + 1
    a, b, scales = make_group_pool(num_slots, [16] * num_slots, h_in, bounds, torch.bfloat16, gen)
    x = torch.randn(sum(lens), h_in, generator=gen).to(torch.bfloat16).to(DEVICE)
    y0 = torch.randn(sum(lens), bounds[-1], generator=gen).to(torch.bfloat16).to(DEVICE)
    segments = LoraBatch.build(slots, lens, device=DEVICE, kernel="sgmv")
    for kernel, num_prefills in (("sgmv", None), ("bgmv", None), ("auto", 12)):  # ("auto", 12): SGMV + BGMV
        batch = LoraBatch.build(slots, lens, device=DEVICE, kernel=kernel, num_prefills=num_prefills)
        assert num_prefills is None or 0 < batch.sgmv_tokens < x.shape[0]
        y, y_ref = y0.clone(), y0.clone()
        ops.add_lora(y, x, a, b, scales, batch, slice_bounds=bounds)
        for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            a_i = a[:, i * 16:(i + 1) * 16]
            v_ref = ops.sgmv_shrink_ref(x, a_i, segments.seg_indptr, segments.seg_slots)
            ops.sgmv_expand_ref(y_ref[:, lo:hi], v_ref, b[:, lo:hi], segments.seg_indptr, segments.seg_slots, scales)
        torch.testing.assert_close(y, y_ref, rtol=Y_TOL[torch.bfloat16][0], atol=Y_TOL[torch.bfloat16][1])


@pytest.mark.cuda
@pytest.mark.parametrize("slice_bounds", [None, (0, 4096, 5120, 6144)], ids=["one", "qkv_gqa"])
@pytest.mark.parametrize("num_requests,max_len", [(64, 1), (12, 300)])
def test_cuda_graph_replay_equals_eager(num_requests, max_len, slice_bounds, capture_graph):
    """Capture once; replays on new inputs (new slots and segment bounds too) equal eager runs.

    Inside the graph, kernels write x and y just before the LoRA ops read them, which checks
    that reads of x, v and y wait for the previous kernel under programmatic dependent launch.
    With slice_bounds, a projection group: stacked A, sliced expand.
    """
    rng = random.Random(num_requests)
    gen = torch.Generator().manual_seed(num_requests)
    dtype, h_in = torch.bfloat16, 4096
    bounds = slice_bounds or (0, 5120)
    h_out, num_slices = bounds[-1], len(bounds) - 1
    a, b, scales = make_group_pool(num_requests, [rng.randint(1, 16) for _ in range(num_requests)],
                                   h_in, bounds, dtype, gen)
    slots, lens = make_requests("uniform", num_requests - 1, max_len, rng)
    num_tokens = sum(lens)
    static = LoraBatch.build(slots, lens, device=DEVICE, kernel="sgmv")
    x_src = torch.randn(num_tokens, h_in, generator=gen).to(dtype).to(DEVICE)
    y_src = torch.randn(num_tokens, h_out, generator=gen).to(dtype).to(DEVICE)
    x, y, y_tok = torch.empty_like(x_src), torch.empty_like(y_src), torch.empty_like(y_src)
    v_seg = torch.empty(num_tokens, 16 * num_slices, device=DEVICE)
    v_tok = torch.empty(num_tokens, 16 * num_slices, device=DEVICE)

    def step():
        torch.mul(y_src, 1.0, out=y)  # kernels, not copies, so that PDL applies
        torch.mul(x_src, 1.0, out=x)
        kernels.sgmv_shrink_triton(x, a, static.seg_indptr, static.seg_slots, out=v_seg)
        kernels.sgmv_expand_triton(y, v_seg, b, static.seg_indptr, static.seg_slots, scales,
                                   slice_bounds=slice_bounds)
        torch.mul(y_src, 1.0, out=y_tok)
        kernels.bgmv_shrink_triton(x, a, static.token_slots, out=v_tok)
        kernels.bgmv_expand_triton(y_tok, v_tok, b, static.token_slots, scales, slice_bounds=slice_bounds)

    graph, _ = capture_graph(step)
    for _ in range(3):
        # same number of tokens and segments, new boundaries, slots and data
        while True:
            slots, lens = make_requests("uniform", num_requests - 1, max_len, rng)
            batch = LoraBatch.build(slots, lens, device=DEVICE, kernel="sgmv")
            if sum(lens) <= num_tokens and batch.seg_slots.numel() <= static.seg_slots.numel():
                break
        lens[-1] += num_tokens - sum(lens)
        pad = static.seg_slots.numel() - batch.seg_slots.numel()
        batch = LoraBatch.build(slots, lens, device=DEVICE, kernel="sgmv")
        static.seg_indptr.copy_(torch.cat([batch.seg_indptr, batch.seg_indptr[-1:].repeat(pad)]))
        static.seg_slots.copy_(torch.cat([batch.seg_slots, batch.seg_slots[-1:].repeat(pad)]))
        static.token_slots.copy_(batch.token_slots)
        x_src.copy_(torch.randn(num_tokens, h_in, generator=gen).to(dtype))
        y_src.copy_(torch.randn(num_tokens, h_out, generator=gen).to(dtype))
        graph.replay()
        y_eager, y_tok_eager = y_src.clone(), y_src.clone()
        v = kernels.sgmv_shrink_triton(x_src, a, static.seg_indptr, static.seg_slots)
        kernels.sgmv_expand_triton(y_eager, v, b, static.seg_indptr, static.seg_slots, scales,
                                   slice_bounds=slice_bounds)
        v_t = kernels.bgmv_shrink_triton(x_src, a, static.token_slots)
        kernels.bgmv_expand_triton(y_tok_eager, v_t, b, static.token_slots, scales, slice_bounds=slice_bounds)
        torch.testing.assert_close(v_seg, v, rtol=1e-5, atol=1e-5)  # split-K atomics: any order
        assert torch.equal(v_tok, v_t) and torch.equal(y_tok, y_tok_eager)
        torch.testing.assert_close(y, y_eager, rtol=1e-2, atol=1e-2)
        # and the padded metadata means what the unpadded batch means
        y_ref = y_src.clone()
        v_ref = ops.sgmv_shrink_ref(x_src, a, batch.seg_indptr, batch.seg_slots)
        ops.sgmv_expand_ref(y_ref, v_ref, b, batch.seg_indptr, batch.seg_slots, scales, slice_bounds)
        torch.testing.assert_close(v_seg, v_ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(y, y_ref, rtol=2e-2, atol=2e-2)
