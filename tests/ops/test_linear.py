"""The skinny GEMM (punica.ops.linear_triton) against F.linear on fresh random inputs: token counts
up to MAX_SKINNY_TOKENS, odd N and K, K slices that do and do not divide K, bias, strided rows.

Without a GPU the kernel runs under Triton's interpreter (tests/ops/conftest.py) on CPU tensors;
tests marked `cuda` run the public op at a 7B model's shapes on the GPU.
"""

import pytest
import torch
import torch.nn.functional as F

from punica.ops import linear as ops
from punica.ops.linear_tiles import MAX_SKINNY_TOKENS, Tile, skinny_tile
from punica.ops.linear_triton import skinny_linear_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3)}


def reference(x, weight, bias):
    """F.linear in fp32 on the same (rounded) operands, rounded once to x's dtype."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


@pytest.mark.parametrize("tokens,n,k,tile", [
    (1, 40, 96, Tile(16, 32, 1, 4, 1)),     # N past the last full tile, K past the last full step
    (5, 33, 160, Tile(16, 32, 3, 4, 1)),    # 3 K slices of 64, the last short
    (17, 64, 256, Tile(32, 64, 2, 4, 1)),   # 2 K slices that divide K (no K mask)
    (32, 48, 64, Tile(16, 16, 1, 4, 1)),    # one K step per program
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_kernel_matches_reference(tokens, n, k, tile, dtype, with_bias):
    gen = torch.Generator().manual_seed(tokens * 1000 + n)
    x = torch.randn(tokens, k, generator=gen).to(dtype).to(DEVICE)
    weight = (torch.randn(n, k, generator=gen) * 0.1).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if with_bias else None
    out = skinny_linear_triton(x, weight, bias, tile)
    assert out.dtype == dtype and out.shape == (tokens, n)
    torch.testing.assert_close(out, reference(x, weight, bias), rtol=TOL[dtype][0], atol=TOL[dtype][1])


def test_skinny_kernel_reads_strided_rows():
    """x as every other row of a wider tensor (rows strided, K contiguous)."""
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(6, 2, 80, generator=gen).to(DEVICE)
    x = wide[:, 1]
    weight = torch.randn(24, 80, generator=gen).to(DEVICE)
    out = skinny_linear_triton(x, weight, None, Tile(16, 32, 2, 4, 1))
    torch.testing.assert_close(out, reference(x, weight, None), rtol=1e-5, atol=1e-5)


def test_skinny_tile_only_for_few_half_precision_rows_of_large_weights():
    for n, k in [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008), (32000, 4096)]:
        for dtype in (torch.bfloat16, torch.float16):
            assert skinny_tile(1, n, k, dtype) is not None and skinny_tile(MAX_SKINNY_TOKENS, n, k, dtype) is not None
            assert skinny_tile(MAX_SKINNY_TOKENS + 1, n, k, dtype) is None
        assert skinny_tile(1, n, k, torch.float32) is None
    assert skinny_tile(1, 576, 576, torch.bfloat16) is None


@pytest.mark.parametrize("rows", [0, 1, 2, 8, 9, 12, ops.MAX_CPU_SKINNY_ROWS, ops.MAX_CPU_SKINNY_ROWS + 1, 33])
def test_linear_on_cpu_is_f_linear(rows):
    """Exactly F.linear past MAX_CPU_SKINNY_ROWS fp32 rows (and in bf16); up to it, W @ x^T: F.linear
    up to the summation order, with and without bias."""
    gen = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 200, generator=gen), torch.randn(70, 200, generator=gen)
    bias = torch.randn(70, generator=gen)
    for b in (None, bias):
        out = ops.linear(x, weight, b)
        assert out.shape == (rows, 70) and out.dtype == torch.float32 and out.is_contiguous()
        if rows > ops.MAX_CPU_SKINNY_ROWS:
            assert torch.equal(out, F.linear(x, weight, b))
        else:
            torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
        half = x.bfloat16(), weight.bfloat16(), None if b is None else b.bfloat16()
        assert torch.equal(ops.linear(*half), F.linear(*half))


def test_one_cpu_row_runs_as_the_first_of_two_equal_rows():
    gen = torch.Generator().manual_seed(3)
    x, weight = torch.randn(1, 64, generator=gen), torch.randn(48, 64, generator=gen)
    assert torch.equal(ops.linear(x, weight), ops.linear(x.repeat(2, 1), weight)[:1])


@pytest.mark.parametrize("rows", [9, 12, 15])
def test_cpu_rows_past_a_block_run_as_the_first_of_sixteen(rows):
    """9 to 16 rows run as 16 columns (zero rows after x's): the rows of x padded to 16, exactly."""
    gen = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 64, generator=gen), torch.randn(48, 64, generator=gen)
    assert [ops.cpu_skinny_columns(n) for n in (1, 2, 8, 9, 16)] == [2, 2, 8, 16, 16]
    assert torch.equal(ops.linear(x, weight), ops.linear(F.pad(x, (0, 0, 0, 16 - rows)), weight)[:rows])


