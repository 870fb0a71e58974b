"""Checks of one adapter tensor, shared by the dense projections' and the fused experts' reading
(punica.lora.adapter, punica.lora.adapter_experts): its header entry against the base model, and
its values for finiteness."""

from __future__ import annotations

import torch

from punica.lora.adapter_config import Fail


def check_shape(key: str, shape: tuple[int, ...], dtype: torch.dtype | str, expected: tuple[int, ...],
                rank_dim: int | None, proj: str, fail: Fail) -> None:
    """A tensor's dtype, rank and shape against the base model. PEFT stores lora_A as [r, h_in] and
    lora_B as [h_out, r] whatever fan_in_fan_out says (that flag describes the base layer's layout,
    not LoRA's)."""
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise fail(f"tensor {key} has dtype {dtype}, not a floating-point type")
    if rank_dim is not None and len(shape) == 2 and shape[rank_dim] != expected[rank_dim]:
        raise fail(f"tensor {key} has rank {shape[rank_dim]}, but adapter_config.json says r={expected[rank_dim]}")
    if shape != expected:
        raise fail(f"tensor {key} has shape {shape}, but the base model's {proj} projection needs {expected}")


def finite(key: str, tensor: torch.Tensor, fail: Fail) -> torch.Tensor:
    """`tensor`, after checking that its values are finite: one reduction in its own dtype, no
    temporary tensor (the min and max are NaN where any value is, else +-inf where one is)."""
    low, high = torch.aminmax(tensor)
    if not (torch.isfinite(low) and torch.isfinite(high)):
        raise fail(f"tensor {key} has non-finite values (NaN or inf) in {tensor.dtype}")
    return tensor
