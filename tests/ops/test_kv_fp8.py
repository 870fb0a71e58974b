"""The fp8 (e4m3) KV cache (punica.ops.kv_cache): the reference's write + read round trip within
e4m3's error bound, and the Triton KV-append and attention kernels against the reference with an
fp8 cache (under the interpreter on CPU, at real shapes in bf16 on a GPU).

Bound of one element (punica.ops.kv_cache): |dequant(x) - x| <= |x| / 16 + scale / 1024, with
scale = amax(row) / 448: 3 mantissa bits round a normal value within 2^-4 relative, and a value
in e4m3's subnormals within half their step, 2^-10 * scale.
"""

import random

import pytest
import torch

from punica.config import ceil_div
from punica.ops import attention as ops
from punica.ops import attention_triton as kernels
from punica.ops import kv_append_triton
from punica.ops.attention import AttnBatch
from punica.ops.fp8 import FP8_DTYPE
from punica.ops.kv_cache import KVCache, dequantize_kv_ref, kv_bytes_per_token

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_batch(query_lens, context_lens, num_prefills, page_size, rng, spare_pages=5):
    """AttnBatch whose requests hold random, scattered pages of a pool with spare pages; its page count."""
    needed = [ceil_div(c, page_size) for c in context_lens]
    pool = list(range(sum(needed) + spare_pages))
    rng.shuffle(pool)
    starts = [sum(needed[:i]) for i in range(len(needed))]
    tables = [pool[s:s + n] for s, n in zip(starts, needed)]
    return AttnBatch.build(query_lens, context_lens, tables, page_size, num_prefills, device=DEVICE), len(pool)


def split_qkv(qkv, num_heads, num_kv_heads, head_dim):
    """q, k, v as views of one fused qkv row, as the model has them."""
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    return q.view(-1, num_heads, head_dim), k.view(-1, num_kv_heads, head_dim), v.view(-1, num_kv_heads, head_dim)


def fp8_cache(num_pages, page_size, num_kv_heads, head_dim):
    cache = KVCache.empty(1, num_pages, page_size, num_kv_heads, head_dim, torch.float32, DEVICE, "fp8")
    return cache.pages[0], cache.scales[0]


