"""Triton LoRA kernels against the references of punica.ops.lora on fresh random inputs.

Without a GPU the kernels run under Triton's interpreter (tests/conftest.py) on CPU tensors,
at small shapes; test_lora_triton_cuda runs them at real shapes on the GPU.
"""

import random

import pytest
import torch

from punica.lora.batch import LoraBatch
from punica.ops import lora as ops
from punica.ops import lora_triton as kernels
from punica.ops.triton_env import num_sms
from punica.workloads import WORKLOADS, adapter_ids

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (rtol, atol) for y; the interpreter truncates to bf16/fp16, the GPU rounds, and tf32 rounds v
Y_TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3)}


def make_pool(num_slots, ranks, h_in, h_out, dtype, gen, device=DEVICE):
    """Random weights with per-slot ranks, zero-padded to the largest rank."""
    max_rank = max(ranks)
    a = torch.zeros(num_slots, max_rank, h_in, dtype=dtype)
    b = torch.zeros(num_slots, h_out, max_rank, dtype=dtype)
    for s, r in enumerate(ranks):
        a[s, :r] = torch.randn(r, h_in, generator=gen).to(dtype) / h_in**0.5
        b[s, :, :r] = torch.randn(h_out, r, generator=gen).to(dtype) / r**0.5
    scales = torch.rand(num_slots, generator=gen) + 0.5
    return a.to(device), b.to(device), scales.to(device)


def make_group_pool(num_slots, ranks, h_in, slice_bounds, dtype, gen, device=DEVICE):
    """A projection group's stacked weights: lora_a [S, n*R, h_in], lora_b [S, sum h_out, R]."""
    parts = [make_pool(num_slots, ranks, h_in, hi - lo, dtype, gen, device)
             for lo, hi in zip(slice_bounds, slice_bounds[1:])]
    return (torch.cat([a for a, _, _ in parts], dim=1), torch.cat([b for _, b, _ in parts], dim=1),
            parts[0][2])


