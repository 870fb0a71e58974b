import random

import pytest
import torch

from punica.lora.batch import LoraBatch
from punica.ops import lora as ops
from punica.workloads import WORKLOADS, adapter_ids


def make_pool(num_slots, ranks, h_in, h_out, dtype, gen):
    """Random pool weights with per-slot ranks, zero-padded to the largest rank."""
    max_rank = max(ranks)
    a = torch.zeros(num_slots, max_rank, h_in, dtype=dtype)
    b = torch.zeros(num_slots, h_out, max_rank, dtype=dtype)
    for s, r in enumerate(ranks):
        a[s, :r] = torch.randn(r, h_in, generator=gen).to(dtype) / h_in**0.5
        b[s, :, :r] = torch.randn(h_out, r, generator=gen).to(dtype)
    scales = torch.rand(num_slots, generator=gen) + 0.5
    return a, b, scales


def naive(y, x, a, b, scales, req_slots, req_lens):
    """Per-request loop in float64: the plain meaning of add_lora."""
    out = y.double().clone()
    lo = 0
    for slot, n in zip(req_slots, req_lens):
        if slot >= 0:
            out[lo:lo + n] += (x[lo:lo + n].double() @ a[slot].double().T) @ b[slot].double().T * float(scales[slot])
        lo += n
    return out


@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sgmv_equals_bgmv_equals_loop(workload, dtype):
    gen = torch.Generator().manual_seed(hash((workload, str(dtype))) % 2**31)
    rng = random.Random(7)
    num_requests, h_in, h_out = 12, 72, 40
    ids = adapter_ids(workload, num_requests, rng)
    num_slots = max(ids) + 2
    ranks = [rng.choice([1, 3, 8, 16]) for _ in range(num_slots)]
    a, b, scales = make_pool(num_slots, ranks, h_in, h_out, dtype, gen)
    # one request without LoRA, sorted so that equal slots are neighbours
    req_slots = sorted(ids[:-1]) + [-1]
    req_lens = [rng.randint(1, 9) for _ in req_slots]
    x = torch.randn(sum(req_lens), h_in, generator=gen).to(dtype)
    y0 = torch.randn(sum(req_lens), h_out, generator=gen).to(dtype)
    expect = naive(y0, x, a, b, scales, req_slots, req_lens)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for kernel in ("sgmv", "bgmv"):
        batch = LoraBatch.build(req_slots, req_lens, kernel=kernel)
        y = y0.clone()
        ops.add_lora(y, x, a, b, scales, batch)
        torch.testing.assert_close(y.double(), expect, rtol=tol, atol=tol)
    # rows of slot -1 are untouched
    n_last = req_lens[-1]
    assert torch.equal(y[-n_last:], y0[-n_last:])


def test_shrink_then_expand_on_column_slice():
    gen = torch.Generator().manual_seed(0)
    a, b, scales = make_pool(3, [4, 8, 2], 16, 24, torch.float32, gen)
    x = torch.randn(6, 16, generator=gen)
    wide = torch.randn(6, 60, generator=gen)
    before = wide.clone()
    batch = LoraBatch.build([2, 0, -1], [1, 3, 2])
    ops.add_lora(wide[:, 10:34], x, a, b, scales, batch)
    expect = naive(before[:, 10:34], x, a, b, scales, [2, 0, -1], [1, 3, 2])
    torch.testing.assert_close(wide[:, 10:34].double(), expect, rtol=1e-5, atol=1e-5)
    assert torch.equal(wide[:, :10], before[:, :10]) and torch.equal(wide[:, 34:], before[:, 34:])


def test_shrink_writes_zeros_for_no_lora_rows():
    gen = torch.Generator().manual_seed(1)
    a, _, _ = make_pool(2, [8, 8], 16, 8, torch.float32, gen)
    x = torch.randn(5, 16, generator=gen)
    batch = LoraBatch.build([-1, 1], [2, 3])
    v_seg = ops.sgmv_shrink(x, a, batch.seg_indptr, batch.seg_slots)
    v_tok = ops.bgmv_shrink(x, a, batch.token_slots)
    assert torch.equal(v_seg[:2], torch.zeros(2, 8)) and torch.equal(v_tok[:2], torch.zeros(2, 8))
    torch.testing.assert_close(v_seg, v_tok)
    torch.testing.assert_close(v_seg[2:], x[2:] @ a[1].T)


