"""The base projections' GEMM: x @ W^T + bias, with decode's few-row case on a skinny kernel.

`linear(x, weight, bias, packed)` = F.linear(x, weight, bias), its reference and the path of every
case but four:
* on CUDA, a bf16/fp16 x of at most MAX_SKINNY_TOKENS rows whose shape gets a tile from
  punica.ops.linear_tiles.skinny_tile runs punica.ops.linear_triton's kernel (fp32 accumulation,
  one rounding to x's dtype, as cuBLAS's). The choice depends on shapes and dtypes only, so a
  captured CUDA graph replays it.
* on a CPU, an fp32 x of at most MAX_CPU_SKINNY_ROWS rows (without a packed weight, or of fewer than
  MIN_CPU_PACKED_ROWS where the packed weight's `few_rows` says so) runs as W @ x^T over
  `cpu_skinny_columns(rows)` columns of x^T: one row as two (the second a copy of the first), 9 to
  16 rows as 16 (zero rows after x's). MKL's F.linear takes its GEMV path at one row, streaming the
  weights at about 10 GB/s on a 2-core AVX-512 CPU, and its GEMM at 2-4 rows is slower still; the
  product with the weight as the left operand streams it at about 18 GB/s at 2-4 columns. That
  product's cost climbs in steps of 8 columns: a second block of 1-7 columns costs more than a whole
  one. The embedded model's four projections over 30 layers, fastest rounds
  (docs/results/cpu_skinny_linear_rows_2026-12-04.log, ..._pad16_2026-12-04.log): 14.1-22.0 ms at
  1-4 rows against 32.7-62.6 (F.linear), 25.4-36.3 at 5-8 rows against 36.5-42.7; at 9-16 rows
  43.6-44.3 ms as 16 columns, against 43.8-51.1 (F.linear) and 43.8-85.1 unpadded; at 17 rows
  F.linear wins. Up to 16 rows covers a CPU step of a few decodes and a prompt chunk at its floor.
* on a CPU, an fp32 x of at least MIN_CPU_PACKED_ROWS rows beside a `PackedWeight` runs through
  oneDNN on the weight reordered once into its blocked layout, where MKL's GEMMs at 5-16 rows take
  about twice what reading the weights takes. The embedded model's four projections over 30 layers,
  fastest of 5 rounds on a 2-core AVX-512 CPU (`python -m benchmarks.cpu_linear`,
  docs/results/cpu_linear_packed_cpu_2026-12-05.json): 15.5-19.4 ms at 3-8 rows against
  20.8-35.9 (W @ x^T), 19.3-25.2 at 9-16 against 45.5-46.6, 40.5 at 32 against 64.8 (F.linear),
  1.95 s at 2,048 rows against 2.22 (222 GFLOP/s).
* on a CPU, an fp32 x of fewer than MIN_CPU_PACKED_ROWS rows beside a `PackedWeight` runs the path
  of FEW_ROWS_PATHS that its `few_rows` names for that row count: W @ x^T ("skinny", above), F.linear
  ("mkl") or the packed copy ("packed"). Which is fastest depends on the CPU and the rows: on the
  2-core AMD EPYC above W @ x^T at 1-2 rows (15.8-16.7 ms against 20.0-22.0 packed and 32.7 or more
  with F.linear) and the packed copy at 3; on a 2-core Intel Xeon with AMX F.linear at 1-3 rows
  (15.7-19.3 ms, against 21.3-23.4 packed and 43.4-44.1 with W @ x^T; the embedded model's lm_head
  2.7-2.9 against 7.7-8.5) and the packed copy from 4 (23.2 against 27.7 with F.linear;
  docs/results/cpu_linear_intel_amx_three_rows_cpu_2026-12-05.json). So `choose_few_rows_paths`
  times the three at each of those row counts over a model's weights of each shape where the engine
  starts (punica.engine.runner) and keeps the fastest for the process; a packed weight is a second
  copy, not a replacement.
Outputs differ from F.linear's by the summation order only.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from punica.ops.linear_tiles import skinny_tile

MAX_CPU_SKINNY_ROWS = 16  # fp32 rows on a CPU that run as W @ x^T (module docstring)
CPU_SKINNY_BLOCK = 8      # columns of W @ x^T whose cost is one step (module docstring)
MIN_CPU_PACKED_ROWS = 4   # fp32 rows on a CPU from which a packed weight runs them (module docstring)
PACKED_ROWS_HINT = 8      # the rows oneDNN picks its blocked layout for: 2-512 give one layout, 1 a slower one
FEW_ROWS_PATHS = ("skinny", "mkl", "packed")  # what fp32 x of fewer than MIN_CPU_PACKED_ROWS rows may run
UNTIMED_FEW_ROWS = ("skinny",) * (MIN_CPU_PACKED_ROWS - 1)  # a path a few-row count before (or without) timing
TIMING_ROUNDS = 3         # passes over a shape's weights that choose_few_rows_paths times per path and row count
MIN_TIMED_BYTES = 16 << 20  # a shape's weights under this many bytes keep W @ x^T untimed (cached: microseconds)
# each shape's path as first timed in this process: every engine of the process computes alike
CHOSEN_PATHS: dict[tuple[int, int], tuple[str, ...]] = {}


def cpu_packing_available() -> bool:
    """Whether this CPU build of torch reorders weights for oneDNN's fp32 GEMM (x86 with AVX2 or
    AVX-512, where it was measured)."""
    return (torch.backends.mkldnn.is_available()
            and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))


class PackedWeight:
    """A CPU fp32 weight [N, K] reordered into oneDNN's blocked layout for `linear`; reordered
    again when the weight it was made from has changed (another tensor, or written in place). A
    pickled or deep-copied one leaves the reordered copy out (an opaque oneDNN tensor has no
    storage to copy) and makes it again at its first use. `few_rows`: the path of FEW_ROWS_PATHS
    that x of each row count under MIN_CPU_PACKED_ROWS runs, at index rows - 1 (W @ x^T until
    choose_few_rows_paths says)."""

    def __init__(self, weight: torch.Tensor):
        assert weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2, weight
        self._key: tuple[int, int] | None = None
        self._packed: torch.Tensor | None = None
        self.few_rows: tuple[str, ...] = UNTIMED_FEW_ROWS
        self.of(weight)

    def of(self, weight: torch.Tensor) -> torch.Tensor:
        """The reordered copy of `weight`, as it is now."""
        key = weight.data_ptr(), weight._version
        if key != self._key:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_ROWS_HINT)
            self._key = key
        return self._packed

    def __getstate__(self) -> dict:
        return {"_key": None, "_packed": None, "few_rows": self.few_rows}


def cpu_skinny_columns(rows: int) -> int:
    """The columns W @ x^T computes for x of `rows` rows on a CPU (module docstring)."""
    return 2 if rows == 1 else rows if rows <= CPU_SKINNY_BLOCK else MAX_CPU_SKINNY_ROWS


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  packed: PackedWeight) -> torch.Tensor:
    """x [T, K] fp32 @ weight^T + bias through oneDNN on the weight's packed copy, whatever T
    (`linear` takes it from MIN_CPU_PACKED_ROWS rows)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed.of(weight), bias, "none", [], "")


