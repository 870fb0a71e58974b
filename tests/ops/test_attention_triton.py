"""Triton paged-attention kernels against the references of punica.ops.attention on fresh random
inputs: mixed prefill/decode batches, cached prefixes, scattered pages, GQA, odd page sizes.

Without a GPU the kernels run under Triton's interpreter (tests/conftest.py) on CPU tensors at
small shapes; tests marked `cuda` run at real shapes on the GPU.
"""

import random

import pytest
import torch

from punica.config import ceil_div
from punica.ops import attention as ops
from punica.ops import attention_triton as kernels
from punica.ops import kv_append_triton
from punica.ops.attention import AttnBatch
from punica.ops.triton_env import num_sms

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (rtol, atol) of the output; the interpreter truncates to bf16/fp16, the GPU rounds P to them
TOL = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3)}


def make_batch(query_lens, context_lens, num_prefills, page_size, rng, spare_pages=7, pad_pages=0):
    """AttnBatch whose requests hold random, scattered pages of a pool with spare pages;
    `pad_pages` extra page-table columns (as a CUDA-graph bucket may have)."""
    needed = [ceil_div(c, page_size) for c in context_lens]
    pool = list(range(sum(needed) + spare_pages))
    rng.shuffle(pool)
    tables, used = [], 0
    for n in needed:
        tables.append(pool[used:used + n] + [pool[-1]] * pad_pages)
        used += n
    batch = AttnBatch.build(query_lens, context_lens, tables, page_size, num_prefills, device=DEVICE)
    return batch, len(pool)


def random_inputs(batch, num_pages, page_size, num_heads, num_kv_heads, head_dim, dtype, gen):
    q = torch.randn(batch.num_tokens, num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    kv = torch.randn(num_pages, 2, page_size, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    return q, kv


def check_attention(query_lens, context_lens, num_prefills, page_size, num_heads, num_kv_heads,
                    head_dim, dtype, seed, num_splits=None, pad_pages=0, window=0, softcap=0.0):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    batch, num_pages = make_batch(query_lens, context_lens, num_prefills, page_size, rng, pad_pages=pad_pages)
    q, kv = random_inputs(batch, num_pages, page_size, num_heads, num_kv_heads, head_dim, dtype, gen)
    scale = head_dim ** -0.5 * (1 + rng.random())  # sharper than usual: exercises the running max
    out = kernels.paged_attention_triton(q, kv, batch, scale, num_splits=num_splits, window=window, softcap=softcap)
    ref = ops.paged_attention_ref(q, kv, batch, scale, window, softcap)
    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out, ref, rtol=TOL[dtype][0], atol=TOL[dtype][1])
    if 0 < window < max(context_lens):  # the window leaves out keys: the output is not full attention's
        full = ops.paged_attention_ref(q, kv, batch, scale)
        assert not torch.allclose(full, ref, rtol=TOL[dtype][0], atol=TOL[dtype][1])


# prefills: a fresh prompt over several query tiles, a prefill behind a cached prefix
# (query_len < context_len), a one-token prompt; decodes: one token, a context ending exactly
# on a page boundary, contexts ending mid-page
MIXED = dict(query_lens=[45, 20, 1, 1, 1, 1, 1], context_lens=[45, 75, 1, 1, 48, 50, 93], num_prefills=3)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,page_size,dtype,num_splits", [
    (4, 4, 64, 16, torch.float32, None),   # group 1, default split count
    (9, 3, 64, 7, torch.bfloat16, 2),      # SmolLM2's group of 3, odd page size
    (4, 1, 128, 16, torch.float16, 3),     # group 4, head_dim 128
])
def test_mixed_batch_matches_reference(num_heads, num_kv_heads, head_dim, page_size, dtype, num_splits):
    check_attention(**MIXED, page_size=page_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                    head_dim=head_dim, dtype=dtype, seed=num_heads * 1000 + page_size, num_splits=num_splits)


def test_prefill_only_batch_with_cached_prefixes():
    check_attention([70, 33, 16], [70, 101, 16], 3, page_size=5, num_heads=2, num_kv_heads=1,
                    head_dim=32, dtype=torch.bfloat16, seed=1)


@pytest.mark.parametrize("num_splits", [1, 3, 7])
def test_decode_splits_merge_to_the_reference(num_splits):
    """Requests whose context ends before the last partitions, and unused page-table columns."""
    check_attention([1] * 4, [130, 17, 1, 64], 0, page_size=16, num_heads=6, num_kv_heads=2,
                    head_dim=64, dtype=torch.float32, seed=num_splits, num_splits=num_splits, pad_pages=1)


