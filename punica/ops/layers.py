"""The decoder layer's elementwise ops, fused: RMSNorm (optionally with the residual add before
it), rotary embedding of q and k in one call, and SiLU-and-mul (GELU-and-mul, Gemma's, runs as
torch's ops on every device).

Unfused, each is a handful of tiny kernels (RMSNorm ~6, rotary ~10 per tensor, SiLU * up 2-3,
plus every residual add); in a decode step captured as a CUDA graph each still costs a launch
slot of about 2 us. RMSNorm and SiLU-and-mul also take a LoRA delta still pending on their input
(PendingDelta: the side stream's delta of the projection that wrote it), which they add as they
read it, so that no launch of its own adds it. The PyTorch references (`*_ref`) are the spec and
match HuggingFace's Llama numerics; each public function runs the Triton kernel of
punica.ops.layers_triton when its tensors are on CUDA, and the reference otherwise.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from punica.ops.lora import add_delta


class PendingDelta(NamedTuple):
    """A projection's LoRA delta not yet added to its output y: the op that next reads y adds it,
    exactly as punica.ops.lora.add_delta would have before it (y = (y + d) rounded to y's dtype,
    the rows of DoRA slots times their out_scales first)."""
    d: torch.Tensor                                     # [T, h_out] float32 (punica.ops.lora.bgmv_delta)
    token_slots: torch.Tensor                           # [T] int32, -1: no adapter (d's row is 0)
    dora: tuple[torch.Tensor, torch.Tensor] | None      # (out_scales, dora_slots) as add_delta takes them

    def add_to(self, y: torch.Tensor) -> None:
        """y as add_delta leaves it (in place)."""
        add_delta(y, self.d, self.token_slots, self.dora)

    def columns(self, start: int, end: int) -> PendingDelta:
        """The delta of y's columns start:end (pending on y[:, start:end])."""
        dora = None if self.dora is None else (self.dora[0][:, start:end], self.dora[1])
        return PendingDelta(self.d[:, start:end], self.token_slots, dora)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
    if residual is not None:
        x = x + residual  # rounded to x's dtype, as HF's residual add in the model dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    normed = weight * x32.to(x.dtype)
    return normed if residual is None else (normed, x)


def rope_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor, delta: PendingDelta | None = None) -> torch.Tensor:
    """GeGLU on the fused gate/up projection's output (Gemma's gelu_pytorch_tanh).

        gate_up: [T, 2 I]  ->  out: [T, I] = gelu(gate, approximate="tanh") * up, in gate_up's dtype
        delta: a LoRA delta pending on gate_up, added to it first (PendingDelta.add_to)
    """
    if delta is not None:
        delta.add_to(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             delta: PendingDelta | None = None):
    """RMSNorm of each row (HF Llama's), optionally of the row plus a residual.

        x: [T, h], weight: [h], residual: None or [T, h] in x's dtype
        delta: a LoRA delta pending on x, added to it first (PendingDelta.add_to; on CUDA by the
               kernel as it reads x, which then stays as it was)
        if residual is given:  x = (x + residual) rounded to x.dtype          (the new residual)
        x32 = float32(x)
        normed[t] = weight * (x32[t] * rsqrt(mean(x32[t]^2) + eps)).to(x.dtype)
                    (product in promote(weight, x) dtype: both rounded operands, one rounding)
        returns normed                    without residual
                (normed, x + residual)    with it: the add after attention / MLP folds into
                                          the next norm, and the sum is the stream carried on
    """
    assert x.shape[-1] == weight.shape[0], (x.shape, weight.shape)
    assert residual is None or (residual.shape == x.shape and residual.dtype == x.dtype), (x, residual)
    if x.is_cuda:
        from punica.ops.layers_triton import rms_norm_triton
        return rms_norm_triton(x, weight, eps, residual, delta=delta)
    if delta is not None:
        delta.add_to(x)
    return rms_norm_ref(x, weight, eps, residual)


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotary position embedding of q and k, in place (HF's rotate_half convention).

        q: [T, Hq, D], k: [T, Hkv, D] (views are fine, last dim contiguous), cos, sin: [T, D/2] float32
        for x in (q, k), every head h:
            x1, x2 = float32(x[t, h, :D/2]), float32(x[t, h, D/2:])
            x[t, h] = cat(x1 * cos[t] - x2 * sin[t], x2 * cos[t] + x1 * sin[t]).to(x.dtype)
    """
    assert q.shape[0] == k.shape[0] == cos.shape[0] and q.shape[2] == k.shape[2] == 2 * cos.shape[1], \
        (q.shape, k.shape, cos.shape)
    if q.is_cuda:
        from punica.ops.layers_triton import rope_triton_
        return rope_triton_(q, k, cos, sin)
    q_rot, k_rot = rope_ref(q, k, cos, sin)
    q.copy_(q_rot)
    k.copy_(k_rot)


def silu_and_mul(gate_up: torch.Tensor, delta: PendingDelta | None = None) -> torch.Tensor:
    """The SwiGLU activation on the fused gate/up projection's output.

        gate_up: [T, 2 I]  ->  out: [T, I] in gate_up's dtype
        delta: a LoRA delta pending on gate_up, added to it first (as rms_norm's)
        gate, up = gate_up[:, :I], gate_up[:, I:]
        out = silu(gate) * up    silu computed in float32 and rounded to the dtype, then the
                                 product of the rounded operands rounded (torch's F.silu(gate) * up)
    """
    assert gate_up.shape[-1] % 2 == 0, gate_up.shape
    if gate_up.is_cuda:
        from punica.ops.layers_triton import silu_and_mul_triton
        return silu_and_mul_triton(gate_up, delta)
    if delta is not None:
        delta.add_to(gate_up)
    return silu_and_mul_ref(gate_up)
