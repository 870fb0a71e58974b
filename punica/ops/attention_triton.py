"""Triton kernels for attention on the paged KV cache; semantics and layout: punica.ops.attention.
(Appending to the cache: punica.ops.kv_append_triton.)

* Prefill: flash attention over each prefill request's pages. One program per (tile of
  BLOCK_M queries of one request, query head). The tiles of all prefill requests share one
  grid axis sized by an upper bound (prefill tokens // BLOCK_M + prefills); a program finds
  its request by a prefix sum of the per-request tile counts, and surplus programs exit.
  Longest-context tiles come first. Key tiles wholly before the tile's first query run
  without masks; the tiles on the diagonal apply the causal mask. When few tiles would leave
  SMs idle (a chunk of a long prompt over its cached context), each tile's keys are cut into
  partitions (`prefill_split_count`): a third grid axis, unnormalised partials with their running
  max and sum per row, and a merge kernel per (prefill token, query head). As decode's, the
  partitions are cut from the tile's own keys, not from the page table's width: a CUDA graph's
  table is as wide as the longest context allowed (34,816 keys in benchmarks.long_prompt), and
  partitions of that would leave a 127-token chunk at 15k cached tokens 2 of its 4 splits, and at
  4k one.
* Decode: flash decoding. Each request's keys (its context, or its window's end of it) are cut
  into `num_splits` partitions of whole key tiles; one program per (decode request, KV head,
  partition) attends all query heads of its KV head, so K and V are read once per group, and
  writes an unnormalised partial output with its running max and sum. A second kernel merges
  each request's partitions. The split count depends on shapes only (`decode_partition`, from the
  context bound, page_table columns * page_size): as many programs as one wave over the SMs
  holds, partitions of the bound of at least MIN_PARTITION tokens and at most MAX_PARTITION (in
  at most MAX_SPLITS), so that one long context is read by many programs even in a batch whose
  short ones fill the SMs (read by one program a KV head, a 16k context made a 7B decode step of
  32 requests take 24 ms against 6.5 on the H200). A request's partitions are cut from its own
  keys, not from the bound: in a CUDA graph the bound is the longest context the graph allows,
  and a request at 512 tokens under a 4,096-token bound would otherwise be read by 2 of 16
  splits, 4 key tiles one after the other. Where the batch fills the SMs without splits, a
  request's partitions take at least MAX_PARTITION keys (`decode_min_partition`). A request whose
  keys one partition holds gets its output normalised and written by the partition kernel, and
  the merge skips it; with one split (large batches over short contexts: e.g. 32 requests x 32
  KV heads already fill 132 SMs) no merge is launched and no partial buffers exist.
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

from punica.ops.attention_batch import AttnBatch
from punica.ops.attention_kernels import (
    decode_merge_kernel,
    decode_partition_kernel,
    prefill_kernel,
    prefill_merge_kernel,
)
from punica.ops.kv_append_triton import check_head_dim, scale_strides
from punica.ops.triton_env import interpreting, num_sms

LOG2E = 1.4426950408889634
DECODE_PROGRAMS_PER_SM = 4  # decode splits contexts until its programs reach this many per SM
MIN_PARTITION = 256         # fewest tokens a decode partition covers
MAX_PARTITION = 2048        # most tokens a decode partition covers (a long context beside short ones)
MAX_SPLITS = 16             # most splits that bound asks for: a split adds a program per request and KV head
# the decode merge reads at least MAX_SPLITS partitions' statistics, so that an eager step (past the
# CUDA graphs' buckets, its page table as wide as its longest context) takes the variant that the
# graphs' capture compiled, whatever its split count up to MAX_SPLITS
PREFILL_PROGRAMS_PER_SM = 2  # prefill splits keys until its programs reach this many per SM
PREFILL_MIN_PARTITION = 512  # fewest keys a prefill partition covers
# the prefill kernel reads this many query starts at least to place its tile (MAX_PREFILLS): the
# CUDA graphs' buckets of 512 tokens and more hold up to 64 prefills, so an eager step of up to 64
# prompts (one long prompt past the largest bucket) runs a variant their capture compiled
MIN_PREFILL_SLOTS = 64
# bf16/fp16 tiles for head_dim <= 128, and those over an fp8 cache (widened to bf16/fp16), from the
# sweeps of benchmarks/attention.py and benchmarks/fp8_kv_attention.py (docs/benchmarks.md)
PREFILL_CONFIG = (64, 64, 4, 3)       # BLOCK_M, BLOCK_N, num_warps, num_stages
FP8_PREFILL_CONFIG = (64, 128, 4, 2)
DECODE_CONFIG = (64, 2, 3)            # BLOCK_N, num_warps, num_stages
FP8_DECODE_CONFIG = (64, 2, 3)
# a prefill merge program reads one token's and head's [splits, head_dim] partials, a few KB: one warp
# took 2.8-3.8 us a layer where four took 7.3-13.0 (H100, docs/benchmarks.md)
PREFILL_MERGE_WARPS = 1


def _precision(dtype: torch.dtype) -> str:
    """fp32 inputs multiply in full precision; bf16/fp16 products are exact either way."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _prefill_blocks(head_dim: int, dtype: torch.dtype, fp8: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages); `fp8`: over an fp8 cache, widened to `dtype`.
    Small tiles under the interpreter, so that small test shapes cross several query and key
    tiles, and for fp32 (whose full-precision dot runs on CUDA cores and needs more registers; it
    spills some even so)."""
    if interpreting():
        return 32, 16, 4, 1
    if dtype == torch.float32:
        return 32, 32, 8, 2
    if head_dim > 128:
        return 64, 32, 8, 2
    return FP8_PREFILL_CONFIG if fp8 else PREFILL_CONFIG


def prefill_query_tile(head_dim: int, dtype: torch.dtype) -> int:
    """Queries of a prefill tile (BLOCK_M) for heads of head_dim computed in `dtype`, over a cache of
    any format: each tile's programs read its request's cached context."""
    return _prefill_blocks(head_dim, dtype)[0]


def _decode_blocks(head_dim: int, dtype: torch.dtype, fp8: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages); `fp8`: over an fp8 cache, widened to `dtype`."""
    if interpreting():
        return 16, 4, 1
    if dtype == torch.float32:
        return 16, 4, 2
    if head_dim > 128:
        return 32, 4, 2
    return FP8_DECODE_CONFIG if fp8 else DECODE_CONFIG


