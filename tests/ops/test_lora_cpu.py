"""The CPU's LoRA forms (punica.ops.lora_cpu: the grouped GEMMs and segment_lora) against the
references of punica.ops.lora: mixed adapters (repeated in separate segments, and tokens without
one), mixed ranks, sliced groups, per-token scales and DoRA slots, in fp32."""

import random
import zlib

import pytest
import torch

from punica.lora.batch import LoraBatch
from punica.ops import lora as ops
from punica.ops import lora_cpu
from punica.workloads import WORKLOADS, adapter_ids

needs_grouped = pytest.mark.skipif(not lora_cpu.grouped_available(), reason="this torch has no CPU grouped GEMM")


def make_group(num_slots, ranks, h_in, slices, gen, max_rank=16):
    """A projection group's pool: A [S, n*R, h_in], B [S, sum h_out, R] with per-slot ranks padded to
    R = max_rank, scales, DoRA out_scales and dora_slots (every third slot)."""
    n, h_out = len(slices), sum(slices)
    a = torch.zeros(num_slots, n * max_rank, h_in)
    b = torch.zeros(num_slots, h_out, max_rank)
    for s, r in enumerate(ranks):
        for j in range(n):
            a[s, j * max_rank:j * max_rank + r] = torch.randn(r, h_in, generator=gen) / h_in**0.5
        b[s, :, :r] = torch.randn(h_out, r, generator=gen)
    scales = torch.rand(num_slots, generator=gen) + 0.5
    out_scales = torch.rand(num_slots, h_out, generator=gen) + 0.5
    dora_slots = torch.tensor([int(s % 3 == 1) for s in range(num_slots)], dtype=torch.int32)
    bounds = tuple(sum(slices[:j]) for j in range(n + 1))
    return a, b, scales, (out_scales, dora_slots), bounds


def reference(y, x, a, b, scales, batch, bounds, dora):
    out = y.clone()
    ops.lora_expand(out, ops.lora_shrink(x, a, batch), b, scales, batch, bounds, dora)
    return out


def grouped(y, x, a, b, scales, batch, bounds, dora):
    out = y.clone()
    groups = batch.slot_groups(a.shape[0])
    lora_cpu.grouped_expand(out, lora_cpu.grouped_shrink(x, a, groups), b, scales, batch.token_scales, groups,
                            bounds, dora)
    return out


def segments(y, x, a, b, scales, batch, bounds, dora):
    out = y.clone()
    lora_cpu.segment_lora(out, x, a, b, scales, batch.token_scales, batch.seg_indptr, batch.seg_slots, bounds, dora)
    return out


FORMS = [pytest.param(grouped, id="grouped", marks=needs_grouped), pytest.param(segments, id="segments")]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("slices", [(40,), (24, 8, 8), (30, 30)])
@pytest.mark.parametrize("with_dora", [False, True])
def test_cpu_lora_is_the_reference(form, workload, slices, with_dora):
    rng = random.Random(zlib.crc32(repr((workload, slices, with_dora)).encode()))
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    num_requests, h_in = 14, 72
    ids = adapter_ids(workload, num_requests - 2, rng)
    num_slots = max(ids) + 3  # slots no token uses, before and after the used ones
    ranks = [rng.choice([1, 3, 8, 16]) for _ in range(num_slots)]
    a, b, scales, dora, bounds = make_group(num_slots, ranks, h_in, slices, gen)
    # unsorted, so that a slot's tokens lie in several segments; two requests without LoRA
    req_slots = ids + [-1, -1]
    rng.shuffle(req_slots)
    req_lens = [rng.choice([1, 1, 1, 5, 9]) for _ in req_slots]
    batch = LoraBatch.build(req_slots, req_lens, request_scales=[rng.choice([0.0, 0.5, 1.0, 2.0])
                                                                 for _ in req_slots])
    x = torch.randn(sum(req_lens), h_in, generator=gen)
    y = torch.randn(sum(req_lens), sum(slices), generator=gen)
    d = dora if with_dora else None
    expect = reference(y, x, a, b, scales, batch, bounds, d)
    got = form(y, x, a, b, scales, batch, bounds, d)
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)
    no_lora = batch.token_slots < 0
    assert no_lora.any() and torch.equal(got[no_lora], y[no_lora])
    assert not torch.equal(got[~no_lora], y[~no_lora])


