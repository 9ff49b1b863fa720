"""The HTML report of a real verified run, opened in Debian's headless chromium.

It must render, show the verdict and then the stubbed actions before anything
else, and make no request at all beyond loading its own file (every request the
page makes is recorded by the browser driver and none is let through).
"""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest
from docker import DockerClient
from playwright.sync_api import Route, sync_playwright

from sandbox.cli import main
from sandbox.contracts.layout import RunLayout
from sandbox.verify.verifystep import verify_step
from tests.conftest import write_workflow

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


def test_report_renders_verdict_first_and_reaches_nothing(
    engine: DockerClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    chromium = shutil.which("chromium")
    assert chromium, "chromium is installed by scripts/ensure-chromium.sh (make test)"
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
            assert page.evaluate("document.scripts.length + document.images.length") == 0
        finally:
            browser.close()
    assert [r for r in requests if not r.endswith(out.as_uri())] == [], requests
    capsys.readouterr()
