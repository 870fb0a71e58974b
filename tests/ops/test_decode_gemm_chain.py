"""benchmarks.decode_gemm_chain's chain on the CPU: every path computes the chain of layers that an
fp32 product over the dequantized weights computes, each GEMM on the first K columns of the last."""

import torch

from benchmarks.decode_gemm_chain import PATHS, chain, make_layers
from punica.ops.fp8 import dequantize

SHAPES = {"qkv": (96, 32), "o": (32, 64), "gate_up": (128, 32), "down": (32, 64)}


def test_every_path_computes_the_chain():
    torch.manual_seed(0)
    ks = [k for _, k in SHAPES.values()]
    layers = make_layers(SHAPES, 3, torch.device("cpu"))
    x0 = torch.randn(5, ks[0], dtype=torch.bfloat16)
    expect = x0.float()
    for layer in layers:
        for weights, k in zip(layer, ks):
            expect = expect[:, :k] @ dequantize(weights["fp8"], weights["scales"], None, torch.float32).T
    assert expect.shape == (5, SHAPES["down"][0]) and expect.abs().max() > 0.1
    # over 12 GEMMs: bf16 outputs (the interpreter's Triton kernels truncate to bf16), and the W8A8
    # GEMM's activations in e4m3 (3 mantissa bits) at every GEMM
    for name, path in PATHS.items():
        got = chain(path, x0, layers, ks)().float()
        error = ((got - expect).abs().max() / expect.abs().max()).item()
        assert error < (0.2 if name == "w8a8" else 0.05), (name, error)