needs_packing = pytest.mark.skipif(not ops.cpu_packing_available(), reason="no oneDNN fp32 reorder on this CPU")


class CountedPacking(ops.PackedWeight):
    """A PackedWeight that counts the times `linear` asks it for the reordered weight."""

    def __init__(self, weight):
        self.calls = 0
        super().__init__(weight)

    def of(self, weight):
        self.calls += 1
        return super().of(weight)


@needs_packing
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 8, 9, 16, 17, 64])
def test_packed_weight_runs_rows_from_four(rows):
    """From MIN_CPU_PACKED_ROWS fp32 rows the packed weight computes F.linear (up to the summation
    order), with and without bias, on strided rows too; fewer rows take the unpacked path exactly."""
    gen = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 400, generator=gen)[:, ::2], torch.randn(70, 200, generator=gen)
    bias = torch.randn(70, generator=gen)
    packed = CountedPacking(weight)
    for b in (None, bias):
        calls = packed.calls
        out = ops.linear(x, weight, b, packed)
        assert out.shape == (rows, 70) and out.dtype == torch.float32 and out.is_contiguous()
        assert packed.calls == calls + (rows >= ops.MIN_CPU_PACKED_ROWS)
        if rows < ops.MIN_CPU_PACKED_ROWS:
            assert torch.equal(out, ops.linear(x, weight, b))
        else:
            torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


@needs_packing
def test_a_product_that_autograd_records_leaves_the_packed_weight_alone():
    gen = torch.Generator().manual_seed(7)
    x, weight = torch.randn(6, 64, generator=gen, requires_grad=True), torch.randn(48, 64, generator=gen)
    packed = CountedPacking(weight)
    calls = packed.calls
    ops.linear(x, weight, None, packed).sum().backward()
    assert packed.calls == calls
    torch.testing.assert_close(x.grad, weight.sum(0).expand(6, -1))


@needs_packing
def test_packed_weight_follows_the_weight():
    """Written in place, or another tensor given: the packed copy is made again from the weight as
    it is, so no step computes with a stale copy."""
    gen = torch.Generator().manual_seed(5)
    x, weight = torch.randn(6, 64, generator=gen), torch.randn(48, 64, generator=gen)
    packed = ops.PackedWeight(weight)
    torch.testing.assert_close(ops.linear(x, weight, None, packed), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    weight.mul_(-2.0)
    torch.testing.assert_close(ops.linear(x, weight, None, packed), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    other = torch.randn(48, 64, generator=gen)
    torch.testing.assert_close(ops.linear(x, other, None, packed), F.linear(x, other), rtol=1e-5, atol=1e-5)


@needs_packing
def test_a_packed_linear_pickles_and_copies_without_its_reordered_copy():
    """Pickled (a Ray worker's model) or deep-copied, a packed Linear computes as before: the opaque
    oneDNN copy is left out and made again at its first use."""
    import copy
    import pickle

    from punica.models.quantized import Linear

    gen = torch.Generator().manual_seed(6)
    layer = Linear(64, 48)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(48, 64, generator=gen))
        layer.bias.copy_(torch.randn(48, generator=gen))
    layer.pack_cpu()
    x = torch.randn(5, 64, generator=gen)
    expected = F.linear(x, layer.weight, layer.bias)
    layer.packed.few_rows = ("mkl", "packed", "skinny")
    for other in (pickle.loads(pickle.dumps(layer)), copy.deepcopy(layer)):
        assert other.packed is not None and other.packed._packed is None
        assert other.packed.few_rows == ("mkl", "packed", "skinny")
        with torch.no_grad():
            torch.testing.assert_close(other(x), expected, rtol=1e-5, atol=1e-5)
        assert other.packed._packed is not None


# ---- GPU, a 7B model's shapes -------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("n,k", [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008), (32000, 4096)])
@pytest.mark.parametrize("tokens", [1, 2, 8, 16, 17])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_real_shapes_through_public_op(n, k, tokens, dtype):
    """The skinny kernel up to MAX_SKINNY_TOKENS rows, cuBLAS beyond: the same function."""
    gen = torch.Generator(device="cuda").manual_seed(n + k + tokens)
    x = torch.randn(tokens, k, device="cuda", generator=gen).to(dtype)
    weight = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(dtype)
    bias = torch.randn(n, device="cuda", generator=gen).to(dtype)
    out = ops.linear(x, weight, bias)
    expect = reference(x, weight, bias)
    assert out.isfinite().all()
    assert ((out.float() - expect.float()).norm() / expect.float().norm()).item() < 1e-2


@pytest.mark.cuda
@pytest.mark.parametrize("tile", [Tile(16, 256, 1, 4, 4), Tile(32, 256, 2, 4, 4), Tile(64, 128, 1, 4, 4),
                                  Tile(16, 512, 1, 4, 3)], ids=str)
@pytest.mark.parametrize("n,k", [(12288, 4096), (4096, 11008)])
@pytest.mark.parametrize("tokens", [1, 32])
def test_real_shapes_each_tile(tile, n, k, tokens):
    """The kernel itself at a 7B model's shapes, whichever tile punica.ops.linear_tiles picks."""
    gen = torch.Generator(device="cuda").manual_seed(n + tokens)
    x = torch.randn(tokens, k, device="cuda", generator=gen).to(torch.bfloat16)
    weight = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    out = skinny_linear_triton(x, weight, None, tile)
    expect = reference(x, weight, None)
    assert ((out.float() - expect.float()).norm() / expect.float().norm()).item() < 1e-2


@needs_packing
@pytest.mark.parametrize("path", ops.FEW_ROWS_PATHS)
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_each_few_rows_path_computes_f_linear(path, rows):
    """A packed weight's `few_rows` path for its row count computes F.linear (up to the summation
    order), with and without bias, on strided rows too; only "packed" reads the packed copy."""
    gen = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 400, generator=gen)[:, ::2], torch.randn(70, 200, generator=gen)
    bias = torch.randn(70, generator=gen)
    packed = CountedPacking(weight)
    other = next(p for p in ops.FEW_ROWS_PATHS if p != path)  # what the other row counts would run
    packed.few_rows = tuple(path if r == rows else other for r in range(1, ops.MIN_CPU_PACKED_ROWS))
    for b in (None, bias):
        calls = packed.calls
        out = ops.linear(x, weight, b, packed)
        assert out.shape == (rows, 70) and out.is_contiguous()
        assert packed.calls == calls + (path == "packed")
        torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


