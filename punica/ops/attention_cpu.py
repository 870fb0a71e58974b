"""Attention over the paged KV cache on the CPU; semantics and layout: punica.ops.attention.

Each request's keys and values are gathered from its pages (only the positions its queries may
see: its context, from the start of its first query's window) and handed to torch's
scaled_dot_product_attention (SDPA), which on the CPU runs a fused flash-attention kernel: key
blocks with an online softmax, no [heads, queries, keys] score tensor, GQA without copying K and V
per query head (`enable_gqa`). So a prompt chunk costs its queries times its context, with the
GEMM-like efficiency of the kernel, and a decode costs its own context.

* Prefill: one SDPA call per prefill request. A fresh prompt (queries == context, no window) runs
  `is_causal`; a chunk behind cached context, or under a window, takes a boolean mask: the query
  at position p sees the keys at positions p - window < key <= p.
* Decode: requests grouped by the span of keys they see (their context, or their window), longest
  first; a group holds the spans of at least 1 / `max_decode_padding` of its longest, and runs one
  SDPA call over keys padded to that longest: a decode beside a long context never pays its width.
  Each query head of a KV head is a row of one query block (GQA folded into the query rows).
* Split keys: a prompt chunk, or a decode alone in its group, after at least MIN_SPLIT_KEYS keys (no
  window). For a chunk of at most MAX_SPLIT_QUERIES queries or a decode: SDPA's kernel runs one task
  per query head, each reading its KV head's keys whole: 9 tasks on 2 cores for the embedded model,
  with a few rows each.
  Instead the query heads of a KV head become rows of one query block, the keys before the queries
  go in parts of about PART_KEYS (a batch of parts x KV heads tasks, no mask), the rest of the keys
  (the last part's remainder and the queries' own, under the causal mask) in a product of their own,
  and the parts' outputs are weighted by their log-sum-exps (the kernel's second output). One
  layer's attention of a C-token chunk on a 2-core CPU (9 query and 3 KV heads, 30 layers' caches
  read in turn, the fastest of 5 rounds; docs/results/cpu_split_keys_attention_2026-12-04.log):
  after 4k keys 0.70-1.08 ms at C = 1-8 against 1.01-1.46 with SDPA, 2.9 against 3.1 at C = 32;
  after 8k keys 1.23-1.93 against 2.40-3.24; after 2k keys about equal, and slower after fewer
  (its few extra ops cost about 0.08 ms).
  A longer chunk after as many keys: each query head of a KV head is a batch entry, the keys before
  the queries one call without a mask and the chunk's own keys one under the causal mask, merged
  the same way. A 512-token chunk after 3.6k keys: 32.3 ms a layer against 36.2 with SDPA's mask,
  after 7.5k 63.3 against 74.4; 64 tokens after 4k: 4.78 against 5.00 (10 layers' caches, fastest
  of 3 rounds; docs/results/cpu_split_keys_attention_long_chunks_2026-12-05.log). After fewer keys
  the two calls cost more than the mask.
* Softcap (Gemma 2): SDPA has none, so a softcapped call runs the reference.

A request whose pages are consecutive is read in place: the CPU cache keeps each layer's K pages of
a KV head in one block and its V pages in another (punica.ops.kv_cache.KVCache.empty), so a run of
pages is a view [2, Hkv, keys, D] whose keys of a head are contiguous rows, which SDPA reads
directly (punica.engine.kv_cache hands a prompt consecutive pages, and its decode the pages after
them while they are free). A request whose pages make at most MAX_COPIED_RUNS runs (a prefix-cache
hit and the pages after it, say) is copied a run at a time, each head's rows of a run one block.
Other requests' K and V are gathered a page of one head at a time, blocks of page_size x D, by one
index_select a plane into the same layout; a decode group's requests all in that one call, padded
to the group's longest span. Copies go into tensors the batch's plan keeps for its layers
(_scratch). On a 2-core CPU, one layer's attention, 30 layers' caches read in turn, the fastest of
7-11 rounds (a cache that kept a page's heads together, read through strided views and gathered
request by request into new tensors, in brackets): a decode after 2,000 keys in place 0.28-0.31 ms
(0.62); 32 decodes after 100 keys each, gathered, 0.79-1.11 ms (2.4-2.5); an 8-token chunk after
3.3k keys 0.97 ms in place (0.98-1.01), 0.95-0.97 with its pages in two runs, 1.09-1.10 with its
pages drawn at random (1.05-1.27).

Isolation: only positions inside a request's context are gathered; a decode group's padding (past
a context, before a window) is set to zero in K and V and masked, so it contributes exactly
nothing. A prompt chunk's own keys after some of its queries are masked by addition in the fused
kernel, which a NaN or inf survives: a prefill whose own chunk's K or V (under a window, any it
gathered) holds one (only its own non-finite activations write one into its context) runs the
reference instead, which keeps causal order exactly; one in its cached prefix, which every query
sees, reaches every output in both. So the outputs are the reference's, NaN and inf included, up
to rounding.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from punica.config import ceil_div
from punica.ops.attention_batch import AttnBatch
from punica.ops.kv_cache import dequantize_kv_ref

MAX_DECODE_PADDING = 2.0  # a decode group's longest key span over its shortest, at most
MIN_SPLIT_KEYS = 3072     # keys before a request's queries from which they are split in parts
MAX_SPLIT_QUERIES = 32    # queries of a request that may take the split keys
PART_KEYS = 2048          # keys a part holds, about (at least two parts)
MAX_COPIED_RUNS = 8       # runs of consecutive pages a request's keys are copied by, at most


def paged_attention_cpu(q: torch.Tensor, kv_layer: torch.Tensor, batch: AttnBatch, scale: float, window: int,
                        kv_scales: torch.Tensor | None, prefill_ref: Callable[..., torch.Tensor],
                        max_decode_padding: float = MAX_DECODE_PADDING,
                        min_split_keys: int = MIN_SPLIT_KEYS) -> torch.Tensor:
    """punica.ops.attention.paged_attention without softcap, on CPU tensors. `prefill_ref`: the
    reference of one prefill request (punica.ops.attention.prefill_request_ref), which runs a prefill
    whose keys and values hold a NaN or inf where some of its queries must not see it.
    `min_split_keys`: keys before a request's queries from which they are split (module docstring)."""
    out = torch.empty_like(q)
    plan = _plan_of(batch, kv_layer.shape[2], window, max_decode_padding)
    for p in plan.prefills:
        kv = _gather(kv_layer, kv_scales, p.pages, p.runs, p.buffers)[:, :, p.first - p.offset:p.context_len - p.offset]
        # Keys every query sees (a cached prefix without a window) give the reference's outputs even
        # when non-finite; the others (the chunk's own, and under a window all) are checked in one
        # pass: a NaN or inf makes the sum non-finite (so does an overflowing sum of finite values,
        # which then runs the reference: exact, only slower).
        num_queries = p.rows.stop - p.rows.start
        if math.isfinite(kv[:, :, -num_queries if not window else 0:].sum()):
            out[p.rows] = _prefill(q[p.rows], kv[0], kv[1], p.first, p.context_len, scale, window,
                                   min_split_keys).to(q.dtype)
        else:
            out[p.rows] = prefill_ref(q[p.rows], kv_layer, kv_scales, p.page_row, p.context_len, scale,
                                      window).to(q.dtype)
    for d in plan.decodes:
        out[d.rows] = _decodes(q[d.rows], kv_layer, kv_scales, d, scale, window, min_split_keys).to(q.dtype)
    return out