def test_round_trip_within_the_e4m3_bound():
    """Rows whose magnitudes span 2^-12 .. 2^8 (V's rows differ so), an all-zero row, a row with
    one outlier: every element read back within the bound, each scale its row's amax / 448."""
    gen = torch.Generator().manual_seed(0)
    num_tokens, num_kv_heads, head_dim, page_size = 24, 3, 64, 8
    magnitudes = 2.0 ** torch.linspace(-12, 8, num_tokens)[:, None, None]
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * magnitudes
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).flip(0) * magnitudes
    v[3] = 0.0
    k[5, 1, 7] = 1e3 * k[5, 1].abs().max()
    slots = torch.randperm(4 * page_size, generator=gen)[:num_tokens]
    pages, scales = fp8_cache(4, page_size, num_kv_heads, head_dim)
    exact = torch.zeros(4, 2, page_size, num_kv_heads, head_dim)
    ops.write_kv_ref(pages, k, v, slots, scales)
    ops.write_kv_ref(exact, k, v, slots)
    assert pages.dtype == FP8_DTYPE
    at = (slots // page_size, slice(None), slots % page_size)
    got, want, row_scales = dequantize_kv_ref(pages, scales)[at], exact[at], scales[at]
    torch.testing.assert_close(row_scales, (want.abs().amax(-1) / 448).clamp(min=torch.finfo().tiny), rtol=1e-6, atol=0)
    bound = want.abs() / 16 + row_scales[..., None] / 1024
    assert ((got - want).abs() <= bound * (1 + 1e-6)).all()
    assert torch.equal(got[3, 1], torch.zeros_like(got[3, 1]))  # a zero row reads back as zeros, not NaN
    assert ((got - want).abs() > want.abs() / 64).any(), "the cache is not just holding fp32"


def test_non_finite_row_stays_non_finite():
    pages, scales = fp8_cache(2, 4, 2, 16)
    k = torch.ones(2, 2, 16)
    k[1, 0, 3] = float("inf")
    v = torch.ones(2, 2, 16)
    v[0, 1, 0] = float("nan")
    ops.write_kv_ref(pages, k, v, torch.tensor([1, 6]), scales)
    cache = dequantize_kv_ref(pages, scales)
    assert not cache[1, 0, 2, 0].isfinite().all() and not cache[0, 1, 1, 1].isfinite().all()
    assert cache[0, 0, 1].isfinite().all() and cache[1, 1, 2].isfinite().all()  # the other rows


def test_fp8_bytes_per_token():
    """Values in 1 byte plus a 4-byte scale per row: SmolLM2's head_dim 64, 30 layers, 3 KV heads."""
    assert kv_bytes_per_token(30, 3, 64, torch.bfloat16, "auto") == 2 * 30 * 3 * 64 * 2
    assert kv_bytes_per_token(30, 3, 64, torch.bfloat16, "fp8") == 2 * 30 * 3 * (64 + 4)


def check_fp8_write(got, expect):
    """The kernel's fp8 cache against the reference's: scales equal to fp32 rounding, values equal
    but for a rare e4m3 rounding tie their fp32 inputs broke apart (one step, 2^-3 relative)."""
    (got_pages, got_scales), (pages, scales) = got, expect
    torch.testing.assert_close(got_scales, scales, rtol=1e-5, atol=0)
    a, b = got_pages.float(), pages.float()
    assert ((a - b).abs() <= b.abs() / 8 + 2 ** -9).all()
    assert (a == b).float().mean() > 0.99


def test_write_kv_kernel_matches_reference_fp8():
    gen = torch.Generator().manual_seed(1)
    num_tokens, num_kv_heads, head_dim, page_size = 9, 3, 32, 5
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(DEVICE)
    v = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * 1e-3).to(DEVICE)
    slots = torch.randperm(6 * page_size, generator=gen)[:num_tokens].to(DEVICE)
    expect, got = fp8_cache(6, page_size, num_kv_heads, head_dim), fp8_cache(6, page_size, num_kv_heads, head_dim)
    ops.write_kv_ref(*expect[:1], k, v, slots, expect[1])
    kv_append_triton.write_kv_triton(got[0], k, v, slots, got[1])
    check_fp8_write(got, expect)
    assert (expect[1] > 0).sum() == 2 * num_tokens * num_kv_heads  # every written row has its scale


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(6, 3, 32), (4, 4, 16)])
def test_rope_and_write_kv_kernel_matches_reference_fp8(num_heads, num_kv_heads, head_dim):
    heads = (num_heads, num_kv_heads, head_dim)
    gen = torch.Generator().manual_seed(head_dim)
    num_tokens, num_pages = 7, 5
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(DEVICE)
    angles = torch.rand(num_tokens, head_dim // 2, generator=gen) * 100
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    slots = torch.randperm(num_pages * 4, generator=gen)[:num_tokens].to(DEVICE)
    expect, got = fp8_cache(num_pages, 4, num_kv_heads, head_dim), fp8_cache(num_pages, 4, num_kv_heads, head_dim)
    expect_qkv, got_qkv = qkv.clone(), qkv.clone()
    ops.rope_and_write_kv_ref(*split_qkv(expect_qkv, *heads), cos, sin, expect[0], slots, expect[1])
    kv_append_triton.rope_and_write_kv_triton_(*split_qkv(got_qkv, *heads), cos, sin, got[0], slots, got[1])
    torch.testing.assert_close(got_qkv, expect_qkv, rtol=1e-4, atol=1e-5)
    check_fp8_write(got, expect)


def filled_fp8_cache(num_pages, page_size, num_kv_heads, head_dim, gen):
    """Every row of the cache written through the reference, V's rows at magnitudes 2^-8 .. 2^2."""
    pages, scales = fp8_cache(num_pages, page_size, num_kv_heads, head_dim)
    rows = num_pages * page_size
    k = torch.randn(rows, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(rows, num_kv_heads, head_dim, generator=gen) * 2.0 ** torch.randint(-8, 3, (rows, 1, 1),
                                                                                        generator=gen)
    ops.write_kv_ref(pages, k.to(DEVICE), v.to(DEVICE), torch.arange(rows, device=DEVICE), scales)
    return pages, scales


@pytest.mark.parametrize("num_splits,prefill_splits", [(None, None), (2, 2)])
def test_attention_kernels_match_reference_fp8(num_splits, prefill_splits):
    """Prefill tiles (a cached prefix, several query tiles) and decodes over an fp8 cache, fp32
    queries: the kernels equal the reference that dequantizes and runs the fp32 math; prefill
    and decode partitions merged (num_splits, prefill_splits 2) too."""
    rng, gen = random.Random(2), torch.Generator().manual_seed(2)
    page_size, num_heads, num_kv_heads, head_dim = 7, 6, 2, 32
    batch, num_pages = make_batch([40, 1, 1, 1], [52, 30, 14, 49], 1, page_size, rng)
    pages, scales = filled_fp8_cache(num_pages, page_size, num_kv_heads, head_dim, gen)
    q = torch.randn(batch.num_tokens, num_heads, head_dim, generator=gen).to(DEVICE)
    out = kernels.paged_attention_triton(q, pages, batch, 0.3, num_splits=num_splits,
                                         prefill_splits=prefill_splits, kv_scales=scales)
    ref = ops.paged_attention_ref(q, pages, batch, 0.3, kv_scales=scales)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    dequantized = ops.paged_attention_ref(q, dequantize_kv_ref(pages, scales), batch, 0.3)
    torch.testing.assert_close(ref, dequantized, rtol=1e-6, atol=1e-6)  # the reference reads value * scale


@pytest.mark.cuda
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,window,softcap", [
    (32, 8, 128, 0, 0.0), (9, 3, 64, 0, 0.0), (16, 8, 256, 40, 50.0)])
