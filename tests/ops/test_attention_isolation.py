"""Paged attention never lets a KV-cache position outside a query's view reach its output.

The cache is shared: a page freed by one request is handed to another with whatever the first
left in it (NaN or inf, if its activations went non-finite), page tables are padded with page 0
or with other requests' pages, and CUDA-graph buckets pad the batch with requests on a scratch
page. So every position a request does not own, or that lies at or after its context, is
poisoned here with NaN, +inf or -inf, and the reference, the CPU path (punica.ops.attention_cpu)
and the Triton kernels must give exactly the outputs of the unpoisoned cache. The reference also
keeps causal order exactly: a position after a query (in the request's own prompt) does not reach
it (the CPU path hands such a prefill to the reference: tests/ops/test_attention_cpu.py); the
Triton prefill kernel may let such a value, which only the request's own non-finite activations
write, reach that request's earlier queries (punica.ops.attention_triton). Without a GPU the
kernels run under Triton's interpreter (tests/conftest.py).
"""

import dataclasses
import random

import pytest
import torch

from punica.config import ceil_div
from punica.engine.cuda_graphs import StaticBatch, buckets
from punica.engine.request import Request
from punica.engine.sampling_params import SamplingParams
from punica.engine.step_input import StepInput
from punica.ops import attention as ops
from punica.ops import attention_cpu
from punica.ops import attention_triton as kernels
from punica.ops.attention import AttnBatch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
POISONS = [float("nan"), float("inf"), float("-inf")]


def reference(q, kv, batch, scale, num_splits):
    return ops.paged_attention_ref(q, kv, batch, scale)


def triton(q, kv, batch, scale, num_splits):
    return kernels.paged_attention_triton(q, kv, batch, scale, num_splits=num_splits)


def cpu(q, kv, batch, scale, num_splits):
    on_cpu = dataclasses.replace(batch, **{f.name: getattr(batch, f.name).cpu() for f in dataclasses.fields(batch)
                                           if isinstance(getattr(batch, f.name), torch.Tensor)})
    out = attention_cpu.paged_attention_cpu(q.cpu(), kv.cpu(), on_cpu, scale, 0, None, ops.prefill_request_ref)
    return out.to(q.device)


IMPLEMENTATIONS = [pytest.param(reference, id="reference"), pytest.param(cpu, id="cpu"),
                   pytest.param(triton, id="triton", marks=pytest.mark.slow)]


def eager_batch(query_lens, context_lens, num_prefills, page_size, rng, pad_pages):
    """AttnBatch over disjoint, scattered pages of a pool whose page 0 and a few others are free
    (AttnBatch.build pads page tables with page 0); every table also gets `pad_pages` columns of
    other requests' pages and free pages. Returns it and the number of pages."""
    needed = [ceil_div(c, page_size) for c in context_lens]
    pool = list(range(1, sum(needed) + 4))
    rng.shuffle(pool)
    tables, used = [], 0
    for n in needed:
        tables.append(pool[used:used + n])
        used += n
    spares = [0] + pool[used:]
    for i, table in enumerate(tables):
        others = [p for j, t in enumerate(tables) if j != i for p in t] + spares
        table += rng.choices(others, k=pad_pages)
    return AttnBatch.build(query_lens, context_lens, tables, page_size, num_prefills, device=DEVICE), len(pool) + 1