@dataclass(frozen=True)
class _PrefillPlan:
    rows: slice                # its query rows
    page_row: torch.Tensor     # its row of the page table
    pages: torch.Tensor        # [N] int64: the pages of the keys it sees
    runs: list[tuple[int, int]] | None  # those pages as runs (punica.ops.attention_cpu._runs)
    first: int                 # the first key it sees (its first query's window; 0 without one)
    offset: int                # the position of pages[0]'s first key
    context_len: int
    buffers: dict = field(default_factory=dict)  # its gathered K and V, reused by every layer (_scratch)


@dataclass(frozen=True)
class _DecodesPlan:
    rows: torch.Tensor         # [B] int64: their query rows
    pages: torch.Tensor        # [B, N] int64: each one's pages from its first key's, padded
    runs: list[tuple[int, int]] | None  # B = 1: its pages as runs (_runs); B > 1: None
    firsts: list[int]          # the first key each sees
    context_lens: list[int]
    seen: torch.Tensor         # [B, N * page_size] bool: which of the padded keys each sees
    unseen: tuple[torch.Tensor, torch.Tensor] | None  # B > 1: seen's False entries (request, key), zeroed
    buffers: dict = field(default_factory=dict)  # their gathered K and V, reused by every layer (_scratch)


@dataclass(frozen=True)
class _Plan:
    prefills: list[_PrefillPlan]
    decodes: list[_DecodesPlan]


