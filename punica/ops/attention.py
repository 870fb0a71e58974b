"""Attention over the paged KV cache for one fused batch of prefill and decode requests.

KV cache layout, per layer: [num_pages, 2, page_size, num_kv_heads, head_dim] (page outermost,
as in the paper: any request's pages can be anywhere, so requests join and leave freely).
The whole cache is one tensor [num_layers, num_pages, 2, page_size, num_kv_heads, head_dim]
(punica.ops.kv_cache.KVCache). An fp8 cache (float8_e4m3fn pages) comes with its scales
`kv_scales` [num_pages, 2, page_size, num_kv_heads] fp32 per layer: every function here takes
them beside the pages, writes e4m3(row / scale) with scale = amax(row) / 448 and reads
value * scale (punica.ops.kv_cache).

Batch order: prefill requests first, then decode requests. A request's queries are the last
`query_len` of its `context_len` tokens (a prefill of a fresh prompt has query_len ==
context_len; a decode has query_len == 1; a recomputed prefill after preemption is a prefill).

Isolation: pages pass from request to request (and tenant to tenant) with whatever the last
one wrote, page tables are padded with pages of other requests or a scratch page, and a request
whose activations went non-finite writes NaN or inf into its pages. So positions outside a
request's context are never read into its output: a query's output depends only on the K and
V of its own request's positions up to its own (at most context_len - 1); every other
position contributes exactly nothing, whatever it holds, NaN and inf included (scores are
selected with where, never masked by arithmetic, and since 0 * NaN = NaN, a zero probability
is not trusted to cancel a masked V). A NaN or inf a query does see makes its output non-finite.
The Triton prefill kernel keeps the part that isolates requests (nothing outside a request's
context is read) but not causal order within a request's own prompt: there a NaN or inf, which
only the request's own non-finite activations write, may also reach its earlier queries.

The PyTorch references (`*_ref`) are the spec; each public function runs the Triton kernel of
punica.ops.attention_triton when its tensors are on CUDA, and the reference otherwise; paged
attention on the CPU runs punica.ops.attention_cpu instead (torch's fused SDPA over each request's
gathered context), but for softcapped scores, which only the reference computes. The batch
metadata, AttnBatch, lives in punica.ops.attention_batch and is imported from here too.
"""

from __future__ import annotations

import itertools

import torch

from punica.config import ceil_div
from punica.ops.attention_batch import AttnBatch
from punica.ops.kv_cache import check_kv_scales, dequantize_kv_ref, quantize_kv_ref
from punica.ops.layers import PendingDelta, rope_ref


def write_kv_ref(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                 kv_scales: torch.Tensor | None = None) -> None:
    """kv_layer[page, 0|1, offset] = k|v for each token's slot = page * page_size + offset
    (fp8: e4m3(row / scale), and kv_scales[page, 0|1, offset] = scale per head)."""
    page_size = kv_layer.shape[2]
    pages, offsets = slot_mapping // page_size, slot_mapping % page_size
    for which, x in ((0, k), (1, v)):
        if kv_scales is None:
            kv_layer[pages, which, offsets] = x.to(kv_layer.dtype)
        else:
            kv_layer[pages, which, offsets], kv_scales[pages, which, offsets] = quantize_kv_ref(x)


def rope_and_write_kv_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor,
                          kv_scales: torch.Tensor | None = None) -> None:
    q_rot, k_rot = rope_ref(q, k, cos, sin)
    q.copy_(q_rot)
    write_kv_ref(kv_layer, k_rot, v, slot_mapping, kv_scales)


def _cached(kv_layer: torch.Tensor, kv_scales: torch.Tensor | None, pages: torch.Tensor, which: int) -> torch.Tensor:
    """K (which 0) or V (1) of `pages` in fp32: [*pages.shape, page_size, Hkv, D]."""
    return dequantize_kv_ref(kv_layer[pages, which], None if kv_scales is None else kv_scales[pages, which])


