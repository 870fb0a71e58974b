"""Fused layer kernels (RMSNorm + residual, rotary, SiLU-and-mul) against the references of
punica.ops.layers on fresh random inputs: odd sizes, token counts from 1, strided views; RMSNorm
and SiLU-and-mul with a pending LoRA delta on their input against add_delta before the reference.

Without a GPU the kernels run under Triton's interpreter (tests/conftest.py) on CPU tensors at
small shapes; tests marked `cuda` run at real shapes on the GPU through the public functions.
"""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from punica.ops import layers as ops
from punica.ops import layers_triton as kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (rtol, atol): bf16/fp16 outputs within ~2.5 units in the last place (the interpreter truncates
# where torch rounds, and a norm rounds twice); fp32 within reduction-order noise
TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (2e-2, 1e-5), torch.float16: (3e-3, 1e-5)}


def added(y, delta):
    """A copy of y with the pending delta added by add_delta (the reference on a CPU)."""
    y = y.clone()
    delta.add_to(y)
    return y


def randn(*shape, gen, dtype, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def assert_close(got, expect, rounded_to=None):
    """Within TOL of the narrowest dtype the values were rounded to (default: their own)."""
    assert got.dtype == expect.dtype and got.shape == expect.shape, (got.dtype, expect.dtype, got.shape)
    rtol, atol = TOL[rounded_to or expect.dtype]
    torch.testing.assert_close(got, expect, rtol=rtol, atol=atol)


# ---- RMSNorm --------------------------------------------------------------------------

def rms_inputs(num_tokens, hidden, dtype, seed, row_stride_pad=0):
    """x as a column slice of a wider tensor when row_stride_pad > 0 (rows not contiguous);
    rows at very different scales, some so small that eps matters."""
    gen = torch.Generator().manual_seed(seed)
    x = randn(num_tokens, hidden + row_stride_pad, gen=gen, dtype=dtype)[:, :hidden]
    scales = torch.logspace(-3, 1, num_tokens, dtype=torch.float32) if num_tokens > 1 else torch.ones(1)
    x = (x.float() * scales[:, None].to(DEVICE)).to(dtype)
    residual = randn(num_tokens, hidden, gen=gen, dtype=dtype)
    weight = (1 + randn(hidden, gen=gen, dtype=torch.float32, scale=0.3)).to(dtype)
    return x, residual, weight


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,hidden", [(1, 64), (3, 333), (17, 72), (5, 1), (2, 4097)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, num_tokens, hidden, with_residual):
    x, residual, weight = rms_inputs(num_tokens, hidden, dtype, seed=num_tokens * hidden, row_stride_pad=3)
    eps = 1e-5
    if with_residual:
        out, new_residual = kernels.rms_norm_triton(x, weight, eps, residual)
        assert_close(new_residual, x + residual)
        if dtype != torch.bfloat16:  # the interpreter truncates the bf16 sum, torch rounds it
            assert torch.equal(new_residual, x + residual)
        # the norm of the sum it carries on (1 ulp of truncation in the sum would compound)
        expect = ops.rms_norm_ref(new_residual, weight, eps)
    else:
        out, expect = kernels.rms_norm_triton(x, weight, eps), ops.rms_norm_ref(x, weight, eps)
    assert_close(out, expect)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_long_rows_loop_over_blocks(dtype, with_residual):
    """Rows longer than the per-program block: the two-pass loop, a ragged last block."""
    x, residual, weight = rms_inputs(6, 333, dtype, seed=7)
    eps = 1e-6
    residual = residual if with_residual else None
    got = kernels.rms_norm_triton(x, weight, eps, residual, max_row_block=64)
    if with_residual:
        assert_close(got[1], x + residual)
        assert_close(got[0], ops.rms_norm_ref(got[1], weight, eps))
    else:
        assert_close(got, ops.rms_norm_ref(x, weight, eps))


def test_rms_norm_eps_and_weight_dtype():
    """eps dominates rows of tiny values; an fp32 weight on bf16 rows gives fp32 out (promotion)."""
    gen = torch.Generator().manual_seed(0)
    x = randn(4, 40, gen=gen, dtype=torch.bfloat16, scale=1e-3)
    weight = 1 + randn(40, gen=gen, dtype=torch.float32, scale=0.3)
    for eps in (1e-6, 1e-4):
        got, expect = kernels.rms_norm_triton(x, weight, eps), ops.rms_norm_ref(x, weight, eps)
        assert got.dtype == torch.float32
        assert_close(got, expect, rounded_to=torch.bfloat16)  # the normalised row is bf16
    assert not torch.allclose(ops.rms_norm_ref(x, weight, 1e-6), ops.rms_norm_ref(x, weight, 1e-4), rtol=0.1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_rms_norm_reference_is_hf_llama_and_residual_is_folded_add(dtype):
    """The spec is HF's LlamaRMSNorm bit for bit; with a residual it is the norm of x + residual."""
    x, residual, weight = rms_inputs(9, 48, dtype, seed=1)
    x, residual, weight = x.cpu(), residual.cpu(), weight.cpu()
    hf = LlamaRMSNorm(48, eps=1e-5).to(dtype)
    hf.weight.data.copy_(weight)
    with torch.no_grad():
        assert torch.equal(ops.rms_norm_ref(x, weight, 1e-5), hf(x))
        normed, summed = ops.rms_norm_ref(x, weight, 1e-5, residual)
        assert torch.equal(summed, x + residual) and torch.equal(normed, hf(x + residual))


# ---- rotary ---------------------------------------------------------------------------

def rope_inputs(num_tokens, num_heads, num_kv_heads, head_dim, dtype, seed, max_position=4096):
    """q, k, v as views of one fused qkv row (as the model has them); cos/sin of random positions."""
    gen = torch.Generator().manual_seed(seed)
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, gen=gen, dtype=dtype)
    q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    q = qkv[:, :q_end].view(num_tokens, num_heads, head_dim)
    k = qkv[:, q_end:k_end].view(num_tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, max_position, (num_tokens,), generator=gen)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return qkv, q, k, freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)


