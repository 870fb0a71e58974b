"""Request validation: one client's bad request is its own 400 (OpenAI's error shape, `param`
naming the field) and nobody else's problem; every OpenAI request field is implemented,
ignored because it cannot change the output, or refused by name."""

import asyncio
import typing

import httpx
import pytest
from fastapi.testclient import TestClient
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params
from openai.types.chat.chat_completion_message_param import ChatCompletionMessageParam

from punica.server.app import ServerState, build_app
from punica.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest

MESSAGES = [{"role": "user", "content": "Name a color."}]


def chat(**fields):
    return {"model": "tenant-0", "messages": MESSAGES, "max_tokens": 3, **fields}


def completion(**fields):
    return {"model": "tenant-0", "prompt": "The sky is", "max_tokens": 3, **fields}


def assert_error(r: httpx.Response, status: int, param: str | None, *fragments: str) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert error["param"] == param and (error["code"] is None or isinstance(error["code"], str))
    for fragment in fragments:
        assert fragment in error["message"], error
    return error


def post_raw(http: httpx.Client, path: str, raw: str) -> httpx.Response:
    return http.post(path, content=raw.encode(), headers={"content-type": "application/json"})


# sampling parameters -------------------------------------------------------------------------
BAD_SAMPLING = [
    ("seed", 1 << 64), ("seed", -(1 << 63) - 1), ("seed", "7"), ("seed", 1.5),
    ("temperature", 1e-39), ("temperature", 1e-3), ("temperature", 101), ("temperature", True),
    ("top_p", 0), ("min_p", 1.5), ("repetition_penalty", 1e-300), ("repetition_penalty", 1000),
    ("frequency_penalty", 2.5), ("presence_penalty", -2.5), ("top_k", -2),
    ("stop", [""]), ("stop", ["x" * 300]), ("stop", [f"s{i}" for i in range(65)]), ("stop", [1]),
    ("stop_token_ids", [-1]), ("stop_token_ids", list(range(65))), ("ignore_eos", 1), ("n", 0), ("n", 17),
    ("lora_scale", -0.5), ("lora_scale", 11), ("lora_scale", "0.5"),
]


@pytest.mark.parametrize("field, value", BAD_SAMPLING)
def test_bad_sampling_parameter_is_a_400_naming_it(http, field, value):
    assert_error(http.post("/v1/completions", json=completion(**{field: value})), 400, field, field)
    assert_error(http.post("/v1/chat/completions", json=chat(**{field: value})), 400, field, field)


@pytest.mark.slow
def test_bad_sampling_parameters_leave_co_batched_requests_alone(server):
    """Requests in flight on three adapters finish as if the bad ones had never been sent."""
    good = [completion(model=m, max_tokens=12, temperature=0, ignore_eos=True)
            for m in ("tenant-0", "tenant-1", server.state.base_model_name)]

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            alone = [await client.post("/v1/completions", json=body) for body in good]
            mixed = await asyncio.gather(*[client.post("/v1/completions", json=body) for body in good],
                                         *[client.post("/v1/completions", json=completion(**{f: v}))
                                           for f, v in BAD_SAMPLING])
            return alone, mixed

    alone, mixed = asyncio.run(run())
    assert [r.status_code for r in mixed] == [200] * len(good) + [400] * len(BAD_SAMPLING)
    assert [r.json()["choices"] for r in mixed[:len(good)]] == [r.json()["choices"] for r in alone]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("value", [0, -1])
def test_chat_max_tokens_below_one_is_a_400(http, field, value):
    body = {"model": "tenant-0", "messages": MESSAGES, field: value}
    assert_error(http.post("/v1/chat/completions", json=body), 400, field, field)


@pytest.mark.parametrize("value", [0, -5])
def test_completion_max_tokens_below_one_is_a_400(http, value):
    assert_error(http.post("/v1/completions", json=completion(max_tokens=value)), 400, "max_tokens", "max_tokens")