def _attend_ref(scores: torch.Tensor, seen: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(scores) @ v over the keys each query sees, the others contributing exactly nothing.

        scores: [H, Q, K] fp32, seen: [Q, K] bool, v: [K, H, D] fp32  ->  [Q, H, D] fp32
        out[j, h] = softmax(scores[h, j, seen[j]]) @ v[seen[j], h]

    Scores are selected with where, not masked by arithmetic; and since 0 * NaN = NaN, the zero
    probability of an unseen key cannot cancel its V: the product takes V with its non-finite
    values zeroed, then each row that sees some adds their terms, so a NaN or inf reaches
    exactly the outputs of the queries that see it (and the other outputs stay bit for bit).
    """
    probs = torch.where(seen, scores, float("-inf")).softmax(-1)
    finite = v.isfinite()
    out = torch.einsum("hqk,khd->qhd", probs, torch.where(finite, v, 0.0))
    sees_non_finite = (seen & ~finite.flatten(1).all(1)).any(1)
    for j in sees_non_finite.nonzero().flatten().tolist():
        non_finite_seen = torch.where(seen[j, :, None, None] & ~finite, v, 0.0)
        out[j] += torch.einsum("hk,khd->hd", probs[:, j], non_finite_seen)
    return out


def softcap_ref(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """softcap * tanh(scores / softcap) (Gemma 2's attention-logit and final-logit softcapping); 0: scores."""
    return softcap * torch.tanh(scores / softcap) if softcap else scores


def prefill_request_ref(q: torch.Tensor, kv_layer: torch.Tensor, kv_scales: torch.Tensor | None,
                        page_row: torch.Tensor, context_len: int, scale: float, window: int = 0,
                        softcap: float = 0.0) -> torch.Tensor:
    """paged_attention_ref of one prefill request: its queries q [Q, Hq, D] (the last Q positions
    of its context of context_len tokens on the pages of page_row [W])  ->  [Q, Hq, D] fp32."""
    q_len, num_heads, head_dim = q.shape
    page_size, num_kv_heads = kv_layer.shape[2], kv_layer.shape[3]
    group = num_heads // num_kv_heads
    pages = page_row[: ceil_div(context_len, page_size)].long()
    k = _cached(kv_layer, kv_scales, pages, 0).reshape(-1, num_kv_heads, head_dim)[:context_len]
    v = _cached(kv_layer, kv_scales, pages, 1).reshape(-1, num_kv_heads, head_dim)[:context_len]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = softcap_ref(torch.einsum("qhd,khd->hqk", q.float(), k) * scale, softcap)
    query_pos = torch.arange(context_len - q_len, context_len, device=q.device)[:, None]
    key_pos = torch.arange(context_len, device=q.device)[None, :]
    seen = (key_pos <= query_pos) & ((key_pos > query_pos - window) if window else True)
    return _attend_ref(scores, seen, v)


def paged_attention_ref(q: torch.Tensor, kv_layer: torch.Tensor, batch: AttnBatch, scale: float,
                        window: int = 0, softcap: float = 0.0, kv_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Causal GQA attention of each request's queries over its cached keys and values.

        q: [T, Hq, D], kv_layer: [P, 2, page_size, Hkv, D]  ->  out: [T, Hq, D]
        for request i with queries rows[i] and context c_i over pages page_table[i]:
            K, V = cached tokens 0..c_i-1;  query j sits at position c_i - q_i + j
            out[rows[i]][j] = softmax(scale * q_j K^T, keys at positions <= its own) V
        with a sliding window (window > 0) only the keys at positions p - window < key <= p
        with softcap > 0 each score s = scale * q K^T becomes softcap * tanh(s / softcap)

    A position a query does not see (past its own, outside its window, past the context, on the
    page table's padding) contributes exactly nothing, whatever the cache holds there (NaN and
    inf too).
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    page_size, num_kv_heads = kv_layer.shape[2], kv_layer.shape[3]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts, context_lens = batch.query_start.tolist(), batch.context_lens.tolist()
    for i in range(batch.num_prefills):
        rows = slice(starts[i], starts[i + 1])
        out[rows] = prefill_request_ref(q[rows], kv_layer, kv_scales, batch.page_table[i], context_lens[i], scale,
                                        window, softcap).to(q.dtype)
    start = starts[batch.num_prefills]
    num_decodes = batch.page_table.shape[0] - batch.num_prefills
    if num_decodes:  # one query each: all decodes at once, keys padded to the page table's width
        pages = batch.page_table[batch.num_prefills:].long()
        max_ctx = pages.shape[1] * page_size
        key_pos = torch.arange(max_ctx, device=q.device)[None, :]
        decode_lens = batch.context_lens[batch.num_prefills:, None]
        seen = (key_pos < decode_lens) & ((key_pos >= decode_lens - window) if window else True)
        k = _cached(kv_layer, kv_scales, pages, 0).reshape(num_decodes, max_ctx, num_kv_heads, head_dim)
        v = _cached(kv_layer, kv_scales, pages, 1).reshape(num_decodes, max_ctx, num_kv_heads, head_dim)
        v = torch.where(seen[:, :, None, None], v, 0.0)  # all of a request's heads see the same keys
        qd = q[start:].float().reshape(num_decodes, num_kv_heads, group, head_dim)
        scores = softcap_ref(torch.einsum("bkgd,blkd->bkgl", qd, k) * scale, softcap)
        scores = torch.where(seen[:, None, None, :], scores, float("-inf"))
        o = torch.einsum("bkgl,blkd->bkgd", scores.softmax(-1), v)
        out[start:] = o.reshape(num_decodes, num_heads, head_dim).to(q.dtype)
    return out


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             kv_scales: torch.Tensor | None = None) -> None:
    """Append each token's key and value to the paged cache, in place.

        kv_layer: [P, 2, page_size, Hkv, D], k, v: [T, Hkv, D], slot_mapping: [T] int64,
        kv_scales: [P, 2, page_size, Hkv] fp32 with an fp8 cache, else None
        for t in range(T):
            page, offset = divmod(slot_mapping[t], page_size)
            kv_layer[page, 0, offset] = k[t];  kv_layer[page, 1, offset] = v[t]   (cast to the cache dtype)
            fp8: for each head h, kv_scales[page, 0, offset, h] = s = max(amax|k[t, h]| / 448, FLT_MIN)
                 and kv_layer[page, 0, offset, h] = e4m3(k[t, h] / s); the same for v in [.., 1, ..]
    """
    check_kv_scales(kv_layer, kv_scales)
    if kv_layer.is_cuda:
        from punica.ops.kv_append_triton import write_kv_triton
        return write_kv_triton(kv_layer, k, v, slot_mapping, kv_scales)
    return write_kv_ref(kv_layer, k, v, slot_mapping, kv_scales)


def rope_and_write_kv_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor,
                       kv_scales: torch.Tensor | None = None, delta: PendingDelta | None = None) -> None:
    """Rotary embedding of q in place, and each token's rotated key and its value appended to
    the paged cache: `rope_` then `write_kv` in one kernel (one launch instead of two).

        q: [T, Hq, D], k, v: [T, Hkv, D] (views are fine, last dim contiguous), cos, sin: [T, D/2]
        float32, kv_layer: [P, 2, page_size, Hkv, D], slot_mapping: [T] int64
        q_rot, k_rot = rope_ref(q, k, cos, sin)       (punica.ops.layers.rope_: rotated, rounded to
        q[:] = q_rot                                    their dtype)
        write_kv(kv_layer, k_rot, v, slot_mapping,     (then cast to the cache dtype, or to e4m3
                 kv_scales)                             with a scale per row)

    k itself is left as given (unrotated): after this the model reads only q and the cache, so
    the kernel saves writing k back. A caller that needs rotated k calls rope_ and write_kv.
    `delta`: a LoRA delta pending on q, k and v side by side (the columns of the q/k/v projection
    whose views they are: [T, (Hq + 2 Hkv) D]), added to them first (PendingDelta.add_to; on CUDA
    by the kernel as it loads them, which then leaves k and v as they were).
    """
    assert q.shape[0] == k.shape[0] == cos.shape[0] and q.shape[2] == k.shape[2] == 2 * cos.shape[1], \
        (q.shape, k.shape, cos.shape)
    assert v.shape == k.shape and kv_layer.shape[3:] == k.shape[1:], (k.shape, v.shape, kv_layer.shape)
    check_kv_scales(kv_layer, kv_scales)
    if q.is_cuda:
        from punica.ops.kv_append_triton import rope_and_write_kv_triton_
        return rope_and_write_kv_triton_(q, k, v, cos, sin, kv_layer, slot_mapping, kv_scales, delta)
    if delta is not None:
        ends = list(itertools.accumulate(x.shape[1] * x.shape[2] for x in (q, k, v)))
        for x, start, end in zip((q, k, v), [0] + ends, ends):
            delta.columns(start, end).add_to(x.view(x.shape[0], -1))
    rope_and_write_kv_ref(q, k, v, cos, sin, kv_layer, slot_mapping, kv_scales)


def prefill_query_tile(device: torch.device, head_dim: int, dtype: torch.dtype) -> int:
    """Queries for which a prefill's attention on `device` reads the cached context at once: a CUDA
    kernel's query tile (punica.ops.attention_triton); 1 elsewhere."""
    if device.type != "cuda":
        return 1
    from punica.ops.attention_triton import prefill_query_tile as tile
    return tile(head_dim, dtype)


def paged_attention(q: torch.Tensor, kv_layer: torch.Tensor, batch: AttnBatch, scale: float,
                    window: int = 0, softcap: float = 0.0, kv_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Causal GQA attention of every request's queries over its pages (prefills first, then decodes),
    over the whole context or (window > 0) a sliding window of the last `window` positions, its
    scores optionally softcapped (softcap > 0: s -> softcap * tanh(s / softcap), before the softmax).

        q: [T, Hq, D], kv_layer: [P, 2, page_size, Hkv, D], Hq % Hkv == 0  ->  out: [T, Hq, D] (q's dtype)
        for request i: rows = query_start[i] : query_start[i+1], q_i = len(rows), c_i = context_lens[i]
            pages = page_table[i, : ceil(c_i / page_size)]
            K, V = kv_layer[pages, 0|1] flattened to [c_i, Hkv, D]   (cached tokens 0 .. c_i-1;
                   fp8: times kv_scales[pages, 0|1], each row by its scale)
            for query j, head h (its key head h // (Hq / Hkv)), position p = c_i - q_i + j:
                out[rows[j], h] = softmax(scale * q[rows[j], h] @ K[w:p+1, kv].T) @ V[w:p+1, kv]
                with w = max(0, p - window + 1) under a window, else 0 (transformers' sliding window)
        accumulated in fp32; no other position of the cache reaches out[rows[j]], whatever it
        holds (NaN and inf too: see Isolation in the module docstring)
    """
    check_kv_scales(kv_layer, kv_scales)
    if q.is_cuda:
        from punica.ops.attention_triton import paged_attention_triton
        return paged_attention_triton(q, kv_layer, batch, scale, window=window, softcap=softcap, kv_scales=kv_scales)
    if q.device.type == "cpu" and not softcap:
        from punica.ops.attention_cpu import paged_attention_cpu
        return paged_attention_cpu(q, kv_layer, batch, scale, window, kv_scales, prefill_request_ref)
    return paged_attention_ref(q, kv_layer, batch, scale, window, softcap, kv_scales)