def _decode_wave(device: torch.device) -> int:
    """Decode programs in one wave over the SMs: the split rules' bound."""
    return DECODE_PROGRAMS_PER_SM * num_sms(device)


def decode_partition(num_decodes: int, num_kv_heads: int, max_context: int, block_n: int,
                     device: torch.device, num_splits: int | None = None) -> tuple[int, int]:
    """(partition_size, num_splits) for decode over contexts up to max_context tokens; the kernels
    cut each request's own keys into num_splits (module docstring), partition_size is the bound's.

    By default: the most splits whose num_decodes * num_kv_heads * splits programs stay within one
    wave of DECODE_PROGRAMS_PER_SM per SM, keeping partitions of at least MIN_PARTITION tokens, and
    whatever the batch into partitions of at most MAX_PARTITION tokens, in at most MAX_SPLITS;
    partitions are whole key tiles. A split costs the programs of every request, most of which exit
    (contexts shorter than the bound): ~0.6 us per 1,024 programs on the H200. A split that starts
    a second wave costs more than it saves: on the H100 at context 2,048, batch 8 on fp8 pages took
    93 us with 3 splits (768 programs past the 528 of one wave) against 78 with 2, and batch 16 on
    bf16 pages 200 us with 2 against 193 with 1.
    """
    if num_splits is None:
        wanted = _decode_wave(device) // (num_decodes * num_kv_heads)
        num_splits = max(1, min(wanted, max_context // MIN_PARTITION),
                         min(MAX_SPLITS, triton.cdiv(max_context, MAX_PARTITION)))
    partition = triton.cdiv(triton.cdiv(max_context, num_splits), block_n) * block_n
    return partition, triton.cdiv(max_context, partition)


def decode_min_partition(num_decodes: int, num_kv_heads: int, num_splits: int, device: torch.device) -> int:
    """The fewest keys a request's decode partition takes (the kernels cut each request's own keys
    into num_splits): none while every split's programs fit one wave of DECODE_PROGRAMS_PER_SM per
    SM, so that a short context still spreads over them; MAX_PARTITION past that (a batch that
    fills the SMs with one program per request and KV head, split only for its long contexts), so
    that only a context longer than that takes more than one program."""
    if num_decodes * num_kv_heads * num_splits <= _decode_wave(device):
        return 0
    return MAX_PARTITION


def prefill_split_count(num_prefill_tokens: int, block_m: int, num_heads: int, max_context: int,
                        device: torch.device) -> int:
    """Partitions of each prefill tile's keys (the kernel cuts the tile's own keys into them, each at
    least PREFILL_MIN_PARTITION keys).

    A chunk of a long prompt is a few query tiles over a long cached context: one program per tile
    and head would leave most SMs idle while each reads the whole context. The most splits whose
    programs, the tiles the prefill tokens fill at least (num_prefill_tokens // block_m, at least
    one) times heads times splits, stay within one wave of PREFILL_PROGRAMS_PER_SM per SM, and no
    more than the context bound max_context holds partitions of PREFILL_MIN_PARTITION keys. A split
    that starts a second wave costs more than it saves: on the H100 a 512-token chunk over 2,048
    cached tokens (256 programs unsplit) took 76.7 us unsplit against 99.3 with 2 splits on bf16
    pages, and a 128-token chunk over 4,096 took 59.4 us with 4 splits against 73.5 with 6. Only
    shapes decide, so the split count of a CUDA-graph bucket is fixed; partitions past a tile's keys
    exit at once.
    """
    tiles = max(1, num_prefill_tokens // block_m)
    wanted = PREFILL_PROGRAMS_PER_SM * num_sms(device) // (tiles * num_heads)
    return max(1, min(wanted, max_context // PREFILL_MIN_PARTITION))


def _partials(out: torch.Tensor, num_rows: int, splits: int) -> tuple:
    """(acc, max, sum, acc strides, stats strides) of `splits` partial outputs of `num_rows` rows;
    with one split none are needed (the kernels write `out`, passed in their place)."""
    if splits == 1:
        return out, out, out, (0, 0, 0, 0), (0, 0, 0)
    num_heads, head_dim = out.shape[1], out.shape[2]
    acc = torch.empty(num_rows, num_heads, splits, head_dim, dtype=torch.float32, device=out.device)
    stats_max = torch.empty(num_rows, num_heads, splits, dtype=torch.float32, device=out.device)
    stats_sum = torch.empty_like(stats_max)
    return acc, stats_max, stats_sum, acc.stride(), stats_max.stride()


def paged_attention_triton(q: torch.Tensor, kv_layer: torch.Tensor, batch: AttnBatch, scale: float,
                           num_splits: int | None = None, window: int = 0, softcap: float = 0.0,
                           prefill_splits: int | None = None, kv_scales: torch.Tensor | None = None) -> torch.Tensor:
    """punica.ops.attention.paged_attention; `num_splits` overrides the decode split count,
    `prefill_splits` the prefill tiles' (each tile's keys cut into that many partitions of whole key
    tiles, of any size; by default `prefill_split_count`'s, each at least PREFILL_MIN_PARTITION
    keys). An fp8 cache takes the tile sizes of bf16, its elements converted to q's dtype as they
    load."""
    assert window >= 0 and softcap >= 0, (window, softcap)
    num_tokens, num_heads, head_dim = q.shape
    page_size, num_kv_heads = kv_layer.shape[2], kv_layer.shape[3]
    check_head_dim(head_dim)
    assert num_heads % num_kv_heads == 0 and kv_layer.shape[4] == head_dim, (q.shape, kv_layer.shape)
    group = num_heads // num_kv_heads
    num_prefills = batch.num_prefills
    num_decodes = batch.page_table.shape[0] - num_prefills
    out = torch.empty_like(q)
    scales, s_strides, fp8 = scale_strides(kv_layer, kv_scales)
    tile_dtype = q.dtype if fp8 else kv_layer.dtype
    common = dict(HEAD_DIM=head_dim, PAGE_SIZE=page_size, SLIDING=window > 0, SOFTCAP=softcap > 0,
                  UPCAST=interpreting(), PRECISION=_precision(q.dtype), FP8=fp8)
    qk_scale = scale if softcap else scale * LOG2E  # a softcapped score goes to the log2 domain after the cap
    if num_prefills:
        block_m, block_n, warps, stages = _prefill_blocks(head_dim, tile_dtype, fp8)
        num_prefill_tokens = num_tokens - num_decodes
        num_tiles = num_prefill_tokens // block_m + num_prefills
        max_context = batch.page_table.shape[1] * page_size
        splits, min_partition = prefill_splits, 0
        if splits is None:
            splits = prefill_split_count(num_prefill_tokens, block_m, num_heads, max_context, q.device)
            min_partition = PREFILL_MIN_PARTITION
        assert min_partition % block_n == 0, (min_partition, block_n)  # partitions of whole key tiles
        part_acc, part_max, part_sum, pa_strides, pm_strides = _partials(out, num_prefill_tokens, splits)
        prefill_kernel[(num_tiles, num_heads, splits)](
            q, kv_layer, scales, out, part_acc, part_max, part_sum, batch.page_table, batch.context_lens,
            batch.query_start, num_prefills, group, qk_scale, min_partition, window, softcap, *q.stride(),
            *out.stride(), *kv_layer.stride(), *s_strides, batch.page_table.stride(0), *pa_strides, *pm_strides,
            BLOCK_M=block_m, BLOCK_N=block_n, MAX_PREFILLS=max(MIN_PREFILL_SLOTS, triton.next_power_of_2(num_prefills)),
            SPLIT=splits > 1, num_warps=warps, num_stages=stages, **common,
        )
        if splits > 1:
            prefill_merge_kernel[(num_prefill_tokens, num_heads)](
                out, part_acc, part_max, part_sum, splits, *out.stride(), *pa_strides, *pm_strides,
                HEAD_DIM=head_dim, BLOCK_S=max(2, triton.next_power_of_2(splits)),
                num_warps=PREFILL_MERGE_WARPS,
            )
    if num_decodes:
        block_n, warps, stages = _decode_blocks(head_dim, tile_dtype, fp8)
        max_context = batch.page_table.shape[1] * page_size
        splits = decode_partition(num_decodes, num_kv_heads, max_context, block_n, q.device, num_splits)[1]
        min_partition = decode_min_partition(num_decodes, num_kv_heads, splits, q.device)
        single = splits == 1  # the partition kernel writes the output: no partials, no merge
        part_acc, part_max, part_sum, pa_strides, pm_strides = _partials(out, num_decodes, splits)
        decode_partition_kernel[(num_decodes, num_kv_heads, splits)](
            q, kv_layer, scales, out, part_acc, part_max, part_sum, batch.page_table, batch.context_lens,
            batch.query_start, num_prefills, group, qk_scale, min_partition, window, softcap, *q.stride(),
            *out.stride(), *kv_layer.stride(), *s_strides, batch.page_table.stride(0), *pa_strides, *pm_strides,
            BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
            num_warps=warps, num_stages=stages, **common,
        )
        if not single:
            decode_merge_kernel[(num_decodes, num_heads)](
                out, part_acc, part_max, part_sum, batch.context_lens, batch.query_start, num_prefills,
                splits, min_partition, window, *out.stride(), *part_acc.stride(), *part_max.stride(), HEAD_DIM=head_dim,
                BLOCK_N=block_n, BLOCK_S=max(MAX_SPLITS, triton.next_power_of_2(splits)), SLIDING=window > 0,
                num_warps=4,
            )
    return out