def test_n_seeds_near_the_top_wrap():
    """Choice j's seed is seed + j modulo 2**64: n > 1 at the largest seed is no 400."""
    body = CompletionRequest.model_validate(completion(seed=(1 << 64) - 1, n=3, temperature=1))
    assert [body.sampling_params(3, False, j).seed for j in range(3)] == [(1 << 64) - 1, 0, 1]


def test_token_ids_out_of_vocabulary_in_a_later_prompt_are_a_400(http, server):
    r = http.post("/v1/completions", json=completion(prompt=[[1, 2, 3], [10**9]], temperature=0))
    assert_error(r, 400, "prompt", "token ids")
    server.wait_idle()
    assert not server.engine.has_unfinished()


# OpenAI's fields ------------------------------------------------------------------------------
def openai_fields(typed_dict) -> set[str]:
    return set(typing.get_type_hints(typed_dict))


def test_every_openai_request_field_is_known():
    """OpenAI's request schemas (the openai package's types) against ours: a field missing here
    would be refused as unknown rather than implemented, ignored or refused by name."""
    assert openai_fields(chat_params.CompletionCreateParamsBase) | {"stream"} <= set(ChatCompletionRequest.model_fields)
    assert openai_fields(completion_params.CompletionCreateParamsBase) | {"stream"} <= set(
        CompletionRequest.model_fields)
    for message in typing.get_args(ChatCompletionMessageParam):
        if "function" not in message.__name__.lower():  # role "function": deprecated function calling
            assert openai_fields(message) <= set(ChatMessage.model_fields), message.__name__


IGNORED_CHAT = dict(
    user="u-1", metadata={"k": "v"}, store=False, service_tier="auto", prompt_cache_key="k", safety_identifier="s",
    prompt_cache_retention="24h", prompt_cache_options={"ttl": "30m"}, prediction={"type": "content", "content": "x"},
    stream_options={"include_usage": False, "include_obfuscation": True}, tool_choice="none",
    parallel_tool_calls=True, function_call="none", modalities=["text"], response_format={"type": "text"},
    logit_bias={}, tools=[], functions=[], top_logprobs=0, n=None, stop=None, seed=None, logprobs=None,
    audio=None, reasoning_effort=None, verbosity=None, web_search_options=None, moderation=None,
)


def test_ignored_chat_fields_do_not_change_the_output(http):
    plain = http.post("/v1/chat/completions", json=chat(temperature=0))
    ignored = http.post("/v1/chat/completions", json=chat(temperature=0, **IGNORED_CHAT))
    assert plain.status_code == ignored.status_code == 200, ignored.text
    assert ignored.json()["choices"] == plain.json()["choices"]
    messages = [{"role": "system", "content": "Be brief.", "name": "rules"},
                {"role": "assistant", "content": [{"type": "text", "text": "Hi."}], "refusal": None, "tool_calls": None,
                 "function_call": None, "audio": None},
                {"role": "user", "content": [{"type": "text", "text": "Name a color.",
                                              "prompt_cache_breakpoint": {"mode": "explicit"}}]}]
    assert http.post("/v1/chat/completions", json=chat(messages=messages)).status_code == 200


def test_ignored_completion_fields_do_not_change_the_output(http):
    plain = http.post("/v1/completions", json=completion(temperature=0))
    ignored = http.post("/v1/completions", json=completion(temperature=0, user="u", echo=False, suffix="", best_of=1,
                                                           logit_bias={}, stream_options={"include_usage": False},
                                                           n=None, logprobs=None))
    assert plain.status_code == ignored.status_code == 200, ignored.text
    assert ignored.json()["choices"] == plain.json()["choices"]


