"""The paged-attention and KV-append kernels compile for a CUDA target (Hopper) in every variant
(an fp8 cache's too, rotary + KV append's with a pending LoRA delta), and the other kernels in
theirs (the layer kernels' with a pending LoRA delta too), on a machine without a GPU
(tests/ops/conftest.py)."""

import pytest

pytestmark = pytest.mark.slow

SCRIPT = """
from punica.ops import attention_triton as k
from punica.ops import kv_append_triton as append

INT_POINTERS = {"page_table", "context_lens", "query_start", "token_slots", "dora_slots"}
FLOATS = {"qk_scale", "softcap"}


def types(name, consts):
    if name in FLOATS:
        return "fp32"
    if name in INT_POINTERS:
        return "*i32"
    if name == "slot_mapping":
        return "*i64"
    if name.startswith(("stride", "num_", "group", "window", "partition", "half", "min_")):
        return "i32"
    if name == "kv":
        return "*fp8e4nv" if consts.get("FP8") else "*bf16"
    return "*bf16" if name in ("q", "k", "v", "out") else "*fp32"


common = dict(HEAD_DIM=128, PAGE_SIZE=16, BLOCK_N=64, UPCAST=False, PRECISION="tf32")
for sliding, softcap, fp8 in ((False, False, False), (False, True, False), (True, False, False),
                              (True, True, False), (False, False, True), (True, True, True)):
    flags = dict(SLIDING=sliding, SOFTCAP=softcap, FP8=fp8)
    for split in (False, True):
        compile_ttir(k.prefill_kernel, common | flags | dict(BLOCK_M=128, MAX_PREFILLS=16, SPLIT=split), types)
    compile_ttir(k.decode_partition_kernel, common | flags | dict(BLOCK_G=16), types)
    compile_ttir(k.decode_merge_kernel, dict(HEAD_DIM=128, BLOCK_N=64, BLOCK_S=k.MAX_SPLITS, SLIDING=sliding),
                 types)
compile_ttir(k.prefill_merge_kernel, dict(HEAD_DIM=128, BLOCK_S=16), types)
for fp8 in (False, True):
    compile_ttir(append._write_kv_kernel, dict(HEAD_DIM=128, PAGE_SIZE=16, BLOCK_H=8, FP8=fp8, EXACT=False), types)
    for has_delta, dora in ((False, False), (True, False), (True, True)):
        compile_ttir(append._rope_and_write_kv_kernel, dict(PAGE_SIZE=16, BLOCK_H=8, BLOCK_D=64, FP8=fp8, EXACT=False,
                                                            HAS_DELTA=has_delta, DORA=dora), types)
"""


def test_attention_kernels_compile_for_cuda_in_every_variant(compile_for_cuda):
    compile_for_cuda(SCRIPT)


LORA_SCRIPT = """
from punica.ops import lora_kernels as k

INT_POINTERS = {"token_slots", "seg_indptr", "seg_slots", "dora_slots"}
INTS = {"num_segments", "num_steps", "h_out", "max_rank", "slice1_start", "slice2_start", "num_tokens",
        "tile_programs"}


def types(name, consts):
    if name in INT_POINTERS:
        return "*i32"
    if name in INTS or name.startswith("stride"):
        return "i32"
    if name == "y":
        return "*bf16" if consts.get("ACCUMULATE", True) else "*fp32"
    return "*bf16" if name == "lora_b" else "*fp32"


rowwise = dict(SEGMENTED=False, FAN=64, BLOCK_N=512, BLOCK_R=16, TOKEN_SCALES=True, PDL=True)
for accumulate, dora in ((True, False), (True, True), (False, False)):
    compile_ttir(k.expand_rowwise_kernel, rowwise | dict(ACCUMULATE=accumulate, DORA=dora), types)
for dora in (False, True):
    compile_ttir(k.add_delta_rowwise_kernel, dict(BLOCK_N=512, DORA=dora, PDL=True), types)
tile = dict(FAN=64, BLOCK_M=16, BLOCK_R=16, TOKEN_SCALES=True, PRECISION="tf32", PDL=True)
for sliced, dora in ((False, False), (True, True)):
    compile_ttir(k.sgmv_expand_tile_kernel, tile | dict(BLOCK_N=128, SLICED=sliced, DORA=dora), types)
    compile_ttir(k.mixed_expand_kernel, dict(FAN=64, BLOCK_M=16, TILE_BLOCK_N=128, TILE_BLOCK_R=16, ROW_BLOCK_N=512,
                                             ROW_BLOCK_R=16, SLICED=sliced, TOKEN_SCALES=True, DORA=dora,
                                             PRECISION="tf32", PDL=True), types)
"""