def check_rope(num_tokens, num_heads, num_kv_heads, head_dim, dtype, seed, rope_fn):
    qkv, q, k, cos, sin = rope_inputs(num_tokens, num_heads, num_kv_heads, head_dim, dtype, seed)
    before = qkv.clone()
    expect_q, expect_k = ops.rope_ref(q, k, cos, sin)
    rope_fn(q, k, cos, sin)
    assert_close(q, expect_q)
    assert_close(k, expect_k)
    v_start = (num_heads + num_kv_heads) * head_dim
    assert torch.equal(qkv[:, v_start:], before[:, v_start:])  # v untouched
    assert not torch.equal(qkv[:, :v_start], before[:, :v_start])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,num_heads,num_kv_heads,head_dim", [
    (1, 4, 4, 16),    # one token, no GQA
    (5, 6, 2, 64),    # GQA 3, head blocks ragged for k
    (33, 3, 1, 20),   # half head_dim 10: not a power of 2
    (4, 1, 3, 8),     # more kv heads than q heads (the kernel takes either)
])
def test_rope_matches_reference_in_place(dtype, num_tokens, num_heads, num_kv_heads, head_dim):
    check_rope(num_tokens, num_heads, num_kv_heads, head_dim, dtype, seed=num_tokens + head_dim,
               rope_fn=kernels.rope_triton_)


def test_rope_public_function_on_cpu_is_the_reference_in_place():
    check_rope(7, 4, 2, 16, torch.bfloat16, seed=3, rope_fn=ops.rope_)


