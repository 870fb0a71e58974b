"""benchmarks.step_profile's LoRA time: the kernel time in which only LoRA's kernels run, from the
profiler's kernel events, whatever stream each reports."""

from benchmarks.step_profile import busy_time, lora_alone_us


def kernel(name, ts, dur, stream=7):
    return {"name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_overlapping_intervals_count_once():
    assert busy_time([(5, 7), (0, 2), (1, 3), (7, 8)]) == 3 + 3
    assert busy_time([(0, 10), (2, 3), (5, 12)]) - busy_time([(2, 3), (5, 12)]) == 2 + 2
    assert busy_time([(0, 2), (4, 6), (1, 5)]) - busy_time([(1, 5)]) == 1 + 1
    assert busy_time([(0, 2)]) == 2 and busy_time([]) == 0


def test_only_the_lora_time_no_other_kernel_hides_counts():
    kernels = [
        kernel("nvjet_sm90_gemm", 0, 10, stream=986), kernel("nvjet_sm90_gemm", 12, 8, stream=987),
        kernel("sgmv_shrink_tile_kernel", 5, 10),     # 10-12 alone
        kernel("expand_rowwise_kernel", 25, 2),       # all alone
        kernel("shrink_rowwise_kernel", 14, 3),       # under the GEMM
        kernel("_rms_norm_kernel", 26, 3),            # hides the expand's last us
    ]
    assert lora_alone_us(kernels) == 2 + 1


def test_lora_kernels_overlapping_each_other_count_once():
    kernels = [kernel("sgmv_shrink_tile_kernel", 0, 10), kernel("shrink_rowwise_kernel", 5, 10, stream=13),
               kernel("_expert_expand_kernel", 30, 4), kernel("prefill_kernel", 12, 10)]
    assert lora_alone_us(kernels) == 12 + 4


def test_a_step_without_lora_has_none():
    assert lora_alone_us([kernel("nvjet_sm90_gemm", 0, 4), kernel("_rms_norm_kernel", 5, 1)]) == 0
    assert lora_alone_us([]) == 0
