"""The rotary + KV-append kernels (punica.ops.kv_append_triton) against the references of
punica.ops.attention: K/V written to scattered slots, q and k rotated, nothing else touched; on a
GPU also at real shapes and captured in a CUDA graph before a decode's attention.

Without a GPU the kernels run under Triton's interpreter (tests/conftest.py) on CPU tensors.
"""

import random

import pytest
import torch

from punica.config import ceil_div
from punica.ops import attention as ops
from punica.ops import attention_triton as kernels
from punica.ops import kv_append_triton
from punica.ops.attention import AttnBatch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

TOL = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3)}


@pytest.mark.parametrize("dtype,page_size", [(torch.float32, 16), (torch.bfloat16, 5)], ids=str)
def test_write_kv_matches_reference(dtype, page_size):
    """Scattered slots, V a column slice of a wider tensor (as the model's fused qkv gives it)."""
    gen = torch.Generator().manual_seed(page_size)
    num_tokens, num_kv_heads, head_dim = 11, 3, 32
    kv = torch.randn(6, 2, page_size, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    slots = torch.randperm(6 * page_size, generator=gen)[:num_tokens].to(DEVICE)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    wide = torch.randn(num_tokens, 2 * num_kv_heads * head_dim, generator=gen).to(dtype).to(DEVICE)
    v = wide[:, num_kv_heads * head_dim:].reshape(num_tokens, num_kv_heads, head_dim)
    expect, got = kv.clone(), kv.clone()
    ops.write_kv_ref(expect, k, v, slots)
    kv_append_triton.write_kv_triton(got, k, v, slots)
    assert torch.equal(got, expect)
    assert not torch.equal(got, kv)


def split_qkv(qkv, num_heads, num_kv_heads, head_dim):
    """q, k, v as views of one fused qkv row, as the model has them."""
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    return q.view(-1, num_heads, head_dim), k.view(-1, num_kv_heads, head_dim), v.view(-1, num_kv_heads, head_dim)


def rope_kv_inputs(num_tokens, num_heads, num_kv_heads, head_dim, page_size, dtype, cache_dtype, seed):
    """A fused qkv, cos/sin of random positions, a random cache and scattered slots in it."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype).to(DEVICE)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    num_pages = ceil_div(num_tokens, page_size) + 3
    kv = torch.randn(num_pages, 2, page_size, num_kv_heads, head_dim, generator=gen).to(cache_dtype).to(DEVICE)
    slots = torch.randperm(num_pages * page_size, generator=gen)[:num_tokens].to(DEVICE)
    return qkv, freqs.cos().to(DEVICE), freqs.sin().to(DEVICE), kv, slots


def check_rope_and_write_kv(num_tokens, num_heads, num_kv_heads, head_dim, page_size, dtype, seed,
                            cache_dtype=None, fn=kv_append_triton.rope_and_write_kv_triton_):
    """fn against the reference: q rotated in place, k and v untouched, rotated k and v in their
    slots of the cache and nothing else written. Returns the cache fn wrote, and which
    (page, offset) slots it wrote."""
    heads = (num_heads, num_kv_heads, head_dim)
    qkv, cos, sin, kv, slots = rope_kv_inputs(num_tokens, *heads, page_size, dtype, cache_dtype or dtype, seed)
    expect_qkv, expect_kv, got_qkv, got_kv = qkv.clone(), kv.clone(), qkv.clone(), kv.clone()
    ops.rope_and_write_kv_ref(*split_qkv(expect_qkv, *heads), cos, sin, expect_kv, slots)
    fn(*split_qkv(got_qkv, *heads), cos, sin, got_kv, slots)
    rtol, atol = TOL[dtype]
    q_end = num_heads * head_dim
    torch.testing.assert_close(got_qkv, expect_qkv, rtol=rtol, atol=atol)
    assert not torch.equal(got_qkv[:, :q_end], qkv[:, :q_end])
    assert torch.equal(got_qkv[:, q_end:], qkv[:, q_end:])  # k and v untouched
    torch.testing.assert_close(got_kv, expect_kv, rtol=rtol, atol=atol)
    assert torch.equal(got_kv[:, 1], expect_kv[:, 1])  # values are copied exactly
    written = torch.zeros(kv.shape[0], page_size, dtype=torch.bool, device=kv.device)
    written[slots // page_size, slots % page_size] = True
    assert torch.equal(got_kv.transpose(1, 2)[~written], kv.transpose(1, 2)[~written])  # other slots untouched
    assert not torch.equal(got_kv.transpose(1, 2)[written], kv.transpose(1, 2)[written])
    return got_kv, written


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)  # the interpreter truncates bf16
@pytest.mark.parametrize("dora", [False, True])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (3, 1, 20)])
def test_rope_and_write_kv_adds_a_pending_delta_as_add_delta_does(dtype, dora, fp8, num_heads, num_kv_heads,
                                                                 head_dim, pending_delta):
    """The kernel with a delta pending on q, k and v (its columns q's, k's, v's) writes what
    add_delta on the fused row and then the kernel without one write: v's cache rows bit for bit;
    k and v are left as they were, q holds its rotation of q + its delta."""
    heads, num_tokens, page_size = (num_heads, num_kv_heads, head_dim), 11, 5
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    qkv, cos, sin, kv, slots = rope_kv_inputs(num_tokens, *heads, page_size, dtype, cache_dtype, seed=head_dim)
    scales = torch.zeros(kv.shape[:-1], dtype=torch.float32, device=DEVICE) if fp8 else None
    delta = pending_delta(num_tokens, qkv.shape[1], torch.Generator().manual_seed(num_heads), dora)
    expect_qkv, got_qkv = qkv.clone(), qkv.clone()
    delta.add_to(expect_qkv)
    added_qkv = expect_qkv.clone()
    expect_kv, got_kv = kv.clone(), kv.clone()
    expect_scales, got_scales = (None, None) if scales is None else (scales.clone(), scales.clone())
    kv_append_triton.rope_and_write_kv_triton_(*split_qkv(expect_qkv, *heads), cos, sin, expect_kv, slots,
                                               expect_scales)
    kv_append_triton.rope_and_write_kv_triton_(*split_qkv(got_qkv, *heads), cos, sin, got_kv, slots, got_scales,
                                               delta)
    q_end = num_heads * head_dim
    assert torch.equal(got_qkv[:, q_end:], qkv[:, q_end:])  # k and v untouched
    assert torch.equal(got_qkv[:, :q_end], expect_qkv[:, :q_end])
    assert not torch.equal(got_qkv[:, :q_end], qkv[:, :q_end])
    assert torch.equal(got_kv.float(), expect_kv.float())
    if scales is not None:
        assert torch.equal(got_scales, expect_scales)
    assert not torch.equal(added_qkv, qkv)


def test_rope_and_write_kv_public_function_on_cpu_adds_a_pending_delta_first(pending_delta):
    heads = (4, 2, 16)
    qkv, cos, sin, kv, slots = rope_kv_inputs(6, *heads, 4, torch.float32, torch.float32, seed=1)
    delta = pending_delta(6, qkv.shape[1], torch.Generator().manual_seed(2), True)
    expect_qkv, got_qkv, expect_kv, got_kv = qkv.clone(), qkv.clone(), kv.clone(), kv.clone()
    delta.add_to(expect_qkv)
    ops.rope_and_write_kv_ref(*split_qkv(expect_qkv, *heads), cos, sin, expect_kv, slots)
    ops.rope_and_write_kv_(*split_qkv(got_qkv, *heads), cos, sin, got_kv, slots, delta=delta)
    assert torch.equal(got_kv, expect_kv)
    q_end = heads[0] * heads[2]
    assert torch.equal(got_qkv[:, :q_end], expect_qkv[:, :q_end])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("num_tokens,num_heads,num_kv_heads,head_dim,page_size", [
    (1, 4, 4, 16, 16),    # one token, no GQA
    (11, 9, 3, 64, 5),    # GQA 3, odd page size, ragged head blocks for k
    (9, 3, 1, 20, 7),     # half head_dim 10: not a power of 2
    (4, 1, 3, 8, 3),      # more kv heads than q heads
])
def test_rope_and_write_kv_matches_reference(dtype, num_tokens, num_heads, num_kv_heads, head_dim, page_size):
    check_rope_and_write_kv(num_tokens, num_heads, num_kv_heads, head_dim, page_size, dtype,
                            seed=num_tokens * head_dim)


def test_rope_and_write_kv_rounds_k_to_its_dtype_before_the_cache():
    """bf16 q/k/v into an fp32 cache: the cache gets k rotated and rounded to bf16, as the
    reference (rope_ then write_kv) gives it, not the fp32 rotation."""
    got_kv, written = check_rope_and_write_kv(6, 4, 2, 32, 4, torch.bfloat16, seed=2, cache_dtype=torch.float32)
    keys = got_kv[:, 0][written]
    assert torch.equal(keys, keys.to(torch.bfloat16).float())


@pytest.mark.parametrize("path", ["public", "kernels"])
def test_rope_and_write_kv_equals_rope_then_write_kv(path):
    """The fused op is the two ops it replaces, bit for bit on CPU (the reference, and the
    kernels under the interpreter); on the GPU within rounding."""
    from punica.ops import layers, layers_triton
    fused, rope, write = ((ops.rope_and_write_kv_, layers.rope_, ops.write_kv) if path == "public" else
                          (kv_append_triton.rope_and_write_kv_triton_, layers_triton.rope_triton_,
                           kv_append_triton.write_kv_triton))
    heads = (6, 2, 64)
    qkv, cos, sin, kv, slots = rope_kv_inputs(13, *heads, 4, torch.bfloat16, torch.bfloat16, seed=8)
    fused_qkv, fused_kv = qkv.clone(), kv.clone()
    fused(*split_qkv(fused_qkv, *heads), cos, sin, fused_kv, slots)
    q, k, v = split_qkv(qkv, *heads)
    rope(q, k, cos, sin)
    write(kv, k, v, slots)
    got_q, expect_q = fused_qkv[:, :6 * 64], qkv[:, :6 * 64]
    if DEVICE == "cpu":
        assert torch.equal(got_q, expect_q) and torch.equal(fused_kv, kv)
    else:
        torch.testing.assert_close(got_q, expect_q, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(fused_kv, kv, rtol=2e-2, atol=2e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim",
                         [(32, 32, 128), (32, 8, 128), (40, 40, 128), (9, 3, 64)])
@pytest.mark.parametrize("num_tokens", [1, 32, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_real_shapes_rope_and_write_kv(num_heads, num_kv_heads, head_dim, num_tokens, dtype):
    check_rope_and_write_kv(num_tokens, num_heads, num_kv_heads, head_dim, 16, dtype,
                            seed=num_heads + num_tokens, fn=ops.rope_and_write_kv_)


@pytest.mark.cuda
def test_cuda_graph_rope_write_kv_then_single_split_decode(capture_graph):
    """A decode layer's attention at Llama-7B heads, 32 requests (one split by default on an
    H200: the partition kernel writes the output): rotary + KV append then attention, captured
    once and replayed on new tokens, positions, pages and context lengths."""
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    page_size, max_pages, num_decodes, heads, head_dim = 16, 128, 32, 32, 128
    block_n = kernels._decode_blocks(head_dim, torch.bfloat16)[0]
    splits = kernels.decode_partition(num_decodes, heads, max_pages * page_size, block_n, torch.device(DEVICE))[1]
    assert splits == 1
    num_pages = max_pages * num_decodes + 8

    def new_batch():
        pool = rng.sample(range(num_pages), max_pages * num_decodes)  # requests never share a page
        tables = [pool[i * max_pages:(i + 1) * max_pages] for i in range(num_decodes)]
        context_lens = [rng.randint(1, max_pages * page_size) for _ in range(num_decodes)]
        return AttnBatch.build([1] * num_decodes, context_lens, tables, page_size, 0, device=DEVICE)

    def cos_sin(positions):
        dims = torch.arange(0, head_dim, 2, dtype=torch.float32, device=DEVICE)
        inv_freq = 1.0 / (10000.0 ** (dims / head_dim))
        freqs = positions.float()[:, None] * inv_freq[None, :]
        return freqs.cos(), freqs.sin()

    batch = new_batch()
    qkv = torch.randn(num_decodes, 3 * heads * head_dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    kv = torch.randn(num_pages, 2, page_size, heads, head_dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    cos, sin = cos_sin(batch.positions)
    q, k, v = split_qkv(qkv, heads, heads, head_dim)

    def step():
        ops.rope_and_write_kv_(q, k, v, cos, sin, kv, batch.slot_mapping)
        return ops.paged_attention(q, kv, batch, 0.1)

    graph, out = capture_graph(step)
    for _ in range(3):
        new = new_batch()
        for name in ("page_table", "context_lens", "query_start", "slot_mapping", "positions"):
            getattr(batch, name).copy_(getattr(new, name))
        new_cos, new_sin = cos_sin(new.positions)
        cos.copy_(new_cos)
        sin.copy_(new_sin)
        qkv.copy_(torch.randn(qkv.shape, generator=gen).to(qkv.dtype))
        kv.copy_(torch.randn(kv.shape, generator=gen).to(kv.dtype))
        expect_qkv, expect_kv = qkv.clone(), kv.clone()
        expect_q, expect_k, expect_v = split_qkv(expect_qkv, heads, heads, head_dim)
        ops.rope_and_write_kv_ref(expect_q, expect_k, expect_v, new_cos, new_sin, expect_kv, new.slot_mapping)
        expect_out = ops.paged_attention_ref(expect_q, expect_kv, new, 0.1)
        out.fill_(float("nan"))
        graph.replay()
        torch.testing.assert_close(kv, expect_kv, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(out, expect_out, rtol=2e-2, atol=2e-2)
