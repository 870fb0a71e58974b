"""The expand's per-token scales (a request's lora_scale) and DoRA out_scales: the Triton kernels
against the references of punica.ops.lora (helpers: test_lora_triton, beside this file)."""

import pytest
import torch
from test_lora_triton import DEVICE, Y_TOL, check_all_kernels, make_group_pool

from punica.lora.batch import LoraBatch
from punica.ops import lora as ops
from punica.ops import lora_triton as kernels


@pytest.mark.slow
def test_token_scales_and_dora_match_reference(slice_bounds=(0, 23, 30, 41)):
    """Per-token scales (requests of one adapter at different strengths in one segment, 0 among
    them) and DoRA slots (outputs times out_scales) beside plain ones: every kernel equals the
    reference; a scale of 0 on a plain slot leaves y as it was, 1 adds the plain delta, and a
    plain slot's rows are the same with or without DoRA slots in the batch."""
    gen = torch.Generator().manual_seed(11)
    h_out = slice_bounds[-1]
    a, b, scales = make_group_pool(3, [8, 3, 5], 19, slice_bounds, torch.float32, gen)
    dora = (torch.rand(3, h_out, generator=gen) + 0.5, torch.tensor([1, 0, 1], dtype=torch.int32))
    dora = tuple(t.to(DEVICE) for t in dora)
    slots, lens, request_scales = [0, 0, -1, 1, 1, 1, 2], [20, 3, 4, 17, 2, 18, 1], [1.0, 1.0, 1.0, 0.0, 1.0, 0.4, 1.0]
    batch = LoraBatch.build(slots, lens, device=DEVICE, request_scales=request_scales, kernel="sgmv")
    assert batch.seg_slots.tolist() == [0, -1, 1, 2], "one segment per run of a slot, whatever the scales"
    x = torch.randn(sum(lens), 19, generator=gen).to(DEVICE)
    y0 = torch.randn(sum(lens), h_out, generator=gen).to(DEVICE)
    check_all_kernels(x, y0, a, b, scales, batch, Y_TOL[torch.float32], block_ms=(1, 16), slice_bounds=slice_bounds,
                      token_scales=batch.token_scales, dora=dora, delta=True)
    v = ops.sgmv_shrink_ref(x, a, batch.seg_indptr, batch.seg_slots)
    plain_slot = batch.token_slots == 1
    zero, one = plain_slot & (batch.token_scales == 0), plain_slot & (batch.token_scales == 1)
    for block_m in (1, 16):  # against the same schedule without token scales and DoRA
        y, plain = y0.clone(), y0.clone()
        kernels.sgmv_expand_triton(y, v, b, batch.seg_indptr, batch.seg_slots, scales, block_m=block_m,
                                   slice_bounds=slice_bounds, token_scales=batch.token_scales, dora=dora)
        kernels.sgmv_expand_triton(plain, v, b, batch.seg_indptr, batch.seg_slots, scales, block_m=block_m,
                                   slice_bounds=slice_bounds)
        assert torch.equal(y[zero], y0[zero]) and torch.equal(y[one], plain[one]), block_m
        assert not torch.allclose(y[batch.token_slots == 0], plain[batch.token_slots == 0]), "DoRA changed its rows"
