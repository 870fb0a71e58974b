"""Triton kernels for the fused layer ops; semantics: punica.ops.layers.

* RMSNorm (+ residual): one program per row. Rows up to MAX_ROW_BLOCK elements stay in
  registers (one read, one write, one more write of the residual sum); longer rows loop over
  blocks twice, the second pass re-reading the inputs (and recomputing the sum) rather than the
  written residual, so no program reads memory another thread of it wrote.
* Rotary embedding: one program per (token, block of heads) rotates those heads of q and the
  same-numbered heads of k in place; cos/sin of the token are loaded once.
* SiLU-and-mul: one program per (token, block of intermediate columns).

All math is fp32; intermediate roundings to the tensor dtype follow the PyTorch references
exactly (the residual sum, the normalised row before the weight, silu before the product).
RMSNorm and SiLU-and-mul add a pending LoRA delta (punica.ops.layers.PendingDelta) to their input
as they load it, with add_delta's arithmetic (an add, DoRA's product, one rounding: nothing to
contract), so the values they go on with are those add_delta would have written.
Kernels allocate nothing but their outputs, never sync, and their grids depend only on shapes,
so they are safe under CUDA-graph capture. Any hidden / head / intermediate size: tails masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from punica.ops.lora_kernels import dora_out_scales
from punica.ops.lora_triton import check_dora
from punica.ops.triton_env import interpreting

MAX_ROW_BLOCK = 16384      # RMSNorm rows up to this many elements are held in registers
ROPE_TILE = 512            # elements (heads x D/2) a rotary program rotates per tensor
SILU_BLOCK = 1024          # intermediate columns per SiLU-and-mul program


@triton.jit
def plus_delta(v, d, slot, offs, mask, out_scales, dora_slots, h_out, stride_os, stride_on, DORA: tl.constexpr):
    """v (one row's values at offs) plus its row's pending LoRA delta d (a pointer to that row), times
    the slot's DoRA out_scales where it is a DoRA slot, rounded once to v's dtype: add_delta."""
    out = v.to(tl.float32) + tl.load(d + offs, mask=mask, other=0.0)
    if DORA:
        out = out * dora_out_scales(out_scales, dora_slots, tl.maximum(slot, 0), offs, tl.where(slot >= 0, h_out, 0),
                                    stride_os, stride_on)
    return out.to(v.dtype)


@triton.jit
def _norm_input(x, residual, offs, mask, d, slot, out_scales, dora_slots, hidden, stride_os, stride_on,
                HAS_RESIDUAL: tl.constexpr, HAS_DELTA: tl.constexpr, DORA: tl.constexpr):
    """The row's input at offs in x's dtype: x (plus its pending delta), or that + residual (rounded
    as the model adds them)."""
    v = tl.load(x + offs, mask=mask, other=0.0)
    if HAS_DELTA:
        v = plus_delta(v, d, slot, offs, mask, out_scales, dora_slots, hidden, stride_os, stride_on, DORA)
    if HAS_RESIDUAL:
        r = tl.load(residual + offs, mask=mask, other=0.0)
        v = (v.to(tl.float32) + r.to(tl.float32)).to(x.dtype.element_ty)
    return v


@triton.jit
def _rms_norm_kernel(x, residual, weight, out, residual_out, d, token_slots, out_scales, dora_slots, hidden, eps,
                     stride_x, stride_r, stride_out, stride_r_out, stride_d, stride_os, stride_on,
                     HAS_RESIDUAL: tl.constexpr, HAS_DELTA: tl.constexpr, DORA: tl.constexpr, BLOCK: tl.constexpr,
                     NUM_BLOCKS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = -1
    if HAS_DELTA:
        slot = tl.load(token_slots + row)
    d += row * stride_d
    x += row * stride_x
    residual += row * stride_r
    out += row * stride_out
    residual_out += row * stride_r_out
    cols = tl.arange(0, BLOCK)
    if NUM_BLOCKS == 1:
        mask = cols < hidden
        v = _norm_input(x, residual, cols, mask, d, slot, out_scales, dora_slots, hidden, stride_os, stride_on,
                        HAS_RESIDUAL, HAS_DELTA, DORA)
        if HAS_RESIDUAL:
            tl.store(residual_out + cols, v, mask=mask)
        v = v.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(v * v, axis=0) / hidden + eps)
        normed = (v * rstd).to(x.dtype.element_ty).to(tl.float32)
        w = tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out + cols, (w * normed).to(out.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, hidden, BLOCK):
            mask = start + cols < hidden
            v = _norm_input(x, residual, start + cols, mask, d, slot, out_scales, dora_slots, hidden, stride_os,
                            stride_on, HAS_RESIDUAL, HAS_DELTA, DORA)
            if HAS_RESIDUAL:
                tl.store(residual_out + start + cols, v, mask=mask)
            v = v.to(tl.float32)
            acc += v * v
        rstd = tl.rsqrt(tl.sum(acc, axis=0) / hidden + eps)
        for start in range(0, hidden, BLOCK):
            mask = start + cols < hidden
            v = _norm_input(x, residual, start + cols, mask, d, slot, out_scales, dora_slots, hidden, stride_os,
                            stride_on, HAS_RESIDUAL, HAS_DELTA, DORA)
            normed = (v.to(tl.float32) * rstd).to(x.dtype.element_ty).to(tl.float32)
            w = tl.load(weight + start + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(out + start + cols, (w * normed).to(out.dtype.element_ty), mask=mask)


@triton.jit
def _rotate(x, heads, num_heads, stride_head, half, dims, cos, sin):
    """Rotate heads `heads` (those < num_heads) of one token's row x in place."""
    mask = (heads < num_heads)[:, None] & (dims < half)[None, :]
    first = x + heads[:, None] * stride_head + dims[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(x.dtype.element_ty), mask=mask)
    tl.store(first + half, (x2 * cos + x1 * sin).to(x.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(q, k, cos, sin, num_heads, num_kv_heads, half,
                 stride_q_token, stride_q_head, stride_k_token, stride_k_head, stride_cos, stride_sin,
                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    c = tl.load(cos + token * stride_cos + dims, mask=dims < half, other=0.0)[None, :]
    s = tl.load(sin + token * stride_sin + dims, mask=dims < half, other=0.0)[None, :]
    _rotate(q + token * stride_q_token, heads, num_heads, stride_q_head, half, dims, c, s)
    _rotate(k + token * stride_k_token, heads, num_kv_heads, stride_k_head, half, dims, c, s)


@triton.jit
def _silu_and_mul_kernel(gate_up, out, d, token_slots, out_scales, dora_slots, inter, stride_in, stride_out, stride_d,
                         stride_os, stride_on, HAS_DELTA: tl.constexpr, DORA: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gate_up + token * stride_in + cols, mask=mask, other=0.0)
    up = tl.load(gate_up + token * stride_in + inter + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        slot = tl.load(token_slots + token)
        d += token * stride_d
        gate = plus_delta(gate, d, slot, cols, mask, out_scales, dora_slots, 2 * inter, stride_os, stride_on, DORA)
        up = plus_delta(up, d, slot, inter + cols, mask, out_scales, dora_slots, 2 * inter, stride_os, stride_on,
                         DORA)
    gate = gate.to(tl.float32)
    up = up.to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out.dtype.element_ty).to(tl.float32)
    tl.store(out + token * stride_out + cols, (act * up).to(out.dtype.element_ty), mask=mask)


def _row_warps(block: int) -> int:
    return min(max(block // 256, 1), 16)


def delta_args(delta: tuple | None, y: torch.Tensor, shape: tuple[int, int] | None = None) -> tuple:
    """A kernel's (d, token_slots, out_scales, dora_slots, d's row stride, out_scales' strides) for
    the delta pending on y (punica.ops.layers.PendingDelta; of `shape`, default y's), and
    (HAS_DELTA, DORA); pointers never read are y's."""
    if delta is None:
        return (y, y, y, y, 0, 0, 0), (False, False)
    d, token_slots, dora = delta
    shape = tuple(y.shape) if shape is None else shape
    assert d.shape == shape and d.dtype == torch.float32 and d.stride(1) == 1, (d.shape, shape, d.dtype)
    assert token_slots.shape == shape[:1], (token_slots.shape, shape)
    out_scales, dora_slots, stride_os, stride_on, has_dora = check_dora(dora, None, shape[1])
    if not has_dora:
        out_scales = dora_slots = y
    return (d, token_slots, out_scales, dora_slots, d.stride(0), stride_os, stride_on), (True, has_dora)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                    max_row_block: int = MAX_ROW_BLOCK, delta: tuple | None = None):
    """punica.ops.layers.rms_norm; `max_row_block` (a power of 2) bounds the per-program block."""
    num_tokens, hidden = x.shape
    assert x.stride(1) == 1 and weight.stride(0) == 1, (x.stride(), weight.stride())
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    residual_out = None if residual is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    if num_tokens:
        if residual is not None:
            assert residual.stride(1) == 1, residual.stride()
        block = min(triton.next_power_of_2(hidden), max_row_block)
        # without a residual its pointers are never read or written: pass x's
        r_in, r_out = (x, x) if residual is None else (residual, residual_out)
        (d, token_slots, out_scales, dora_slots, stride_d, stride_os, stride_on), (has_delta, dora) = delta_args(
            delta, x)
        _rms_norm_kernel[(num_tokens,)](
            x, r_in, weight, out, r_out, d, token_slots, out_scales, dora_slots, hidden, eps, x.stride(0),
            r_in.stride(0), out.stride(0), r_out.stride(0), stride_d, stride_os, stride_on,
            HAS_RESIDUAL=residual is not None, HAS_DELTA=has_delta, DORA=dora, BLOCK=block,
            NUM_BLOCKS=triton.cdiv(hidden, block), num_warps=_row_warps(block),
        )
    return out if residual is None else (out, residual_out)


def rope_triton_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """punica.ops.layers.rope_ (in place)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, half = k.shape[1], head_dim // 2
    assert head_dim % 2 == 0 and q.stride(2) == k.stride(2) == cos.stride(1) == sin.stride(1) == 1, \
        (q.stride(), k.stride(), cos.stride(), sin.stride())
    assert cos.dtype == sin.dtype == torch.float32, (cos.dtype, sin.dtype)
    if num_tokens == 0:
        return
    block_d = triton.next_power_of_2(half)
    max_heads = max(num_heads, num_kv_heads)
    block_h = 2 if interpreting() else max(1, ROPE_TILE // block_d)
    block_h = min(block_h, triton.next_power_of_2(max_heads))
    _rope_kernel[(num_tokens, triton.cdiv(max_heads, block_h))](
        q, k, cos, sin, num_heads, num_kv_heads, half, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos.stride(0), sin.stride(0), BLOCK_H=block_h, BLOCK_D=block_d,
    )


def silu_and_mul_triton(gate_up: torch.Tensor, delta: tuple | None = None) -> torch.Tensor:
    """punica.ops.layers.silu_and_mul."""
    num_tokens, width = gate_up.shape
    inter = width // 2
    assert gate_up.stride(1) == 1, gate_up.stride()
    out = torch.empty(num_tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens:
        block = 64 if interpreting() else min(SILU_BLOCK, triton.next_power_of_2(inter))
        (d, token_slots, out_scales, dora_slots, stride_d, stride_os, stride_on), (has_delta, dora) = delta_args(
            delta, gate_up)
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
            gate_up, out, d, token_slots, out_scales, dora_slots, inter, gate_up.stride(0), out.stride(0), stride_d,
            stride_os, stride_on, HAS_DELTA=has_delta, DORA=dora, BLOCK=block, num_warps=4,
        )
    return out