@pytest.mark.parametrize("window,num_splits", [(1, None), (7, 2), (24, 3), (40, 1), (200, 2)])
def test_sliding_window_matches_reference(window, num_splits):
    """Windows shorter than one key tile (1, 7), than a query tile (24), than the longest prompts
    (40), and longer than every context (200: full attention); decode splits wholly before the
    window; prefills behind cached prefixes."""
    check_attention(**MIXED, page_size=5, num_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float32,
                    seed=window, num_splits=num_splits, window=window)


@pytest.mark.parametrize("window,dtype", [(0, torch.float32), (7, torch.float32), (0, torch.bfloat16)], ids=str)
def test_softcapped_scores_match_reference(window, dtype):
    """Gemma 2's attention-logit softcapping, with and without a sliding window; scores scaled up
    (q times 8) so that the cap of 2 bites."""
    rng = random.Random(3)
    batch, num_pages = make_batch(**MIXED, page_size=5, rng=rng)
    q, kv = random_inputs(batch, num_pages, 5, 4, 2, 32, dtype, torch.Generator().manual_seed(3))
    q = q * 8
    out = kernels.paged_attention_triton(q, kv, batch, 0.2, num_splits=2, window=window, softcap=2.0)
    ref = ops.paged_attention_ref(q, kv, batch, 0.2, window, softcap=2.0)
    torch.testing.assert_close(out, ref, rtol=TOL[dtype][0], atol=TOL[dtype][1])
    uncapped = ops.paged_attention_ref(q, kv, batch, 0.2, window)
    assert not torch.allclose(uncapped, ref, rtol=TOL[dtype][0], atol=TOL[dtype][1])


def test_sliding_window_reference_sees_only_the_window():
    """The reference's sliding window is transformers': query p sees keys p - window < key <= p.
    A key outside every window may hold NaN: no output is touched by it."""
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    batch, num_pages = make_batch([12, 1], [12, 30], 1, 4, rng)
    q, kv = random_inputs(batch, num_pages, 4, 2, 1, 16, torch.float32, gen)
    pages = batch.page_table[1].long()
    kv[pages[0], :, 0] = float("nan")  # position 0 of the decode, outside its window of 5
    out = ops.paged_attention_ref(q, kv, batch, 0.25, window=5)
    assert out.isfinite().all()
    k = kv[pages, 0].reshape(-1, 1, 16)[25:30].float()
    v = kv[pages, 1].reshape(-1, 1, 16)[25:30].float()
    expect = torch.softmax(0.25 * q[-1] @ k[:, 0].T, -1) @ v[:, 0]
    torch.testing.assert_close(out[-1], expect)


def test_decode_partition_policy():
    """Splits until the programs fill the SMs, never below MIN_PARTITION tokens; partitions are
    whole key tiles and cover the context bound."""
    sms = num_sms(torch.device(DEVICE))
    for num_decodes, num_kv_heads, max_context in [(1, 1, 4096), (1, 8, 512), (64, 32, 4096), (2, 2, 100)]:
        partition, splits = kernels.decode_partition(num_decodes, num_kv_heads, max_context, 64,
                                                     torch.device(DEVICE))
        assert partition % 64 == 0 and (splits - 1) * partition < max_context <= splits * partition
        assert splits == 1 or partition >= kernels.MIN_PARTITION
        programs = num_decodes * num_kv_heads * splits
        assert programs >= kernels.DECODE_PROGRAMS_PER_SM * sms or splits >= max_context // kernels.MIN_PARTITION
    assert kernels.decode_partition(1, 1, 4096, 64, torch.device("cpu")) == (512, 8)
    assert kernels.decode_partition(64, 32, 4096, 64, torch.device("cpu"))[1] == 1
    assert kernels.decode_partition(3, 2, 1000, 64, torch.device("cpu"), num_splits=4) == (256, 4)


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


class Unlaunchable:
    def __getitem__(self, grid):
        raise AssertionError("merge kernel launched")


def test_single_split_writes_the_output_without_the_merge(monkeypatch):
    """One split: the partition kernel normalises and writes the output; the merge never runs
    (with two it does)."""
    monkeypatch.setattr(kernels, "_decode_merge_kernel", Unlaunchable())
    check_attention([1] * 3, [40, 1, 33], 0, page_size=5, num_heads=9, num_kv_heads=3, head_dim=32,
                    dtype=torch.bfloat16, seed=5, num_splits=1, pad_pages=2)
    check_attention(**MIXED, page_size=16, num_heads=4, num_kv_heads=4, head_dim=64, dtype=torch.float32,
                    seed=6, num_splits=1)
    with pytest.raises(AssertionError, match="merge kernel launched"):
        check_attention([1] * 3, [40, 1, 33], 0, page_size=5, num_heads=9, num_kv_heads=3, head_dim=32,
                        dtype=torch.bfloat16, seed=5, num_splits=2)


