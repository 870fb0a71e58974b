"""The playground page in headless Chromium: it loads, and one click streams two adapters' answers."""

import shutil

import pytest

CHROMIUM = shutil.which("chromium")


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_playground_streams_two_adapters(server):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        try:
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
        finally:
            browser.close()
