"""The paged KV cache's tensors, and the FP8 (e4m3) format of its rows.

KVCache holds the pages of every layer, [L, P, 2, page_size, Hkv, D], in the activation dtype
("auto") or in float8 e4m3 ("fp8"); an fp8 cache also holds one fp32 scale per (token, KV head)
for K and for V, [L, P, 2, page_size, Hkv], beside the pages and indexed like them.

FP8 rows, a dynamic scale per (token, KV head): when a token's K (or V) row x [D] of one head is
written, scale = max(amax(|x|) / 448, FLT_MIN) and the cache holds e4m3(x / scale), so the
row's largest element maps to e4m3's largest finite value 448 and every row uses the format's
whole range. It needs no calibration (dummy and real weights alike), and one scale per row
follows the values where they vary most: across tokens (V's rows differ by orders of magnitude)
and across heads. A per-tensor scale fixed without calibration (1.0) leaves small values in
e4m3's subnormals (below 2^-6, relative error up to 100%). Cost: 4 bytes per (token, head, K|V)
beside 2 * D bytes of values; bytes per token and layer 2 * Hkv * (D + 4) instead of 2 * Hkv *
2 * D in bf16 (D = 64: 0.53x, D = 128: 0.52x).

Error bound of one element: e4m3 keeps 3 mantissa bits, so a normal value is rounded with
relative error at most 2^-4; a value below the smallest normal (2^-6 * scale) with absolute
error at most 2^-10 * scale (half the subnormal step 2^-9). So |dequant(x) - x| <=
max(|x| / 16, amax / 448 / 1024) per element, the row's own amax deciding the absolute floor.

A non-finite row stays non-finite: its scale is inf or NaN, and so is every dequantized element.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from punica.ops.fp8 import FP8_DTYPE, FP8_MAX

MIN_SCALE = torch.finfo(torch.float32).tiny  # an all-zero row's scale: quantizes to 0, not 0 / 0
SCALE_BYTES = 4  # fp32


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       kv_cache_dtype: str) -> int:
    """Bytes one token's K and V take over all layers: 2 * L * Hkv * D elements of `dtype`
    ("auto"), or (fp8) as many bytes plus a 4-byte scale per (layer, K|V, head)."""
    rows = 2 * num_layers * num_kv_heads
    if kv_cache_dtype == "fp8":
        return rows * (head_dim + SCALE_BYTES)
    return rows * head_dim * dtype.itemsize


def quantize_kv_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (e4m3 values [..., D], fp32 scales [...]): one scale per row, amax / 448."""
    x = x.float()
    scale = (x.abs().amax(-1) / FP8_MAX).clamp(min=MIN_SCALE)
    return (x / scale[..., None]).to(FP8_DTYPE), scale


def dequantize_kv_ref(values: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """Rows of the cache in fp32: values [..., D] (e4m3 with scales [...], or the activation dtype
    with scales None)."""
    return values.float() if scales is None else values.float() * scales[..., None]


def check_kv_scales(pages: torch.Tensor, scales: torch.Tensor | None) -> None:
    """fp8 pages (a cache's, or one layer's) come with their float32 scales, one per row of
    head_dim (shape pages.shape[:-1]); other pages with none."""
    fp8 = pages.dtype == FP8_DTYPE
    assert fp8 == (scales is not None), f"a {pages.dtype} cache takes {'its' if fp8 else 'no'} scales"
    assert scales is None or (scales.shape == pages.shape[:-1] and scales.dtype == torch.float32), (
        pages.shape, scales.shape, scales.dtype)


@dataclass(frozen=True)
class KVCache:
    pages: torch.Tensor           # [L, P, 2, page_size, Hkv, D]: activation dtype, or float8_e4m3fn
    scales: torch.Tensor | None   # [L, P, 2, page_size, Hkv] fp32 with fp8 pages, else None

    def __post_init__(self):
        check_kv_scales(self.pages, self.scales)

    @classmethod
    def empty(cls, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
              dtype: torch.dtype, device: torch.device | str, kv_cache_dtype: str = "auto") -> KVCache:
        """Zeroed pages in `dtype` ("auto") or e4m3 with zero scales ("fp8"). On a CPU each layer's K
        pages of one KV head are one block of memory, and its V pages another (stored [L, 2, Hkv, P,
        page_size, ...], seen as [L, P, 2, page_size, Hkv, ...] through strides): the CPU attention
        reads a run of consecutive pages as a view whose keys of a head are contiguous rows, instead
        of copying it (punica.ops.attention_cpu)."""
        shape = (num_layers, num_pages, 2, page_size, num_kv_heads, head_dim)
        heads_outside = torch.device(device).type == "cpu"

        def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            if heads_outside:
                stored = (shape[0], shape[2], shape[4], shape[1], shape[3]) + shape[5:]
                seen = (0, 3, 1, 4, 2) + tuple(range(5, len(shape)))
                return torch.zeros(stored, dtype=dtype, device=device).permute(seen)
            return torch.zeros(shape, dtype=dtype, device=device)

        if kv_cache_dtype == "auto":
            return cls(zeros(shape, dtype), None)
        assert kv_cache_dtype == "fp8", kv_cache_dtype
        return cls(zeros(shape, FP8_DTYPE), zeros(shape[:-1], torch.float32))

    @property
    def num_layers(self) -> int:
        return self.pages.shape[0]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(pages [P, 2, page_size, Hkv, D], scales [P, 2, page_size, Hkv] or None) of one layer."""
        return self.pages[index], None if self.scales is None else self.scales[index]

    def dequantized(self) -> torch.Tensor:
        """Every layer's pages in fp32, [L, P, 2, page_size, Hkv, D] (tests and benchmarks)."""
        return dequantize_kv_ref(self.pages, self.scales)
