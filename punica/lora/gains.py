"""How far one LoRA delta can scale its input: the gain |scale| * ||B @ A||_2 and the limit on it
that punica.lora.adapter checks when an adapter is read."""

from __future__ import annotations

import torch

# Bounds on what one adapter may do to the activations, checked when it is read. A layer's LoRA
# delta adds scale * B @ A @ x to a projection's output, x being the projection's RMS-normalised
# input (||x||_2 = sqrt(hidden) times the norm weights), so each delta scales its input by at most
# its gain |scale| * ||B @ A||_2. Within one decoder layer at most ~gain^3 reaches the residual
# stream (v then o on the attention path; gate times up, then down, on the MLP path, whose product
# is quadratic in ||x||). With gains <= 1e3 a layer adds at most ~1e9 * hidden (~1e13 for hidden
# 8192) to the residual, 100 layers ~1e15: far below bf16's and float32's max (~3.4e38), and below
# the ~1.8e19 whose square RMSNorm's float32 sum of squares still holds, with four orders of
# magnitude left for the base weights' own norms. The demo adapters' gains are 0.5-3.5 and the
# random test and benchmark adapters' at most ~20, a margin of 50x; weights of 1e30 (finite in
# bf16) give gains of ~1e60 and are refused instead of making inf/NaN of every request on them.
MAX_LORA_GAIN = 1e3
# first_gain_over_limit computes the exact gain where the Frobenius bound is over this fraction of the limit
BOUND_MARGIN = 0.98
# lora_gains converts a batch to float64 this many bytes at a time (into one buffer it reuses)
MAX_GAIN_CHUNK_BYTES = 8 << 20


def lora_gain(a: torch.Tensor, b: torch.Tensor, scale: float) -> float:
    """|scale| * ||B @ A||_2 of A [r, h_in], B [h_out, r] (`lora_gains` of one)."""
    return float(lora_gains(a, b, scale))


def lora_gains(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """|scale| * ||B @ A||_2 (the largest singular value) of each A [..., r, h_in], B [..., h_out, r]
    (batched: [...], float64), from r x r Gram matrices, never forming the [h_out, h_in] product:
    with G_A = A A^T = S^2 (S its symmetric square root) and G_B = B^T B, ||B @ A||_2^2 is the
    largest eigenvalue of A^T G_B A, whose nonzero eigenvalues are those of G_B G_A and so of
    S G_B S. O((h_in + h_out) r^2); float64 keeps the largest eigenvalue to its relative precision,
    and finite float32 inputs (< 3.4e38) cannot overflow it (the largest intermediate is below ~1e170)."""
    batch = a.shape[:-2]
    a, b = a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:])
    num_items = a.shape[0]
    step = max(1, min(num_items, MAX_GAIN_CHUNK_BYTES // ((a[0].numel() + b[0].numel()) * 8)))
    # one float64 buffer reused by every chunk: a fresh allocation each time costs more in page
    # faults than the conversion and the Gram matrices together
    a64 = torch.empty((step, *a.shape[1:]), dtype=torch.float64, device=a.device)
    b64 = torch.empty((step, *b.shape[1:]), dtype=torch.float64, device=b.device)
    squares = torch.empty(num_items, dtype=torch.float64, device=a.device)
    for start in range(0, num_items, step):
        n = min(step, num_items - start)
        a_n, b_n = a64[:n].copy_(a[start:start + n]), b64[:n].copy_(b[start:start + n])
        eigenvalues, vectors = torch.linalg.eigh(a_n @ a_n.mT)
        root = (vectors * eigenvalues.clamp(min=0).sqrt().unsqueeze(-2)) @ vectors.mT
        squares[start:start + n] = torch.linalg.eigvalsh(root @ (b_n.mT @ b_n) @ root)[..., -1]
    return abs(scale) * squares.clamp(min=0).sqrt().reshape(batch)


def gain_bounds(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """|scale| * ||A||_F ||B||_F >= |scale| * ||B @ A||_2 of each item of A [n, r, h_in], B [n, h_out, r]
    ([n] float64): one pass over the weights, in their dtype (each norm rounded to it: bf16, 2^-9).
    An item with a NaN or inf weight has a NaN or inf bound (inf times a zero norm is NaN); so
    has one whose finite weights' squares overflow."""
    return (abs(scale) * torch.linalg.vector_norm(a.flatten(1), dim=-1).double()
            * torch.linalg.vector_norm(b.flatten(1), dim=-1).double())


def first_gain_over_limit(a: torch.Tensor, b: torch.Tensor, scale: float,
                          bound: torch.Tensor | None = None) -> tuple[int, float] | None:
    """The first item of A [n, r, h_in], B [n, h_out, r] whose `lora_gains` is over MAX_LORA_GAIN (or
    NaN), with that gain; None if there is none. Screened by `gain_bounds` (`bound`, if given): the
    Frobenius norms clear the items far under the limit, and only the others (an overflowing bound
    among them) get the exact gain. The bounds of the demo adapters' projections are 2.3-6.7x their
    gains (at most ~23), random adapters' ~14x, far under the limit, so the exact gains, whose
    float64 copies and eigenvalues took most of the time of reading a mixture-of-experts adapter,
    are rarely computed."""
    if bound is None:
        bound = gain_bounds(a, b, scale)
    suspects = (~(bound <= MAX_LORA_GAIN * BOUND_MARGIN)).nonzero().flatten()
    if not len(suspects):
        return None
    gains = lora_gains(a[suspects], b[suspects], scale)
    over = (~(gains <= MAX_LORA_GAIN)).nonzero()  # NaN included
    return (int(suspects[int(over[0])]), float(gains[int(over[0])])) if len(over) else None