@pytest.mark.parametrize("field, value", [
    ("tools", [{"type": "function", "function": {"name": "f", "colour": 1}}]), ("tool_choice", "auto"),
    ("tool_choice", {"type": "function", "function": {"name": "f"}}), ("functions", [{"name": "f"}]),
    ("function_call", "auto"), ("modalities", ["text", "audio"]), ("audio", {"voice": "alloy", "format": "wav"}),
    ("response_format", {"type": "json_object", "x": 1}), ("top_logprobs", 2), ("top_logprobs", 21),
    ("logit_bias", {"x": 5}), ("logit_bias", {"1": 101}), ("guided_regex", ""), ("structured_outputs", {"json": 1}),
    ("reasoning_effort", "low"), ("verbosity", "low"), ("web_search_options", {}), ("moderation", {}),
])
def test_unsupported_chat_field_is_a_400_naming_it(http, field, value):
    r = http.post("/v1/chat/completions", json=chat(**{field: value}))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith(field) and field in error["message"], error


@pytest.mark.parametrize("message, param", [
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]},
     "messages.0.tool_calls.0"),
    ({"role": "assistant", "content": "x", "function_call": {"name": "f", "arguments": "{}"}},
     "messages.0.function_call"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]},
     "messages.0.content.0.type"),
    ({"role": "user", "content": [{"type": "text", "text": 5}]}, "messages.0.content.0"),
    ({"role": "user", "content": 5}, "messages.0.content"),
    ({"role": "user", "content": "x", "colour": "red"}, "messages.0.colour"),
])
def test_unsupported_message_field_is_a_400_naming_it(http, message, param):
    assert_error(http.post("/v1/chat/completions", json=chat(messages=[message])), 400, param, param)


@pytest.mark.parametrize("field, value", [("suffix", "end"), ("best_of", 3), ("logprobs", 21),
                                          ("logit_bias", {"-1": 5}), ("guided_choice", [])])
def test_unsupported_completion_field_is_a_400_naming_it(http, field, value):
    assert_error(http.post("/v1/completions", json=completion(**{field: value})), 400, field, field)


@pytest.mark.parametrize("path, body", [("/v1/completions", completion(foo=1, bar={"x": 2})),
                                        ("/v1/chat/completions", chat(foo=1, bar={"x": 2}))])
def test_unknown_fields_are_a_400_naming_each(http, path, body):
    error = assert_error(http.post(path, json=body), 400, "foo", "Unrecognized request argument supplied: foo, bar")
    assert "bar" in error["message"]
    assert_error(http.post(path, json={**body, "foo": None, "bar": None}), 400, "foo", "foo, bar")
    nested = {k: v for k, v in body.items() if k not in ("foo", "bar")} | {"stream_options": {"include_usage": True,
                                                                                             "extra": 1}}
    assert_error(http.post(path, json=nested), 400, "stream_options.extra", "stream_options.extra")


def test_lora_scale_on_the_base_model_is_a_400_naming_it(http, server):
    base = server.state.base_model_name
    for path, body in (("/v1/completions", completion(model=base, lora_scale=0.5)),
                       ("/v1/chat/completions", chat(model=base, lora_scale=0.5))):
        assert_error(http.post(path, json=body), 400, "lora_scale", "lora_scale 0.5 needs an adapter")
    assert http.post("/v1/completions", json=completion(model=base, lora_scale=1)).status_code == 200


def test_vllm_extra_fields_are_accepted(http):
    body = completion(top_k=5, min_p=0.1, repetition_penalty=1.1, ignore_eos=True, stop_token_ids=[2],
                      include_stop_str_in_output=True, seed=3, temperature=0.5, lora_scale=0.5)
    assert http.post("/v1/completions", json=body).status_code == 200
    chat_body = chat(**{k: v for k, v in body.items() if k != "prompt"})
    assert http.post("/v1/chat/completions", json=chat_body).status_code == 200


def test_types_are_json_types(http):
    for field, value in [("max_tokens", "3"), ("max_tokens", 3.0), ("stream", 1), ("temperature", "0.5")]:
        assert_error(http.post("/v1/completions", json=completion(**{field: value})), 400, field, field)


