"""Triton kernels for attention on the paged KV cache; semantics and layout: punica.ops.attention.
(Appending to the cache: punica.ops.kv_append_triton.)

* Prefill: flash attention over each prefill request's pages. One program per (tile of
  BLOCK_M queries of one request, query head). The tiles of all prefill requests share one
  grid axis sized by an upper bound (prefill tokens // BLOCK_M + prefills); a program finds
  its request by a prefix sum of the per-request tile counts, and surplus programs exit.
  Longest-context tiles come first. Key tiles wholly before the tile's first query run
  without masks; the tiles on the diagonal apply the causal mask.
* Decode: flash decoding. The context bound (page_table columns * page_size) is cut into
  `num_splits` partitions of whole key tiles; one program per (decode request, KV head,
  partition) attends all query heads of its KV head, so K and V are read once per group, and
  writes an unnormalised partial output with its running max and sum. A second kernel merges
  each request's partitions. The split count depends on shapes only: enough programs to fill
  the SMs, partitions of at least MIN_PARTITION tokens. With one split (large batches: e.g. 32
  requests x 32 KV heads already fill 132 SMs) the partition kernel normalises and writes the
  output itself: one launch, no partial buffers.
* Softcapping (softcap > 0, Gemma 2): each score is capped, softcap * tanh(score / softcap),
  before the online softmax.
* Sliding window (window > 0): a prefill tile starts at the key tile of its first query's
  window and masks every tile (a key outside a row's window is left out like one after it); a
  decode partition starts at context_len - window, the partitions before it exit and the merge
  skips them.

Isolation (punica.ops.attention): nothing outside a request's context reaches its output.
Key tiles wholly before the tile's first query and inside the context run unmasked; the others
(the causal diagonal, the last partial page or tile, and so the page-table padding past the
context) load nothing past the context (page, K and V masked to 0) and select scores with where.
Decode partitions past a request's context exit, and the merge reads only the partitions that
ran. Within a prefill's diagonal tile, the V of a key after some of its queries still enters
P @ V with a zero P, so a NaN or inf in a request's own prompt can reach that request's earlier
queries: only a request whose own activations went non-finite puts one there, and it fails alone.

Every per-request length is read on the device, and the grids depend only on tensor shapes and
`num_prefills`, so the calls are safe under CUDA-graph capture. Scores, softmax statistics
and outputs accumulate in fp32; P is rounded to V's dtype for the P @ V product (as in
FlashAttention), and fp32 inputs multiply in full fp32 precision. head_dim must be a power of
2 in 16..256; any GQA group (num_heads a multiple of num_kv_heads) and any page size work.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from punica.ops.attention_batch import AttnBatch
from punica.ops.kv_append_triton import check_head_dim
from punica.ops.triton_env import interpreting, num_sms

LOG2E = 1.4426950408889634
DECODE_PROGRAMS_PER_SM = 4  # decode splits contexts until its programs reach this many per SM
MIN_PARTITION = 256         # fewest tokens a decode partition covers
# bf16/fp16 tiles for head_dim <= 128, from the sweep of benchmarks/attention.py (docs/benchmarks.md)
PREFILL_CONFIG = (128, 64, 8, 3)  # BLOCK_M, BLOCK_N, num_warps, num_stages
DECODE_CONFIG = (64, 2, 3)        # BLOCK_N, num_warps, num_stages


@triton.jit
def _attend(acc, m, l, qt, kv_head, pages_row, lo, hi, query_pos, window, qk_scale, softcap,
            stride_kv_page, stride_kv_kv, stride_kv_token, stride_kv_dim,
            HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
            MASKED: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, UPCAST: tl.constexpr,
            PRECISION: tl.constexpr):
    """Online softmax of the query rows qt over keys lo..hi-1 of one request and KV head.

    acc [rows, HEAD_DIM], m, l [rows] fp32 (max and sum in the log2 domain). MASKED: keys at
    or past hi, or after a row's query_pos, are left out (and with SLIDING those at or before
    query_pos - window, so a row may see no key of a tile: its max stays -inf and nothing is
    added); else every key is attended. SOFTCAP: qk_scale is the plain scale, and each score
    becomes softcap * tanh(score / softcap), then goes to the log2 domain.
    """
    dims = tl.arange(0, HEAD_DIM)
    for start in range(lo, hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        if MASKED:
            key_ok = keys < hi
            pages = tl.load(pages_row + keys // PAGE_SIZE, mask=key_ok, other=0)
        else:
            pages = tl.load(pages_row + keys // PAGE_SIZE)
        token = kv_head + pages.to(tl.int64) * stride_kv_page + (keys % PAGE_SIZE) * stride_kv_token
        k_ptrs = token[None, :] + dims[:, None] * stride_kv_dim
        v_ptrs = token[:, None] + stride_kv_kv + dims[None, :] * stride_kv_dim
        if MASKED:
            kt = tl.load(k_ptrs, mask=key_ok[None, :], other=0.0)
            vt = tl.load(v_ptrs, mask=key_ok[:, None], other=0.0)
        else:
            kt = tl.load(k_ptrs)
            vt = tl.load(v_ptrs)
        if UPCAST:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        s = tl.dot(qt, kt, input_precision=PRECISION) * qk_scale
        if SOFTCAP:  # tanh(x) = 2 sigmoid(2x) - 1; log2(e) as a literal (a jitted function reads no globals)
            s = (softcap * 1.4426950408889634) * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
        if MASKED:
            seen = key_ok[None, :] & (keys[None, :] <= query_pos[:, None])
            if SLIDING:
                seen = seen & (keys[None, :] > query_pos[:, None] - window)
            s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        if SLIDING:  # a row that has seen no key yet: exp2(-inf - 0) = 0, not exp2(-inf + inf) = NaN
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
        m = m_new
    return acc, m, l


@triton.jit
def _prefill_tile(query_start, num_prefills, tile, BLOCK_M: tl.constexpr, MAX_PREFILLS: tl.constexpr):
    """(request, query block) of prefill tile `tile`; request == num_prefills past the last.
    Each request's blocks are numbered last (longest context) first."""
    idx = tl.arange(0, MAX_PREFILLS)
    is_prefill = idx < num_prefills
    lo = tl.load(query_start + idx, mask=is_prefill, other=0)
    hi = tl.load(query_start + idx + 1, mask=is_prefill, other=0)
    tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(tiles, axis=0)
    request = tl.sum((ends <= tile).to(tl.int32), axis=0)
    end = tl.sum(tl.where(idx == request, ends, 0), axis=0)
    return request, end - 1 - tile


