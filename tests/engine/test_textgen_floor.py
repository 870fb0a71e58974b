"""benchmarks.textgen's memory floor of a run: its first-come-first-served steps, each reading the
weights once and every running request's cached K and V."""

from benchmarks.textgen import floor_seconds


def test_floor_counts_each_steps_weights_and_contexts():
    # one at a time: the 2-token prompt's steps read 2, 3 and 4 keys, then the 1-token prompt's 1
    assert floor_seconds([(2, 3), (1, 1)], weights=100, kv_per_token=1, bandwidth=1.0,
                         max_batch=1) == 4 * 100 + (2 + 3 + 4 + 1)
    # together: the first step reads both prompts and finishes the second request
    assert floor_seconds([(2, 3), (1, 1)], weights=100, kv_per_token=1, bandwidth=1.0,
                         max_batch=2) == 3 * 100 + (2 + 1 + 3 + 4)
    assert floor_seconds([(2, 3)], weights=100, kv_per_token=2, bandwidth=4.0) == (300 + 2 * 9) / 4.0
