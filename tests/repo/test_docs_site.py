"""The docs site, built strictly and opened in Debian's headless chromium.

Three pages are served from a local http.server on 127.0.0.1 (search needs http, not
file://): each loads with no console error and no request beyond the local server, and
the search box finds a word that is on only some pages.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from playwright.sync_api import sync_playwright

from tests import paths

ROOT = paths.REPO
PAGES = ("", "guides/verifying/", "reference/workflow-toml/")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    out = tmp_path_factory.mktemp("site")
    mkdocs = Path(sys.executable).with_name("mkdocs")
    subprocess.run(
        [str(mkdocs), "build", "--strict", "--quiet", "--site-dir", str(out)],
        cwd=ROOT,
        check=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    handler = functools.partial(_QuietHandler, directory=str(out))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def test_pages_load_cleanly_and_search_finds_a_word(site: str) -> None:
    chromium = shutil.which("chromium")
    assert chromium, "chromium is installed by scripts/ensure-chromium.sh (make test)"
    errors: list[str] = []
    outside: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on(
                "request",
                lambda r: None if r.url.startswith(site) else outside.append(r.url),
            )
            page.route(
                "**/*",
                lambda route: (
                    route.continue_() if route.request.url.startswith(site) else route.abort()
                ),
            )
            for path in PAGES:
                response = page.goto(site + path)
                assert response is not None and response.ok, path
                page.wait_for_load_state("networkidle")
                assert page.locator("h1").first.inner_text().strip(), path

            page.goto(site)
            page.wait_for_load_state("networkidle")
            page.keyboard.press("/")  # Material's search shortcut opens the box
            box = page.locator("input.md-search__input")
            box.wait_for(state="visible", timeout=10_000)
            box.press_sequentially("landlock", delay=20)
            result = page.locator(".md-search-result__item").first
            result.wait_for(state="visible", timeout=20_000)
            assert "landlock" in result.inner_text().lower()
        finally:
            browser.close()
    assert not errors, f"console errors: {errors}"
    assert not outside, f"requests beyond the local server: {outside}"