def make_requests(workload, num_requests, max_len, rng):
    """Slots sorted so equal slots neighbour, plus one request without LoRA in the middle."""
    slots = sorted(adapter_ids(workload, num_requests, rng))
    slots.insert(num_requests // 2, -1)
    return slots, [rng.randint(1, max_len) for _ in slots]


def check_all_kernels(x, y0, a, b, scales, batch, y_tol, block_ms=(None,), slice_bounds=None, token_scales=None,
                      dora=None, delta=False):
    """Every kernel (both SGMV schedules when asked) equals its reference; with slice_bounds, a
    projection group: shrink over the stacked A, sliced expand; with token_scales, each token's;
    with dora, DoRA's out_scales; with delta, the BGMV expand split into bgmv_delta + add_delta
    equals it bit for bit."""
    v_ref = ops.sgmv_shrink_ref(x, a, batch.seg_indptr, batch.seg_slots)
    y_ref = y0.clone()
    ops.sgmv_expand_ref(y_ref, v_ref, b, batch.seg_indptr, batch.seg_slots, scales, slice_bounds, token_scales, dora)
    no_lora = batch.token_slots < 0
    results = []
    for block_m in block_ms:
        v = kernels.sgmv_shrink_triton(x, a, batch.seg_indptr, batch.seg_slots, block_m=block_m)
        y = y0.clone()
        kernels.sgmv_expand_triton(y, v_ref, b, batch.seg_indptr, batch.seg_slots, scales,
                                   block_m=block_m, slice_bounds=slice_bounds, token_scales=token_scales, dora=dora)
        results.append((f"sgmv block_m={block_m}", v, y))
    v = kernels.bgmv_shrink_triton(x, a, batch.token_slots)
    y = y0.clone()
    kernels.bgmv_expand_triton(y, v_ref, b, batch.token_slots, scales, slice_bounds=slice_bounds,
                               token_scales=token_scales, dora=dora)
    results.append(("bgmv", v, y))
    if delta:
        check_delta_and_add(y0, y, v_ref, b, scales, batch, slice_bounds, token_scales, dora)
    for name, v, y in results:
        torch.testing.assert_close(v, v_ref, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name} shrink: {m}")
        torch.testing.assert_close(y, y_ref, rtol=y_tol[0], atol=y_tol[1], msg=lambda m: f"{name} expand: {m}")
        assert torch.equal(v[no_lora], torch.zeros_like(v[no_lora])), name
        assert torch.equal(y[no_lora], y0[no_lora]), name


def check_delta_and_add(y0, y_bgmv, v, b, scales, batch, slice_bounds, token_scales, dora):
    """bgmv_delta then add_delta leave y as the BGMV expand does (y_bgmv), bit for bit, kernels and
    references alike; the delta is zero for tokens without LoRA."""
    d = kernels.bgmv_delta_triton(v, b, batch.token_slots, scales, slice_bounds, token_scales)
    y = y0.clone()
    kernels.add_delta_triton(y, d, batch.token_slots, dora)
    assert torch.equal(y, y_bgmv)
    no_lora = batch.token_slots < 0
    assert torch.equal(d[no_lora], torch.zeros_like(d[no_lora]))
    y_ref, y_expand_ref = y0.clone(), y0.clone()
    ops.add_delta_ref(y_ref, ops.bgmv_delta_ref(v, b, batch.token_slots, scales, slice_bounds, token_scales),
                      batch.token_slots, dora)
    ops.bgmv_expand_ref(y_expand_ref, v, b, batch.token_slots, scales, slice_bounds, token_scales, dora)
    assert torch.equal(y_ref, y_expand_ref)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("workload", WORKLOADS)
def test_kernels_match_reference_mixed_ranks(workload, dtype):
    rng = random.Random(f"{workload}{dtype}")
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    slots, lens = make_requests(workload, 6, 14, rng)
    num_slots = max(slots) + 2
    ranks = [rng.choice([1, 3, 5, 8, 13]) for _ in range(num_slots)]
    a, b, scales = make_pool(num_slots, ranks, 67, 45, dtype, gen)
    batch = LoraBatch.build(slots, lens, device=DEVICE, kernel="sgmv")
    x = torch.randn(sum(lens), 67, generator=gen).to(dtype).to(DEVICE)
    y0 = torch.randn(sum(lens), 45, generator=gen).to(dtype).to(DEVICE)
    check_all_kernels(x, y0, a, b, scales, batch, Y_TOL[dtype], block_ms=(1, 16))


@pytest.mark.slow
@pytest.mark.parametrize("rank", [8, 16, 64])
def test_kernels_match_reference_ranks(rank):
    rng = random.Random(rank)
    gen = torch.Generator().manual_seed(rank)
    slots, lens = make_requests("uniform", 5, 20, rng)
    a, b, scales = make_pool(max(slots) + 1, [rank] * (max(slots) + 1), 33, 70, torch.bfloat16, gen)
    batch = LoraBatch.build(slots, lens, device=DEVICE, kernel="sgmv")
    x = torch.randn(sum(lens), 33, generator=gen).to(torch.bfloat16).to(DEVICE)
    y0 = torch.randn(sum(lens), 70, generator=gen).to(torch.bfloat16).to(DEVICE)
    check_all_kernels(x, y0, a, b, scales, batch, Y_TOL[torch.bfloat16], block_ms=(1, 32))


@pytest.mark.slow
def test_tiles_without_split_k_and_long_segments():
    """Enough tiles that shrink needs no split (plain stores), segments longer than a tile."""
    gen = torch.Generator().manual_seed(3)
    slots, lens = [0, -1, 2, 1], [150, 40, 70, 19]
    a, b, scales = make_pool(3, [4, 16, 9], 40, 24, torch.float32, gen)
    batch = LoraBatch.build(slots, lens, device=DEVICE, kernel="sgmv")
    x = torch.randn(sum(lens), 40, generator=gen).to(DEVICE)
    y0 = torch.randn(sum(lens), 24, generator=gen).to(DEVICE)
    assert sum(lens) // 16 >= kernels.TILE_PROGRAMS_PER_SM * num_sms(x.device) or DEVICE == "cuda"
    check_all_kernels(x, y0, a, b, scales, batch, Y_TOL[torch.float32], block_ms=(16, None))


@pytest.mark.parametrize("block_m", [1, 16])
def test_empty_segments_and_tokens_past_the_last_segment(block_m):
    """Padding as a CUDA-graph runner may do it: empty segments, trailing tokens without one."""
    gen = torch.Generator().manual_seed(block_m)
    a, b, scales = make_pool(3, [8, 5, 8], 24, 20, torch.float32, gen)
    seg_indptr = torch.tensor([0, 0, 7, 7, 25, 25, 30], dtype=torch.int32, device=DEVICE)
    seg_slots = torch.tensor([1, 2, 0, -1, 1, 2], dtype=torch.int32, device=DEVICE)
    x = torch.randn(36, 24, generator=gen).to(DEVICE)
    y0 = torch.randn(36, 20, generator=gen).to(DEVICE)
    v = kernels.sgmv_shrink_triton(x, a, seg_indptr, seg_slots, block_m=block_m)
    v_ref = ops.sgmv_shrink_ref(x, a, seg_indptr, seg_slots)
    torch.testing.assert_close(v, v_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(v[30:], torch.zeros(6, 8, device=DEVICE))
    y, y_ref = y0.clone(), y0.clone()
    kernels.sgmv_expand_triton(y, v_ref, b, seg_indptr, seg_slots, scales, block_m=block_m)
    ops.sgmv_expand_ref(y_ref, v_ref, b, seg_indptr, seg_slots, scales)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(y[30:], y0[30:])


def test_expand_into_column_slice_and_shrink_into_out():
    gen = torch.Generator().manual_seed(5)
    a, b, scales = make_pool(3, [4, 8, 2], 16, 24, torch.bfloat16, gen)
    batch = LoraBatch.build([2, 0, -1, 1], [1, 3, 2, 4], device=DEVICE, kernel="sgmv")
    x = torch.randn(10, 16, generator=gen).to(torch.bfloat16).to(DEVICE)
    wide = torch.randn(10, 60, generator=gen).to(torch.bfloat16).to(DEVICE)
    before = wide.clone()
    out = torch.full((10, 8), float("nan"), device=DEVICE)
    v = kernels.bgmv_shrink_triton(x, a, batch.token_slots, out=out)
    assert v is out
    torch.testing.assert_close(v, ops.bgmv_shrink_ref(x, a, batch.token_slots), rtol=1e-5, atol=1e-5)
    expect = before[:, 10:34].clone()
    ops.sgmv_expand_ref(expect, v, b, batch.seg_indptr, batch.seg_slots, scales)
    for expand in (kernels.bgmv_expand_triton, kernels.sgmv_expand_triton):
        wide = before.clone()
        if expand is kernels.bgmv_expand_triton:
            expand(wide[:, 10:34], v, b, batch.token_slots, scales)
        else:
            expand(wide[:, 10:34], v, b, batch.seg_indptr, batch.seg_slots, scales)
        torch.testing.assert_close(wide[:, 10:34], expect, rtol=2e-2, atol=2e-2)
        assert torch.equal(wide[:, :10], before[:, :10]) and torch.equal(wide[:, 34:], before[:, 34:])


def check_group_kernels(slots, lens, num_slots, rank, h_in, slice_bounds, dtype, rng, gen, block_ms):
    """A group pool (slot 0 of `rank`, the others of random ranks up to it), random x and y, and
    every kernel of the group against the references (check_all_kernels)."""
    ranks = [rank] + [rng.randint(1, rank) for _ in range(num_slots - 1)]
    a, b, scales = make_group_pool(num_slots, ranks, h_in, slice_bounds, dtype, gen)
    batch = LoraBatch.build(slots, lens, device=DEVICE, kernel="sgmv")
    x = torch.randn(sum(lens), h_in, generator=gen).to(dtype).to(DEVICE)
    y0 = torch.randn(sum(lens), slice_bounds[-1], generator=gen).to(dtype).to(DEVICE)
    check_all_kernels(x, y0, a, b, scales, batch, Y_TOL[dtype], block_ms=block_ms, slice_bounds=slice_bounds)


# (h_in, slice_bounds, rank): odd sizes; bounds off every block multiple; with rank 64 the
# expand's column blocks are 128 wide (row-wise and tiled), so blocks lie inside one slice,
# straddle one boundary or two, and the tiled shrink takes its 192 ranks in two blocks
GROUP_SHAPES = [(37, (0, 23, 30, 41), 5), (29, (0, 45, 90), 8), (19, (0, 33), 13),
                (24, (0, 130, 211, 300), 64), (40, (0, 0, 17, 17), 4)]


@pytest.mark.slow
@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("h_in,slice_bounds,rank", GROUP_SHAPES, ids=str)
def test_group_kernels_match_reference(workload, h_in, slice_bounds, rank):
    """A projection group: one shrink over stacked A, one sliced expand (mixed ranks, slot -1)."""
    rng = random.Random(f"{workload}{slice_bounds}")
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    dtype = torch.bfloat16 if rank == 64 else torch.float32
    slots, lens = make_requests(workload, 5, 12 if rank == 64 else 20, rng)
    check_group_kernels(slots, lens, max(slots) + 2, rank, h_in, slice_bounds, dtype, rng, gen, block_ms=(1, 16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("slice_bounds,block_m", [((0, 24, 32, 40), 16), ((0, 150), 32)])
def test_a_mixed_expand_in_one_launch_equals_its_tiles_then_its_rows(dtype, slice_bounds, block_m):
    """The mixed expand (SGMV's tiles over the prompt rows, row-wise programs over the decodes')
    leaves y as the tiled expand of the first rows and the row-wise expand of the others do, bit
    for bit: slot -1 segments and decodes, a DoRA slot, token scales, sliced or not."""
    gen = torch.Generator().manual_seed(11)
    a, b, scales = make_group_pool(4, [8, 4, 6, 2], 16, slice_bounds, dtype, gen)
    dora = (torch.rand(4, slice_bounds[-1], generator=gen).to(DEVICE) + 0.5,
            torch.tensor([0, 1, 0, 0], dtype=torch.int32, device=DEVICE))
    batch = LoraBatch.build([2, -1, 0, 1, -1, 3, 1, 0], [9, 5, 20, 1, 1, 1, 1, 1], device=DEVICE, kernel="sgmv",
                            num_prefills=3, request_scales=[1.0, 1.0, 0.5, 2.0, 1.0, 1.0, 0.25, 1.0])
    n = batch.sgmv_tokens
    assert n == 34 and batch.token_slots.numel() == 39
    x = torch.randn(39, 16, generator=gen).to(dtype).to(DEVICE)
    y0 = torch.randn(39, slice_bounds[-1], generator=gen).to(dtype).to(DEVICE)
    v = ops.bgmv_shrink_ref(x, a, batch.token_slots)
    got, expect = y0.clone(), y0.clone()
    kernels.mixed_expand_triton(got, v, b, batch.seg_indptr, batch.seg_slots, batch.token_slots, n, scales,
                                block_m, slice_bounds, batch.token_scales, dora)
    kernels.sgmv_expand_triton(expect[:n], v[:n], b, batch.seg_indptr, batch.seg_slots, scales, block_m,
                               slice_bounds, batch.token_scales[:n], dora)
    kernels.bgmv_expand_triton(expect[n:], v[n:], b, batch.token_slots[n:], scales, slice_bounds,
                               batch.token_scales[n:], dora)
    assert torch.equal(got, expect)
    assert torch.equal(got[9:14], y0[9:14]) and torch.equal(got[35], y0[35])  # no adapter
    reference = y0.clone()
    ops.sgmv_expand_ref(reference, v, b, batch.seg_indptr, batch.seg_slots, scales, slice_bounds,
                        batch.token_scales, dora)
    ops.bgmv_expand_ref(reference[n:], v[n:], b, batch.token_slots[n:], scales, slice_bounds,
                        batch.token_scales[n:], dora)
    torch.testing.assert_close(got, reference, rtol=Y_TOL[dtype][0], atol=Y_TOL[dtype][1])


def test_delta_and_add_equal_the_bgmv_expand_in_bf16():
    """A q/k/v-like group in bf16 with a DoRA slot, token scales and a token without LoRA: the
    expand split into bgmv_delta + add_delta rounds y exactly as the expand does."""
    gen = torch.Generator().manual_seed(5)
    slice_bounds = (0, 24, 32, 40)
    a, b, scales = make_group_pool(3, [8, 4, 6], 16, slice_bounds, torch.bfloat16, gen)
    dora = (torch.rand(3, 40, generator=gen).to(DEVICE) + 0.5,
            torch.tensor([0, 1, 0], dtype=torch.int32, device=DEVICE))
    batch = LoraBatch.build([0, 1, -1, 2, 1], [1] * 5, device=DEVICE, request_scales=[1.0, 0.5, 1.0, 1.0, 0.0],
                            kernel="bgmv")
    x = torch.randn(5, 16, generator=gen).to(torch.bfloat16).to(DEVICE)
    y0 = torch.randn(5, 40, generator=gen).to(torch.bfloat16).to(DEVICE)
    v = ops.bgmv_shrink_ref(x, a, batch.token_slots)
    y = y0.clone()
    kernels.bgmv_expand_triton(y, v, b, batch.token_slots, scales, slice_bounds, batch.token_scales, dora)
    check_delta_and_add(y0, y, v, b, scales, batch, slice_bounds, batch.token_scales, dora)


@pytest.mark.slow
def test_group_sliced_expand_equals_one_expand_per_projection():
    """The sliced expand into the fused output equals one plain expand per column slice."""
    gen = torch.Generator().manual_seed(9)
    bounds, rank = (0, 150, 170, 190), 16
    a, b, scales = make_group_pool(4, [16, 7, 3, 12], 21, bounds, torch.float32, gen)
    batch = LoraBatch.build([3, -1, 0, 2, 1], [40, 3, 50, 9, 60], device=DEVICE, kernel="sgmv")
    v = ops.sgmv_shrink_ref(torch.randn(162, 21, generator=gen).to(DEVICE), a, batch.seg_indptr,
                            batch.seg_slots)
    y0 = torch.randn(162, bounds[-1], generator=gen).to(DEVICE)
    expect = y0.clone()
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        kernels.sgmv_expand_triton(expect[:, lo:hi], v[:, i * rank:(i + 1) * rank].contiguous(),
                                   b[:, lo:hi], batch.seg_indptr, batch.seg_slots, scales, block_m=16)
    for block_m in (1, 16, 32):
        y = y0.clone()
        kernels.sgmv_expand_triton(y, v, b, batch.seg_indptr, batch.seg_slots, scales,
                                   block_m=block_m, slice_bounds=bounds)
        torch.testing.assert_close(y, expect, rtol=1e-5, atol=1e-5)
    y = y0.clone()
    kernels.bgmv_expand_triton(y, v, b, batch.token_slots, scales, slice_bounds=bounds)
    torch.testing.assert_close(y, expect, rtol=1e-5, atol=1e-5)


def test_sliced_expand_rejects_mismatched_shapes():
    gen = torch.Generator().manual_seed(2)
    a, b, scales = make_group_pool(2, [4, 4], 8, (0, 5, 9), torch.float32, gen)
    batch = LoraBatch.build([0, 1], [2, 2], device=DEVICE, kernel="sgmv")
    y, v = torch.zeros(4, 9, device=DEVICE), torch.zeros(4, 8, device=DEVICE)
    with pytest.raises(AssertionError):  # v has 2 slices of ranks, bounds name 3
        kernels.bgmv_expand_triton(y, v, b, batch.token_slots, scales, slice_bounds=(0, 3, 5, 9))
    with pytest.raises(AssertionError):  # bounds do not end at h_out
        kernels.bgmv_expand_triton(y, v, b, batch.token_slots, scales, slice_bounds=(0, 5, 8))
    with pytest.raises(AssertionError):  # more slices than the kernels take
        kernels.bgmv_expand_triton(y, torch.zeros(4, 16, device=DEVICE), b, batch.token_slots, scales,
                                   slice_bounds=(0, 2, 4, 6, 9))


def test_the_tiled_shrink_runs_one_variant_split_or_not(monkeypatch):
    """A short prompt splits h_in across programs, a long one (run eagerly, past the CUDA graphs'
    sizes) takes one split: both launch the kernel with the same compile-time arguments, so a long
    prompt never compiles a variant while others wait, and both match the reference."""
    launches = []
    kernel = kernels.sgmv_shrink_tile_kernel

    class Recorded:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((grid[1], {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}))
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(kernels, "sgmv_shrink_tile_kernel", Recorded())
    gen = torch.Generator().manual_seed(3)
    a, _, _ = make_pool(2, [8, 8], 256, 8, torch.float32, gen)
    for num_tokens in (64, 64 * 2 * kernels.TILE_PROGRAMS_PER_SM * num_sms(torch.device(DEVICE))):
        x = torch.randn(num_tokens, 256, generator=gen).to(DEVICE)
        half = num_tokens // 2
        batch = LoraBatch.build([0, 1], [half, num_tokens - half], device=DEVICE, kernel="sgmv")
        got = kernels.sgmv_shrink_triton(x, a, batch.seg_indptr, batch.seg_slots, block_m=64)
        want = ops.sgmv_shrink_ref(x, a, batch.seg_indptr, batch.seg_slots)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    (splits_short, short), (splits_long, long) = launches
    assert splits_short > 1 and splits_long == 1 and short == long


def test_sgmv_runs_rowwise_exactly_where_bgmv_is_preferred():
    for num_tokens, num_segments, block_m in [(64, 64, 1), (64, 1, 1), (4096, 4096, 1),
                                              (4096, 300, 1), (4096, 16, 64), (512, 20, 16)]:
        assert kernels.sgmv_block_m(num_tokens, num_segments) == block_m
        assert ops.prefer_bgmv(num_tokens, num_segments) == (block_m == 1)


# ---- GPU, real shapes -------------------------------------------------------------------