def graph_batch(prefills, decodes, page_size, max_pages, rng):
    """The AttnBatch of a mixed CUDA-graph bucket (punica.engine.cuda_graphs), as its captured
    step sees it: prefills (query_len, context_len) and decode contexts on scattered pages,
    padded with requests and decode rows on the scratch page (the last page), page tables
    padded with it. Returns it, the number of pages and the rows of the real requests."""
    needed = [ceil_div(c, page_size) for _, c in prefills] + [ceil_div(c, page_size) for c in decodes]
    num_pages = sum(needed) + 3
    pool = list(range(num_pages - 1))
    rng.shuffle(pool)
    pages = [pool[sum(needed[:i]):sum(needed[:i + 1])] for i in range(len(needed))]

    def request(i, context_len, num_cached):
        r = Request(f"r{i}", [rng.randrange(100) for _ in range(context_len)], SamplingParams())
        r.pages, r.num_cached = pages[i], num_cached
        return r

    prefill_requests = [request(i, c, c - q) for i, (q, c) in enumerate(prefills)]
    decode_requests = [request(len(prefills) + i, c, c - 1) for i, c in enumerate(decodes)]
    step = StepInput.from_requests(prefill_requests + decode_requests, [q for q, _ in prefills] + [1] * len(decodes),
                                   len(prefills), page_size)
    bucket = next(b for b in buckets(8, max_pages * page_size) if b.num_prefills and b.fits(step))
    static = StaticBatch(bucket, max_pages, page_size, scratch_page=num_pages - 1, device=torch.device(DEVICE))
    static.fill(step)
    sampled = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    batch = static.forward(lambda ids, batch: batch.attn, None, sampled, with_lora=False)
    num_prefill_rows = sum(q for q, _ in prefills)
    rows = list(range(num_prefill_rows)) + list(range(bucket.prefill_tokens, bucket.prefill_tokens + len(decodes)))
    return batch, num_pages, torch.tensor(rows, device=DEVICE)