# ---- SiLU-and-mul ---------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's exp(200)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,inter", [(1, 96), (4, 1), (19, 200), (3, 131)])
def test_silu_and_mul_matches_reference(dtype, num_tokens, inter):
    gen = torch.Generator().manual_seed(num_tokens * inter)
    wide = randn(num_tokens, 2 * inter + 5, gen=gen, dtype=dtype, scale=4.0)
    gate_up = wide[:, :2 * inter]  # rows not contiguous
    gate_up[0, :2] = torch.tensor([-200.0, 90.0], dtype=dtype)  # exp(-gate) overflows; a huge value
    assert_close(kernels.silu_and_mul_triton(gate_up), ops.silu_and_mul_ref(gate_up))


# ---- a pending LoRA delta -------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)  # the interpreter truncates bf16
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dora", [False, True])
@pytest.mark.parametrize("max_row_block", [kernels.MAX_ROW_BLOCK, 64])
def test_rms_norm_adds_a_pending_delta_as_add_delta_does(dtype, with_residual, dora, max_row_block, pending_delta):
    """The kernel's input after the delta is add_delta's output bit for bit (the residual sum shows
    it); x itself is left as it was."""
    x, residual, weight = rms_inputs(11, 333, dtype, seed=5)
    delta = pending_delta(11, 333, torch.Generator().manual_seed(6), dora)
    before = x.clone()
    expect = ops.rms_norm_ref(added(x, delta), weight, 1e-5, residual if with_residual else None)
    got = kernels.rms_norm_triton(x, weight, 1e-5, residual if with_residual else None, max_row_block, delta=delta)
    assert torch.equal(x, before)
    if with_residual:
        assert torch.equal(got[1], expect[1])
        got, expect = got[0], expect[0]
    assert_close(got, expect)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("dora", [False, True])
def test_silu_and_mul_adds_a_pending_delta_as_add_delta_does(dtype, dora, pending_delta):
    gen = torch.Generator().manual_seed(9)
    gate_up = randn(7, 2 * 131 + 5, gen=gen, dtype=dtype, scale=3.0)[:, :2 * 131]
    delta = pending_delta(7, 2 * 131, gen, dora)
    before = gate_up.clone()
    got = kernels.silu_and_mul_triton(gate_up, delta)
    assert torch.equal(gate_up, before)
    assert_close(got, ops.silu_and_mul_ref(added(gate_up, delta)))


@pytest.mark.parametrize("dora", [False, True])
def test_public_ops_on_cpu_add_a_pending_delta_first(dora, pending_delta):
    """On the CPU the public functions add the delta in place (add_delta), then run the reference;
    GeLU-and-mul takes one too."""
    gen = torch.Generator().manual_seed(3)
    x, residual, weight = rms_inputs(6, 64, torch.float32, seed=3)
    delta = pending_delta(6, 64, gen, dora)
    expect = ops.rms_norm_ref(added(x, delta), weight, 1e-5, residual)
    got = ops.rms_norm(x.clone(), weight, 1e-5, residual, delta=delta)
    assert torch.equal(got[0], expect[0]) and torch.equal(got[1], expect[1])
    gate_up = randn(6, 128, gen=gen, dtype=torch.float32)
    delta = pending_delta(6, 128, gen, dora)
    assert torch.equal(ops.silu_and_mul(gate_up.clone(), delta), ops.silu_and_mul_ref(added(gate_up, delta)))
    assert torch.equal(ops.gelu_tanh_and_mul(gate_up.clone(), delta),
                       ops.gelu_tanh_and_mul(added(gate_up, delta)))


# ---- GPU: real shapes, public functions, CUDA graphs ------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("hidden", [4096, 5120, 8192])
@pytest.mark.parametrize("num_tokens", [1, 32, 4096])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_real_shapes_rms_norm(hidden, num_tokens, dtype):
    x, residual, weight = rms_inputs(num_tokens, hidden, dtype, seed=hidden + num_tokens)
    assert_close(ops.rms_norm(x, weight, 1e-5), ops.rms_norm_ref(x, weight, 1e-5))
    got, expect = ops.rms_norm(x, weight, 1e-5, residual), ops.rms_norm_ref(x, weight, 1e-5, residual)
    assert torch.equal(got[1], expect[1])  # the GPU rounds the sum as torch does
    assert_close(got[0], expect[0])


