"""Which free pages a request takes (punica.engine.kv_cache): a prompt's pages are consecutive
beside running decodes, and a decode goes on in the pages after its own while they are free, so
the CPU attention reads a long context in place (punica.ops.attention_cpu)."""

from punica.engine.kv_cache import PageAllocator
from punica.engine.request import Request
from punica.engine.sampling_params import SamplingParams


def request(name, num_prompt_tokens):
    return Request(name, list(range(1, num_prompt_tokens + 1)), SamplingParams(max_tokens=1000))


def prefill(alloc, r, num_tokens):
    """Compute `num_tokens` more of r's prompt: its pages grow while it is still in its prompt."""
    alloc.grow(r, r.num_cached + num_tokens)
    r.num_cached += num_tokens


def decode(alloc, r):
    """One decode step of r: a sampled token, then its KV."""
    r.output_token_ids.append(7)
    alloc.grow(r, r.num_cached + 1)
    r.num_cached += 1


def is_run(pages):
    return pages == list(range(pages[0], pages[0] + len(pages)))


def test_a_prompt_chunked_beside_decodes_holds_consecutive_pages():
    alloc = PageAllocator(64, 4)
    stream, prompt = request("stream", 3), request("prompt", 40)
    prefill(alloc, stream, 3)
    for _ in range(5):  # the stream takes its first decode page after its prompt's, then the prompt comes
        decode(alloc, stream)
    for _ in range(10):
        prefill(alloc, prompt, 4)
        decode(alloc, stream)
    assert is_run(prompt.pages) and len(prompt.pages) == 10
    assert stream.pages[:2] == [0, 1], "its first decode page followed its prompt's"
    assert all(page > prompt.pages[-1] for page in stream.pages[2:]), "then the highest, away from the prompt"


def test_a_long_prompts_decode_goes_on_in_the_pages_after_it():
    alloc = PageAllocator(64, 4)
    chat = request("chat", 30)
    prefill(alloc, chat, 16)
    prefill(alloc, chat, 14)
    for _ in range(20):
        decode(alloc, chat)
    assert chat.pages == list(range(13)), "prompt and decodes: one run"


def test_a_decode_whose_next_page_is_taken_takes_the_highest_and_goes_on_from_there_only_if_it_can():
    alloc = PageAllocator(16, 4)
    chat, other = request("chat", 8), request("other", 4)
    prefill(alloc, chat, 8)                   # pages 0, 1
    prefill(alloc, other, 4)                  # page 2: the one after chat's
    decode(alloc, chat)
    assert chat.pages == [0, 1, 15]
    for _ in range(4):
        decode(alloc, chat)
    assert chat.pages == [0, 1, 15, 14], "the highest again: nothing follows page 15"


def test_freed_pages_are_taken_again_and_none_is_lost():
    alloc = PageAllocator(12, 4)
    first, second = request("first", 16), request("second", 8)
    prefill(alloc, first, 16)
    alloc.free(first)
    prefill(alloc, second, 8)
    for _ in range(12):
        decode(alloc, second)
    assert is_run(second.pages) and len(second.pages) == 5
    assert alloc.num_free == 12 - 5
    alloc.free(second)
    assert alloc.num_free == 12 and sorted(alloc._free) == list(range(12))
