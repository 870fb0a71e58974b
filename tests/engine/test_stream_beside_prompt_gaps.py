"""benchmarks.stream_beside_prompt's gaps while a prompt waits: those of the stream that overlap
the span from the prompt's arrival to its first token, whichever way the stamps were taken."""

import pytest

from benchmarks.stream_beside_prompt import gap_stats


def test_only_the_gaps_that_overlap_the_prompts_wait_count():
    # gaps 1, 1, 4 (ends after the arrival at 2.5), 2, 6 (starts before the first token at 9.5), 1
    stamps = [0.0, 1.0, 2.0, 6.0, 8.0, 14.0, 15.0]
    stats = gap_stats(stamps, arrival=2.5, first=9.5, steady=1.0)
    assert stats["max_gap_ms"] == 6000.0 and stats["max_gap_end"] == 14.0
    assert stats["median_gap_ms"] == 4000.0  # of 4, 2 and 6
    assert stats["max_over_steady"] == 6.0 and stats["steady_gap_ms"] == 1000.0
    assert stats["p99_gap_ms"] == 6000.0


def test_a_prompt_answered_within_one_gap_has_that_gap():
    stats = gap_stats([0.0, 1.0, 5.0, 6.0], arrival=1.5, first=2.0, steady=1.0)
    assert stats["max_gap_ms"] == stats["median_gap_ms"] == 4000.0 and stats["max_gap_end"] == 5.0


def test_no_gap_overlapping_the_wait_is_an_error():
    with pytest.raises(ValueError):
        gap_stats([0.0, 1.0], arrival=2.0, first=3.0, steady=1.0)
