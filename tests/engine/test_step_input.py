"""StepInput.build: a step of decodes only takes its own path (fewer numpy calls before the launch);
its arrays are those the general path gives the same decodes behind a prefill, and what the module
docstring defines."""

import numpy as np
import pytest

from punica.engine.step_input import StepInput

PAGE_SIZE = 4
# three decodes: (last token, tokens cached before it, pages, adapter slot, lora_scale, fed row)
DECODES = [(11, 6, [7, 2], 0, 1.0, 2), (12, 0, [5], -1, 1.0, -1), (13, 12, [9, 3, 4, 8], 3, 0.5, 0)]


def decodes_step(prefill: tuple | None = None) -> StepInput:
    rows = ([prefill] if prefill else []) + DECODES
    return StepInput.build([[r[0]] if i >= bool(prefill) else r[0] for i, r in enumerate(rows)],
                           [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows], int(bool(prefill)),
                           PAGE_SIZE, [r[5] for r in DECODES], [r[4] for r in rows])


def test_decodes_only_arrays_are_the_definitions():
    step = decodes_step()
    assert step.num_prefills == 0 and step.num_tokens == step.num_requests == 3
    np.testing.assert_array_equal(step.token_ids, [11, 12, 13])
    np.testing.assert_array_equal(step.query_start, [0, 1, 2, 3])
    np.testing.assert_array_equal(step.positions, [6, 0, 12])
    np.testing.assert_array_equal(step.context_lens, [7, 1, 13])
    # position p of a request is written at pages[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE
    np.testing.assert_array_equal(step.kv_slots, [2 * 4 + 2, 5 * 4 + 0, 8 * 4 + 0])
    np.testing.assert_array_equal(step.page_table, [[7, 2, 0, 0], [5, 0, 0, 0], [9, 3, 4, 8]])
    np.testing.assert_array_equal(step.token_slots, [0, -1, 3])
    np.testing.assert_array_equal(step.token_scales, np.array([1.0, 1.0, 0.5], np.float32))
    np.testing.assert_array_equal(step.fed_rows, [2, -1, 0])
    np.testing.assert_array_equal(step.num_logits, [1, 1, 1])
    assert step.only_last_logits and step.any_lora and step.any_fed
    np.testing.assert_array_equal(step.logits_rows, [0, 1, 2])


def test_decodes_only_equal_the_general_paths_decode_rows():
    alone = decodes_step()
    mixed = decodes_step(prefill=([20, 21, 22, 23, 24], 3, [6, 1], 2, 2.0, None))
    rows, requests = slice(mixed.num_prefill_tokens, None), slice(1, None)
    assert mixed.num_prefill_tokens == 5
    for field in ("token_ids", "positions", "kv_slots", "token_slots", "token_scales", "fed_rows"):
        np.testing.assert_array_equal(getattr(alone, field), getattr(mixed, field)[rows], err_msg=field)
    for field in ("context_lens", "request_slots", "request_scales", "num_logits"):
        np.testing.assert_array_equal(getattr(alone, field), getattr(mixed, field)[requests], err_msg=field)
    np.testing.assert_array_equal(alone.page_table, mixed.page_table[requests])
    np.testing.assert_array_equal(alone.query_start, mixed.query_start[requests] - mixed.num_prefill_tokens)


def test_decodes_positions_are_not_the_callers_array():
    cached = np.array([6, 0, 12])
    step = StepInput.build([[11], [12], [13]], cached, [[7, 2], [5], [9, 3, 4, 8]], [-1] * 3, 0, PAGE_SIZE)
    cached[:] = 0
    np.testing.assert_array_equal(step.positions, [6, 0, 12])


@pytest.mark.parametrize("num_prefills", [0, 1])
def test_a_decode_of_two_tokens_is_refused(num_prefills):
    tokens = [[1, 2, 3]] * num_prefills + [[4], [5, 6]]
    with pytest.raises(ValueError, match="exactly one query token"):
        StepInput.build(tokens, [0] * len(tokens), [[0, 1]] * len(tokens), [-1] * len(tokens), num_prefills, PAGE_SIZE)


@pytest.mark.parametrize("num_prefills", [0, 1])
def test_too_few_pages_are_refused(num_prefills):
    tokens = [[1, 2, 3]] * num_prefills + [[4], [5]]
    with pytest.raises(ValueError, match="fewer pages"):
        StepInput.build(tokens, [0] * num_prefills + [2, PAGE_SIZE], [[0]] * len(tokens), [-1] * len(tokens),
                        num_prefills, PAGE_SIZE)