# ---- rotary + KV append, fused -----------------------------------------------------------

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


# ---- GPU, real shapes -------------------------------------------------------------------

def real_mixed_batch(rng, num_decodes, max_context):
    """Two prefills (a fresh prompt, a prompt behind a cached prefix), then decodes."""
    fresh = rng.randint(700, 1100)
    cached_q, cached_ctx = rng.randint(200, 400), rng.randint(1500, max_context)
    contexts = [rng.randint(1, max_context) for _ in range(num_decodes)]
    contexts[0] = max_context
    return [fresh, cached_q] + [1] * num_decodes, [fresh, cached_ctx] + contexts


@pytest.mark.cuda
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,page_size,dtype", [
    (32, 32, 128, 16, torch.bfloat16),   # Llama-7B
    (32, 8, 128, 16, torch.bfloat16),    # GQA 8 of 32
    (32, 8, 128, 16, torch.float16),
    (32, 8, 128, 16, torch.float32),
    (9, 3, 64, 7, torch.bfloat16),       # SmolLM2, odd page size
], ids=str)
def test_real_shapes_through_public_ops(num_heads, num_kv_heads, head_dim, page_size, dtype):
    rng = random.Random(f"{num_heads}{num_kv_heads}{page_size}{dtype}")
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    query_lens, context_lens = real_mixed_batch(rng, 62, 4096)
    batch, num_pages = make_batch(query_lens, context_lens, 2, page_size, rng, spare_pages=100)
    q, kv = random_inputs(batch, num_pages, page_size, num_heads, num_kv_heads, head_dim, dtype, gen)
    k = torch.randn(batch.num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(batch.num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    expect = kv.clone()
    ops.write_kv_ref(expect, k, v, batch.slot_mapping)
    ops.write_kv(kv, k, v, batch.slot_mapping)
    assert torch.equal(kv, expect)
    out = ops.paged_attention(q, kv, batch, head_dim ** -0.5)
    ref = ops.paged_attention_ref(q, kv, batch, head_dim ** -0.5)
    torch.testing.assert_close(out, ref, rtol=TOL[dtype][0], atol=TOL[dtype][1])


@pytest.mark.cuda
@pytest.mark.parametrize("num_splits", [1, 2, 16, 64])
def test_real_shapes_decode_splits(num_splits):
    rng = random.Random(num_splits)
    check_attention([1] * 32, [rng.randint(1, 4096) for _ in range(32)], 0, page_size=16,
                    num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, seed=num_splits,
                    num_splits=num_splits)


@pytest.mark.cuda
@pytest.mark.parametrize("num_prefills", [0, 2])
def test_cuda_graph_replay_equals_eager(num_prefills, capture_graph):
    """Capture once, then replay on new queries, cache contents, pages and context lengths
    written into the captured tensors: equals the reference on the new batch."""
    rng = random.Random(num_prefills)
    gen = torch.Generator().manual_seed(num_prefills)
    page_size, max_pages, num_decodes = 16, 128, 32
    prefill_lens = [rng.randint(1, 300) for _ in range(num_prefills)]

    def new_batch():
        """Same shapes (query lengths, page-table columns), new contexts and pages."""
        query_lens = prefill_lens + [1] * num_decodes
        context_lens = ([p + rng.randint(0, 200) for p in prefill_lens]
                        + [rng.randint(1, max_pages * page_size) for _ in range(num_decodes)])
        tables = [rng.sample(range(num_pages), max_pages) for _ in query_lens]
        return AttnBatch.build(query_lens, context_lens, tables, page_size, num_prefills, device=DEVICE)

    num_pages = max_pages * (num_prefills + num_decodes) + 8
    batch = new_batch()
    q = torch.randn(batch.num_tokens, 32, 128, generator=gen).to(torch.bfloat16).to(DEVICE)
    kv = torch.randn(num_pages, 2, page_size, 8, 128, generator=gen).to(torch.bfloat16).to(DEVICE)
    graph, out = capture_graph(lambda: ops.paged_attention(q, kv, batch, 0.1))
    for _ in range(3):
        new = new_batch()
        for name in ("page_table", "context_lens", "query_start"):
            getattr(batch, name).copy_(getattr(new, name))
        q.copy_(torch.randn(q.shape, generator=gen).to(q.dtype))
        kv.copy_(torch.randn(kv.shape, generator=gen).to(kv.dtype))
        out.fill_(float("nan"))
        graph.replay()
        torch.testing.assert_close(out, ops.paged_attention_ref(q, kv, new, 0.1), rtol=2e-2, atol=2e-2)


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