@triton.jit
def _prefill_kernel(
    q, kv, out, page_table, context_lens, query_start, num_prefills, group, qk_scale, window, softcap,
    stride_q_token, stride_q_head, stride_q_dim, stride_o_token, stride_o_head, stride_o_dim,
    stride_kv_page, stride_kv_kv, stride_kv_token, stride_kv_head, stride_kv_dim, stride_table,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, MAX_PREFILLS: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    head = tl.program_id(1)
    request, block = _prefill_tile(query_start, num_prefills, tl.program_id(0), BLOCK_M, MAX_PREFILLS)
    if request >= num_prefills:
        return
    first_token = tl.load(query_start + request)
    query_len = tl.load(query_start + request + 1) - first_token
    context_len = tl.load(context_lens + request)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < query_len
    query_pos = context_len - query_len + rows  # padding rows sit past the context: no empty row
    dims = tl.arange(0, HEAD_DIM)
    tokens = (first_token + rows).to(tl.int64)
    qt = tl.load(q + tokens[:, None] * stride_q_token + head * stride_q_head + dims[None, :] * stride_q_dim,
                 mask=row_ok[:, None], other=0.0)
    if UPCAST:
        qt = qt.to(tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    kv_head = kv + (head // group) * stride_kv_head
    pages_row = page_table + request.to(tl.int64) * stride_table
    first_pos = context_len - query_len + block * BLOCK_M
    keys_end = tl.minimum(first_pos + BLOCK_M, context_len)
    if SLIDING:  # from the key tile of the first row's window on, every tile masked
        keys_start = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
        acc, m, l = _attend(acc, m, l, qt, kv_head, pages_row, keys_start, keys_end, query_pos, window, qk_scale,
                            softcap, stride_kv_page, stride_kv_kv, stride_kv_token, stride_kv_dim,
                            HEAD_DIM, PAGE_SIZE, BLOCK_N, True, True, SOFTCAP, UPCAST, PRECISION)
    else:
        unmasked_end = (first_pos + 1) // BLOCK_N * BLOCK_N  # keys every row of the tile sees
        acc, m, l = _attend(acc, m, l, qt, kv_head, pages_row, 0, unmasked_end, query_pos, window, qk_scale, softcap,
                            stride_kv_page, stride_kv_kv, stride_kv_token, stride_kv_dim,
                            HEAD_DIM, PAGE_SIZE, BLOCK_N, False, False, SOFTCAP, UPCAST, PRECISION)
        acc, m, l = _attend(acc, m, l, qt, kv_head, pages_row, unmasked_end, keys_end, query_pos, window,
                            qk_scale, softcap, stride_kv_page, stride_kv_kv, stride_kv_token, stride_kv_dim,
                            HEAD_DIM, PAGE_SIZE, BLOCK_N, True, False, SOFTCAP, UPCAST, PRECISION)
    if SLIDING:  # a padding row's window may hold no key of the context
        l = tl.where(row_ok, l, 1.0)
    o = acc / l[:, None]
    tl.store(out + tokens[:, None] * stride_o_token + head * stride_o_head + dims[None, :] * stride_o_dim,
             o.to(out.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _decode_partition_kernel(
    q, kv, out, part_acc, part_max, part_sum, page_table, context_lens, query_start, num_prefills,
    group, qk_scale, partition_size, window, softcap,
    stride_q_token, stride_q_head, stride_q_dim, stride_o_token, stride_o_head, stride_o_dim,
    stride_kv_page, stride_kv_kv, stride_kv_token, stride_kv_head, stride_kv_dim, stride_table,
    stride_pa_request, stride_pa_head, stride_pa_split, stride_pa_dim,
    stride_pm_request, stride_pm_head, stride_pm_split,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, SINGLE_SPLIT: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """One partition of one decode request and KV head: its partial output and statistics, or
    with SINGLE_SPLIT (one partition covers every context) the normalised output itself. Under a
    sliding window the query sees keys context_len - window .. context_len - 1: the partitions
    wholly before them exit, and the one it starts in begins there (the merge skips the former)."""
    decode, kv_head_index, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    request = num_prefills + decode
    context_len = tl.load(context_lens + request)
    lo = split * partition_size
    hi = tl.minimum(lo + partition_size, context_len)
    if SLIDING:
        lo = tl.maximum(lo, context_len - window)
    if lo >= hi:
        return
    full_end = lo + (hi - lo) // BLOCK_N * BLOCK_N
    g = tl.arange(0, BLOCK_G)
    g_ok = g < group
    heads = kv_head_index * group + g
    dims = tl.arange(0, HEAD_DIM)
    token = tl.load(query_start + request).to(tl.int64)
    qt = tl.load(q + token * stride_q_token + heads[:, None] * stride_q_head + dims[None, :] * stride_q_dim,
                 mask=g_ok[:, None], other=0.0)
    if UPCAST:
        qt = qt.to(tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    kv_head = kv + kv_head_index * stride_kv_head
    pages_row = page_table + request.to(tl.int64) * stride_table
    query_pos = tl.full([BLOCK_G], 0, tl.int32) + context_len - 1
    acc, m, l = _attend(acc, m, l, qt, kv_head, pages_row, lo, full_end, query_pos, window, qk_scale, softcap,
                        stride_kv_page, stride_kv_kv, stride_kv_token, stride_kv_dim,
                        HEAD_DIM, PAGE_SIZE, BLOCK_N, False, False, SOFTCAP, UPCAST, PRECISION)
    acc, m, l = _attend(acc, m, l, qt, kv_head, pages_row, full_end, hi, query_pos, window, qk_scale, softcap,
                        stride_kv_page, stride_kv_kv, stride_kv_token, stride_kv_dim,
                        HEAD_DIM, PAGE_SIZE, BLOCK_N, True, False, SOFTCAP, UPCAST, PRECISION)
    if SINGLE_SPLIT:
        o = acc / l[:, None]
        tl.store(out + token * stride_o_token + heads[:, None] * stride_o_head + dims[None, :] * stride_o_dim,
                 o.to(out.dtype.element_ty), mask=g_ok[:, None])
        return
    stats = decode.to(tl.int64) * stride_pm_request + heads * stride_pm_head + split * stride_pm_split
    tl.store(part_max + stats, m, mask=g_ok)
    tl.store(part_sum + stats, l, mask=g_ok)
    tl.store(part_acc + decode.to(tl.int64) * stride_pa_request + heads[:, None] * stride_pa_head
             + split * stride_pa_split + dims[None, :] * stride_pa_dim, acc, mask=g_ok[:, None])


@triton.jit
def _decode_merge_kernel(
    out, part_acc, part_max, part_sum, context_lens, query_start, num_prefills, partition_size, window,
    stride_o_token, stride_o_head, stride_o_dim,
    stride_pa_request, stride_pa_head, stride_pa_split, stride_pa_dim,
    stride_pm_request, stride_pm_head, stride_pm_split,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, SLIDING: tl.constexpr,
):
    decode, head = tl.program_id(0), tl.program_id(1)
    request = num_prefills + decode
    context_len = tl.load(context_lens + request)
    num_used = tl.cdiv(context_len, partition_size)
    splits = tl.arange(0, BLOCK_S)
    used = splits < num_used
    if SLIDING:  # the partitions wholly before the window did not run
        used = used & (splits >= tl.maximum(context_len - window, 0) // partition_size)
    stats = decode.to(tl.int64) * stride_pm_request + head * stride_pm_head + splits * stride_pm_split
    m = tl.load(part_max + stats, mask=used, other=float("-inf"))
    l = tl.load(part_sum + stats, mask=used, other=0.0)
    weight = tl.exp2(m - tl.max(m, axis=0))
    dims = tl.arange(0, HEAD_DIM)
    acc = tl.load(part_acc + decode.to(tl.int64) * stride_pa_request + head * stride_pa_head
                  + splits[:, None] * stride_pa_split + dims[None, :] * stride_pa_dim,
                  mask=used[:, None], other=0.0)
    o = tl.sum(acc * weight[:, None], axis=0) / tl.sum(l * weight, axis=0)
    token = tl.load(query_start + request).to(tl.int64)
    tl.store(out + token * stride_o_token + head * stride_o_head + dims * stride_o_dim,
             o.to(out.dtype.element_ty))


def _precision(dtype: torch.dtype) -> str:
    """fp32 inputs multiply in full precision; bf16/fp16 products are exact either way."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _prefill_blocks(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). Small tiles under the interpreter, so that
    small test shapes cross several query and key tiles, and for fp32 (whose full-precision
    dot runs on CUDA cores and needs more registers; it spills some even so)."""
    if interpreting():
        return 32, 16, 4, 1
    if dtype == torch.float32:
        return 32, 32, 8, 2
    return PREFILL_CONFIG if head_dim <= 128 else (64, 32, 8, 2)


def _decode_blocks(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages)."""
    if interpreting():
        return 16, 4, 1
    if dtype == torch.float32:
        return 16, 4, 2
    return DECODE_CONFIG if head_dim <= 128 else (32, 4, 2)


def decode_partition(num_decodes: int, num_kv_heads: int, max_context: int, block_n: int,
                     device: torch.device, num_splits: int | None = None) -> tuple[int, int]:
    """(partition_size, num_splits) for decode over contexts up to max_context tokens.

    By default: split until num_decodes * num_kv_heads * splits reaches DECODE_PROGRAMS_PER_SM
    programs per SM, keeping partitions of at least MIN_PARTITION tokens; partitions are whole
    key tiles.
    """
    if num_splits is None:
        wanted = triton.cdiv(DECODE_PROGRAMS_PER_SM * num_sms(device), num_decodes * num_kv_heads)
        num_splits = max(1, min(wanted, max_context // MIN_PARTITION))
    partition = triton.cdiv(triton.cdiv(max_context, num_splits), block_n) * block_n
    return partition, triton.cdiv(max_context, partition)


def paged_attention_triton(q: torch.Tensor, kv_layer: torch.Tensor, batch: AttnBatch, scale: float,
                           num_splits: int | None = None, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """punica.ops.attention.paged_attention; `num_splits` overrides the decode split count."""
    assert window >= 0 and softcap >= 0, (window, softcap)
    num_tokens, num_heads, head_dim = q.shape
    page_size, num_kv_heads = kv_layer.shape[2], kv_layer.shape[3]
    check_head_dim(head_dim)
    assert num_heads % num_kv_heads == 0 and kv_layer.shape[4] == head_dim, (q.shape, kv_layer.shape)
    group = num_heads // num_kv_heads
    num_prefills = batch.num_prefills
    num_decodes = batch.page_table.shape[0] - num_prefills
    out = torch.empty_like(q)
    common = dict(HEAD_DIM=head_dim, PAGE_SIZE=page_size, SLIDING=window > 0, SOFTCAP=softcap > 0,
                  UPCAST=interpreting(), PRECISION=_precision(q.dtype))
    qk_scale = scale if softcap else scale * LOG2E  # a softcapped score goes to the log2 domain after the cap
    if num_prefills:
        block_m, block_n, warps, stages = _prefill_blocks(head_dim, kv_layer.dtype)
        num_tiles = (num_tokens - num_decodes) // block_m + num_prefills
        _prefill_kernel[(num_tiles, num_heads)](
            q, kv_layer, out, batch.page_table, batch.context_lens, batch.query_start, num_prefills,
            group, qk_scale, window, softcap, *q.stride(), *out.stride(), *kv_layer.stride(),
            batch.page_table.stride(0), BLOCK_M=block_m, BLOCK_N=block_n,
            MAX_PREFILLS=max(16, triton.next_power_of_2(num_prefills)), num_warps=warps,
            num_stages=stages, **common,
        )
    if num_decodes:
        block_n, warps, stages = _decode_blocks(head_dim, kv_layer.dtype)
        max_context = batch.page_table.shape[1] * page_size
        partition, splits = decode_partition(num_decodes, num_kv_heads, max_context, block_n, q.device,
                                             num_splits)
        single = splits == 1  # the partition kernel writes the output: no partials, no merge
        if single:  # never read or written: pass out in their place
            part_acc = part_max = part_sum = out
            pa_strides, pm_strides = (0, 0, 0, 0), (0, 0, 0)
        else:
            part_acc = torch.empty(num_decodes, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
            part_max = torch.empty(num_decodes, num_heads, splits, dtype=torch.float32, device=q.device)
            part_sum = torch.empty_like(part_max)
            pa_strides, pm_strides = part_acc.stride(), part_max.stride()
        _decode_partition_kernel[(num_decodes, num_kv_heads, splits)](
            q, kv_layer, out, part_acc, part_max, part_sum, batch.page_table, batch.context_lens,
            batch.query_start, num_prefills, group, qk_scale, partition, window, softcap, *q.stride(),
            *out.stride(),
            *kv_layer.stride(), batch.page_table.stride(0), *pa_strides, *pm_strides,
            BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, SINGLE_SPLIT=single,
            num_warps=warps, num_stages=stages, **common,
        )
        if not single:
            _decode_merge_kernel[(num_decodes, num_heads)](
                out, part_acc, part_max, part_sum, batch.context_lens, batch.query_start, num_prefills,
                partition, window, *out.stride(), *part_acc.stride(), *part_max.stride(), HEAD_DIM=head_dim,
                BLOCK_S=max(2, triton.next_power_of_2(splits)), SLIDING=window > 0, num_warps=4,
            )
    return out