def test_real_shapes_fp8_through_public_ops(num_heads, num_kv_heads, head_dim, window, softcap):
    """bf16 activations on the GPU: the append kernel writes what the reference writes, and the
    attention kernels read the fp8 cache as the reference does, prefills and decodes, one or more
    partitions."""
    rng, gen = random.Random(3), torch.Generator().manual_seed(3)
    page_size = 16
    batch, num_pages = make_batch([300, 64, 1, 1, 1], [300, 700, 1000, 33, 2048], 2, page_size, rng)
    tokens = batch.num_tokens
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(DEVICE, torch.bfloat16)
    q, k, v = split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    cos, sin = torch.ones(tokens, head_dim // 2, device=DEVICE), torch.zeros(tokens, head_dim // 2, device=DEVICE)
    pages, scales = filled_fp8_cache(num_pages, page_size, num_kv_heads, head_dim, gen)
    ref_pages, ref_scales = pages.clone(), scales.clone()
    ops.rope_and_write_kv_(q, k, v, cos, sin, pages, batch.slot_mapping, scales)
    ops.write_kv_ref(ref_pages, k, v, batch.slot_mapping, ref_scales)
    check_fp8_write((pages, scales), (ref_pages, ref_scales))
    for num_splits in (None, 1, 4):
        out = kernels.paged_attention_triton(q, pages, batch, head_dim ** -0.5, num_splits=num_splits, window=window,
                                             softcap=softcap, kv_scales=scales)
        ref = ops.paged_attention_ref(q, pages, batch, head_dim ** -0.5, window, softcap, kv_scales=scales)
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
