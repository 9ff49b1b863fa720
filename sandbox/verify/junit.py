"""A verification as JUnit XML: one testsuite per verification, one testcase per expectation.

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
from sandbox.verify.verdict import Verification

_NOT_XML = re.compile("[^\u0009\u000a\u000d\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _x(text: str) -> str:
    return _NOT_XML.sub("\ufffd", text)


def junit_xml(verification: Verification, duration_s: float | None = None) -> str:
    results = verification.results
    failures = sum(not r.ok for r in results)
    suite = ET.Element(
        "testsuite",
        {
            "name": _x(f"sandbox verify {verification.workflow_name}/{verification.step_id}"),
            "tests": str(len(results)),
            "failures": str(failures),
            "errors": "0",
            "skipped": "0",
            "time": f"{duration_s or 0.0:.3f}",
            "timestamp": verification.at.strftime("%Y-%m-%dT%H:%M:%S"),
            "hostname": "sandbox",
            "id": "0",
            "package": _x(verification.workflow_name),
        },
    )
    ET.SubElement(suite, "properties")
    for result in results:
        case = ET.SubElement(
            suite,
            "testcase",
            {
                "name": _x(result.label),
                "classname": _x(f"{verification.workflow_name}.{verification.step_id}"),
                "time": "0.000",
            },
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
    out.text = _x("\n".join(verification.lines()))
    ET.SubElement(suite, "system-err").text = ""
    suites = ET.Element("testsuites")
    suites.append(suite)
    ET.indent(suites)
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"
    )


def write_junit(path: Path, verification: Verification, duration_s: float | None = None) -> None:
    write_json_atomic(path, junit_xml(verification, duration_s))
