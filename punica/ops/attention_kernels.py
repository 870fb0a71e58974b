"""The Triton kernels of paged attention; their schedules, and the launches that pick them:
punica.ops.attention_triton.

FP8 (an e4m3 cache with one scale per key row, punica.ops.kv_cache): a K tile is widened to
q's dtype (punica.ops.fp8_widen_triton) for Q K^T and each score column multiplied by its key's
scale; a V tile likewise, its scales folded into P's columns before P @ V (the softmax sum takes P
unscaled). So each tile reads 1-byte elements plus one 4-byte scale per key for K and for V.

Integer arguments that change from step to step (the step's prefill count, the page table's width,
strides that hold a split count) are not specialized: Triton would compile a variant of a kernel
the first time one of them is 1 or not a multiple of 16, and an eager step of a new shape (a prompt
past the CUDA graphs' buckets) would compile while others wait on it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from punica.ops.fp8_widen_triton import widen_e4m3

STEP_VARYING = ["num_prefills", "min_partition", "stride_table"]  # do_not_specialize (module docstring)


@triton.jit
def _attend(acc, m, l, qt, kv_head, scale_head, pages_row, lo, hi, query_pos, window, qk_scale, softcap,
            stride_kv_page, stride_kv_kv, stride_kv_token, stride_kv_dim, stride_s_page, stride_s_kv, stride_s_token,
            HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
            MASKED: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, UPCAST: tl.constexpr,
            PRECISION: tl.constexpr, MAY_BE_EMPTY: tl.constexpr, FP8: tl.constexpr):
    """Online softmax of the query rows qt over keys lo..hi-1 of one request and KV head.

    acc [rows, HEAD_DIM], m, l [rows] fp32 (max and sum in the log2 domain). MASKED: keys at
    or past hi, or after a row's query_pos, are left out (and with SLIDING those at or before
    query_pos - window); else every key is attended. MAY_BE_EMPTY (with SLIDING, or a key
    partition after a row's query): a row may see no key of a tile, and then its max stays at
    most 0 and nothing is added. SOFTCAP: qk_scale is the plain scale, and each score becomes
    softcap * tanh(score / softcap), then goes to the log2 domain. FP8: scale_head points at the
    KV head's scales (the module docstring); masked keys' scales load as 0.
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
        if FP8:
            scale_ptrs = scale_head + pages.to(tl.int64) * stride_s_page + (keys % PAGE_SIZE) * stride_s_token
            if MASKED:
                k_scale = tl.load(scale_ptrs, mask=key_ok, other=0.0)
                v_scale = tl.load(scale_ptrs + stride_s_kv, mask=key_ok, other=0.0)
            else:
                k_scale = tl.load(scale_ptrs)
                v_scale = tl.load(scale_ptrs + stride_s_kv)
            kt = widen_e4m3(kt, qt.dtype)
            vt = widen_e4m3(vt, qt.dtype)
        elif UPCAST:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        s = tl.dot(qt, kt, input_precision=PRECISION)
        if FP8:
            s = s * k_scale[None, :]
        s = s * qk_scale
        if SOFTCAP:  # tanh(x) = 2 sigmoid(2x) - 1; log2(e) as a literal (a jitted function reads no globals)
            s = (softcap * 1.4426950408889634) * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
        if MASKED:
            seen = key_ok[None, :] & (keys[None, :] <= query_pos[:, None])
            if SLIDING:
                seen = seen & (keys[None, :] > query_pos[:, None] - window)
            s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        if MAY_BE_EMPTY:  # a row that has seen no key yet: exp2(-inf - 0) = 0, not exp2(-inf + inf) = NaN
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        if FP8:
            p = p * v_scale[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
        m = m_new
    return acc, m, l


@triton.jit
def _partition_size(num_keys, num_splits, min_partition, BLOCK_N: tl.constexpr):
    """Keys of each of num_splits partitions that cut num_keys keys: whole key tiles, at least
    min_partition (a multiple of BLOCK_N) keys."""
    return tl.maximum(tl.cdiv(tl.cdiv(num_keys, num_splits), BLOCK_N) * BLOCK_N, min_partition)


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


@triton.jit(do_not_specialize=STEP_VARYING + ["stride_pm_token", "stride_pm_head"])
def prefill_kernel(
    q, kv, kv_scales, out, part_acc, part_max, part_sum, page_table, context_lens, query_start, num_prefills, group,
    qk_scale, min_partition, window, softcap,
    stride_q_token, stride_q_head, stride_q_dim, stride_o_token, stride_o_head, stride_o_dim,
    stride_kv_page, stride_kv_kv, stride_kv_token, stride_kv_head, stride_kv_dim,
    stride_s_page, stride_s_kv, stride_s_token, stride_s_head, stride_table,
    stride_pa_token, stride_pa_head, stride_pa_split, stride_pa_dim,
    stride_pm_token, stride_pm_head, stride_pm_split,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, MAX_PREFILLS: tl.constexpr, SPLIT: tl.constexpr, SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
):
    """One query tile of one prefill request and query head: its normalised output, or with SPLIT
    its unnormalised partial over key partition program_id(2) of the tile's own keys (cut into
    num_programs(2) partitions of whole key tiles, each at least min_partition keys) with the rows'
    running max and sum; a partition past the tile's last key writes a sum of 0 (the merge leaves
    it out)."""
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
    first_pos = context_len - query_len + block * BLOCK_M
    keys_end = tl.minimum(first_pos + BLOCK_M, context_len)
    if SLIDING:  # from the key tile of the first row's window on, every tile masked
        keys_start = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
        unmasked_end = keys_start
    else:
        keys_start = 0
        unmasked_end = (first_pos + 1) // BLOCK_N * BLOCK_N  # keys every row of the tile sees
    lo, hi = keys_start, keys_end
    if SPLIT:
        split = tl.program_id(2)
        part = _partition_size(keys_end - keys_start, tl.num_programs(2), min_partition, BLOCK_N)
        lo = keys_start + split * part
        hi = tl.minimum(lo + part, keys_end)
        if lo >= hi:
            stats = tokens * stride_pm_token + head * stride_pm_head + split * stride_pm_split
            tl.store(part_sum + stats, tl.zeros([BLOCK_M], tl.float32), mask=row_ok)
            return
    qt = tl.load(q + tokens[:, None] * stride_q_token + head * stride_q_head + dims[None, :] * stride_q_dim,
                 mask=row_ok[:, None], other=0.0)
    if UPCAST:
        qt = qt.to(tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    kv_head = kv + (head // group) * stride_kv_head
    scale_head = kv_scales + (head // group) * stride_s_head
    pages_row = page_table + request.to(tl.int64) * stride_table
    if not SLIDING:
        acc, m, l = _attend(acc, m, l, qt, kv_head, scale_head, pages_row, lo, tl.minimum(hi, unmasked_end),
                            query_pos, window, qk_scale, softcap, stride_kv_page, stride_kv_kv, stride_kv_token,
                            stride_kv_dim, stride_s_page, stride_s_kv, stride_s_token,
                            HEAD_DIM, PAGE_SIZE, BLOCK_N, False, False, SOFTCAP, UPCAST, PRECISION, False, FP8)
    # a partition after a row's query may hold no key it sees, as may a window
    acc, m, l = _attend(acc, m, l, qt, kv_head, scale_head, pages_row, tl.maximum(lo, unmasked_end), hi, query_pos,
                        window, qk_scale, softcap, stride_kv_page, stride_kv_kv, stride_kv_token, stride_kv_dim,
                        stride_s_page, stride_s_kv, stride_s_token, HEAD_DIM, PAGE_SIZE, BLOCK_N, True, SLIDING,
                        SOFTCAP, UPCAST, PRECISION, SLIDING or SPLIT, FP8)
    if SPLIT:
        stats = tokens * stride_pm_token + head * stride_pm_head + split * stride_pm_split
        tl.store(part_max + stats, m, mask=row_ok)
        tl.store(part_sum + stats, l, mask=row_ok)
        tl.store(part_acc + tokens[:, None] * stride_pa_token + head * stride_pa_head + split * stride_pa_split
                 + dims[None, :] * stride_pa_dim, acc, mask=row_ok[:, None])
        return
    if SLIDING:  # a padding row's window may hold no key of the context
        l = tl.where(row_ok, l, 1.0)
    o = acc / l[:, None]
    tl.store(out + tokens[:, None] * stride_o_token + head * stride_o_head + dims[None, :] * stride_o_dim,
             o.to(out.dtype.element_ty), mask=row_ok[:, None])


@triton.jit(do_not_specialize=["num_splits", "stride_pm_token", "stride_pm_head"])
def prefill_merge_kernel(
    out, part_acc, part_max, part_sum, num_splits,
    stride_o_token, stride_o_head, stride_o_dim,
    stride_pa_token, stride_pa_head, stride_pa_split, stride_pa_dim,
    stride_pm_token, stride_pm_head, stride_pm_split,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """One prefill token and query head: its partitions' partials merged, those of sum 0 left out
    (a partition past its tile's keys, or one whose keys the row does not see)."""
    token, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    stats = token * stride_pm_token + head * stride_pm_head + splits * stride_pm_split
    l = tl.load(part_sum + stats, mask=splits < num_splits, other=0.0)
    used = l > 0
    m = tl.load(part_max + stats, mask=used, other=float("-inf"))
    weight = tl.where(used, tl.exp2(m - tl.max(m, axis=0)), 0.0)
    dims = tl.arange(0, HEAD_DIM)
    acc = tl.load(part_acc + token * stride_pa_token + head * stride_pa_head + splits[:, None] * stride_pa_split
                  + dims[None, :] * stride_pa_dim, mask=used[:, None], other=0.0)
    o = tl.sum(acc * weight[:, None], axis=0) / tl.sum(l * weight, axis=0)
    tl.store(out + token * stride_o_token + head * stride_o_head + dims * stride_o_dim, o.to(out.dtype.element_ty))


@triton.jit
def _decode_partition(context_len, window, num_splits, min_partition, BLOCK_N: tl.constexpr,
                      SLIDING: tl.constexpr):
    """(first key, partition size) of a decode request's keys: the keys it sees (its context, or the
    window's end of it) cut into num_splits partitions of whole key tiles, each at least
    min_partition keys, so that a context shorter than the step's bound still spreads over the
    splits (punica.ops.attention_triton.decode_partition)."""
    first = 0
    if SLIDING:
        first = tl.maximum(context_len - window, 0)
    return first, _partition_size(context_len - first, num_splits, min_partition, BLOCK_N)


@triton.jit(do_not_specialize=["num_prefills", "min_partition", "stride_table", "stride_pm_request",
                               "stride_pm_head"])
def decode_partition_kernel(
    q, kv, kv_scales, out, part_acc, part_max, part_sum, page_table, context_lens, query_start, num_prefills,
    group, qk_scale, min_partition, window, softcap,
    stride_q_token, stride_q_head, stride_q_dim, stride_o_token, stride_o_head, stride_o_dim,
    stride_kv_page, stride_kv_kv, stride_kv_token, stride_kv_head, stride_kv_dim,
    stride_s_page, stride_s_kv, stride_s_token, stride_s_head, stride_table,
    stride_pa_request, stride_pa_head, stride_pa_split, stride_pa_dim,
    stride_pm_request, stride_pm_head, stride_pm_split,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
):
    """One partition of one decode request and KV head (_decode_partition): its partial output and
    statistics, or, when one partition holds all the keys it sees, the normalised output itself
    (the merge skips that request; with one split no partial buffers exist). Under a sliding window
    the query sees keys context_len - window .. context_len - 1, and the partitions cut those."""
    decode, kv_head_index, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    request = num_prefills + decode
    context_len = tl.load(context_lens + request)
    first, partition_size = _decode_partition(context_len, window, tl.num_programs(2), min_partition, BLOCK_N,
                                               SLIDING)
    lo = first + split * partition_size
    hi = tl.minimum(lo + partition_size, context_len)
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
    scale_head = kv_scales + kv_head_index * stride_s_head
    pages_row = page_table + request.to(tl.int64) * stride_table
    query_pos = tl.full([BLOCK_G], 0, tl.int32) + context_len - 1
    acc, m, l = _attend(acc, m, l, qt, kv_head, scale_head, pages_row, lo, full_end, query_pos, window, qk_scale,
                        softcap, stride_kv_page, stride_kv_kv, stride_kv_token, stride_kv_dim,
                        stride_s_page, stride_s_kv, stride_s_token,
                        HEAD_DIM, PAGE_SIZE, BLOCK_N, False, False, SOFTCAP, UPCAST, PRECISION, False, FP8)
    acc, m, l = _attend(acc, m, l, qt, kv_head, scale_head, pages_row, full_end, hi, query_pos, window, qk_scale,
                        softcap, stride_kv_page, stride_kv_kv, stride_kv_token, stride_kv_dim,
                        stride_s_page, stride_s_kv, stride_s_token,
                        HEAD_DIM, PAGE_SIZE, BLOCK_N, True, False, SOFTCAP, UPCAST, PRECISION, False, FP8)
    if context_len - first <= partition_size:
        o = acc / l[:, None]
        tl.store(out + token * stride_o_token + heads[:, None] * stride_o_head + dims[None, :] * stride_o_dim,
                 o.to(out.dtype.element_ty), mask=g_ok[:, None])
        return
    stats = decode.to(tl.int64) * stride_pm_request + heads * stride_pm_head + split * stride_pm_split
    tl.store(part_max + stats, m, mask=g_ok)
    tl.store(part_sum + stats, l, mask=g_ok)
    tl.store(part_acc + decode.to(tl.int64) * stride_pa_request + heads[:, None] * stride_pa_head
             + split * stride_pa_split + dims[None, :] * stride_pa_dim, acc, mask=g_ok[:, None])


@triton.jit(do_not_specialize=["num_prefills", "num_splits", "min_partition", "stride_pm_request", "stride_pm_head"])
def decode_merge_kernel(
    out, part_acc, part_max, part_sum, context_lens, query_start, num_prefills, num_splits, min_partition, window,
    stride_o_token, stride_o_head, stride_o_dim,
    stride_pa_request, stride_pa_head, stride_pa_split, stride_pa_dim,
    stride_pm_request, stride_pm_head, stride_pm_split,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, SLIDING: tl.constexpr,
):
    decode, head = tl.program_id(0), tl.program_id(1)
    request = num_prefills + decode
    context_len = tl.load(context_lens + request)
    first, partition_size = _decode_partition(context_len, window, num_splits, min_partition, BLOCK_N, SLIDING)
    if context_len - first <= partition_size:  # one partition: it wrote the output
        return
    splits = tl.arange(0, BLOCK_S)
    used = splits < tl.cdiv(context_len - first, partition_size)
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