_last_plan: tuple[weakref.ref, tuple, _Plan] | None = None


def _plan_of(batch: AttnBatch, page_size: int, window: int, max_decode_padding: float) -> _Plan:
    """The host-side values of a batch that are the same for every layer (its lists, pages, decode
    groups and masks), made at its first layer and kept for the others: a layer's call then costs
    its tensor work, not these few dozen small ops again."""
    global _last_plan
    key = (page_size, window, max_decode_padding)
    last = _last_plan
    if last is not None and last[0]() is batch and last[1] == key:
        return last[2]
    starts, context_lens = batch.query_start.tolist(), batch.context_lens.tolist()
    prefills = []
    for i in range(batch.num_prefills):
        num_queries, context_len = starts[i + 1] - starts[i], context_lens[i]
        first = max(0, context_len - num_queries - window + 1) if window else 0
        first_page = first // page_size
        pages = batch.page_table[i, first_page:ceil_div(context_len, page_size)].long()
        prefills.append(_PrefillPlan(slice(starts[i], starts[i + 1]), batch.page_table[i], pages,
                                     _runs(pages), first, first_page * page_size, context_len))
    num_prefills, decode_start = batch.num_prefills, starts[batch.num_prefills]
    decodes = []
    for group in decode_groups(context_lens[num_prefills:], window, max_decode_padding):
        requests = [num_prefills + j for j in group]
        decodes.append(_decodes_plan(torch.tensor([decode_start + j for j in group]), batch.page_table[requests],
                                     [context_lens[i] for i in requests], page_size, window))
    plan = _Plan(prefills, decodes)
    _last_plan = (weakref.ref(batch), key, plan)
    return plan


