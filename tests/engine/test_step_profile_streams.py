"""benchmarks.step_profile's side-stream time: the kernel time in which only streams other than the
GEMMs' run, from the profiler's kernel events."""

from benchmarks.step_profile import busy_time, side_alone_us


def kernel(name, stream, ts, dur):
    return {"name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_overlapping_intervals_count_once():
    assert busy_time([(5, 7), (0, 2), (1, 3), (7, 8)]) == 3 + 3
    assert busy_time([(0, 10), (2, 3), (5, 12)]) - busy_time([(2, 3), (5, 12)]) == 2 + 2
    assert busy_time([(0, 2), (4, 6), (1, 5)]) - busy_time([(1, 5)]) == 1 + 1
    assert busy_time([(0, 2)]) == 2 and busy_time([]) == 0


def test_only_the_side_streams_time_outside_the_gemms_stream_counts():
    kernels = [
        kernel("nvjet_sm90_gemm", 7, 0, 10), kernel("nvjet_sm90_gemm", 7, 12, 8),
        kernel("sgmv_shrink_tile_kernel", 13, 5, 10),    # 10-12 alone
        kernel("expand_rowwise_kernel", 14, 25, 2),     # all alone
        kernel("sgmv_shrink_tile_kernel", 13, 14, 3),    # under the GEMM
    ]
    assert side_alone_us(kernels) == 2 + 2


def test_the_main_stream_is_the_gemms_even_with_less_kernel_time():
    kernels = [kernel("nvjet_sm90_gemm", 7, 0, 4), kernel("shrink_rowwise_kernel", 13, 0, 30)]
    assert side_alone_us(kernels) == 26


def test_one_stream_has_no_side_time():
    assert side_alone_us([kernel("nvjet_sm90_gemm", 7, 0, 4), kernel("rms_norm", 7, 5, 1)]) == 0
