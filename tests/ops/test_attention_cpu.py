"""The CPU paged attention (punica.ops.attention_cpu: torch's fused SDPA over each request's
gathered context), the CPU branch of punica.ops.attention.paged_attention, against the reference
on fresh random inputs: GQA, sliding windows, softcap (the reference itself), an fp8 cache, prompt
chunks behind cached context, decodes of mixed lengths in groups, and NaN or inf in the cache.
"""

import random

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from punica.config import ceil_div
from punica.ops import attention as ops
from punica.ops import attention_cpu
from punica.ops.attention import AttnBatch
from punica.ops.kv_cache import KVCache

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}  # (rtol, atol) of the output
POISONS = [float("nan"), float("inf"), float("-inf")]


def make_batch(query_lens, context_lens, num_prefills, page_size, rng, pad_pages=2, spare_pages=5):
    """AttnBatch (on the CPU) whose requests hold random, scattered pages of a pool with spare pages,
    each page table padded with `pad_pages` pages of the pool; its page count."""
    needed = [ceil_div(c, page_size) for c in context_lens]
    pool = list(range(sum(needed) + spare_pages))
    rng.shuffle(pool)
    tables, used = [], 0
    for n in needed:
        tables.append(pool[used:used + n] + rng.choices(pool, k=pad_pages))
        used += n
    return AttnBatch.build(query_lens, context_lens, tables, page_size, num_prefills), len(pool)