def _decodes_plan(rows: torch.Tensor, page_table: torch.Tensor, context_lens: list[int], page_size: int,
                  window: int) -> _DecodesPlan:
    """A decode group's pages, from each one's first key seen, padded to the longest span (a late
    window's span may run past the table: page 0 pads it, zeroed and masked like any key past a
    context), and which of the padded keys each sees."""
    firsts = [max(0, c - window) if window else 0 for c in context_lens]
    first_pages = [f // page_size for f in firsts]
    num_pages = max(ceil_div(c, page_size) - p for c, p in zip(context_lens, first_pages))
    width = max(first_pages) + num_pages
    if width > page_table.shape[1]:
        page_table = F.pad(page_table, (0, width - page_table.shape[1]))
    starts = torch.tensor(first_pages)
    pages = page_table.gather(1, starts[:, None] + torch.arange(num_pages)).long()
    key = torch.arange(num_pages * page_size) + starts[:, None] * page_size  # [B, keys]: positions
    seen = (key >= torch.tensor(firsts)[:, None]) & (key < torch.tensor(context_lens)[:, None])
    alone = len(context_lens) == 1  # its keys read as they are: no padding to zero
    return _DecodesPlan(rows, pages, _runs(pages[0]) if alone else None, firsts, context_lens, seen,
                        None if alone else (~seen).nonzero(as_tuple=True))


def decode_groups(context_lens: list[int], window: int = 0,
                  max_padding: float = MAX_DECODE_PADDING) -> list[list[int]]:
    """The decodes (indices into context_lens) in groups run by one call each: by the span of keys
    each sees (its context, capped at `window`), longest first; a group takes the next span while
    it is at least its longest / max_padding."""
    spans = [min(c, window) if window else c for c in context_lens]
    groups: list[list[int]] = []
    for j in sorted(range(len(spans)), key=lambda j: -spans[j]):
        if groups and spans[j] * max_padding >= spans[groups[-1][0]]:
            groups[-1].append(j)
        else:
            groups.append([j])
    return groups


def _scratch(buffers: dict | None, x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialised tensor of x's dtype: from `buffers` (a request's, kept by its plan), where
    every layer's call finds the one the first made, or new without them. A new one of a few MB a
    layer costs its page faults again each time."""
    if buffers is None:
        return x.new_empty(shape)
    key = (x.dim(), x.dtype)  # values and scales apart
    out = buffers.get(key)
    if out is None or out.shape != shape:
        out = buffers[key] = x.new_empty(shape)
    return out


def _select_pages(x: torch.Tensor, pages: torch.Tensor, buffers: dict | None = None) -> torch.Tensor:
    """x [num_pages, 2, page_size, Hkv, ...] at `pages` [..., N], as [2, ..., Hkv, N * page_size, ...]:
    by one index_select a plane over its (head, page) blocks, contiguous page_size x D rows in the
    CPU cache's layout (another layout is copied first), into a tensor of `buffers` (_scratch)."""
    num_pages, page_size, num_kv_heads = x.shape[0], x.shape[2], x.shape[3]
    blocks = torch.arange(num_kv_heads)[:, None] * num_pages + pages[..., None, :]  # page p of head h: h * P + p
    out = _scratch(buffers, x, (2, blocks.numel(), page_size) + x.shape[4:])
    for plane in range(2):
        heads_first = x[:, plane].movedim(2, 0).reshape((num_kv_heads * num_pages, page_size) + x.shape[4:])
        torch.index_select(heads_first, 0, blocks.flatten(), out=out[plane])
    return out.view((2,) + pages.shape[:-1] + (num_kv_heads, pages.shape[-1] * page_size) + x.shape[4:])


def _planes_outside_pages(x: torch.Tensor) -> bool:
    """Whether x [P, 2, page_size, ...] holds the pages of each plane (and head) one after another
    (the CPU cache's layout, punica.ops.kv_cache.KVCache.empty), so that a run of consecutive pages
    is one view."""
    return x.stride(0) == x.shape[2] * x.stride(2)


def _runs(pages: torch.Tensor) -> list[tuple[int, int]] | None:
    """`pages` [N] as runs of consecutive pages, (first page, pages), in order; None if they make
    more than MAX_COPIED_RUNS (or none)."""
    runs: list[list[int]] = []
    for page in pages.tolist():
        if runs and page == runs[-1][0] + runs[-1][1]:
            runs[-1][1] += 1
        elif len(runs) == MAX_COPIED_RUNS:
            return None
        else:
            runs.append([page, 1])
    return [(first, count) for first, count in runs] or None


def _read_runs(x: torch.Tensor, runs: list[tuple[int, int]], buffers: dict | None = None) -> torch.Tensor:
    """x [P, 2, page_size, Hkv, ...] of the CPU cache's layout at the pages of `runs`, as [2, Hkv,
    keys, ...]: a view of one run; the runs copied one after another (a copy a run, each head's rows
    of a run one block) for several, into a tensor of `buffers` (_scratch)."""
    views = [x[first:first + count].transpose(0, 1).movedim(3, 1).flatten(2, 3)
             for first, count in runs]  # each [2, Hkv, count * page_size, ...]
    if len(views) == 1:
        return views[0]
    shape = views[0].shape[:2] + (sum(v.shape[2] for v in views),) + views[0].shape[3:]
    return torch.cat(views, dim=2, out=_scratch(buffers, x, shape))


def _gather(kv_layer: torch.Tensor, kv_scales: torch.Tensor | None, pages: torch.Tensor,
            runs: list[tuple[int, int]] | None, buffers: dict | None = None) -> torch.Tensor:
    """K and V of `pages` [N] (`runs`: the same pages as runs, or None) in fp32, as [2, Hkv,
    N * page_size, D] (K at 0, V at 1), from a cache of the CPU's layout a view of one run or the
    runs copied, else the pages copied a page of a head at a time (the module docstring); copies go
    into tensors of `buffers` (_scratch)."""
    if runs is not None and _planes_outside_pages(kv_layer) and (
            kv_scales is None or _planes_outside_pages(kv_scales)):
        values = _read_runs(kv_layer, runs, buffers)
        scales = None if kv_scales is None else _read_runs(kv_scales, runs, buffers)
    else:
        values = _select_pages(kv_layer, pages, buffers)
        scales = None if kv_scales is None else _select_pages(kv_scales, pages, buffers)
    return dequantize_kv_ref(values, scales)


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, context_len: int, scale: float,
             window: int, min_split_keys: int) -> torch.Tensor:
    """One request's queries q [Q, Hq, D] (the last Q positions of its context) over its keys and
    values k, v [Hkv, K, D] fp32 (positions first .. context_len - 1)  ->  [Q, Hq, D] fp32."""
    num_queries = q.shape[0]
    if not window and context_len - num_queries >= min_split_keys:
        return (_split_keys if num_queries <= MAX_SPLIT_QUERIES else _prefix_then_chunk)(q.float(), k, v, scale)
    # [1, heads, rows, D]: with a batch dimension SDPA takes the fused kernel (3-D inputs do not)
    qt, kt, vt = q.float().transpose(0, 1)[None], k[None], v[None]
    if num_queries == context_len and not window:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
    else:
        query_pos = torch.arange(context_len - num_queries, context_len)[:, None]
        key_pos = torch.arange(first, context_len)[None, :]
        seen = key_pos <= query_pos
        if window:
            seen &= key_pos > query_pos - window
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=seen, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def _split_keys(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [C, Hq, D] fp32, the queries of the last C of the keys k, v [Hkv, N, D] (no window), over
    them  ->  [C, Hq, D] fp32 (module docstring). The keys before the queries go in parts of equal
    length, a batch of one call to the fused kernel without a mask, and the rest (the last part's
    remainder and the queries' own keys, under the causal mask) in a product of their own; the
    parts' outputs are weighted by their log-sum-exps."""
    num_queries, num_heads, head_dim = q.shape
    num_kv_heads, num_keys = k.shape[0], k.shape[1]
    group = num_heads // num_kv_heads
    qg = q.view(num_queries, num_kv_heads, group, head_dim).transpose(0, 1).reshape(num_kv_heads, -1, head_dim)
    num_parts = max(2, (num_keys - num_queries) // PART_KEYS)
    part = (num_keys - num_queries) // num_parts
    split = num_parts * part
    kp, vp = (x[:, :split].view(num_kv_heads, num_parts, part, head_dim).transpose(0, 1) for x in (k, v))
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qg.expand(num_parts, -1, -1, -1), kp, vp, scale=scale)  # [parts, Hkv, C * G, D], [parts, Hkv, C * G]
    scores = torch.bmm(qg, k[:, split:].transpose(1, 2)).mul_(scale)  # [Hkv, C * G, rest], rows (query, head)
    rest = num_keys - split
    later = torch.ones(num_queries, num_queries, dtype=torch.bool).triu_(1)[:, None]  # [query, 1, own key]
    scores.view(num_kv_heads, num_queries, group, rest)[..., rest - num_queries:].masked_fill_(later, -math.inf)
    rest_lse = torch.logsumexp(scores, dim=-1)
    rest_o = torch.bmm(torch.exp(scores - rest_lse[..., None]), v[:, split:])
    out = _merged([*o, rest_o], [*lse, rest_lse])
    out = out.view(num_kv_heads, num_queries, group, head_dim).transpose(0, 1)
    return out.reshape(num_queries, num_heads, head_dim)


def _prefix_then_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """As _split_keys, for a longer chunk (module docstring): each query head of a KV head is a batch
    entry over that KV head's keys (a view), the keys before the queries in one call without a mask
    and the queries' own in one under the causal mask, weighted by their log-sum-exps."""
    num_queries, num_heads, head_dim = q.shape
    num_kv_heads, prefix = k.shape[0], k.shape[1] - num_queries
    group = num_heads // num_kv_heads
    qb = q.view(num_queries, num_kv_heads, group, head_dim).permute(2, 1, 0, 3)  # [G, Hkv, C, D]
    kb, vb = (x[None].expand(group, -1, -1, -1) for x in (k, v))
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    o, lse = flash(qb, kb[:, :, :prefix], vb[:, :, :prefix], scale=scale)
    own_o, own_lse = flash(qb, kb[:, :, prefix:], vb[:, :, prefix:], is_causal=True, scale=scale)
    out = _merged([o, own_o], [lse, own_lse])
    return out.permute(2, 1, 0, 3).reshape(num_queries, num_heads, head_dim)


def _merged(outputs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Attention over the union of disjoint sets of keys, from each set's outputs [..., D] and
    log-sum-exps [...]: each set's outputs weighted by its share of the softmax's sum."""
    weights = torch.softmax(torch.stack(lses), dim=0)[..., None]
    return sum(o * w for o, w in zip(outputs, weights))


def _decodes(q: torch.Tensor, kv_layer: torch.Tensor, kv_scales: torch.Tensor | None, plan: _DecodesPlan,
             scale: float, window: int, min_split_keys: int) -> torch.Tensor:
    """Decodes' queries q [B, Hq, D] over their pages (`plan`): one call over keys padded to the
    longest span of the group, the padding zeroed and masked  ->  [B, Hq, D] fp32.
    Each query head of a KV head is a row of that head's query block (GQA folded into the rows)."""
    page_size, num_kv_heads, head_dim = kv_layer.shape[2], kv_layer.shape[3], kv_layer.shape[4]
    num_decodes, group = q.shape[0], q.shape[1] // num_kv_heads
    qg = q.float().view(num_decodes, num_kv_heads, group, head_dim)
    if num_decodes == 1:  # its keys alone: nothing to pad; the mask of all of them keeps a single
        # key's NaN in (without a mask SDPA skips the softmax of one key)
        offset = plan.firsts[0] // page_size * page_size
        kv = _gather(kv_layer, kv_scales, plan.pages[0], plan.runs, plan.buffers)
        kv = kv[:, :, plan.firsts[0] - offset:plan.context_lens[0] - offset]
        if not window and plan.context_lens[0] - 1 >= min_split_keys:
            return _split_keys(q.float(), kv[0], kv[1], scale)
        every = plan.seen[:, plan.firsts[0] - offset:plan.context_lens[0] - offset][:, None, None, :]
        return F.scaled_dot_product_attention(qg, kv[0][None], kv[1][None], attn_mask=every, scale=scale).view_as(q)
    kv = dequantize_kv_ref(_select_pages(kv_layer, plan.pages, plan.buffers),  # [2, B, Hkv, keys, D]
                           None if kv_scales is None else _select_pages(kv_scales, plan.pages, plan.buffers))
    kv[:, plan.unseen[0], :, plan.unseen[1]] = 0  # before its window, and past its context: nothing
    o = F.scaled_dot_product_attention(qg, kv[0], kv[1], attn_mask=plan.seen[:, None, None, :], scale=scale)
    return o.reshape(num_decodes, num_kv_heads * group, head_dim)
