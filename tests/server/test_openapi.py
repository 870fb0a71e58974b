"""No /docs or /redoc (their pages load scripts from the internet); /openapi.json needs the API key."""

import httpx
import pytest


@pytest.fixture(scope="module")
def keyed(tokenizer, start_server, stub_state):
    running = start_server(stub_state(tokenizer, api_key="sekret"))
    yield running
    running.stop()


def test_docs_and_redoc_are_gone(keyed):
    for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
        assert httpx.get(keyed.url + path).status_code == 404


def test_openapi_needs_the_api_key(keyed):
    r = httpx.get(keyed.url + "/openapi.json")
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert httpx.get(keyed.url + "/openapi.json", headers={"Authorization": "Bearer wrong"}).status_code == 401
    schema = httpx.get(keyed.url + "/openapi.json", headers={"Authorization": "Bearer sekret"}).json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(schema["paths"])
    assert "/openapi.json" not in schema["paths"]


def test_openapi_is_open_without_an_api_key(tokenizer, start_server, stub_state):
    running = start_server(stub_state(tokenizer))
    try:
        assert "/v1/completions" in httpx.get(running.url + "/openapi.json").json()["paths"]
    finally:
        running.stop()
