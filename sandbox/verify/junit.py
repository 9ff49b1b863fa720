"""A verification as JUnit XML: one testsuite per verification, one testcase per expectation.

A workflow's verification is one testsuite per step that had expectations and
one for the chain (`<workflow>.chain`), in one `<testsuites>`.

The shape CI tools read (the Jenkins/Ant JUnit schema): a failed expectation is a
`<failure>` whose message is what happened and whose text is the evidence; the
run's digest goes in `<system-out>`. Text from the run (tool arguments, file
content) is only ever character data, escaped by the XML writer, with characters
XML cannot carry replaced.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

from sandbox.contracts.record import write_json_atomic
from sandbox.verify.check import ExpectationResult
from sandbox.verify.verification import Verification
from sandbox.verify.workflow_verification import WorkflowVerification

_NOT_XML = re.compile("[^\u0009\u000a\u000d\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _x(text: str) -> str:
    return _NOT_XML.sub("\ufffd", text)


def _suite(
    name: str,
    classname: str,
    package: str,
    results: list[ExpectationResult],
    at: str,
    out_lines: list[str],
    suite_id: int,
    duration_s: float | None,
) -> ET.Element:
    suite = ET.Element(
        "testsuite",
        {
            "name": _x(name),
            "tests": str(len(results)),
            "failures": str(sum(not r.ok for r in results)),
            "errors": "0",
            "skipped": "0",
            "time": f"{duration_s or 0.0:.3f}",
            "timestamp": at,
            "hostname": "sandbox",
            "id": str(suite_id),
            "package": _x(package),
        },
    )
    ET.SubElement(suite, "properties")
    for result in results:
        case = ET.SubElement(
            suite,
            "testcase",
            {"name": _x(result.label), "classname": _x(classname), "time": "0.000"},
        )
        if not result.ok:
            failure = ET.SubElement(
                case,
                "failure",
                {
                    "message": _x(f"expected {result.expected}; {result.happened}"),
                    "type": result.kind,
                },
            )
            failure.text = _x("\n".join(result.evidence) or result.happened)
    out = ET.SubElement(suite, "system-out")
    out.text = _x("\n".join(out_lines))
    ET.SubElement(suite, "system-err").text = ""
    return suite


def _document(suites: ET.Element) -> str:
    ET.indent(suites)
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"
    )


def junit_xml(verification: Verification, duration_s: float | None = None) -> str:
    suites = ET.Element("testsuites")
    suites.append(
        _suite(
            f"sandbox verify {verification.workflow_name}/{verification.step_id}",
            f"{verification.workflow_name}.{verification.step_id}",
            verification.workflow_name,
            verification.results,
            verification.at.strftime("%Y-%m-%dT%H:%M:%S"),
            verification.lines(),
            0,
            duration_s,
        )
    )
    return _document(suites)


def workflow_junit_xml(verification: WorkflowVerification, duration_s: float | None = None) -> str:
    name = verification.workflow_name
    at = verification.at.strftime("%Y-%m-%dT%H:%M:%S")
    suites = ET.Element("testsuites")
    judged = [s for s in verification.steps if s.results]
    for suite_id, step in enumerate(judged):
        lines = [f"step {step.index} {step.step_id}: {step.status}"]
        lines += step.digest.lines() if step.digest is not None else []
        suites.append(
            _suite(
                f"sandbox verify-workflow {name}/{step.step_id}",
                f"{name}.{step.step_id}",
                name,
                step.results,
                at,
                lines,
                suite_id,
                None,
            )
        )
    suites.append(
        _suite(
            f"sandbox verify-workflow {name} (chain)",
            f"{name}.chain",
            name,
            verification.chain,
            at,
            verification.lines(),
            len(judged),
            duration_s,
        )
    )
    return _document(suites)


def write_junit(path: Path, verification: Verification, duration_s: float | None = None) -> None:
    write_json_atomic(path, junit_xml(verification, duration_s))


def write_workflow_junit(path: Path, verification: WorkflowVerification) -> None:
    write_json_atomic(path, workflow_junit_xml(verification))
