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
* Softcap (Gemma 2): SDPA has none, so a softcapped call runs the reference.

Isolation: only positions inside a request's context are gathered; a decode group's padding (past
a context, before a window) is set to zero in K and V and masked, so it contributes exactly
nothing. A prompt chunk's own keys after some of its queries are masked by addition in the fused
kernel, which a NaN or inf survives: a prefill whose gathered K or V holds one (only its own
non-finite activations write one into its context) runs the reference instead, which keeps causal
order exactly. So the outputs are the reference's, NaN and inf included, up to rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from punica.config import ceil_div
from punica.ops.attention_batch import AttnBatch
from punica.ops.kv_cache import dequantize_kv_ref

MAX_DECODE_PADDING = 2.0  # a decode group's longest key span over its shortest, at most


def paged_attention_cpu(q: torch.Tensor, kv_layer: torch.Tensor, batch: AttnBatch, scale: float, window: int,
                        kv_scales: torch.Tensor | None, prefill_ref: Callable[..., torch.Tensor],
                        max_decode_padding: float = MAX_DECODE_PADDING) -> torch.Tensor:
    """punica.ops.attention.paged_attention without softcap, on CPU tensors. `prefill_ref`: the
    reference of one prefill request (punica.ops.attention.prefill_request_ref), which runs a prefill
    whose context holds a NaN or inf."""
    out = torch.empty_like(q)
    starts, context_lens = batch.query_start.tolist(), batch.context_lens.tolist()
    for i in range(batch.num_prefills):
        rows = slice(starts[i], starts[i + 1])
        kv, first = _prefill_context(kv_layer, kv_scales, batch.page_table[i], rows.stop - rows.start,
                                     context_lens[i], window)
        # one pass: a NaN or inf anywhere makes the sum non-finite (so does an overflowing sum of
        # finite values, which then runs the reference: exact, only slower)
        if math.isfinite(kv.sum()):
            out[rows] = _prefill(q[rows], kv[0], kv[1], first, context_lens[i], scale, window).to(q.dtype)
        else:
            out[rows] = prefill_ref(q[rows], kv_layer, kv_scales, batch.page_table[i], context_lens[i], scale,
                                    window).to(q.dtype)
    num_prefills, decode_start = batch.num_prefills, starts[batch.num_prefills]
    for group in decode_groups(context_lens[num_prefills:], window, max_decode_padding):
        token_rows, requests = [decode_start + j for j in group], [num_prefills + j for j in group]
        out[token_rows] = _decodes(q[token_rows], kv_layer, kv_scales, batch.page_table[requests],
                                   [context_lens[i] for i in requests], scale, window).to(q.dtype)
    return out


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


def _gather(kv_layer: torch.Tensor, kv_scales: torch.Tensor | None, pages: torch.Tensor) -> torch.Tensor:
    """K and V of `pages` [..., N] in fp32: [..., 2, N * page_size, Hkv, D] (K at 0, V at 1)."""
    x = dequantize_kv_ref(kv_layer[pages], None if kv_scales is None else kv_scales[pages])
    return x.transpose(-5, -4).flatten(-4, -3)


def _prefill_context(kv_layer: torch.Tensor, kv_scales: torch.Tensor | None, page_row: torch.Tensor,
                     num_queries: int, context_len: int, window: int) -> tuple[torch.Tensor, int]:
    """K and V [2, keys, Hkv, D] fp32 of the positions first .. context_len - 1 that one prefill
    request's queries see, and `first`: from its first query's window (0 without one)."""
    page_size = kv_layer.shape[2]
    first = max(0, context_len - num_queries - window + 1) if window else 0
    first_page = first // page_size
    pages = page_row[first_page:ceil_div(context_len, page_size)].long()
    offset = first_page * page_size
    return _gather(kv_layer, kv_scales, pages)[:, first - offset:context_len - offset], first


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, context_len: int, scale: float,
             window: int) -> torch.Tensor:
    """One request's queries q [Q, Hq, D] (the last Q positions of its context) over its keys and
    values k, v [K, Hkv, D] fp32 (positions first .. context_len - 1)  ->  [Q, Hq, D] fp32."""
    num_queries = q.shape[0]
    # [1, heads, rows, D]: with a batch dimension SDPA takes the fused kernel (3-D inputs do not)
    qt, kt, vt = (x.transpose(0, 1)[None] for x in (q.float(), k, v))
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


def _decodes(q: torch.Tensor, kv_layer: torch.Tensor, kv_scales: torch.Tensor | None, page_table: torch.Tensor,
             context_lens: list[int], scale: float, window: int) -> torch.Tensor:
    """Decodes' queries q [B, Hq, D] over their pages (page_table [B, W]): one call over keys padded
    to the longest span of the group, the padding zeroed and masked  ->  [B, Hq, D] fp32."""
    page_size, num_kv_heads, head_dim = kv_layer.shape[2], kv_layer.shape[3], kv_layer.shape[4]
    num_decodes = q.shape[0]
    lens = torch.tensor(context_lens)
    first_pages = ((lens - window).clamp(min=0) // page_size) if window else torch.zeros_like(lens)
    num_pages = max(ceil_div(c, page_size) - int(p) for c, p in zip(context_lens, first_pages))
    columns = (first_pages[:, None] + torch.arange(num_pages)).clamp(max=page_table.shape[1] - 1)
    pages = page_table.gather(1, columns).long()
    key_pos = first_pages[:, None] * page_size + torch.arange(num_pages * page_size)
    seen = key_pos < lens[:, None]
    if window:
        seen &= key_pos >= (lens - window)[:, None]
    kv = torch.where(seen[:, None, :, None, None], _gather(kv_layer, kv_scales, pages), 0.0)
    k, v = kv[:, 0].transpose(1, 2), kv[:, 1].transpose(1, 2)
    group = q.shape[1] // num_kv_heads
    qg = q.float().view(num_decodes, num_kv_heads, group, head_dim)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=seen[:, None, None, :], scale=scale)
    return o.reshape(num_decodes, num_kv_heads * group, head_dim)