def owned_context(batch, requests, num_pages, page_size):
    """[num_pages, page_size] bool: the positions inside the context of one of `requests`
    (indices into the batch), on its own pages."""
    keep = torch.zeros(num_pages, page_size, dtype=torch.bool, device=DEVICE)
    for i in requests:
        pos = torch.arange(batch.context_lens[i].item(), device=DEVICE)
        keep[batch.page_table[i, pos // page_size].long(), pos % page_size] = True
    return keep


def poisoned(kv, keep, value):
    """kv with K and V of every (page, offset) outside `keep` set to `value`."""
    out = kv.clone()
    out.transpose(1, 2)[~keep] = value
    return out


def random_inputs(num_tokens, num_pages, page_size, num_heads, num_kv_heads, head_dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    kv = torch.randn(num_pages, 2, page_size, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    return q, kv


def check_poison_outside_context(attend, batch, num_pages, page_size, requests, rows, heads, dtype, num_splits,
                                 seed):
    """With every position outside the contexts of `requests` poisoned (NaN, then inf, then
    -inf), the outputs of `rows` (theirs) are exactly those of the clean cache, and finite."""
    q, kv = random_inputs(batch.num_tokens, num_pages, page_size, *heads, dtype, seed)
    keep = owned_context(batch, requests, num_pages, page_size)
    scale = heads[2] ** -0.5
    clean = attend(q, kv, batch, scale, num_splits)[rows]
    assert clean.isfinite().all()
    for value in POISONS:
        out = attend(q, poisoned(kv, keep, value), batch, scale, num_splits)[rows]
        bad_rows = (~out.isfinite()).flatten(1).any(1)
        assert not bad_rows.any(), f"{value} reached rows {rows[bad_rows].tolist()}"
        assert torch.equal(out, clean), value


# (query_lens, context_lens, num_prefills, page_size, pad_pages, (num_heads, num_kv_heads,
# head_dim), dtype, num_splits): prefills over several query tiles, behind a cached prefix, of
# one token; decodes of one token, ending on a page boundary and mid-page; decode splits that
# merge, and a single split
EAGER = {
    "prefills": ([45, 20, 1, 3], [45, 75, 1, 17], 4, 5, 1, (2, 1, 32), torch.bfloat16, None),
    "decodes": ([1] * 5, [130, 17, 1, 64, 33], 0, 16, 2, (6, 2, 32), torch.float32, 3),
    "mixed": ([45, 20, 1, 1, 1, 1, 1], [45, 75, 1, 1, 48, 50, 93], 3, 7, 1, (9, 3, 32), torch.bfloat16, 2),
    "mixed-one-split": ([13, 1, 1, 1], [13, 9, 32, 31], 1, 16, 1, (4, 4, 32), torch.float16, 1),
}


@pytest.mark.parametrize("attend", IMPLEMENTATIONS)
@pytest.mark.parametrize("layout", EAGER)
def test_poison_outside_the_context_never_reaches_the_output(attend, layout):
    """Free pages (page 0 among them: AttnBatch.build pads page tables with it), other
    requests' pages in the page-table padding, and the tails of the requests' own last pages
    are poisoned."""
    query_lens, context_lens, num_prefills, page_size, pad_pages, heads, dtype, num_splits = EAGER[layout]
    batch, num_pages = eager_batch(query_lens, context_lens, num_prefills, page_size, random.Random(layout),
                                   pad_pages)
    check_poison_outside_context(attend, batch, num_pages, page_size, range(len(query_lens)),
                                 torch.arange(batch.num_tokens, device=DEVICE), heads, dtype, num_splits,
                                 seed=len(layout))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy, on the padding rows' NaN
@pytest.mark.parametrize("attend", IMPLEMENTATIONS)
def test_poison_never_reaches_the_real_rows_of_a_cuda_graph_bucket(attend):
    """A bucket's padding requests and padded decode rows read and write the scratch page, and
    every page table is padded with it: the scratch page, the free pages and the tails of the
    real requests' pages are poisoned, and the real rows (a prefill behind a cached prefix, one
    without, decodes) are exactly those of the clean cache."""
    prefills, decodes, page_size = [(30, 30), (12, 40)], [1, 20, 49, 7, 35], 7
    batch, num_pages, rows = graph_batch(prefills, decodes, page_size, max_pages=10, rng=random.Random(0))
    num_prefills, num_requests = batch.num_prefills, batch.page_table.shape[0]
    assert num_prefills > len(prefills) and num_requests > num_prefills + len(decodes)  # padded on both sides
    real = list(range(len(prefills))) + list(range(num_prefills, num_prefills + len(decodes)))
    check_poison_outside_context(attend, batch, num_pages, page_size, real, rows, (4, 2, 32), torch.bfloat16,
                                 None, seed=1)


# prefills whose queries cross query tiles and key tiles (a fresh prompt, one behind a cached
# prefix), and a decode: (query_len, context_len) each, and the position poisoned in each prefill
CAUSAL = dict(query_lens=[45, 20, 1], context_lens=[45, 75, 33], num_prefills=2)
CAUSAL_POSITIONS = [20, 60]


@pytest.mark.parametrize("value", POISONS, ids=str)
@pytest.mark.parametrize("which", ["k", "v"])
def test_a_position_reaches_only_the_queries_at_or_after_it_in_the_reference(value, which):
    """K (every dim) or V (one dim) of one KV head at one position inside each prefill's
    queries is poisoned: the queries before it give exactly the clean outputs; those at or
    after it are non-finite exactly where that K or V enters (that KV head's query heads;
    for V, its dim), and clean elsewhere."""
    page_size, (num_heads, num_kv_heads, head_dim), kv_head, dim = 5, (6, 2, 32), 1, 3
    batch, num_pages = eager_batch(**CAUSAL, page_size=page_size, rng=random.Random(which), pad_pages=0)
    q, kv = random_inputs(batch.num_tokens, num_pages, page_size, num_heads, num_kv_heads, head_dim,
                          torch.bfloat16, seed=2)
    poison = kv.clone()
    expect_bad = torch.zeros(q.shape, dtype=torch.bool, device=DEVICE)
    heads = slice(kv_head * num_heads // num_kv_heads, (kv_head + 1) * num_heads // num_kv_heads)
    dims = slice(None) if which == "k" else slice(dim, dim + 1)
    starts = batch.query_start.tolist()
    for i, pos in enumerate(CAUSAL_POSITIONS):
        page = batch.page_table[i, pos // page_size]
        poison[page, "kv".index(which), pos % page_size, kv_head, dims] = value
        first_query = batch.context_lens[i].item() - (starts[i + 1] - starts[i])
        expect_bad[starts[i] + pos - first_query:starts[i + 1], heads, dims] = True
    clean = reference(q, kv, batch, 0.2, None)
    out = reference(q, poison, batch, 0.2, None)
    bad = ~out.isfinite()
    assert not (bad & ~expect_bad).any(), f"non-finite where nothing poisoned enters: rows {rows_of(bad & ~expect_bad)}"
    assert not (expect_bad & ~bad).any(), f"lost, rows {rows_of(expect_bad & ~bad)}"
    assert torch.equal(out[~expect_bad], clean[~expect_bad])


def rows_of(mask):
    return mask.flatten(1).any(1).nonzero().flatten().tolist()