@needs_packing
def test_few_rows_paths_are_chosen_per_shape_and_row_count_by_their_times():
    """Each shape takes, at each row count, the path its times there make fastest, on every weight
    of that shape; a shape already chosen keeps its paths untimed, and one of few bytes keeps W @
    x^T untimed."""
    big = ops.MIN_TIMED_BYTES // (4 * 64 * 2) + 1  # rows of two [big, 64] fp32 weights past MIN_TIMED_BYTES
    fast = {"skinny": {"skinny": 1.0, "mkl": 2.0, "packed": 3.0}, "mkl": {"skinny": 3.0, "mkl": 1.0, "packed": 2.0},
            "packed": {"skinny": 3.0, "mkl": 2.0, "packed": 1.0}}
    shapes = {(big, 64): ("mkl", "mkl", "packed"), (64, big): ("packed", "skinny", "mkl"),
              (big + 1, 64): ("skinny",) * 3, (8, 64): ("mkl",) * 3}
    linears = [(w, ops.PackedWeight(w)) for shape in shapes for w in (torch.zeros(shape), torch.zeros(shape))]
    timed = []

    def path_times(group):
        timed.append(tuple(group[0][0].shape))
        return [fast[path] for path in shapes[timed[-1]]]

    chosen = {(big + 1, 64): ("packed", "packed", "mkl")}
    paths = ops.choose_few_rows_paths(linears, path_times, chosen)
    assert paths == {(big, 64): ("mkl", "mkl", "packed"), (64, big): ("packed", "skinny", "mkl"),
                     (big + 1, 64): ("packed", "packed", "mkl"), (8, 64): ("skinny",) * 3}
    assert timed == [(big, 64), (64, big)]
    assert chosen == {shape: paths[shape] for shape in [(big, 64), (64, big), (big + 1, 64)]}
    assert all(packed.few_rows == paths[tuple(w.shape)] for w, packed in linears)


@needs_packing
def test_few_rows_path_times_times_every_path_at_every_few_row_count():
    """A clock that ticks once a call: each path's time at each row count under MIN_CPU_PACKED_ROWS
    is one pass (the fastest of TIMING_ROUNDS after a warm-up pass)."""
    ticks = iter(range(10_000))
    group = [(w, ops.PackedWeight(w)) for w in (torch.randn(16, 8), torch.randn(16, 8))]
    times = ops.few_rows_path_times(group, clock=lambda: float(next(ticks)))
    assert times == [dict.fromkeys(ops.FEW_ROWS_PATHS, 1.0)] * (ops.MIN_CPU_PACKED_ROWS - 1)
    # a start and an end a timed pass, a start for the warm-up
    assert next(ticks) == len(ops.FEW_ROWS_PATHS) * (ops.MIN_CPU_PACKED_ROWS - 1) * (2 * ops.TIMING_ROUNDS + 1)
