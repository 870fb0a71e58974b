"""Structured outputs, logit_bias, top logprobs, echo and tool calling through the official openai client."""

import json

import jsonschema
import openai
import pytest

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "population": {"type": "integer", "minimum": 0, "maximum": 10**7},
                                           "sunny": {"type": "boolean"}},
          "required": ["city", "population", "sunny"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["base", "tenant-1"])
def test_json_schema_and_json_object(client, server, model):
    model = server.state.base_model_name if model == "base" else model
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "A city, as JSON."}],
                                          response_format=fmt, max_tokens=80, temperature=0.7, seed=1)
    jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)
    completion = client.completions.create(model=model, prompt="A city as JSON:", max_tokens=80, temperature=0,
                                           extra_body={"response_format": fmt})
    jsonschema.validate(json.loads(completion.choices[0].text), SCHEMA)
    anything = client.chat.completions.create(model=model, messages=ASK, max_tokens=60, temperature=0,
                                              response_format={"type": "json_object"})
    assert anything.choices[0].finish_reason == "length" or isinstance(
        json.loads(anything.choices[0].message.content), dict)


@pytest.mark.slow
def test_vllm_fields_regex_choice_grammar(client, server):
    model = "tenant-0"
    regex = client.completions.create(model=model, prompt="A phone number:", max_tokens=20, temperature=0.9, seed=2,
                                      extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"})
    assert len(regex.choices[0].text) == 8 and regex.choices[0].text[3] == "-"
    choice = client.chat.completions.create(model=model, messages=ASK, max_tokens=10, temperature=0,
                                            extra_body={"guided_choice": ["sunny", "rainy"]})
    assert choice.choices[0].message.content in ("sunny", "rainy")
    grammar = client.completions.create(model=model, prompt="Count:", max_tokens=20, temperature=0,
                                        extra_body={"structured_outputs": {"grammar": 'root ::= "a" ("b" | "c")+ "."'}})
    text = grammar.choices[0].text
    assert text[0] == "a" and text[-1] == "." and set(text[1:-1]) <= {"b", "c"}


BAD_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}


@pytest.mark.parametrize("extra, param, fragment", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format.json_schema.schema", 'Unsupported type "objectx"'),
    ({"guided_json": {"type": "objectx"}}, "guided_json", "objectx"),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex", "parenthesis"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar", "undefined_rule"),
    ({"tools": [BAD_TOOL], "tool_choice": "required"}, "tools", "objectx"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format", "at most one"),
])
def test_invalid_constraints_are_a_400_naming_the_problem_and_the_field(client, extra, param, fragment):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tenant-0", messages=ASK, max_tokens=4, extra_body=extra)
    assert fragment in e.value.message and e.value.param == param
    if fragment != "at most one":  # the grammar engine's rejection names the request's own field
        assert f"{param} is not accepted by the grammar engine: " in e.value.message
        assert param.startswith("structured_outputs") or "structured_outputs" not in e.value.message


