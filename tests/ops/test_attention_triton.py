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
                    head_dim, dtype, seed, num_splits=None, pad_pages=0, window=0, softcap=0.0, prefill_splits=None):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    batch, num_pages = make_batch(query_lens, context_lens, num_prefills, page_size, rng, pad_pages=pad_pages)
    q, kv = random_inputs(batch, num_pages, page_size, num_heads, num_kv_heads, head_dim, dtype, gen)
    scale = head_dim ** -0.5 * (1 + rng.random())  # sharper than usual: exercises the running max
    out = kernels.paged_attention_triton(q, kv, batch, scale, num_splits=num_splits, window=window, softcap=softcap,
                                         prefill_splits=prefill_splits)
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


def test_decode_partitions_are_cut_from_each_request_s_keys():
    """Under a page table far wider than the contexts (a CUDA graph's bound), every split reads part
    of a short context: the merged output is the reference's, with and without a window."""
    for window in (0, 20):
        check_attention([1] * 3, [40, 3, 97], 0, page_size=16, num_heads=4, num_kv_heads=2, head_dim=32,
                        dtype=torch.float32, seed=11 + window, num_splits=8, pad_pages=40, window=window)


# chunks behind cached prefixes: a partition boundary (128) inside the first chunk's query tile
# (queries at 120..149: rows before 128 see no key of the partition from 128), a chunk wholly
# inside one partition, a fresh prompt over two query tiles, a one-token prompt; then decodes
CHUNKS = dict(query_lens=[30, 7, 45, 1, 1, 1], context_lens=[150, 71, 45, 1, 64, 30], num_prefills=4)


@pytest.mark.parametrize("prefill_splits,window,softcap", [(2, 0, 0.0), (5, 0, 0.0), (5, 24, 0.0), (3, 0, 2.0)])
def test_prefill_splits_merge_to_the_reference(prefill_splits, window, softcap):
    """Key partitions of prefill tiles (a chunk of a long prompt over its cached context), merged:
    the unsplit output, with a sliding window and with softcapping too; unused page-table columns."""
    check_attention(**CHUNKS, page_size=16, num_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float32,
                    seed=prefill_splits, num_splits=2, pad_pages=1, window=window, softcap=softcap,
                    prefill_splits=prefill_splits)


def test_prefill_partitions_are_cut_from_each_tile_s_keys():
    """Under a page table far wider than the contexts (a CUDA graph's bound), every split of a tile
    reads part of its keys: the merged output is the reference's, with and without a window; then
    the default split count, whose partitions hold at least PREFILL_MIN_PARTITION keys (a chunk of
    8 queries over 1,100 keys: 2 splits of 560 keys on the interpreter's 2 SMs)."""
    for window in (0, 40):
        check_attention(**CHUNKS, page_size=16, num_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float32,
                        seed=21 + window, num_splits=2, pad_pages=40, window=window, prefill_splits=4)
    assert kernels.prefill_split_count(8, 32, 1, 1136, torch.device(DEVICE)) == 2
    check_attention([8, 1], [1100, 30], 1, page_size=16, num_heads=1, num_kv_heads=1, head_dim=16,
                    dtype=torch.float32, seed=5, pad_pages=2)


