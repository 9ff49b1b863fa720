"""What the record and a verification say is what happened, however the step hides it:
a file rewritten in place with its timestamp set back, a POST sent to an allowed
host's address instead of its name, an output flood past the engine's log cap.
Judged from outside: the real record, the real action log, the real verification."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from docker import DockerClient

from sandbox.contracts.config import load_workflow
from sandbox.contracts.layout import RunLayout
from sandbox.contracts.record import RunStatus
from sandbox.run.testrun import RunOptions, TestRun
from sandbox.verify.check import ExpectationResult
from sandbox.verify.expect import load_expectations
from sandbox.verify.finished import FinishedStep
from sandbox.verify.verifystep import judge
from tests.conftest import WorkflowFactory, tree_digest
from tests.fakes.harness import outside_server

pytestmark = pytest.mark.engine


def judge_toml(wf: Path, run_root: Path, toml: str) -> list[ExpectationResult]:
    (wf / "expect.toml").write_text(textwrap.dedent(toml))
    workflow = load_workflow(wf)
    step = workflow.step("step1").model_copy(update={"expect_file": "expect.toml"})
    return judge(FinishedStep.load(run_root), load_expectations(wf, workflow, step)).results


REWRITE_IN_PLACE = """
import os
st = os.stat("data.txt")
with open("data.txt", "r+b") as handle:
    handle.write(b"B" * st.st_size)  # same size, other bytes
os.utime("data.txt", ns=(st.st_atime_ns, st.st_mtime_ns))  # the old timestamps back
after = os.stat("data.txt")
assert (after.st_size, after.st_mtime_ns) == (st.st_size, st.st_mtime_ns)
print("rewritten")
"""


def test_a_file_rewritten_in_place_with_its_time_set_back_is_changed(
    engine: DockerClient, make_workflow: WorkflowFactory
) -> None:
    wf = make_workflow(
        command=["python3", "/workflow/code/step.py"],
        earlier_files={"data.txt": "A" * 4096, "other.txt": "left alone"},
        db_sql=None,
    )
    (wf / "code" / "step.py").write_text(REWRITE_IN_PLACE)
    before = tree_digest(wf)
    record = TestRun(wf, "step1").execute()
    assert tree_digest(wf) == before
    assert record.status is RunStatus.PASSED, record.stderr.text
    assert "rewritten" in record.stdout.text
    assert record.files.changed == ["data.txt"]
    assert record.files.created == [] and record.files.deleted == []
    run_root = RunLayout(wf, record.id, "g").root
    assert (run_root / "g" / "data.txt").read_bytes() == b"B" * 4096
    untouched, other = judge_toml(
        wf,
        run_root,
        """
        [[expect]]
        kind = "file"
        path = "data.txt"
        change = "untouched"

        [[expect]]
        kind = "file"
        path = "other.txt"
        change = "untouched"
        """,
    )
    assert not untouched.ok, untouched.line()
    assert other.ok, other.line()


POST_TO_ADDRESS = """
import json, urllib.request, urllib.error
def post(url):
    request = urllib.request.Request(url, data=b"x", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=20) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code
print(json.dumps({"post": post("http://OUTSIDE_V4:8080/effect")}))
"""

EGRESS = """
[egress]
allow = [{ host = "outside.test", port = 8080 }]
"""


def test_a_post_to_the_allowed_hosts_address_is_a_post_to_that_host(
    engine: DockerClient, make_workflow: WorkflowFactory
) -> None:
    """The step never names the host: it POSTs to its address. `no_call ... host=` of
    the name, in any spelling, does not pass as "never tried"."""
    wf = make_workflow(
        command=["python3", "/workflow/code/step.py"], extra_toml=EGRESS, db_sql=None
    )
    with outside_server(engine) as outside:
        (wf / "code" / "step.py").write_text(POST_TO_ADDRESS.replace("OUTSIDE_V4", outside.ipv4))
        record = TestRun(wf, "step1", RunOptions(upstream_networks=(outside.network,))).execute()
        assert outside.seen() == [], "a POST reached the outside"
    assert record.status is RunStatus.PASSED, record.stderr.text
    run_root = RunLayout(wf, record.id, "g").root
    results = judge_toml(
        wf,
        run_root,
        """
        [[expect]]
        kind = "no_call"
        method = "POST"
        host = "outside.test"

        [[expect]]
        kind = "no_call"
        method = "post"
        host = "OUTSIDE.test."

        [[expect]]
        kind = "no_call"
        method = "POST"
        host = "outside.test:8080"

        [[expect]]
        kind = "no_call"
        method = "POST"
        host = "outside.test:80"

        [[expect]]
        kind = "no_call"
        method = "POST"
        host = "elsewhere.test"
        """,
    )
    by_name, spelt, with_port, other_port, other_host = results
    assert not by_name.ok, by_name.line()
    assert "decision stub" in by_name.happened
    assert not spelt.ok, spelt.line()
    assert not with_port.ok, with_port.line()
    assert other_port.ok, other_port.line()  # 80 is not the port it went to
    assert other_host.ok, other_host.line()


FLOOD_BYTES = 150 * 1024**2


def test_an_output_flood_is_counted_to_the_byte(
    engine: DockerClient, make_workflow: WorkflowFactory
) -> None:
    wf = make_workflow(
        command=["sh", "-c", f"head -c {FLOOD_BYTES} /dev/zero; printf 'a tail' >&2"],
        db_sql=None,
    )
    record = TestRun(wf, "step1").execute()
    assert record.status is RunStatus.PASSED, record.stderr.text
    assert record.stdout.total_bytes == FLOOD_BYTES
    assert record.stdout.truncated
    assert record.stderr.text.startswith("a tail")  # the other stream kept apart
