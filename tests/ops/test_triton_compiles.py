"""The paged-attention and KV-append kernels compile for a CUDA target (Hopper) in every variant
(an fp8 cache's too), on a machine without a GPU: Triton's front end (Python AST to TTIR) runs
on the CPU. The interpreter the other CPU tests use accepts code the compiler rejects (a global
that is not constexpr, say), so this is the CPU's one check of what the GPU would compile."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent('''
    import sys
    try:
        from triton._C.libtriton import ir
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.compiler.compiler import make_backend
        backend = make_backend(GPUTarget("cuda", 90, 32))
    except Exception as e:  # no CUDA backend in this Triton build
        print(f"no CUDA backend: {e!r}")
        sys.exit(77)
    from punica.ops import attention_triton as k
    from punica.ops import kv_append_triton as append

    INT_POINTERS = {"page_table", "context_lens", "query_start"}

    def compile_ttir(fn, floats, consts):
        signature, constexprs = {}, {}
        for i, name in enumerate(fn.arg_names):
            if name in consts:
                signature[name], constexprs[(i,)] = "constexpr", consts[name]
            elif name in floats:
                signature[name] = "fp32"
            elif name in INT_POINTERS:
                signature[name] = "*i32"
            elif name == "slot_mapping":
                signature[name] = "*i64"
            elif name.startswith(("stride", "num_", "group", "window", "partition", "half")):
                signature[name] = "i32"
            elif name == "kv":
                signature[name] = "*fp8e4nv" if consts.get("FP8") else "*bf16"
            else:
                signature[name] = "*bf16" if name in ("q", "k", "v", "out") else "*fp32"
        options = backend.parse_options({})
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        ASTSource(fn=fn, signature=signature, constexprs=constexprs).make_ir(
            backend.target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)

    common = dict(HEAD_DIM=128, PAGE_SIZE=16, BLOCK_N=64, UPCAST=False, PRECISION="tf32")
    for sliding, softcap, fp8 in ((False, False, False), (False, True, False), (True, False, False),
                                  (True, True, False), (False, False, True), (True, True, True)):
        flags = dict(SLIDING=sliding, SOFTCAP=softcap, FP8=fp8)
        for split in (False, True):
            compile_ttir(k.prefill_kernel, {"qk_scale", "softcap"},
                         common | flags | dict(BLOCK_M=128, MAX_PREFILLS=16, SPLIT=split))
        for single in (False, True):
            compile_ttir(k.decode_partition_kernel, {"qk_scale", "softcap"},
                         common | flags | dict(BLOCK_G=16, SINGLE_SPLIT=single))
        compile_ttir(k.decode_merge_kernel, set(), dict(HEAD_DIM=128, BLOCK_S=4, SLIDING=sliding))
    compile_ttir(k.prefill_merge_kernel, set(), dict(HEAD_DIM=128, BLOCK_S=16))
    for fp8 in (False, True):
        compile_ttir(append._write_kv_kernel, set(), dict(HEAD_DIM=128, PAGE_SIZE=16, BLOCK_H=8, FP8=fp8, EXACT=False))
        compile_ttir(append._rope_and_write_kv_kernel, set(), dict(PAGE_SIZE=16, BLOCK_H=8, BLOCK_D=64, FP8=fp8,
                                                                            EXACT=False))
    print("compiled")
''')


def test_attention_kernels_compile_for_cuda_in_every_variant():
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=root, env=env | {"PYTHONPATH": str(root)},
                          capture_output=True, text=True, timeout=300)
    if done.returncode == 77:
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