def test_lora_expand_and_delta_kernels_compile_for_cuda(compile_for_cuda):
    compile_for_cuda(LORA_SCRIPT)


LINEAR_SCRIPT = """
from punica.ops import linear_triton as k


def types(name, consts):
    if name in ("x", "w", "bias", "out"):
        return "*bf16"
    if name in ("partial", "scales"):
        return "*fp32"
    return "i32"


for split_k, even_k in ((1, True), (1, False), (4, True), (4, False)):
    compile_ttir(k._skinny_gemm_kernel, dict(HAS_BIAS=True, UPCAST=False, PRECISION="tf32", EVEN_K=even_k,
                                             BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, SPLIT_K=split_k), types)
for has_scales in (False, True):
    compile_ttir(k._split_k_sum_kernel, dict(HAS_SCALES=has_scales, HAS_BIAS=True, SPLIT_K=4, BLOCK=1024), types)
"""


def test_skinny_gemm_kernels_compile_for_cuda(compile_for_cuda):
    compile_for_cuda(LINEAR_SCRIPT)


MOE_SCRIPT = """
from punica.ops import moe_triton as k


def types(name, consts):
    if name in ("rows", "w", "out"):
        return "*bf16"
    if name in ("block_rows", "block_experts"):
        return "*i32"
    return "*i64" if name == "expert_indptr" else "i32"


for block_m in (16, 64):
    compile_ttir(k._grouped_gemm_kernel, dict(UPCAST=False, PRECISION="tf32", BLOCK_M=block_m, BLOCK_N=64,
                                              BLOCK_K=64), types)
    compile_ttir(k._align_blocks_kernel, dict(BLOCK_M=block_m, BLOCK_E=128, BLOCK=k.ALIGN_ROWS), types)

from punica.ops import moe_route_triton as rk


def route_types(name, consts):
    if name in ("logits", "out", "down"):
        return "*bf16"
    if name in ("topk_probs", "token_totals", "pair_weights"):
        return "*fp32"
    if name in ("topk_experts", "block_counts"):
        return "*i32"
    return "*i64" if name in ("pair_tokens", "pair_experts", "expert_indptr", "token_pairs") else "i32"


for top_k, block_t in ((8, 8), (2, 32)):
    compile_ttir(rk._route_topk_kernel, dict(TOP_K=top_k, BLOCK_T=block_t, BLOCK_E=128), route_types)
    compile_ttir(rk._route_sort_kernel, dict(TOP_K=top_k, RENORMALIZE=True, BLOCK_T=block_t, BLOCK_P=64,
                                             BLOCK_E=128, COUNT_ROWS=rk.COUNT_ROWS), route_types)
    compile_ttir(rk._combine_kernel, dict(TOP_K=top_k, BLOCK_H=rk.COMBINE_BLOCK_H), route_types)

from punica.ops import lora_moe_triton as lk


def lora_types(name, consts):
    if name in ("y", "rows", "lora_a", "lora_b"):
        return "*bf16"
    if name in ("shrunk", "token_scales", "slot_scales"):
        return "*fp32"
    if name in ("pair_slots", "token_slots"):
        return "*i32"
    return "*i64" if name in ("pair_tokens", "pair_experts") else "i32"


for block_r, block_k in ((16, 512), (64, 128)):
    compile_ttir(lk._expert_shrink_kernel, dict(BLOCK_R=block_r, BLOCK_K=block_k), lora_types)
    compile_ttir(lk._expert_expand_kernel, dict(BLOCK_R=block_r, BLOCK_N=lk.EXPAND_BLOCK_N, BLOCK_PARTS=4),
                 lora_types)
"""


def test_expert_kernels_compile_for_cuda(compile_for_cuda):
    compile_for_cuda(MOE_SCRIPT)


LAYERS_SCRIPT = """
from punica.ops import layers_triton as k


def types(name, consts):
    if name in ("token_slots", "dora_slots"):
        return "*i32"
    if name.startswith("stride") or name in ("hidden", "inter"):
        return "i32"
    if name == "eps":
        return "fp32"
    return "*fp32" if name in ("d", "out_scales") else "*bf16"


for has_delta, dora in ((False, False), (True, False), (True, True)):
    delta = dict(HAS_DELTA=has_delta, DORA=dora)
    for residual in (False, True):
        for blocks in (1, 2):
            compile_ttir(k._rms_norm_kernel, delta | dict(HAS_RESIDUAL=residual, BLOCK=4096, NUM_BLOCKS=blocks), types)
    compile_ttir(k._silu_and_mul_kernel, delta | dict(BLOCK=1024), types)
"""


def test_layer_kernels_compile_for_cuda_with_and_without_a_pending_delta(compile_for_cuda):
    compile_for_cuda(LAYERS_SCRIPT)