@pytest.mark.cuda
@pytest.mark.parametrize("num_tokens", [1, 32, 300])
@pytest.mark.parametrize("dora", [False, True])
def test_real_shapes_pending_delta(num_tokens, dora, pending_delta):
    """bf16 on the GPU: the norm's input and SiLU's operands after the delta are add_delta's bit for
    bit (the residual sum, and the activation of an exact input, show it)."""
    gen = torch.Generator().manual_seed(num_tokens)
    x, residual, weight = rms_inputs(num_tokens, 4096, torch.bfloat16, seed=num_tokens)
    delta = pending_delta(num_tokens, 4096, gen, dora)
    got = ops.rms_norm(x, weight, 1e-5, residual, delta=delta)
    expect = ops.rms_norm_ref(added(x, delta), weight, 1e-5, residual)
    assert torch.equal(got[1], expect[1])
    assert_close(got[0], expect[0])
    gate_up = randn(num_tokens, 2 * 11008, gen=gen, dtype=torch.bfloat16, scale=3.0)
    delta = pending_delta(num_tokens, 2 * 11008, gen, dora)
    assert torch.equal(ops.silu_and_mul(gate_up, delta), ops.silu_and_mul(added(gate_up, delta)))


@pytest.mark.cuda
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(32, 32, 128), (40, 40, 128), (64, 8, 128)])
@pytest.mark.parametrize("num_tokens", [1, 32, 4096])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_real_shapes_rope(num_heads, num_kv_heads, head_dim, num_tokens, dtype):
    check_rope(num_tokens, num_heads, num_kv_heads, head_dim, dtype, seed=num_heads + num_tokens,
               rope_fn=ops.rope_)


@pytest.mark.cuda
@pytest.mark.parametrize("inter", [11008, 13824, 28672])
@pytest.mark.parametrize("num_tokens", [1, 32, 4096])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_real_shapes_silu_and_mul(inter, num_tokens, dtype):
    gen = torch.Generator().manual_seed(inter + num_tokens)
    gate_up = randn(num_tokens, 2 * inter, gen=gen, dtype=dtype, scale=3.0)
    assert_close(ops.silu_and_mul(gate_up), ops.silu_and_mul_ref(gate_up))


@pytest.mark.cuda
def test_cuda_graph_replay_equals_reference(capture_graph):
    """One decode layer's elementwise chain captured once, replayed on new inputs."""
    dtype, num_tokens, hidden, inter = torch.bfloat16, 32, 4096, 11008
    gen = torch.Generator().manual_seed(0)
    x, residual, weight = rms_inputs(num_tokens, hidden, dtype, seed=0)
    _, q, k, cos, sin = rope_inputs(num_tokens, 32, 8, 128, dtype, seed=0)
    gate_up = randn(num_tokens, 2 * inter, gen=gen, dtype=dtype)

    def chain():
        normed, summed = ops.rms_norm(x, weight, 1e-5, residual)
        ops.rope_(q, k, cos, sin)
        return normed, summed, ops.silu_and_mul(gate_up)

    graph, outs = capture_graph(chain)
    for _ in range(3):
        for t in (x, residual, q, k, gate_up):
            t.copy_(torch.randn(t.shape, generator=gen).to(dtype))
        positions = torch.randint(0, 4096, (num_tokens,), generator=gen).float()
        freqs = positions[:, None] * (1.0 / 10000.0 ** (torch.arange(0, 128, 2) / 128))[None, :]
        cos.copy_(freqs.cos())
        sin.copy_(freqs.sin())
        expect_normed, expect_summed = ops.rms_norm_ref(x, weight, 1e-5, residual)
        expect_q, expect_k = ops.rope_ref(q, k, cos, sin)
        expect_act = ops.silu_and_mul_ref(gate_up)
        graph.replay()
        for got, expect in zip(outs + (q, k), (expect_normed, expect_summed, expect_act, expect_q, expect_k)):
            assert_close(got, expect)
