"""What a request may cost before it is refused: the body limit (413, checked as the body is read),
the prompt bound (400 without tokenizing), and tokenization off the event loop."""

import json
import socket
import threading

import httpx
import pytest

LIMIT = 1024 * 1024
MAX_MODEL_LEN = 2048


class GatedTokenizer:
    """The real tokenizer, whose `encode` counts its calls and can be held until the test opens the gate."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.chat_template = tokenizer.chat_template
        self.calls = 0
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.gate.set()

    def get_vocab(self):
        return self.tokenizer.get_vocab()

    def apply_chat_template(self, *args, **kwargs):
        return self.tokenizer.apply_chat_template(*args, **kwargs)

    def encode(self, *args, **kwargs):
        self.calls += 1
        self.entered.set()
        assert self.gate.wait(timeout=60)
        return self.tokenizer.encode(*args, **kwargs)


@pytest.fixture(scope="module")
def limited(tokenizer, start_server, stub_state):
    """A server (no model behind it) with a 1 MiB body limit and a 2,048-token context."""
    gated = GatedTokenizer(tokenizer)
    running = start_server(stub_state(gated, max_model_len=MAX_MODEL_LEN), max_request_bytes=LIMIT)
    yield running, gated
    running.stop()


@pytest.fixture(name="raw_request")
def raw_request_fixture(read_answer):
    """The function `raw_request(port, head, body_parts=()) -> (status, JSON body)`: a request head
    and body parts sent over one connection, and its answer."""
    def raw_request(port: int, head: bytes, body_parts=()) -> tuple[int, dict]:
        with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
            sock.sendall(head)
            for part in body_parts:
                sock.sendall(part)
            return read_answer(sock)
    return raw_request


def assert_too_large(status: int, body: dict) -> None:
    assert status == 413, body
    error = body["error"]
    assert error["type"] == "invalid_request_error" and error["param"] is None and error["code"] == 413
    assert f"limit of {LIMIT} bytes" in error["message"]


def test_content_length_over_the_limit_is_413_before_the_body_is_sent(limited, raw_request):
    server, _ = limited
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (50 * LIMIT))
    assert_too_large(*raw_request(server.port, head))  # not a byte of the 50 MiB was sent
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_chunked_body_over_the_limit_is_413(limited, raw_request):
    server, gated = limited
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" \
           b"Transfer-Encoding: chunked\r\n\r\n"
    prefix = b'{"model": "base", "messages": [{"role": "user", "content": "'
    piece = b"x" * 65536
    chunks = [prefix] + [piece] * (LIMIT // len(piece) + 1)
    calls = gated.calls
    assert_too_large(*raw_request(server.port, head, [b"%x\r\n%s\r\n" % (len(c), c) for c in chunks]))
    assert gated.calls == calls
    # the same through httpx, which sends a generator chunked, to the end, and then reads the answer
    body = (c for c in chunks + [b'"}]}'])
    r = httpx.post(server.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert_too_large(r.status_code, r.json())
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_a_body_just_within_the_limit_is_read(limited):
    server, _ = limited
    body = json.dumps({"model": "base", "prompt": [1] * 300_000}).encode()  # 900 kB of token ids
    assert len(body) < LIMIT
    r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "300000 in the prompt" in r.json()["error"]["message"], r.json()


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "base", "prompt": ["Hi", "word " * 100_000]}),
    ("/v1/chat/completions", {"model": "base", "messages": [{"role": "system", "content": "word " * 50_000},
                                                            {"role": "user", "content": "word " * 50_000}]}),
])
def test_text_that_cannot_fit_the_context_is_refused_without_tokenizing(limited, path, body):
    server, gated = limited
    calls = gated.calls
    r = httpx.post(server.url + path, json=body)  # 500 kB of text, under the body limit, over the bound
    assert r.status_code == 400
    assert "maximum context length" in r.json()["error"]["message"], r.json()
    assert gated.calls == calls


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "base", "prompt": "word " * 60_000}),
    ("/v1/chat/completions", {"model": "base", "messages": [{"role": "user", "content": "word " * 60_000}]}),
])
def test_health_answers_while_a_large_prompt_is_tokenized(limited, path, body):
    server, gated = limited
    gated.gate.clear()
    gated.entered.clear()
    answer = {}
    sender = threading.Thread(target=lambda: answer.update(r=httpx.post(server.url + path, json=body, timeout=120)))
    sender.start()
    try:
        assert gated.entered.wait(timeout=60)  # the 300 kB prompt (within the bound) is being tokenized
        assert httpx.get(server.url + "/health", timeout=30).json() == {"status": "ok"}
    finally:
        gated.gate.set()
        sender.join(timeout=120)
    r = answer["r"]  # tokenized, and counted: 60,000 tokens and more do not fit 2,048
    assert r.status_code == 400 and "in the prompt" in r.json()["error"]["message"], r.json()
