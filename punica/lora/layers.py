"""LoraLinear: a base projection plus each token's adapter delta, the one place a model runs LoRA.

Each projection group of a decoder layer (q/k/v, o, gate/up, down: punica.lora.pool.GROUPS) is
one fused base linear wrapped in a LoraLinear. The base is whichever linear it is given
(punica.models.quantized's Linear or Fp8Linear, or a tensor-parallel shard of either), called as
base(x), or base(x, beside_lora=True) where the side stream below runs beside it (the fp8 base
picks its GEMM by it); the LoraLinear adds the group's deltas to its output: one shrink over the
group's stacked A and one sliced expand into the fused output (punica.ops.lora), DoRA's
out_scales applied by the expand. It picks the kernels from the step's LoraBatch: SGMV over the
batch's leading prefill segments, BGMV per token for the rest; on the CPU (fp32), in batches of
several adapters, one grouped GEMM per shrink and expand slice over the whole batch, in batches of
fewer, a product per segment and slice (punica.ops.lora_cpu).
On CUDA the shrink runs on a side stream beside the base GEMM (inside captured graphs too: two
branches joined before the expand), so the GPU overlaps its launch and ramp with the GEMM's; in
BGMV batches of up to SIDE_STREAM_DELTA_MAX_TOKENS tokens, such as decode steps, the expand's delta
runs there too, and the main stream adds it (add_delta), or with `forward_deferred` the op that
next reads the output does (punica.ops.layers.PendingDelta), which saves that launch.

Its weights are its group's part of the adapter pool (punica.lora.pool.GroupWeights: views of one
layer's A, B, scales and DoRA tensors), set by `attach_pool`; without them, and in steps where no
token has an adapter, it is its base linear.

Under tensor parallelism a row-parallel projection (o, down: punica.parallel.tensor_parallel)
has a `tp_group`: each rank's output, base and delta alike, is a partial sum, all-reduced after
the delta is added.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from punica.lora.batch import LoraBatch
from punica.lora.experts import LoraExperts
from punica.lora.pool import GroupWeights, LoraPool
from punica.ops.layers import PendingDelta
from punica.ops.lora import add_delta, bgmv_delta, lora_expand, lora_shrink
from punica.ops.lora_cpu import grouped_applies, grouped_expand, grouped_shrink, segment_lora, segments_apply

# BGMV batches of up to this many tokens compute the expand's delta on the side stream too,
# beside the base GEMM, into a float32 [tokens, h_out] buffer that the main stream then adds
# (punica.ops.lora.bgmv_delta; benchmarks.rowwise_sweep --compare-delta); larger batches, whose
# buffer would cost activation memory, expand after the GEMM
SIDE_STREAM_DELTA_MAX_TOKENS = 256

_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The stream this process runs LoRA shrinks (and deltas) on beside the base GEMMs of `device`;
    None on CPU."""
    if device.type != "cuda":
        return None
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


class LoraLinear(nn.Module):
    """base(x) plus the deltas of projection group `group` ("qkv", "o", "gate_up", "down") of layer
    `layer`, whose part of the adapter pool `attach_pool` sets."""

    def __init__(self, base: nn.Module, layer: int, group: str):
        super().__init__()
        self.base, self.layer, self.group = base, layer, group
        self.weights: GroupWeights | None = None
        # row-parallel under tensor parallelism: the ranks whose partial outputs are summed
        self.tp_group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor, lora: LoraBatch) -> torch.Tensor:
        """x: [T, h_in]  ->  [T, h_out], each token's delta added by its slot (lora.token_slots)."""
        y = self.base(x) if self.weights is None or not lora.any_lora else self._with_lora(x, lora)[0]
        if self.tp_group is not None:
            dist.all_reduce(y, group=self.tp_group)
        return y

    def forward_deferred(self, x: torch.Tensor, lora: LoraBatch) -> tuple[torch.Tensor, PendingDelta | None]:
        """(y, delta): forward's output, where the delta was computed on the side stream (small BGMV
        batches) without it, and the delta then pending on y, for the op that next reads y to add
        (punica.ops.layers.rms_norm, silu_and_mul), which saves add_delta's launch; else (forward's
        output, None). A row-parallel projection adds its delta before the all-reduce."""
        if self.weights is None or not lora.any_lora or self.tp_group is not None:
            return self.forward(x, lora), None
        return self._with_lora(x, lora, defer=True)

    def _with_lora(self, x: torch.Tensor, lora: LoraBatch,
                   defer: bool = False) -> tuple[torch.Tensor, PendingDelta | None]:
        w = self.weights
        dora = (w.out_scales, w.dora_slots)
        stream = side_stream(x.device)
        if stream is None:
            y = self.base(x)
            if grouped_applies(x, w.lora_a, w.lora_b, lora.seg_slots.numel()):
                groups = lora.slot_groups(w.lora_a.shape[0])
                grouped_expand(y, grouped_shrink(x, w.lora_a, groups), w.lora_b, w.scales, lora.token_scales, groups,
                               w.slice_bounds, dora)
            elif segments_apply(x, w.lora_a, w.lora_b, lora.sgmv_tokens):
                segment_lora(y, x, w.lora_a, w.lora_b, w.scales, lora.token_scales, lora.seg_indptr, lora.seg_slots,
                             w.slice_bounds, dora)
            else:
                lora_expand(y, lora_shrink(x, w.lora_a, lora), w.lora_b, w.scales, lora, w.slice_bounds, dora)
            return y, None
        # The shrink (and for small BGMV batches the expand's delta too) runs on the side stream
        # beside the base GEMM. v and the delta are freed after their last use, which the side
        # stream's next work waits for (a deferred delta's last use, the op that reads y, comes
        # before the next projection's input exists); x lives until the join.
        main = torch.cuda.current_stream(x.device)
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            v = lora_shrink(x, w.lora_a, lora)
            delta = (bgmv_delta(v, w.lora_b, lora.token_slots, w.scales, w.slice_bounds, lora.token_scales)
                     if lora.sgmv_tokens == 0 and x.shape[0] <= SIDE_STREAM_DELTA_MAX_TOKENS else None)
        y = self.base(x, beside_lora=True)
        main.wait_stream(stream)
        if delta is None:
            lora_expand(y, v, w.lora_b, w.scales, lora, w.slice_bounds, dora)
        elif defer:
            return y, PendingDelta(delta, lora.token_slots, dora)
        else:
            add_delta(y, delta, lora.token_slots, dora)
        return y, None

    def extra_repr(self) -> str:
        return f"layer={self.layer}, group={self.group!r}"


def attach_pool(model: nn.Module, pool: LoraPool | None) -> None:
    """Point every LoraLinear (and LoraExperts) of `model` at its group's (its layer's experts') part
    of `pool`, which then serves it as adapters are written to its slots; None lets go of the pool
    (the model then runs without LoRA). Attach after the pool's last `allocate` (tensor-parallel
    sharding reallocates it), and before CUDA graphs that read it are captured."""
    for module in model.modules():
        if isinstance(module, LoraLinear):
            module.weights = None if pool is None else pool.group_weights(module.layer, module.group)
        elif isinstance(module, LoraExperts):
            module.weights = None if pool is None else pool.expert_weights(module.layer)