def test_lora_batch_merges_neighbouring_equal_slots():
    batch = LoraBatch.build([3, 3, -1, 0, 0, 3], [2, 1, 4, 1, 1, 2])
    assert batch.seg_indptr.tolist() == [0, 3, 7, 9, 11]
    assert batch.seg_slots.tolist() == [3, -1, 0, 3]
    assert batch.token_slots.tolist() == [3, 3, 3, -1, -1, -1, -1, 0, 0, 3, 3]
    assert batch.any_lora
    assert not LoraBatch.build([-1, -1], [2, 2]).any_lora


def test_lora_batch_runs_prefills_on_sgmv_and_decodes_on_bgmv():
    """A mixed batch (3 prefill requests, then decodes): the segments cover the prefill tokens
    only, SGMV runs them and BGMV the decodes; forced BGMV covers no token with segments."""
    slots, lens = [2, 2, 0, 1, -1, 2, 0], [3, 2, 6, 1, 1, 1, 1]
    mixed = LoraBatch.build(slots, lens, kernel="sgmv", num_prefills=3)
    assert mixed.sgmv_tokens == 11 and mixed.seg_indptr.tolist() == [0, 5, 11] and mixed.seg_slots.tolist() == [2, 0]
    assert mixed.token_slots.tolist() == [2] * 5 + [0] * 6 + [1, -1, 2, 0]
    every = LoraBatch.build(slots, lens)  # on the CPU: every request a segment
    assert every.sgmv_tokens == 15 and every.seg_slots.tolist() == [2, 0, 1, -1, 2, 0]
    bgmv = LoraBatch.build(slots, lens, kernel="bgmv", num_prefills=3)
    assert bgmv.sgmv_tokens == 0 and bgmv.seg_indptr.tolist() == [0] and bgmv.seg_slots.numel() == 0
    with pytest.raises(ValueError, match="kernel must be one of"):
        LoraBatch.build(slots, lens, kernel="segmented")


@pytest.mark.parametrize("kernel,num_prefills", [("sgmv", None), ("bgmv", None), ("sgmv", 3)])
def test_add_lora_on_a_group_equals_one_add_lora_per_projection(kernel, num_prefills):
    """q/k/v as one group: stacked A [S, 3R, h], stacked B [S, q+2kv, R], one call on the fused
    output; equal to the plain meaning, one projection (column slice) at a time, in float64."""
    gen = torch.Generator().manual_seed(4)
    bounds, h_in = (0, 24, 32, 40), 16
    parts = [make_pool(4, [8, 3, 5, 1], h_in, hi - lo, torch.float32, gen) for lo, hi in zip(bounds, bounds[1:])]
    scales = parts[0][2]
    a = torch.cat([p[0] for p in parts], dim=1)
    b = torch.cat([p[1] for p in parts], dim=1)
    req_slots, req_lens = [3, 3, -1, 0, 2, 1], [2, 1, 4, 5, 1, 3]
    x = torch.randn(sum(req_lens), h_in, generator=gen)
    y0 = torch.randn(sum(req_lens), bounds[-1], generator=gen)
    expect = torch.cat([naive(y0[:, lo:hi], x, p[0], p[1], scales, req_slots, req_lens)
                        for (lo, hi), p in zip(zip(bounds, bounds[1:]), parts)], dim=1)
    y = y0.clone()
    batch = LoraBatch.build(req_slots, req_lens, kernel=kernel, num_prefills=num_prefills)
    ops.add_lora(y, x, a, b, scales, batch, bounds)
    torch.testing.assert_close(y.double(), expect, rtol=1e-5, atol=1e-5)
    assert torch.equal(y[3:7], y0[3:7])  # the request without LoRA