def skinny_linear_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, K] fp32 (T <= MAX_CPU_SKINNY_ROWS) @ weight^T + bias as W @ x^T over
    cpu_skinny_columns(T) columns (module docstring)."""
    rows, columns = x.shape[0], cpu_skinny_columns(x.shape[0])
    xt = torch.cat((x, x)) if rows == 1 else F.pad(x, (0, 0, 0, columns - rows))
    # contiguous like F.linear's output (tensor parallelism all-reduces it in place)
    out = torch.mm(weight, xt.t())[:, :rows].t().contiguous()
    return out + bias if bias is not None else out


def few_rows_linear(path: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    packed: PackedWeight) -> torch.Tensor:
    """x [T, K] fp32 of fewer than MIN_CPU_PACKED_ROWS rows @ weight^T + bias by `path` of FEW_ROWS_PATHS."""
    if path == "packed":
        return packed_linear(x, weight, bias, packed)
    if path == "mkl":
        return F.linear(x, weight, bias)
    return skinny_linear_cpu(x, weight, bias)


def few_rows_path_times(group: Sequence[tuple[torch.Tensor, PackedWeight]],
                        clock: Callable[[], float] = time.perf_counter) -> list[dict[str, float]]:
    """Seconds each path of FEW_ROWS_PATHS takes over the weights of `group` (one shape) in turn, at
    each row count under MIN_CPU_PACKED_ROWS (index rows - 1): the fastest of TIMING_ROUNDS passes
    after one that warms."""
    k = group[0][0].shape[1]
    times: list[dict[str, float]] = []
    for rows in range(1, MIN_CPU_PACKED_ROWS):
        x = torch.ones(rows, k)  # the values do not change the time
        times.append({})
        for path in FEW_ROWS_PATHS:
            fastest = math.inf
            for round_ in range(TIMING_ROUNDS + 1):
                start = clock()
                for weight, packed in group:
                    few_rows_linear(path, x, weight, None, packed)
                if round_:
                    fastest = min(fastest, clock() - start)
            times[-1][path] = fastest
    return times


def choose_few_rows_paths(linears: Sequence[tuple[torch.Tensor, PackedWeight]],
                          path_times: Callable[[Sequence[tuple[torch.Tensor, PackedWeight]]], list[dict[str, float]]]
                          = few_rows_path_times,
                          chosen: dict[tuple[int, int], tuple[str, ...]] | None = None
                          ) -> dict[tuple[int, int], tuple[str, ...]]:
    """Set each PackedWeight's `few_rows` to the paths of FEW_ROWS_PATHS that `path_times` finds
    fastest over the weights of its shape (weights with their packed copies), a path a row count;
    shape -> paths. A shape in `chosen` keeps the paths there, and one whose weights come to under
    MIN_TIMED_BYTES keeps W @ x^T, untimed: a later engine, or a small model's two, never computes
    otherwise because of a timing's noise. What is timed goes into `chosen` (CHOSEN_PATHS by default)."""
    chosen = CHOSEN_PATHS if chosen is None else chosen
    groups: dict[tuple[int, int], list[tuple[torch.Tensor, PackedWeight]]] = defaultdict(list)
    for weight, packed in linears:
        groups[tuple(weight.shape)].append((weight, packed))
    paths = {}
    with torch.no_grad():
        for shape, group in groups.items():
            if shape not in chosen and sum(weight.nbytes for weight, _ in group) >= MIN_TIMED_BYTES:
                chosen[shape] = tuple(min(FEW_ROWS_PATHS, key=times.__getitem__) for times in path_times(group))
            paths[shape] = chosen.get(shape, UNTIMED_FEW_ROWS)
            for _, packed in group:
                packed.few_rows = paths[shape]
    return paths


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: PackedWeight | None = None) -> torch.Tensor:
    """A linear layer.

        x: [T, K], weight: [N, K], bias: None or [N], all in one dtype  ->  out: [T, N] in that dtype
        out[t, n] = sum_k x[t, k] * weight[n, k] + bias[n]   accumulated in fp32, rounded once
        packed: None, or the weight's PackedWeight (a CPU fp32 weight); not used where autograd
            records the product (oneDNN's op has no backward)
    """
    if (packed is not None and x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):  # no backward
        if x.shape[0] >= MIN_CPU_PACKED_ROWS:
            return packed_linear(x, weight, bias, packed)
        if x.shape[0]:
            return few_rows_linear(packed.few_rows[x.shape[0] - 1], x, weight, bias, packed)
    if x.is_cuda and x.dim() == 2 and x.stride(1) == 1 and weight.is_contiguous():
        tile = skinny_tile(x.shape[0], weight.shape[0], weight.shape[1], x.dtype)
        if tile is not None:
            from punica.ops.linear_triton import skinny_linear_triton
            return skinny_linear_triton(x, weight, bias, tile)
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[0] <= MAX_CPU_SKINNY_ROWS:
        return skinny_linear_cpu(x, weight, bias)
    return F.linear(x, weight, bias)
