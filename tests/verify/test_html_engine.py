"""The HTML report of a real verified run, opened in Debian's headless chromium.

It must render, show the verdict and then the stubbed actions before anything
else, and make no request at all beyond loading its own file (every request the
page makes is recorded by the browser driver and none is let through).
"""

from __future__ import annotations

import contextlib
import shutil
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from docker import DockerClient
from playwright.sync_api import Page, Route, sync_playwright

from sandbox.cli import main
from sandbox.contracts.layout import RunLayout
from sandbox.verify.verifystep import verify_step
from tests.conftest import write_workflow
from tests.verify.recordparts import finished_run

pytestmark = pytest.mark.engine

STEP = """
import agentworks_bridge as b, pathlib, sqlite3, os
b.call("send_slack_message", {"channel": "@dana", "text": "<img src=http://outside.test/x.png> hi"})
b.call("notify_user", {"text": "<script>fetch('http://outside.test/')</script>"})
db = sqlite3.connect(os.environ["DB_PATH"])
db.execute("INSERT INTO t VALUES (2, '<iframe src=http://outside.test/>')")
db.commit()
pathlib.Path("<b>out<i>.txt").write_text("x")
"""

EXPECT = """
[[steps.expect]]
kind = "call"
tool = "send_slack_message"
count = 1

[[steps.expect]]
kind = "no_call"
tool = "notify_user"
"""


@contextlib.contextmanager
def browse(out: Path) -> Iterator[Page]:
    """The report opened in chromium; on leaving, no request was made but for its file."""
    chromium = shutil.which("chromium")
    assert chromium, "chromium is installed by scripts/ensure-chromium.sh (make test)"
    requests: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page()

            def refuse(route: Route) -> None:
                requests.append(route.request.url)
                if route.request.url == out.as_uri():
                    route.continue_()
                else:
                    route.abort()

            page.route("**/*", refuse)
            page.on("request", lambda r: requests.append("seen " + r.url))
            page.goto(out.as_uri())
            page.wait_for_load_state("load")
            yield page
            assert page.evaluate("document.scripts.length + document.images.length") == 0
        finally:
            browser.close()
    assert [r for r in requests if not r.endswith(out.as_uri())] == [], requests


def test_report_renders_verdict_first_and_reaches_nothing(
    engine: DockerClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wf = write_workflow(tmp_path, command=["python3", "/workflow/code/step.py"], extra_toml=EXPECT)
    (wf / "code" / "step.py").write_text(textwrap.dedent(STEP))
    verification = verify_step(wf, "step1")
    assert not verification.passed  # notify_user was tried
    run = RunLayout(wf, verification.run_id, "g").root
    out = tmp_path / "report.html"
    assert main(["report", str(run), "--html", str(out)]) == 0
    text = out.read_text()
    assert "<script" not in text and "<img" not in text and "<iframe" not in text
    assert "&lt;script&gt;" in text

    with browse(out) as page:
        ids = page.eval_on_selector_all("section", "els => els.map(e => e.id)")
        assert ids == [
            "verdict",
            "effects",
            "stubbed",
            "timeline",
            "db",
            "files",
            "egress",
            "preflight",
        ]
        tops = [page.locator(f"#{i}").bounding_box()["y"] for i in ids]  # type: ignore[index]
        assert tops == sorted(tops)
        verdict = page.inner_text("#verdict")
        assert verdict.split()[:2] == ["Verdict", "FAIL:"]
        assert "FAIL: 2 of 3 expectation(s) held" in verdict
        assert "notify_user is never tried" in verdict
        assert "stubbed call(s)" in page.inner_text("#effects")
        stubbed = page.inner_text("#stubbed")
        assert "send_slack_message" in stubbed and "notify_user" in stubbed
        assert "<img src=http://outside.test/x.png> hi" in stubbed  # shown as text
        assert "<b>out<i>.txt" in page.inner_text("#files")
        assert page.locator("#db table").count() == 1  # the DB diff as a table
        assert "<iframe src=http://outside.test/>" in page.inner_text("#db table")
        timeline = page.inner_text("#timeline")
        assert "send_slack_message\tstub" in timeline and "root" in timeline
    capsys.readouterr()


def test_what_changed_against_another_run_renders_as_text_and_reaches_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`report RUN --against RUN_B`: the section right after the verdict, the first
    divergence first; a hostile argument in it is text, and the page still reaches nothing."""
    runs = tmp_path / "wf" / "runs"
    slack = ("send_slack_message", "stub", {"channel": "@dana", "text": "hi"})
    before = finished_run(runs / "test-before", [slack])
    hostile = "<img src=http://outside.test/y.png><script>fetch('http://outside.test/')</script>"
    after = finished_run(runs / "test-after", [(*slack[:2], slack[2] | {"text": hostile})])
    out = tmp_path / "report.html"
    assert main(["report", str(after), "--html", str(out), "--against", str(before)]) == 0
    text = out.read_text()
    assert "<script" not in text and "<img" not in text
    with browse(out) as page:
        ids = page.eval_on_selector_all("section", "els => els.map(e => e.id)")
        assert ids[:3] == ["verdict", "against", "effects"]
        section = [line for line in page.inner_text("#against").splitlines() if line]
        assert section[:3] == [
            "What changed against test-before",
            "A: test run test-before of s",
            "B: test run test-after of s",
        ]
        assert (
            "first divergence: call changed: send_slack_message at A #1 / B #1: "
            f'text "hi" -> "{hostile}"'
        ) in section[3]
    capsys.readouterr()