def test_prefill_split_count_policy():
    """A chunk of one query tile over a long context bound is split into the most partitions whose
    programs fit one wave of PREFILL_PROGRAMS_PER_SM per SM, no more than the bound holds
    partitions of PREFILL_MIN_PARTITION keys; many tiles are not split. Three heads on the CPU (a
    wave of 4) stay unsplit: 2 splits would start a second wave."""
    sms, device = num_sms(torch.device(DEVICE)), torch.device(DEVICE)
    wave = kernels.PREFILL_PROGRAMS_PER_SM * sms
    for heads in (1, 3, 32):
        splits = kernels.prefill_split_count(136, 128, heads, 18432, device)
        assert splits == max(1, min(wave // heads, 18432 // kernels.PREFILL_MIN_PARTITION)), heads
        assert splits == 1 or splits * heads <= wave, (heads, splits)
    assert kernels.prefill_split_count(4096, 128, 32, 18432, device) == 1
    assert kernels.prefill_split_count(136, 128, 1, 1000, device) == 1


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
    """The most splits whose programs stay within one wave over the SMs, never below MIN_PARTITION
    tokens, and into partitions of at most MAX_PARTITION tokens up to MAX_SPLITS of them; partitions
    are whole key tiles and cover the context bound."""
    wave = kernels.DECODE_PROGRAMS_PER_SM * num_sms(torch.device(DEVICE))
    for num_decodes, num_kv_heads, max_context in [(1, 1, 4096), (1, 8, 512), (64, 32, 4096), (2, 2, 100),
                                                   (3, 1, 4096)]:
        partition, splits = kernels.decode_partition(num_decodes, num_kv_heads, max_context, 64,
                                                     torch.device(DEVICE))
        assert partition % 64 == 0 and (splits - 1) * partition < max_context <= splits * partition
        assert splits == 1 or partition >= kernels.MIN_PARTITION
        assert partition <= kernels.MAX_PARTITION or splits == kernels.MAX_SPLITS
        per_split = num_decodes * num_kv_heads
        if partition < kernels.MAX_PARTITION:
            assert splits == 1 or per_split * splits <= wave
            assert per_split * (splits + 1) > wave or splits >= max_context // kernels.MIN_PARTITION
    assert kernels.decode_partition(1, 1, 4096, 64, torch.device("cpu")) == (512, 8)
    assert kernels.decode_partition(64, 32, 2048, 64, torch.device("cpu")) == (2048, 1)
    # 3 requests a split: 2 splits fill 6 of one wave's 8 programs, a third would start a second wave
    assert kernels.decode_partition(3, 1, 4096, 64, torch.device("cpu")) == (2048, 2)
    # the batch fills the SMs, but a context of 16k would be read by one program a KV head; past
    # MAX_SPLITS partitions grow instead
    assert kernels.decode_partition(64, 32, 16384, 64, torch.device("cpu")) == (2048, 8)
    assert kernels.decode_partition(64, 32, 131072, 64, torch.device("cpu")) == (8192, kernels.MAX_SPLITS)
    assert kernels.decode_partition(3, 2, 1000, 64, torch.device("cpu"), num_splits=4) == (256, 4)
    # each request's keys spread over the splits while their programs fit one wave (8 programs on
    # the CPU's 2 "SMs"); past it only contexts longer than MAX_PARTITION split
    assert kernels.decode_min_partition(1, 2, 4, torch.device("cpu")) == 0
    assert kernels.decode_min_partition(3, 2, 2, torch.device("cpu")) == kernels.MAX_PARTITION


class Unlaunchable:
    def __getitem__(self, grid):
        raise AssertionError("merge kernel launched")


def test_single_split_writes_the_output_without_the_merge(monkeypatch):
    """One split: the partition kernel normalises and writes the output; the merge never runs
    (with two it does)."""
    monkeypatch.setattr(kernels, "decode_merge_kernel", Unlaunchable())
    check_attention([1] * 3, [40, 1, 33], 0, page_size=5, num_heads=9, num_kv_heads=3, head_dim=32,
                    dtype=torch.bfloat16, seed=5, num_splits=1, pad_pages=2)
    check_attention(**MIXED, page_size=16, num_heads=4, num_kv_heads=4, head_dim=64, dtype=torch.float32,
                    seed=6, num_splits=1)
    with pytest.raises(AssertionError, match="merge kernel launched"):  # contexts past a GPU's 64-key tile
        check_attention([1] * 3, [300, 1, 133], 0, page_size=5, num_heads=9, num_kv_heads=3, head_dim=32,
                        dtype=torch.bfloat16, seed=5, num_splits=2)


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
