import pytest
from transformers import AutoTokenizer

from punica.engine.detokenizer import CONTEXT_TOKENS, IncrementalDetokenizer, skipped_ids
from punica.models.sources import resolve_model_dir


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(resolve_model_dir(None)))


TEXTS = ["Hello, world! Ünïcödé: 世界 🎉🎉 naïve café — ok.", "  two  spaces\nand a newline\t tab",
         "日本語のテキスト👍🏽"]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_full_decode(tokenizer, text):
    prompt = tokenizer.encode("Say:")
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces = []
    for t in ids:
        detok.add_token(t)
        piece = detok.take_new_text(finished=False)
        assert "\ufffd" not in piece  # never a broken multi-byte character
        pieces.append(piece)
    pieces.append(detok.take_new_text(finished=True))
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True) == detok.text


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_truncates_and_streaming_never_leaks_it(tokenizer, include):
    ids = tokenizer.encode("The answer is 42. END of story, more text")
    detok = IncrementalDetokenizer(tokenizer, [], stop=("END", "never"), include_stop_str_in_output=include)
    streamed = ""
    stopped_at = None
    for i, t in enumerate(ids):
        if detok.add_token(t):
            stopped_at = i
            break
        streamed += detok.take_new_text(finished=False)
        assert "EN" not in streamed  # a possible stop-string prefix is held back
    streamed += detok.take_new_text(finished=True)
    assert stopped_at is not None
    assert streamed == detok.text == ("The answer is 42. END" if include else "The answer is 42. ")


def test_special_tokens_add_no_text_and_keep_the_window_short(tokenizer):
    """EOS run past (ignore_eos) and other special tokens between text: the text is the full decode's
    with them skipped, and they never enter the window that each token decodes."""
    specials = sorted(skipped_ids(tokenizer))
    assert tokenizer.eos_token_id in specials
    words = tokenizer.encode(" Hello there, naïve 世界")
    ids = [tokenizer.eos_token_id] * 500 + words[:3] + specials + words[3:] + [tokenizer.eos_token_id] * 500
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"))
    widest = 0
    for t in ids:
        detok.add_token(t)
        widest = max(widest, len(detok.ids) - detok.prefix_offset)
    assert detok.text == tokenizer.decode(ids, skip_special_tokens=True) == tokenizer.decode(words)
    assert widest <= CONTEXT_TOKENS + 4  # the prompt's context and a character's bytes, at most


def test_skipped_ids_are_what_decode_drops(tokenizer):
    words = tokenizer.encode("one two")
    for special in skipped_ids(tokenizer):
        assert tokenizer.decode(words[:1] + [special] + words[1:], skip_special_tokens=True) == tokenizer.decode(words)
    assert tokenizer.decode(words[:1] + [tokenizer.encode("x")[0]] + words[1:], skip_special_tokens=True) != \
        tokenizer.decode(words)
