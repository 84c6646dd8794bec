"""The web console at ``GET /`` in a real headless browser: Debian's chromium driven by
Playwright (its own browser download is never used). The page loads with no console
errors, shows both packaged models, offers both to its chat box (the chat model with
embeddings on too), streams a chat answer, says the admin buttons need the admin key, and
with the key a load button changes the model's state live; opened again, it shows the
events the server holds. A screenshot is
saved in the test's folder and, if ``BUNKHOUSE_ARTIFACTS`` names a folder, there too."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.server import Server, serve
from tests.models import GEMMA, QWEN

CHROMIUM = os.environ.get("BUNKHOUSE_CHROMIUM", "/usr/bin/chromium")
# as this machine's notes start it: no sandbox as root, and none of the background
# connections a closed network refuses
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TIMEOUT_MS = 240_000  # a loaded machine loads a model slowly; each wait ends at its event


def browser_or_skip() -> None:
    if Path(CHROMIUM).exists():
        return
    message = f"no chromium at {CHROMIUM} (apt install chromium; .ci/run installs it)"
    if os.environ.get("BUNKHOUSE_REQUIRE_BROWSER"):
        pytest.fail(message)
    pytest.skip(message)


@contextlib.contextmanager
def console_page(url: str) -> Iterator[tuple[Any, list[str]]]:
    """The console of the server at ``url`` open in headless chromium (the test skipped
    where there is none): the page, and the errors its script raised so far."""
    browser_or_skip()
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            page = browser.new_page()
            page.set_default_timeout(120_000)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url + "/")
            yield page, errors
        finally:
            browser.close()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    browser_or_skip()
    config = tmp_path / "bunkhouse.toml"  # a chat model that embeds too
    config.write_text(f'[[models]]\nid = "{QWEN}"\nembeddings = true\n')
    with serve(tmp_path, "--context", "8192", "--admin-key", "admin-secret",
               "--config", str(config)) as s:
        yield s


def test_console_in_headless_chromium(server: Server, tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(TIMEOUT_MS)
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(server.url + "/")

            for model in (QWEN, GEMMA):
                page.wait_for_selector(f'#models tr[data-model="{model}"]')
            page.wait_for_selector("#live.on")  # the event stream is open
            assert page.locator(f'#models tr[data-model="{GEMMA}"] [data-state]'
                                ).get_attribute("data-state") == "absent"
            # the box offers what generates text, a chat model with embeddings on included
            offered = page.eval_on_selector_all("#chat-model option",
                                                "options => options.map(o => o.value)")
            assert sorted(offered) == sorted([QWEN, GEMMA]), offered
            # a browser's own EventSource is open at once, before any event or heartbeat
            assert page.evaluate("""() => new Promise((resolve) => {
                const source = new EventSource("/admin/events");
                source.onopen = () => { source.close(); resolve(source.url); };
            })""").endswith("/admin/events")

            # without the key, the buttons say what they need
            page.click(f'#models tr[data-model="{GEMMA}"] button[data-action="load"]')
            page.wait_for_selector("#admin-note.bad")
            assert "admin key" in page.inner_text("#admin-note")

            # a chat, streamed into the box
            page.select_option("#chat-model", QWEN)
            page.fill("#chat-input", "Write the word hello.")
            page.click("#chat-send")
            page.wait_for_selector('#chat-output[data-done="true"]')
            answer = page.inner_text("#chat-output")
            assert answer.strip() and "Error" not in answer, answer

            # with the admin key, load changes the state live (from the event stream)
            page.fill("#admin-key", "admin-secret")
            page.click("#keys button")
            page.click(f'#models tr[data-model="{GEMMA}"] button[data-action="load"]')
            page.wait_for_selector(
                f'#models tr[data-model="{GEMMA}"] [data-state="ready"]')
            page.wait_for_selector('#events li[data-kind="ready"]')
            page.wait_for_selector(f'#bar .seg[data-model="{GEMMA}"]')
            shot = tmp_path / "console.png"
            page.screenshot(path=str(shot), full_page=True)

            # a change made elsewhere reaches the page by its event stream alone
            unload = httpx.post(f"{server.url}/v1/models/{QWEN}/unload", timeout=120,
                                headers={"authorization": "Bearer admin-secret"})
            assert unload.status_code == 204
            page.wait_for_selector(f'#models tr[data-model="{QWEN}"] [data-state="absent"]')
            page.wait_for_selector('#events li[data-kind="absent"]')

            # a page opened now shows the events the server holds (newest first), and
            # then any that came since
            held = [e["kind"] for e in server.stats()["events"]
                    if e["kind"] != "load_progress"]
            page.reload()
            page.wait_for_selector("#live.on")
            shown = page.eval_on_selector_all("#events li",
                                              "items => items.map(i => i.dataset.kind)")
            assert held and shown[len(shown) - len(held):] == held[::-1], (shown, held)
        finally:
            browser.close()
    assert shot.stat().st_size > 10_000
    artifacts = os.environ.get("BUNKHOUSE_ARTIFACTS")
    if artifacts:
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(artifacts) / "console.png")
    assert not errors, errors


def test_console_with_client_keys_asks_for_one_and_clears_its_note(tmp_path: Path) -> None:
    browser_or_skip()
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    with serve(tmp_path, "--context", "8192", "--api-key", "client-secret") as server, \
            sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            page = browser.new_page()
            page.set_default_timeout(TIMEOUT_MS)
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(server.url + "/")
            page.wait_for_selector("#admin-note.bad")
            assert "Enter a client key above." in page.inner_text("#admin-note")
            assert page.locator("#models tbody tr").count() == 0  # nothing without a key
            page.fill("#client-key", "wrong")
            page.click("#keys button")
            page.fill("#client-key", "client-secret")
            page.click("#keys button")
            page.wait_for_selector(f'#models tr[data-model="{QWEN}"]')
            page.wait_for_selector("#admin-note:not(.bad)", state="attached")
            assert page.inner_text("#admin-note").strip() == ""
            # bunkhouse's own version, not the Ollama release /api/version names
            page.wait_for_selector(f"#version:text-is('v{version('bunkhouse')}')")
            page.wait_for_selector("#live.on")  # the stream reconnects with the key
        finally:
            browser.close()
    # the refused reads before the key are the browser's own 401 lines, nothing else
    assert all("status of 401" in e for e in errors), errors