@pytest.mark.slow
def test_logit_bias_top_logprobs_and_echo(client, server):
    model = server.state.base_model_name
    biased = client.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0.8, seed=0,
                                       logit_bias={"42": 100}, logprobs=3)
    lp = biased.choices[0].logprobs
    assert len(lp.tokens) == 3 and all(len(top) == 3 for top in lp.top_logprobs)
    assert all(max(top.values()) >= chosen or tok in top for tok, chosen, top in
               zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
    token_42 = server.state.tokenizer.decode([42])
    assert lp.tokens == [token_42] * 3
    chat = client.chat.completions.create(model=model, messages=ASK, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=20)
    for entry in chat.choices[0].logprobs.content:
        values = [t.logprob for t in entry.top_logprobs]
        assert len(values) == 20 and values == sorted(values, reverse=True)
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob  # greedy
    echo = client.completions.create(model=model, prompt="Once upon a time", max_tokens=5, temperature=0, echo=True)
    plain = client.completions.create(model=model, prompt="Once upon a time", max_tokens=5, temperature=0)
    assert echo.choices[0].text == "Once upon a time" + plain.choices[0].text
    streamed = client.completions.create(model=model, prompt="Once upon a time", max_tokens=5, temperature=0,
                                         echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == echo.choices[0].text


def test_echo_with_logprobs_covers_the_prompt_streamed_or_not(client, server):
    """The prompt's tokens come first (the first without logprobs), then the generated ones with the
    logprobs a plain request gets; a stream sends the prompt's with its first chunk."""
    prompt = "The capital of France is"
    ids = server.state.tokenizer.encode(prompt)
    n = len(ids)
    kwargs = {"model": "tenant-1", "prompt": prompt, "max_tokens": 3, "temperature": 0, "logprobs": 2}
    echo = client.completions.create(echo=True, **kwargs).choices[0]
    plain = client.completions.create(**kwargs).choices[0].logprobs
    lp = echo.logprobs
    assert lp.tokens == [server.state.tokenizer.decode([t]) for t in ids] + plain.tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(value < 0 for value in lp.token_logprobs[1:n])
    assert lp.token_logprobs[n:] == pytest.approx(plain.token_logprobs, abs=1e-4)
    for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert len(top) == 2
        assert top[token] == pytest.approx(value, abs=1e-4) if token in top else min(top.values()) >= value
    assert lp.text_offset[0] == 0
    assert all(echo.text[o:o + len(t)] == t for o, t in zip(lp.text_offset[:n], lp.tokens[:n]))
    chunks = [c.choices[0].logprobs for c in client.completions.create(echo=True, stream=True, **kwargs)
              if c.choices and c.choices[0].logprobs]
    assert chunks[0].tokens[:n] == lp.tokens[:n] and chunks[0].token_logprobs[1:n] == pytest.approx(
        lp.token_logprobs[1:n], abs=1e-4)
    for name in ("tokens", "text_offset"):
        assert sum((getattr(c, name) for c in chunks), []) == getattr(lp, name)


def reassembled(stream) -> tuple[str | None, list[dict], str]:
    """(content, tool calls, finish_reason) of a streamed chat completion, put together from its deltas."""
    content, calls, reason = None, {}, None
    for chunk in stream:
        choice = chunk.choices[0]
        if choice.delta.content:
            content = (content or "") + choice.delta.content
        for d in choice.delta.tool_calls or ():
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = d.id or call["id"]
            call["name"] += (d.function.name or "") if d.function else ""
            call["arguments"] += (d.function.arguments or "") if d.function else ""
        reason = choice.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


@pytest.mark.slow
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
@pytest.mark.parametrize("model", ["base", "tenant-2"])
def test_required_and_named_tool_choice_always_call_and_stream_the_same(client, server, tool_choice, model):
    model = server.state.base_model_name if model == "base" else model
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed in range(3):
        # one call: a model free to call again and again (parallel_tool_calls) may not stop within max_tokens
        kwargs = dict(model=model, messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=80,
                      temperature=0.8, seed=seed, parallel_tool_calls=False)
        full = client.chat.completions.create(**kwargs)
        message = full.choices[0].message
        assert full.choices[0].finish_reason == "tool_calls" and len(message.tool_calls) == 1, message
        for call in message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            if isinstance(tool_choice, dict):
                assert call.function.name == "get_time"
            jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])
        content, calls, reason = reassembled(client.chat.completions.create(**kwargs, stream=True))
        assert reason == "tool_calls" and content == message.content
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c.function.name, c.function.arguments) for c in message.tool_calls]
        assert all(c["id"] and c["id"].startswith("call_") for c in calls)


@pytest.mark.slow
def test_tools_reach_the_prompt_and_auto_answers_text_or_calls(client, server):
    kwargs = dict(model=server.state.base_model_name, messages=ASK, tools=TOOLS, max_tokens=40, temperature=0)
    full = client.chat.completions.create(**kwargs)
    message = full.choices[0].message
    assert message.content or message.tool_calls
    content, calls, _ = reassembled(client.chat.completions.create(**kwargs, stream=True))
    assert content == message.content
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls or ()]
    usage_with, usage_without = full.usage.prompt_tokens, client.chat.completions.create(
        model=server.state.base_model_name, messages=ASK, max_tokens=1).usage.prompt_tokens
    assert usage_with > usage_without + 50  # the tools are in the prompt
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    follow = client.chat.completions.create(model=server.state.base_model_name, messages=history, tools=TOOLS,
                                            tool_choice="none", max_tokens=8, temperature=0)
    assert follow.choices[0].message.tool_calls is None and follow.choices[0].finish_reason in ("stop", "length")


def test_metrics_count_constrained_requests_and_compile_time(client, server):
    client.completions.create(model="tenant-1", prompt="Hi", max_tokens=2, extra_body={"guided_choice": ["a", "b"]})
    text = server_metrics(server)
    constrained = [line for line in text.splitlines() if line.startswith("punica_constrained_requests_total ")]
    compile_s = [line for line in text.splitlines() if line.startswith("punica_grammar_compile_seconds_total ")]
    assert float(constrained[0].split()[1]) >= 1 and float(compile_s[0].split()[1]) > 0


def server_metrics(server) -> str:
    import httpx

    return httpx.get(server.url + "/metrics", timeout=30).text
