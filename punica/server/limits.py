"""What one request may cost the server before it is refused: its body's size, its prompt's length.

The body limit is checked while the body is read, so an oversized body is neither buffered
nor parsed; the prompt bound refuses text that cannot fit the context without tokenizing it.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from punica.server.protocol import ProtocolError

TOO_LARGE = 413


class BodyTooLarge(Exception):
    """Raised into the app by `receive` once a body has grown over the limit."""


class RequestBodyLimit:
    """ASGI middleware: a body over `max_bytes` is a 413 OpenAI error. A Content-Length over the
    limit is refused before anything is read; a body of unknown length (chunked) is counted as it
    arrives and refused once over. Whatever the app makes of the cut-off body is dropped."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None and length > self.max_bytes:
            await self._refuse(send, f"{length} bytes")
            return
        received, over, started = 0, False, False

        async def counting_receive() -> Message:
            nonlocal received, over
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    over = True
                    raise BodyTooLarge
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if over and not started:
                return  # the app's answer to a cut-off body; the 413 below replaces it
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except BodyTooLarge:
            if started:
                raise
        if over and not started:
            await self._refuse(send, f"more than {self.max_bytes} bytes")

    async def _refuse(self, send: Send, size: str) -> None:
        message = (f"the request body ({size}) is over this server's limit of {self.max_bytes} bytes "
                   f"(punica serve --max-request-bytes)")
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": TOO_LARGE}}).encode()
        await send({"type": "http.response.start", "status": TOO_LARGE,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class PromptBound:
    """Whether text can fit the context at all: `max_model_len` tokens each stand for at most as
    many bytes as the vocabulary's longest entry. The entries are measured as stored (byte-level
    BPE writes a byte as a character of up to 2 bytes, SentencePiece a space as 3), which is never
    less than the text a token stands for."""

    def __init__(self, tokenizer):
        self.max_token_bytes = max(len(token.encode()) for token in tokenizer.get_vocab())

    def check(self, num_bytes: int, max_model_len: int, param: str) -> None:
        """A 400 for text of `num_bytes` UTF-8 bytes that cannot fit, before anything tokenizes it."""
        max_bytes = max_model_len * self.max_token_bytes
        if num_bytes > max_bytes:
            raise ProtocolError(
                f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
                f"{num_bytes} bytes of text, and {max_model_len} tokens of this vocabulary (at most "
                f"{self.max_token_bytes} bytes each) span at most {max_bytes}. Please reduce the prompt.",
                param=param)