def random_inputs(batch, num_pages, page_size, num_heads, num_kv_heads, head_dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch.num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    kv = torch.randn(num_pages, 2, page_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    return q, kv


def fast(q, kv, batch, scale, window=0, kv_scales=None, max_decode_padding=attention_cpu.MAX_DECODE_PADDING,
         min_split_keys=attention_cpu.MIN_SPLIT_KEYS):
    return attention_cpu.paged_attention_cpu(q, kv, batch, scale, window, kv_scales, ops.prefill_request_ref,
                                             max_decode_padding, min_split_keys)


# prefills: a fresh prompt, chunks behind cached context (one within a page, one over several),
# a one-token prompt; decodes: contexts of 1 to 300 tokens, ending on a page boundary and mid-page
MIXED = dict(query_lens=[45, 20, 7, 1, 1, 1, 1, 1, 1, 1], context_lens=[45, 75, 130, 1, 1, 300, 17, 48, 150, 33],
             num_prefills=4)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,page_size,dtype", [
    (9, 3, 64, 16, torch.float32),   # SmolLM2's heads
    (4, 4, 32, 7, torch.bfloat16),   # no GQA, odd page size
    (8, 1, 16, 5, torch.float32),    # group 8
])
@pytest.mark.parametrize("window", [0, 1, 10, 64, 400])
def test_mixed_batch_matches_reference(num_heads, num_kv_heads, head_dim, page_size, dtype, window):
    rng = random.Random(window + page_size)
    batch, num_pages = make_batch(**MIXED, page_size=page_size, rng=rng)
    q, kv = random_inputs(batch, num_pages, page_size, num_heads, num_kv_heads, head_dim, dtype, seed=window)
    scale = head_dim ** -0.5 * (1 + rng.random())
    out = fast(q, kv, batch, scale, window)
    ref = ops.paged_attention_ref(q, kv, batch, scale, window)
    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out, ref, rtol=TOL[dtype][0], atol=TOL[dtype][1])
    torch.testing.assert_close(ops.paged_attention(q, kv, batch, scale, window), out, rtol=0, atol=0)
    if 0 < window < max(MIXED["context_lens"]):  # the window leaves out keys: not full attention's output
        assert not torch.allclose(out, ops.paged_attention_ref(q, kv, batch, scale), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("max_decode_padding", [1.0, 2.0, 1e9])
def test_decode_grouping_does_not_change_the_output(max_decode_padding):
    """Decodes of contexts 1 .. 900 run each alone (1.0: only equal spans share a call), in groups,
    or all padded to the longest (1e9): each way the reference's outputs."""
    contexts = [900, 3, 1, 64, 65, 128, 400, 17, 16, 450, 899, 2]
    batch, num_pages = make_batch([1] * len(contexts), contexts, 0, 16, random.Random(1))
    q, kv = random_inputs(batch, num_pages, 16, 6, 2, 32, torch.float32, seed=1)
    ref = ops.paged_attention_ref(q, kv, batch, 0.2)
    torch.testing.assert_close(fast(q, kv, batch, 0.2, max_decode_padding=max_decode_padding), ref,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [8, 10])
def test_decodes_whose_windows_start_on_different_pages_of_tables_without_padding(window):
    """Page tables as wide as the longest context (as the engine builds them): a decode whose window
    starts on a later page than the group's other decodes has fewer table entries past it than the
    group's span of pages."""
    rng = random.Random(window)
    batch, num_pages = make_batch([1, 1, 1], [20, 19, 18], 0, 4, rng, pad_pages=0)
    q, kv = random_inputs(batch, num_pages, 4, 4, 2, 16, torch.float32, seed=window)
    out = fast(q, kv, batch, 0.25, window, max_decode_padding=1e9)
    torch.testing.assert_close(out, ops.paged_attention_ref(q, kv, batch, 0.25, window), rtol=1e-5, atol=1e-5)


def test_a_batchs_plan_serves_its_layers_and_only_them():
    """The host-side plan made at a batch's first layer is kept for its other layers (other layer
    caches), and made again for another batch, or the same batch under another window or grouping:
    each call the reference's outputs."""
    rng = random.Random(3)
    first, num_pages = make_batch(**MIXED, page_size=16, rng=rng)
    second, _ = make_batch([3, 1, 1], [40, 200, 9], 1, 16, rng, spare_pages=num_pages)
    layers = [random_inputs(first, num_pages + 40, 16, 9, 3, 32, torch.float32, seed=s)[1] for s in range(3)]
    for batch, window, padding in [(first, 0, 2.0), (first, 0, 2.0), (second, 0, 2.0), (first, 30, 2.0),
                                   (first, 30, 1e9), (second, 0, 2.0)]:
        q = torch.randn(batch.num_tokens, 9, 32, generator=torch.Generator().manual_seed(window))
        for kv in layers:
            torch.testing.assert_close(fast(q, kv, batch, 0.2, window, max_decode_padding=padding),
                                       ops.paged_attention_ref(q, kv, batch, 0.2, window), rtol=1e-5, atol=1e-5)


def test_decode_groups():
    """Longest span first; a group takes the next span while it is at least its longest / max_padding;
    under a window a span is the context capped at the window."""
    contexts = [100, 7, 50, 49, 4000, 8, 3]
    assert attention_cpu.decode_groups(contexts) == [[4], [0, 2], [3], [5, 1], [6]]
    assert attention_cpu.decode_groups(contexts, max_padding=1.0) == [[4], [0], [2], [3], [5], [1], [6]]
    assert attention_cpu.decode_groups(contexts, max_padding=1e9) == [[4, 0, 2, 3, 5, 1, 6]]
    assert attention_cpu.decode_groups(contexts, window=50) == [[0, 2, 4, 3], [5, 1], [6]]
    assert attention_cpu.decode_groups([]) == []


def test_softcap_runs_the_reference():
    """SDPA has no softcap: the public function's CPU branch gives the reference's output bit for bit."""
    batch, num_pages = make_batch(**MIXED, page_size=16, rng=random.Random(2))
    q, kv = random_inputs(batch, num_pages, 16, 4, 2, 32, torch.float32, seed=2)
    out = ops.paged_attention(q, kv, batch, 0.3, window=10, softcap=2.0)
    assert torch.equal(out, ops.paged_attention_ref(q, kv, batch, 0.3, 10, 2.0))
    assert not torch.allclose(out, ops.paged_attention_ref(q, kv, batch, 0.3, 10), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("window", [0, 20])
def test_fp8_cache_matches_reference(window):
    """Every row written in e4m3 with its scale (V's magnitudes 2^-8 .. 2^2): the CPU path reads the
    scales as the reference does."""
    gen = torch.Generator().manual_seed(3)
    page_size, num_kv_heads, head_dim = 8, 3, 32
    batch, num_pages = make_batch(**MIXED, page_size=page_size, rng=random.Random(3))
    cache = KVCache.empty(1, num_pages, page_size, num_kv_heads, head_dim, torch.float32, "cpu", "fp8")
    pages, scales = cache.pages[0], cache.scales[0]
    rows = num_pages * page_size
    k = torch.randn(rows, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(rows, num_kv_heads, head_dim, generator=gen) * 2.0 ** torch.randint(-8, 3, (rows, 1, 1),
                                                                                        generator=gen)
    ops.write_kv_ref(pages, k, v, torch.arange(rows), scales)
    q = torch.randn(batch.num_tokens, 9, head_dim, generator=gen)
    out = ops.paged_attention(q, pages, batch, 0.2, window, kv_scales=scales)
    torch.testing.assert_close(out, ops.paged_attention_ref(q, pages, batch, 0.2, window, kv_scales=scales),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("window", [0, 20])
def test_consecutive_pages_of_a_cpu_cache_are_read_in_place(kv_cache_dtype, window):
    """A CPU cache keeps each plane's pages of a KV head in one block (KVCache.empty): a request whose
    pages are consecutive (a chunk behind cached context, a fresh prompt, a decode) is read through
    a view of it, one whose pages make a few runs by a copy a run, the others a page at a time; each
    way each head's keys are contiguous rows, and the outputs the reference's, on the fused kernel."""
    gen = torch.Generator().manual_seed(5)
    page_size, num_kv_heads, head_dim = 8, 3, 32
    query_lens, context_lens = [6, 30, 1, 1, 1], [50, 30, 70, 40, 300]
    scattered = [31, 2, 29, 4, 27, 6, 25, 8, 23, 10, 21, 12, 19, 14, 17, 16, 15, 18, 13, 20, 11, 22, 9, 24, 7,
                 26, 5, 28, 3, 30, 1, 32, 0, 33, 34, 35, 36, 37]  # 38 pages, far more runs than MAX_COPIED_RUNS
    tables = [[2, 3, 4, 5, 26, 27, 28], list(range(9, 13)), list(range(13, 22)), [30, 24, 27, 22, 25], scattered]
    batch = AttnBatch.build(query_lens, context_lens, tables, page_size, num_prefills=2)
    cache = KVCache.empty(1, 40, page_size, num_kv_heads, head_dim, torch.float32, "cpu", kv_cache_dtype)
    pages, scales = cache.pages[0], None if cache.scales is None else cache.scales[0]
    rows = 40 * page_size
    k, v = (torch.randn(rows, num_kv_heads, head_dim, generator=gen) for _ in range(2))
    ops.write_kv_ref(pages, k, v, torch.arange(rows), scales)
    q = torch.randn(batch.num_tokens, 9, head_dim, generator=gen)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = ops.paged_attention(q, pages, batch, 0.2, window, kv_scales=scales)
    torch.testing.assert_close(out, ops.paged_attention_ref(q, pages, batch, 0.2, window, kv_scales=scales),
                               rtol=1e-5, atol=1e-5)

    def gather(kv, page_list):
        page_list = torch.tensor(page_list)
        return attention_cpu._gather(kv, scales, page_list, attention_cpu._runs(page_list))

    assert attention_cpu._runs(torch.tensor([30, 24, 25, 27])) == [(30, 1), (24, 2), (27, 1)]
    assert attention_cpu._runs(torch.tensor(scattered)) is None
    for page_list in (list(range(2, 9)), [30, 24, 25, 27], scattered):
        got = gather(pages, page_list)
        assert got.shape == (2, num_kv_heads, len(page_list) * page_size, head_dim)
        assert got.stride()[2:] == (head_dim, 1)
        in_place = got.untyped_storage().data_ptr() == pages.untyped_storage().data_ptr()
        assert in_place == (kv_cache_dtype == "auto" and len(page_list) == 7)  # fp8 dequantizes: a copy either way
        torch.testing.assert_close(got, gather(pages.contiguous(), page_list), rtol=0, atol=0)


@pytest.mark.parametrize("kv_cache_dtype,in_place", [("auto", True), ("auto", False), ("fp8", True)])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("min_split_keys", [attention_cpu.MIN_SPLIT_KEYS, 40])
def test_keys_before_few_queries_are_split_in_parts(kv_cache_dtype, in_place, num_heads, num_kv_heads, min_split_keys,
                                                    monkeypatch):
    """Prompt chunks of up to MAX_SPLIT_QUERIES queries and single decodes after at least
    `min_split_keys` keys take the split keys (two or more parts, the rest under the causal mask), a
    longer chunk the keys before it and its own apart: the reference's outputs. A fresh prompt and a
    decode group do not; neither do requests after fewer keys."""
    gen = torch.Generator().manual_seed(num_heads + min_split_keys)
    page_size, head_dim = 16, 32
    long = min_split_keys + 1
    query_lens = [1, 5, attention_cpu.MAX_SPLIT_QUERIES, attention_cpu.MAX_SPLIT_QUERIES + 1, 30, 3, 1, 1, 1]
    context_lens = [long, long + 4 + 2 * attention_cpu.PART_KEYS, long + 40, long + 50, 30, 20, long + 7, 5, 6]
    split, apart = {0, 1, 2, 6}, {3}  # the requests that take each
    pages_needed = [ceil_div(c, page_size) for c in context_lens]
    num_pages = sum(pages_needed) + 4
    order = list(range(num_pages)) if in_place else random.Random(6).sample(range(num_pages), num_pages)
    tables, used = [], 0
    for n in pages_needed:
        tables.append(order[used:used + n])
        used += n
    batch = AttnBatch.build(query_lens, context_lens, tables, page_size, num_prefills=6)
    cache = KVCache.empty(1, num_pages, page_size, num_kv_heads, head_dim, torch.float32, "cpu", kv_cache_dtype)
    pages, scales = cache.pages[0], None if cache.scales is None else cache.scales[0]
    rows = num_pages * page_size
    k, v = (torch.randn(rows, num_kv_heads, head_dim, generator=gen) for _ in range(2))
    ops.write_kv_ref(pages, k, v, torch.arange(rows), scales)
    q = torch.randn(batch.num_tokens, num_heads, head_dim, generator=gen)
    calls = {"_split_keys": [], "_prefix_then_chunk": []}
    for name, run in ((name, getattr(attention_cpu, name)) for name in calls):
        monkeypatch.setattr(attention_cpu, name,
                            lambda q, *a, name=name, run=run: calls[name].append(q.shape[0]) or run(q, *a))
    out = fast(q, pages, batch, 0.2, kv_scales=scales, min_split_keys=min_split_keys)
    torch.testing.assert_close(out, ops.paged_attention_ref(q, pages, batch, 0.2, kv_scales=scales),
                               rtol=1e-5, atol=1e-5)
    assert sorted(calls["_split_keys"]) == sorted(query_lens[i] for i in split)
    assert calls["_prefix_then_chunk"] == [query_lens[i] for i in apart]


def owned_context(batch, num_pages, page_size):
    """[num_pages, page_size] bool: the positions inside some request's context, on its own pages."""
    keep = torch.zeros(num_pages, page_size, dtype=torch.bool)
    for i, context_len in enumerate(batch.context_lens.tolist()):
        pos = torch.arange(context_len)
        keep[batch.page_table[i, pos // page_size].long(), pos % page_size] = True
    return keep


@pytest.mark.parametrize("min_split_keys", [attention_cpu.MIN_SPLIT_KEYS, 8])
@pytest.mark.parametrize("window", [0, 10])
@pytest.mark.parametrize("value", POISONS, ids=str)
def test_poison_outside_the_context_never_reaches_the_output(value, window, min_split_keys):
    """Free pages, the page tables' padding (other requests' pages) and the tails of the requests'
    own last pages hold NaN or inf: the outputs are exactly those of the clean cache (decode
    groups pad the shorter contexts to the longest, over such positions)."""
    page_size = 16
    batch, num_pages = make_batch(**MIXED, page_size=page_size, rng=random.Random(4))
    q, kv = random_inputs(batch, num_pages, page_size, 9, 3, 32, torch.float32, seed=4)
    clean = fast(q, kv, batch, 0.2, window, max_decode_padding=1e9, min_split_keys=min_split_keys)
    assert clean.isfinite().all()
    poisoned = kv.clone()
    poisoned.transpose(1, 2)[~owned_context(batch, num_pages, page_size)] = value
    assert torch.equal(fast(q, poisoned, batch, 0.2, window, max_decode_padding=1e9, min_split_keys=min_split_keys),
                       clean)


@pytest.mark.parametrize("max_decode_padding,min_split_keys", [
    (attention_cpu.MAX_DECODE_PADDING, attention_cpu.MIN_SPLIT_KEYS),
    (1.0, 8),  # every decode alone, and every chunk and decode with keys split
], ids=["defaults", "split"])
@pytest.mark.parametrize("value", POISONS, ids=str)
@pytest.mark.parametrize("which", [0, 1])
@pytest.mark.parametrize("window", [0, 10])
def test_poison_inside_a_context_reaches_what_it_reaches_in_the_reference(value, which, window, max_decode_padding,
                                                                           min_split_keys):
    """K or V at one position inside each request's context is poisoned (in a prompt chunk, after
    some of its queries; in a decode's context, in and out of its window): the outputs are the
    reference's, non-finite exactly where the reference's are."""
    page_size = 16
    batch, num_pages = make_batch(**MIXED, page_size=page_size, rng=random.Random(5))
    q, kv = random_inputs(batch, num_pages, page_size, 9, 3, 32, torch.float32, seed=5)
    poisoned = kv.clone()
    for i, context_len in enumerate(batch.context_lens.tolist()):
        pos = context_len // 2 if i != 1 else 60  # request 1: its 6th query (of 20, from position 55)
        poisoned[batch.page_table[i, pos // page_size], which, pos % page_size, 1] = value
    out = fast(q, poisoned, batch, 0.2, window, max_decode_padding=max_decode_padding, min_split_keys=min_split_keys)
    ref = ops.paged_attention_ref(q, poisoned, batch, 0.2, window)
    assert torch.equal(out.isfinite(), ref.isfinite())
    assert not out.isfinite().all() and out[45:50].isfinite().all()  # request 1's queries before position 60
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, equal_nan=True)



@pytest.mark.parametrize("window", [0, 10])
def test_every_call_takes_the_fused_kernel(window):
    """With SDPA limited to its flash-attention kernel (it raises on inputs that kernel does not
    take, 3-D ones for instance, which would run the unfused math path), the batch still runs."""
    batch, num_pages = make_batch(**MIXED, page_size=16, rng=random.Random(7))
    q, kv = random_inputs(batch, num_pages, 16, 9, 3, 64, torch.float32, seed=7)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = fast(q, kv, batch, 0.125, window)
    torch.testing.assert_close(out, ops.paged_attention_ref(q, kv, batch, 0.125, window), rtol=1e-5, atol=1e-5)
