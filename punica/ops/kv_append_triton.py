"""Triton kernels that append to the paged KV cache; semantics and layout: punica.ops.attention.

* KV append: one program per token copies its K and V rows into its slot.
* Rotary + KV append: one program per (token, block of heads) rotates q in place and writes
  rotated K and V into the token's slot.
* FP8 (an e4m3 cache, FP8): each program holds whole rows (all D of a head), so it takes each
  row's amax, stores scale = max(amax / 448, FLT_MIN) beside the pages and e4m3(row / scale)
  into them (punica.ops.kv_cache). Triton's interpreter converts fp32 to e4m3 wrongly (it rounds
  ties away and drops a rounding carry into the exponent: 127 becomes 64), so under it (EXACT) the
  kernels first round each value to e4m3's grid in fp32 arithmetic, which leaves the conversion
  exact; compiled for a GPU the conversion rounds itself (to nearest, ties to even).

Grids depend only on tensor shapes; each token's slot is read on the device (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from punica.ops.layers_triton import delta_args, plus_delta
from punica.ops.triton_env import interpreting

ROPE_TILE = 512  # elements (heads x D/2) of q, and of k, one rotary + KV-append program handles


@triton.jit
def fp8_row_scale(amax):
    """punica.ops.kv_cache.quantize_kv_ref's scale: max(amax / 448, FLT_MIN)."""
    return tl.maximum(amax / 448.0, 1.1754943508222875e-38)


@triton.jit
def to_e4m3(x, EXACT: tl.constexpr):
    """x (fp32, |x| <= 448) as e4m3; EXACT: rounded to e4m3's grid first, to nearest in fp32
    arithmetic: normal values (|x| >= 2^-6) to 4 significant bits by Veltkamp's split (2^20 + 1),
    subnormal ones to a multiple of 2^-9 by adding and subtracting 1.5 * 2^14."""
    if EXACT:
        split = x * 1048577.0
        x = tl.where(tl.abs(x) < 0.015625, (x + 24576.0) - 24576.0, split - (split - x))
    return x.to(tl.float8e4nv)


