"""The OpenAI-compatible server driven by the official openai client and raw HTTP."""

import asyncio

import httpx
import openai
import pytest

from punica import LLM, SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def async_client(server):
    """A new async client per event loop (asyncio.run)."""
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_models_lists_base_and_adapters(client, server):
    models = {m.id: m for m in client.models.list().data}
    assert server.state.base_model_name in models
    assert {"tenant-0", "tenant-1", "tenant-2"} <= set(models)
    assert models["tenant-1"].model_extra["parent"] == server.state.base_model_name


@pytest.mark.slow
def test_completions_across_adapters_equal_offline_engine(server, adapter_dirs):
    names = [server.state.base_model_name, "tenant-0", "tenant-1", "tenant-2"]

    async def run():
        aclient = async_client(server)
        calls = [aclient.completions.create(model=m, prompt=p, max_tokens=12, temperature=0)
                 for m in names for p in PROMPTS]
        return await asyncio.gather(*calls)

    responses = asyncio.run(run())
    llm = LLM(adapters=adapter_dirs[0], max_batch_size=4)
    offline = llm.generate([p for _ in names for p in PROMPTS], SamplingParams(max_tokens=12, temperature=0),
                           adapter=[None if m == server.state.base_model_name else m for m in names for _ in PROMPTS])
    texts = [r.choices[0].text for r in responses]
    assert texts == [o.text for o in offline]
    assert len(set(texts)) > len(PROMPTS)  # the adapters change the outputs
    assert all(r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length" for r in responses)


@pytest.mark.slow
def test_streaming_equals_non_streaming(client):
    for model in ("tenant-0", "tenant-2"):
        full = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=10, temperature=0)
        chunks = list(client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=10, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
        assert chunks[-1].usage.completion_tokens == 10 and chunks[-2].choices[0].finish_reason == "length"


@pytest.mark.slow
def test_chat_streaming_and_not_across_adapters(server):
    messages = [{"role": "user", "content": "Name three colors."}]

    async def run():
        aclient = async_client(server)
        plain = await asyncio.gather(*[aclient.chat.completions.create(model=m, messages=messages, max_tokens=16,
                                                                        temperature=0)
                                       for m in ("tenant-0", "tenant-1", server.state.base_model_name)])
        streamed = []
        for m in ("tenant-0", "tenant-1", server.state.base_model_name):
            text = ""
            async for chunk in await aclient.chat.completions.create(model=m, messages=messages, max_tokens=16,
                                                                      temperature=0, stream=True):
                text += chunk.choices[0].delta.content or ""
            streamed.append(text)
        return plain, streamed

    plain, streamed = asyncio.run(run())
    assert [p.choices[0].message.content for p in plain] == streamed
    assert all(p.choices[0].message.role == "assistant" for p in plain)


def test_chat_uses_the_chat_template(client, server):
    reply = client.chat.completions.create(
        model=server.state.base_model_name, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16, temperature=0)
    assert "Paris" in reply.choices[0].message.content and reply.choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_n_seed_stop_and_logprobs(client):
    r = client.completions.create(model="tenant-0", prompt=PROMPTS[0], max_tokens=8, temperature=1.0, n=3, seed=7,
                                  logprobs=1)
    again = client.completions.create(model="tenant-0", prompt=PROMPTS[0], max_tokens=8, temperature=1.0, n=3, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [c.text for c in again.choices]
    assert all(len(c.logprobs.token_logprobs) == 8 for c in r.choices)
    greedy = client.completions.create(model="tenant-1", prompt=PROMPTS[1], max_tokens=12,
                                       temperature=0).choices[0].text
    stop = greedy.strip().split()[1]
    stopped = client.completions.create(model="tenant-1", prompt=PROMPTS[1], max_tokens=12, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop" and stop not in stopped.choices[0].text


def assert_error(response: httpx.Response, status: int, fragment: str):
    assert response.status_code == status, response.text
    body = response.json()
    assert fragment in body["error"]["message"], body


def still_serving(http: httpx.Client, server):
    assert http.get("/health").json() == {"status": "ok"}
    r = http.post("/v1/completions", json={"model": "tenant-2", "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("body, status, fragment", [
    ({"model": "nope", "prompt": "x"}, 404, "does not exist"),
    ({"model": "tenant-0"}, 400, "prompt"),
    ({"model": "tenant-0", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": "tenant-0", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tenant-0", "prompt": "x", "top_p": 7}, 400, "top_p"),
    ({"model": "tenant-0", "prompt": "x", "n": "many"}, 400, "n"),
    ({"model": "tenant-0", "prompt": "x", "echo": True, "logprobs": 21}, 400, "logprobs"),
    ({"model": "tenant-0", "prompt": "x", "logit_bias": {"1": 200}}, 400, "logit_bias"),
    ({"model": "tenant-0", "prompt": "x", "guided_regex": "("}, 400, "parenthesis"),
    ({"model": "tenant-0", "prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}}, 400, "objectx"),
    ({"model": "tenant-0", "prompt": [], "max_tokens": 1}, 400, "empty"),
    ({"model": "tenant-0", "prompt": [10**9]}, 400, "token ids"),
    ({"model": "tenant-0", "prompt": "word " * 9000}, 400, "maximum context length"),
    ({"model": "tenant-0", "prompt": "x", "max_tokens": 10**6}, 400, "maximum context length"),
])
def test_completion_errors(http, server, body, status, fragment):
    assert_error(http.post("/v1/completions", json=body), status, fragment)
    still_serving(http, server)


@pytest.mark.parametrize("body, status, fragment", [
    ({"model": "tenant-0", "messages": []}, 400, "messages"),
    ({"model": "tenant-0", "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ({"model": "tenant-0", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400,
     "tools"),
    ({"model": "ghost", "messages": [{"role": "user", "content": "x"}]}, 404, "ghost"),
])
def test_chat_errors(http, server, body, status, fragment):
    assert_error(http.post("/v1/chat/completions", json=body), status, fragment)
    still_serving(http, server)


def test_malformed_json_is_400(http, server):
    r = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert_error(r, 400, "invalid request")
    still_serving(http, server)


def test_metrics(http, server):
    http.post("/v1/completions", json={"model": "tenant-1", "prompt": "Hi", "max_tokens": 2})
    text = http.get("/metrics").text
    for name in ("punica_requests_total", "punica_request_latency_seconds_bucket", "punica_time_to_first_token_seconds",
                 "punica_tokens_per_second", "punica_batch_size", "punica_kv_cache_usage", "punica_lora_slots_in_use",
                 "punica_queue_length"):
        assert name in text
    assert 'punica_requests_total{adapter="tenant-1",finish_reason="length"}' in text


def test_usage_and_metrics_report_prefix_cache_hits_per_adapter(http):
    prompt = "A prompt of its own, long enough for a few full pages of the KV cache: " * 4

    def cached(model):
        r = http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("tenant-2") == 0
    hit = cached("tenant-2")
    assert hit >= 32 and hit % 16 == 0
    assert cached("tenant-0") == 0, "another adapter never reads this KV"
    text = http.get("/metrics").text
    series = 'punica_prefix_cache_hit_tokens_total{adapter="tenant-2"}'
    line = next(x for x in text.splitlines() if x.startswith(series))
    assert float(line.split()[-1]) >= hit


def test_client_disconnect_aborts_and_frees_pages(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={"model": "tenant-0", "prompt": "Count:", "max_tokens": 2000,
                                                           "stream": True, "ignore_eos": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break
    server.wait_idle(timeout=60)
    assert not server.engine.has_unfinished() and server.engine.allocator.num_used == 0
