"""The playground page in headless Chromium: it loads, one click streams two adapters' answers,
and behind an API key it lists the models once the key is typed."""

import shutil
from contextlib import contextmanager

import pytest

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")


@contextmanager
def chromium():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        try:
            yield browser
        finally:
            browser.close()


@needs_chromium
def test_playground_streams_two_adapters(server):
    with chromium() as browser:
        page = browser.new_page()
        page.goto(server.url + "/")
        page.wait_for_selector("#models input[value='tenant-1']")
        for box in page.query_selector_all("#models input"):
            if box.is_checked():
                box.uncheck()
        page.check("#models input[value='tenant-1']")
        page.check("#models input[value='tenant-2']")
        page.fill("#max-tokens", "8")
        page.click("#send")
        for model in ("tenant-1", "tenant-2"):
            page.wait_for_function(f"document.querySelector(\"pre[data-model='{model}']\").textContent.length > 3",
                                   timeout=60_000)
        texts = {m: page.text_content(f"pre[data-model='{m}']") for m in ("tenant-1", "tenant-2")}
        assert len(page.query_selector_all(".answer")) == 2
        assert all(texts.values()) and not page.query_selector_all(".error")


@needs_chromium
def test_playground_lists_the_models_once_the_api_key_is_typed(tokenizer, start_server, stub_state):
    running = start_server(stub_state(tokenizer, api_key="sekret", adapters={"tenant-a": "/a", "tenant-b": "/b"}))
    try:
        with chromium() as browser:
            page = browser.new_page()
            page.goto(running.url + "/")
            page.wait_for_selector("#models.error")
            assert "API key" in page.text_content("#models") and "401" in page.text_content("#models")
            with page.expect_response(lambda r: r.url.endswith("/v1/models") and r.status == 401):
                page.fill("#api-key", "wrong")  # asked again, refused again
            assert not page.query_selector_all("#models input")
            assert "API key" in page.text_content("#models.error")
            page.fill("#api-key", "sekret")
            page.wait_for_selector("#models input[value='tenant-b']")
            assert page.get_attribute("#models", "class") == ""
            assert [i.get_attribute("value") for i in page.query_selector_all("#models input")] == [
                "base", "tenant-a", "tenant-b"]
    finally:
        running.stop()