@needs_grouped
def test_grouped_shrink_of_distinct_decodes_is_each_tokens_product():
    """One token per adapter, the decode step of a batch of distinct adapters: each row of v is that
    token's product with its slot's A, exactly; rows without an adapter are zero."""
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(9, 16, 64, generator=gen)
    slots = [4, 0, -1, 7, 2, 8]
    batch = LoraBatch.build(slots, [1] * len(slots))
    x = torch.randn(len(slots), 64, generator=gen)
    v = lora_cpu.grouped_shrink(x, a, batch.slot_groups(9))
    for t, slot in enumerate(slots):
        assert torch.equal(v[t], (x[t:t + 1] @ a[slot].T)[0] if slot >= 0 else torch.zeros(16))


@pytest.mark.parametrize("form", FORMS)
def test_a_batch_without_adapters_leaves_y_alone(form):
    gen = torch.Generator().manual_seed(4)
    a, b, scales, dora, bounds = make_group(3, [4, 4, 4], 32, (20,), gen)
    batch = LoraBatch.build([-1, -1], [2, 3])
    x, y = torch.randn(5, 32, generator=gen), torch.randn(5, 20, generator=gen)
    assert torch.equal(form(y, x, a, b, scales, batch, bounds, dora), y)


def test_slot_groups_sort_the_tokens_with_an_adapter_by_slot():
    batch = LoraBatch.build([2, -1, 0, 2], [1, 1, 3, 1])
    groups = batch.slot_groups(4)
    assert groups.rows.tolist() == [2, 3, 4, 0, 5] and groups.slots.tolist() == [0, 0, 0, 2, 2]
    assert groups.offsets.tolist() == [3, 3, 5, 5]
    assert batch.slot_groups(4) is groups


@needs_grouped
def test_grouped_lora_applies_to_cpu_fp32_with_aligned_strides_and_several_segments_only():
    """fp32 on the CPU, h_in and the padded rank multiples of 4 (the grouped GEMM's 16-byte strides),
    a batch of at least MIN_SEGMENTS segments."""
    a, b, n = torch.zeros(2, 4, 8), torch.zeros(2, 6, 4), lora_cpu.MIN_SEGMENTS
    assert lora_cpu.grouped_applies(torch.zeros(3, 8), a, b, n)
    assert not lora_cpu.grouped_applies(torch.zeros(3, 8), a, b, n - 1)
    assert not lora_cpu.grouped_applies(torch.zeros(3, 8, dtype=torch.bfloat16), a.bfloat16(), b.bfloat16(), n)
    assert not lora_cpu.grouped_applies(torch.zeros(3, 6), torch.zeros(2, 4, 6), b, n)
    assert not lora_cpu.grouped_applies(torch.zeros(3, 8), torch.zeros(2, 6, 8), torch.zeros(2, 6, 6), n)


def test_segments_apply_to_cpu_fp32_batches_whose_tokens_are_all_in_segments():
    a, b = torch.zeros(2, 4, 8), torch.zeros(2, 6, 4)
    assert lora_cpu.segments_apply(torch.zeros(3, 8), a, b, sgmv_tokens=3)
    assert not lora_cpu.segments_apply(torch.zeros(3, 8), a, b, sgmv_tokens=2)
    assert not lora_cpu.segments_apply(torch.zeros(3, 8, dtype=torch.bfloat16), a.bfloat16(), b.bfloat16(), 3)


def test_one_decode_token_on_one_adapter_gets_its_delta():
    """The single stream's decode step: y += scale * token scale * x @ A.T @ B.T, slice by slice."""
    gen = torch.Generator().manual_seed(5)
    a, b, scales, dora, bounds = make_group(4, [8, 8, 8, 8], 32, (24, 8, 8), gen)
    batch = LoraBatch.build([2], [1], request_scales=[0.5])
    x, y = torch.randn(1, 32, generator=gen), torch.randn(1, 40, generator=gen)
    got = segments(y, x, a, b, scales, batch, bounds, None)
    expect = y.clone()
    for j, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        expect[:, lo:hi] += 0.5 * scales[2] * (x @ a[2, j * 16:(j + 1) * 16].T) @ b[2, lo:hi].T
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)