# strings --------------------------------------------------------------------------------------
M = '"model": "tenant-0"'


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/completions", '{%s, "prompt": "hi \\ud800"}' % M, "prompt"),
    ("/v1/completions", '{"model": "\\udfff", "prompt": "hi"}', "model"),
    ("/v1/completions", '{%s, "prompt": ["ok", "bad \\ud800"]}' % M, "prompt.1"),
    ("/v1/completions", '{%s, "prompt": "hi", "stop": ["\\ud800"]}' % M, "stop.0"),
    ("/v1/completions", '{%s, "prompt": "hi", "user": "\\ud800"}' % M, "user"),
    ("/v1/chat/completions", '{%s, "messages": [{"role": "user", "content": "a\\udc00b"}]}' % M, "messages.0.content"),
    ("/v1/chat/completions", '{%s, "messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}'
     % M, "messages.0.content.0.text"),
    ("/v1/chat/completions", '{%s, "messages": [{"role": "user", "content": "a"}], "metadata": {"k": "\\ud800"}}' % M,
     "metadata.k"),
    ("/v1/load_lora_adapter", '{"lora_name": "\\ud800", "lora_path": "/x"}', "lora_name"),
    ("/v1/unload_lora_adapter", '{"lora_name": "x\\ud800"}', "lora_name"),
])
def test_lone_surrogate_is_a_400_naming_where(http, server, path, raw, param):
    assert_error(post_raw(http, path, raw), 400, param, param, "lone surrogate")


def test_lone_surrogate_in_a_key_is_a_400(http):
    error = assert_error(post_raw(http, "/v1/completions", '{%s, "prompt": "hi", "\\ud800": 1}' % M), 400,
                         ascii("\ud800"), "lone surrogate")
    assert error["message"].isascii()


@pytest.mark.parametrize("body, param, fragment", [
    ({"lora_name": "x", "lora_path": "/adapters/a\0b"}, "lora_path", "NUL"),
    ({"lora_name": "x", "lora_path": "/" + "a" * 4096}, "lora_path", "4096"),
    ({"lora_name": "n" * 129, "lora_path": "/x"}, "lora_name", "128"),
    ({"lora_name": "", "lora_path": "/x"}, "lora_name", "lora_name"),
    ({"lora_name": "x", "lora_path": "/x", "base_model_name": "y"}, "base_model_name", "Unrecognized"),
])
def test_bad_adapter_load_body_is_a_400(http, body, param, fragment):
    assert_error(http.post("/v1/load_lora_adapter", json=body), 400, param, fragment)
    assert body["lora_name"] not in {m["id"] for m in http.get("/v1/models").json()["data"]}


# error shape ----------------------------------------------------------------------------------
def test_error_shapes(http):
    error = assert_error(http.post("/v1/completions", json=completion(model="nope")), 404, "model", "nope")
    assert error["code"] == "model_not_found"
    assert_error(http.post("/v1/chat/completions", json=chat(messages=[{"role": "wizard", "content": "x"}])), 400,
                 "messages.0.role", "messages.0.role")
    assert_error(http.post("/v1/completions", json={"prompt": "x"}), 400, "model", "model")
    assert_error(http.post("/v1/nowhere", json={}), 404, None, "Invalid URL (POST /v1/nowhere)")
    assert_error(post_raw(http, "/v1/completions", "{not json"), 400, None, "not valid JSON")
    assert_error(http.post("/v1/unload_lora_adapter", json={"lora_name": "never-loaded"}), 404, "lora_name",
                 "not loaded")


class RefusingBackend:
    """A backend whose engine refuses every adapter name, as Engine.load_adapter does a bad one."""
    max_model_len = 64

    def has_adapter(self, name):
        return False

    async def load_adapter(self, name, path):
        raise ValueError(f"adapter name {name!r} is not allowed")

    async def start(self):
        pass

    async def shutdown(self):
        pass


def test_engine_refusing_an_adapter_name_is_a_400_on_lora_name(tmp_path):
    state = ServerState(RefusingBackend(), None, "base", adapter_dirs=[tmp_path])
    with TestClient(build_app(state)) as client:
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "bad name", "lora_path": str(tmp_path / "a")})
    assert_error(r, 400, "lora_name", "not allowed")
