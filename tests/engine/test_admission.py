"""punica.engine.admission.checked_prompt: what a prompt of token ids may hold."""

import pytest

from punica.engine.admission import checked_prompt, ids_in_vocabulary


def test_token_ids_within_the_vocabulary_pass_as_given():
    assert checked_prompt([0, 5, 99], None, 100, vocab_size=100) == (None, [0, 5, 99])
    assert checked_prompt(range(3), None, None, vocab_size=3) == (None, [0, 1, 2])


@pytest.mark.parametrize("ids", [[1, 100], [-1, 2], [1, 2.0], [1, "2"], [1, None], [1, 1 << 70], [[1, 2]]])
def test_token_ids_outside_the_vocabulary_or_not_integers_are_refused(ids):
    with pytest.raises(ValueError, match=r"prompt token ids must be integers in \[0, 100\)"):
        checked_prompt(ids, None, None, vocab_size=100)


def test_an_empty_or_too_long_prompt_is_refused():
    with pytest.raises(ValueError, match="the prompt is empty"):
        checked_prompt([], None, 10, vocab_size=100)
    with pytest.raises(ValueError, match="has 10 tokens"):
        checked_prompt([1] * 10, None, 10, vocab_size=100)


def test_no_ids_are_all_in_the_vocabulary():
    assert ids_in_vocabulary([], 100)
    assert not ids_in_vocabulary([100], 100) and ids_in_vocabulary([0, 99], 100)