@triton.jit
def _write_kv_kernel(
    k, v, kv, scales, slot_mapping, num_kv_heads,
    stride_k_token, stride_k_head, stride_k_dim, stride_v_token, stride_v_head, stride_v_dim,
    stride_kv_page, stride_kv_kv, stride_kv_token, stride_kv_head, stride_kv_dim,
    stride_s_page, stride_s_kv, stride_s_token, stride_s_head,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, FP8: tl.constexpr,
    EXACT: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HEAD_DIM)
    ok = (heads < num_kv_heads)[:, None]
    dst = (kv + (slot // PAGE_SIZE) * stride_kv_page + (slot % PAGE_SIZE) * stride_kv_token
           + heads[:, None] * stride_kv_head + dims[None, :] * stride_kv_dim)
    kt = tl.load(k + t * stride_k_token + heads[:, None] * stride_k_head + dims[None, :] * stride_k_dim, mask=ok)
    vt = tl.load(v + t * stride_v_token + heads[:, None] * stride_v_head + dims[None, :] * stride_v_dim, mask=ok)
    if FP8:
        scale_dst = (scales + (slot // PAGE_SIZE) * stride_s_page + (slot % PAGE_SIZE) * stride_s_token
                     + heads * stride_s_head)
        kt = kt.to(tl.float32)
        vt = vt.to(tl.float32)
        k_scale = fp8_row_scale(tl.max(tl.abs(kt), axis=1))
        v_scale = fp8_row_scale(tl.max(tl.abs(vt), axis=1))
        tl.store(scale_dst, k_scale, mask=heads < num_kv_heads)
        tl.store(scale_dst + stride_s_kv, v_scale, mask=heads < num_kv_heads)
        tl.store(dst, to_e4m3(kt / k_scale[:, None], EXACT), mask=ok)
        tl.store(dst + stride_kv_kv, to_e4m3(vt / v_scale[:, None], EXACT), mask=ok)
    else:
        tl.store(dst, kt.to(kv.dtype.element_ty), mask=ok)
        tl.store(dst + stride_kv_kv, vt.to(kv.dtype.element_ty), mask=ok)


@triton.jit
def _loaded_halves(x, token, stride_token, stride_head, heads, dims, half, ok, d, slot, col, out_scales,
                   dora_slots, h_out, stride_os, stride_on, HAS_DELTA: tl.constexpr, DORA: tl.constexpr):
    """(pointer to the first halves, first halves, second halves) of heads `heads` of one token's
    row x, in x's dtype, with its pending LoRA delta added where HAS_DELTA (d: the token's row of
    the delta, col: the delta's column of each head's first element)."""
    first = x + token * stride_token + heads[:, None] * stride_head + dims[None, :]
    x1 = tl.load(first, mask=ok, other=0.0)
    x2 = tl.load(first + half, mask=ok, other=0.0)
    if HAS_DELTA:
        cols = col[:, None] + dims[None, :]
        x1 = plus_delta(x1, d, slot, cols, ok, out_scales, dora_slots, h_out, stride_os, stride_on, DORA)
        x2 = plus_delta(x2, d, slot, cols + half, ok, out_scales, dora_slots, h_out, stride_os, stride_on, DORA)
    return first, x1, x2


@triton.jit
def _rope_and_write_kv_kernel(
    q, k, v, kv, scales, cos, sin, slot_mapping, d, token_slots, out_scales, dora_slots, num_heads, num_kv_heads,
    half, stride_q_token, stride_q_head, stride_k_token, stride_k_head, stride_v_token, stride_v_head,
    stride_kv_page, stride_kv_kv, stride_kv_token, stride_kv_head, stride_cos, stride_sin,
    stride_s_page, stride_s_kv, stride_s_token, stride_s_head, stride_d, stride_os, stride_on,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
    EXACT: tl.constexpr, HAS_DELTA: tl.constexpr, DORA: tl.constexpr,
):
    """Heads of one block of one token: q's rotated in place, k's rotated and v's copied into
    the token's slot (k rounded to its own dtype first, as rope_ then write_kv round); with
    HAS_DELTA each first plus its pending LoRA delta (d's columns: q's, then k's, then v's)."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < half
    c = tl.load(cos + token * stride_cos + dims, mask=dim_ok, other=0.0)[None, :]
    s = tl.load(sin + token * stride_sin + dims, mask=dim_ok, other=0.0)[None, :]
    lora_slot = -1
    if HAS_DELTA:
        lora_slot = tl.load(token_slots + token)
    d += token * stride_d
    head_dim = 2 * half
    h_out = (num_heads + 2 * num_kv_heads) * head_dim
    q_ok = (heads < num_heads)[:, None] & dim_ok[None, :]
    first, x1, x2 = _loaded_halves(q, token, stride_q_token, stride_q_head, heads, dims, half, q_ok, d, lora_slot,
                                   heads * head_dim, out_scales, dora_slots, h_out, stride_os, stride_on, HAS_DELTA,
                                   DORA)
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    tl.store(first, (x1 * c - x2 * s).to(q.dtype.element_ty), mask=q_ok)
    tl.store(first + half, (x2 * c + x1 * s).to(q.dtype.element_ty), mask=q_ok)
    kv_ok = (heads < num_kv_heads)[:, None] & dim_ok[None, :]
    slot = tl.load(slot_mapping + token).to(tl.int64)
    dst = (kv + (slot // PAGE_SIZE) * stride_kv_page + (slot % PAGE_SIZE) * stride_kv_token
           + heads[:, None] * stride_kv_head + dims[None, :])
    _, x1, x2 = _loaded_halves(k, token, stride_k_token, stride_k_head, heads, dims, half, kv_ok, d, lora_slot,
                               (num_heads + heads) * head_dim, out_scales, dora_slots, h_out, stride_os, stride_on,
                               HAS_DELTA, DORA)
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    k1 = (x1 * c - x2 * s).to(k.dtype.element_ty)
    k2 = (x2 * c + x1 * s).to(k.dtype.element_ty)
    _, v1, v2 = _loaded_halves(v, token, stride_v_token, stride_v_head, heads, dims, half, kv_ok, d, lora_slot,
                               (num_heads + num_kv_heads + heads) * head_dim, out_scales, dora_slots, h_out,
                               stride_os, stride_on, HAS_DELTA, DORA)
    if FP8:  # masked elements load as 0, so each row's amax is its own
        k1, k2, v1, v2 = k1.to(tl.float32), k2.to(tl.float32), v1.to(tl.float32), v2.to(tl.float32)
        k_scale = fp8_row_scale(tl.maximum(tl.max(tl.abs(k1), axis=1), tl.max(tl.abs(k2), axis=1)))
        v_scale = fp8_row_scale(tl.maximum(tl.max(tl.abs(v1), axis=1), tl.max(tl.abs(v2), axis=1)))
        head_ok = heads < num_kv_heads
        scale_dst = (scales + (slot // PAGE_SIZE) * stride_s_page + (slot % PAGE_SIZE) * stride_s_token
                     + heads * stride_s_head)
        tl.store(scale_dst, k_scale, mask=head_ok)
        tl.store(scale_dst + stride_s_kv, v_scale, mask=head_ok)
        tl.store(dst, to_e4m3(k1 / k_scale[:, None], EXACT), mask=kv_ok)
        tl.store(dst + half, to_e4m3(k2 / k_scale[:, None], EXACT), mask=kv_ok)
        tl.store(dst + stride_kv_kv, to_e4m3(v1 / v_scale[:, None], EXACT), mask=kv_ok)
        tl.store(dst + stride_kv_kv + half, to_e4m3(v2 / v_scale[:, None], EXACT), mask=kv_ok)
    else:
        tl.store(dst, k1.to(kv.dtype.element_ty), mask=kv_ok)
        tl.store(dst + half, k2.to(kv.dtype.element_ty), mask=kv_ok)
        tl.store(dst + stride_kv_kv, v1.to(kv.dtype.element_ty), mask=kv_ok)
        tl.store(dst + stride_kv_kv + half, v2.to(kv.dtype.element_ty), mask=kv_ok)


def check_head_dim(head_dim: int) -> None:
    assert head_dim in (16, 32, 64, 128, 256), f"head_dim {head_dim}: the kernels take powers of 2 in 16..256"


def scale_strides(kv_layer: torch.Tensor, kv_scales: torch.Tensor | None) -> tuple[torch.Tensor, tuple, bool]:
    """(scales pointer, its 4 strides, FP8) for a kernel: with no scales, the pages and zeros."""
    if kv_scales is None:
        return kv_layer, (0, 0, 0, 0), False
    return kv_scales, kv_scales.stride(), True


def write_kv_triton(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                    kv_scales: torch.Tensor | None = None) -> None:
    """punica.ops.attention.write_kv."""
    num_tokens, num_kv_heads, head_dim = k.shape
    check_head_dim(head_dim)
    assert v.shape == k.shape and kv_layer.shape[3:] == (num_kv_heads, head_dim), (k.shape, v.shape, kv_layer.shape)
    if num_tokens == 0:
        return
    scales, s_strides, fp8 = scale_strides(kv_layer, kv_scales)
    _write_kv_kernel[(num_tokens,)](
        k, v, kv_layer, scales, slot_mapping, num_kv_heads, *k.stride(), *v.stride(), *kv_layer.stride(), *s_strides,
        HEAD_DIM=head_dim, PAGE_SIZE=kv_layer.shape[2], BLOCK_H=triton.next_power_of_2(num_kv_heads), FP8=fp8,
        EXACT=interpreting(),
    )


def rope_and_write_kv_triton_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                              sin: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor,
                              kv_scales: torch.Tensor | None = None, delta: tuple | None = None) -> None:
    """punica.ops.attention.rope_and_write_kv_ (q in place, k and v untouched; `delta` a
    punica.ops.layers.PendingDelta of q, k and v side by side). Grid: (token, block of heads), each
    program rotating ROPE_TILE elements (heads x D/2) of q and as many of k."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, half = k.shape[1], head_dim // 2
    assert head_dim % 2 == 0 and q.stride(2) == k.stride(2) == v.stride(2) == kv_layer.stride(4) == 1, \
        (q.stride(), k.stride(), v.stride(), kv_layer.stride())
    assert cos.stride(1) == sin.stride(1) == 1 and cos.dtype == sin.dtype == torch.float32, (cos, sin)
    if num_tokens == 0:
        return
    block_d = triton.next_power_of_2(half)
    max_heads = max(num_heads, num_kv_heads)
    block_h = min(2 if interpreting() else max(1, ROPE_TILE // block_d), triton.next_power_of_2(max_heads))
    scales, s_strides, fp8 = scale_strides(kv_layer, kv_scales)
    width = (num_heads + 2 * num_kv_heads) * head_dim  # the delta's columns: q's, k's, v's
    (d, token_slots, out_scales, dora_slots, stride_d, stride_os, stride_on), (has_delta, dora) = delta_args(
        delta, q, (num_tokens, width))
    _rope_and_write_kv_kernel[(num_tokens, triton.cdiv(max_heads, block_h))](
        q, k, v, kv_layer, scales, cos, sin, slot_mapping, d, token_slots, out_scales, dora_slots, num_heads,
        num_kv_heads, half, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *kv_layer.stride()[:4], cos.stride(0), sin.stride(0), *s_strides, stride_d, stride_os, stride_on,
        PAGE_SIZE=kv_layer.shape[2], BLOCK_H=block_h, BLOCK_D=block_d, FP8=fp8, EXACT=interpreting(),
        HAS_DELTA=has_delta, DORA=dora,
    )
