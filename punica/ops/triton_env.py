"""What the Triton kernels ask of where they run: the interpreter or a GPU, and its size."""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """Triton's CPU interpreter (TRITON_INTERPRET=1): it multiplies bf16 dot operands as raw
    bits, so the kernels upcast their operands to fp32 there."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2  # the interpreter runs programs one by one; any count exercises the same code
