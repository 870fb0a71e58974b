"""The check that Triton kernels compile for a CUDA target (Hopper) on a machine without a GPU:
Triton's front end (Python AST to TTIR) runs on the CPU. The interpreter the other CPU tests use
accepts code the compiler rejects (a global that is not constexpr, say), so this is the CPU's one
check of what the GPU would compile. Also a LoRA delta pending on a kernel's input, for the
kernels that add one."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from punica.ops.layers import PendingDelta

# what every compile script starts with: the CUDA backend (exit 77 where this Triton build has
# none), and compile_ttir(fn, consts, types): fn to TTIR with the constexprs `consts`, every other
# argument of the Triton type types(name, consts) ("*bf16", "i32", ...)
PREAMBLE = '''
import sys
try:
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    backend = make_backend(GPUTarget("cuda", 90, 32))
except Exception as e:
    print(f"no CUDA backend: {e!r}")
    sys.exit(77)


def compile_ttir(fn, consts, types):
    signature, constexprs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            signature[name], constexprs[(i,)] = "constexpr", consts[name]
        else:
            signature[name] = types(name, consts)
    options = backend.parse_options({})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    ASTSource(fn=fn, signature=signature, constexprs=constexprs).make_ir(
        backend.target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)
'''


def compile_for_cuda(script: str) -> None:
    """Run `script` (compile_ttir calls) after PREAMBLE in a fresh Python without the interpreter;
    skip where Triton has no CUDA backend, fail on any error."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    code = PREAMBLE + textwrap.dedent(script) + '\nprint("compiled")\n'
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env | {"PYTHONPATH": str(root)},
                          capture_output=True, text=True, timeout=300)
    if done.returncode == 77:
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


@pytest.fixture(scope="session", name="compile_for_cuda")
def compile_for_cuda_fixture():
    """The function `compile_for_cuda(script)`: see its docstring."""
    return compile_for_cuda


def pending_delta(num_tokens: int, width: int, gen: torch.Generator, dora: bool) -> PendingDelta:
    """A PendingDelta on [num_tokens, width] (on the GPU where there is one): 4 slots, rows of slot
    -1 (their d is 0, as bgmv_delta writes it), and with `dora` slots 1 and 3 DoRA slots."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    d = (torch.randn(num_tokens, width, generator=gen) * 0.5).to(device)
    token_slots = torch.tensor([(t % 5) - 1 for t in range(num_tokens)], dtype=torch.int32, device=device)
    d[token_slots < 0] = 0
    scales = None
    if dora:
        out_scales = (1 + 0.2 * torch.randn(4, width, generator=gen)).to(device)
        scales = (out_scales, torch.tensor([0, 1, 0, 1], dtype=torch.int32, device=device))
    return PendingDelta(d, token_slots, scales)


@pytest.fixture(scope="session", name="pending_delta")
def pending_delta_fixture():
    """The function `pending_delta(num_tokens, width, gen, dora)`: see its docstring."""
    return pending_delta
