"""The bridge's front (its one HTTP path): every kind of request the step can make,
its answer and its line, malformed and oversized ones included (in-process guard;
the forwarded calls go to a real upstream server on loopback)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sandbox.contracts.wire import ActionLine
from sandbox.guard.app import build_app
from sandbox.guard.bridge.front import Answer, BridgeFront
from tests.guard.bridge.bridgeparts import (
    AUTH,
    REQUESTS,
    Request,
    Upstream,
    call_body,
    make_guard,
    ok,
)


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    server = Upstream(lambda n, body: ok(f"reply {n}"))
    yield server
    server.close()


async def _send(
    app: Any, requests: list[Request]
) -> list[tuple[int, str | None, str | None, bytes]]:
    transport = httpx.ASGITransport(app=app)
    answers = []
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8790") as client:
        for method, path, headers, body in requests:
            content = body() if callable(body) else body
            fields = [
                (name, one)
                for name, value in headers.items()
                for one in (value if isinstance(value, list) else [value])
            ]
            r = await client.request(method, path, headers=fields, content=content)
            answers.append(
                (
                    r.status_code,
                    r.headers.get("content-type"),
                    r.headers.get("connection"),
                    r.content,
                )
            )
    return answers


# What each of REQUESTS gets: its status, and the line (tool, decision, category) each
# answer from the guard's own code writes first, in order.
STATUSES = [
    200, 200, 200, 200, 200, 200, 401, 401, 401, 400, 401, 400, 400, 400, 400,
    400, 413, 413, 431, 431, 200, 200, 200, 400, 400, 401, 413, 404, 200, 401,
]  # fmt: skip
REFUSED = ("?", "refuse", "request")
LINES = [
    ("notify_user", "stub", "messaging"),
    ("generate_text_llm", "allow", "model"),  # its start line
    ("generate_text_llm", "allow", "model"),  # its outcome line
    ("read_file", "allow", "local"),
    ("read_file", "allow", "local"),
    ("no_such_tool_anywhere", "stub", "unknown"),
    ("notify_user", "refuse", "session"),
    *[REFUSED] * 10,
    ("/v1/tools/call", "refuse", "request"),
    ("/v1/tools/call", "refuse", "request"),
    ("/v1/tools/call", "refuse", "request"),
    ("/v1/health", "refuse", "request"),
    ("session.create", "allow", "session"),
    ("session.create", "allow", "session"),
    ("session.create", "allow", "session"),
    *[REFUSED] * 3,
    ("/v1/sessions", "refuse", "request"),
    ("mcp", "refuse", "request"),
]


def test_every_request_gets_its_answer_and_its_line(tmp_path: Path, upstream: Upstream) -> None:
    """The front is the bridge's one HTTP path: every kind of request, malformed and
    oversized ones included, gets its status and a JSON body, and every refusal from
    the guard's own code has its line."""
    guard, actions = make_guard(tmp_path, "front", upstream.url)

    async def main() -> list[Any]:
        front = build_app(guard)
        assert isinstance(front, BridgeFront)
        answers = await _send(front, REQUESTS)
        await guard.close()
        return answers

    answers = asyncio.run(main())
    assert [a[0] for a in answers] == STATUSES
    for request, (status, media, connection, body) in zip(REQUESTS, answers, strict=True):
        where = f"{request[0]} {request[1]} {request[3]!r:.60}"
        if request[1] == "/v1/nope":  # not a bridge path: the app behind answers
            continue
        assert media == "application/json", where
        assert connection == ("close" if status in (413, 431) else None), where
        reply = json.loads(body)
        assert (set(reply) == {"error"}) == (status >= 400), where
    statuses = [a[0] for a in answers]
    assert statuses.count(401) == 6 and statuses.count(413) == 3 and statuses.count(431) == 2
    assert statuses.count(400) >= 7
    lines = [ActionLine.model_validate_json(x) for x in actions.read_text().split("\n")[:-1]]
    assert [(x.tool, x.decision, x.category) for x in lines] == LINES
    # Every refused request has its line: one per 4xx from the guard's own code.
    refused = [x for x in lines if x.category == "request"]
    guard_4xx = [
        a for req, a in zip(REQUESTS, answers, strict=True) if a[0] >= 400 and req[1] != "/v1/nope"
    ]
    assert len(refused) == len(guard_4xx)
    # The forwarded call went out exactly once.
    assert len(upstream.requests) == 1


def test_a_wrong_method_or_a_trailing_slash_is_refused_with_its_line(
    tmp_path: Path, upstream: Upstream
) -> None:
    """A wrong method or a bridge path with a trailing slash is refused (not a bare
    405 with no line, not a redirect), the refusal is on disk, and nothing is forwarded."""
    guard, actions = make_guard(tmp_path, "front", upstream.url)
    requests: list[Request] = [
        ("GET", "/v1/tools/call", AUTH, b""),
        ("PUT", "/v1/tools/call", AUTH, call_body("generate_text_llm", prompt="p")),
        ("GET", "/v1/sessions", AUTH, b""),
        ("POST", "/v1/health", AUTH, b"{}"),
        ("POST", "/v1/tools/call/", AUTH, call_body("generate_text_llm", prompt="p")),
        ("POST", "/v1/sessions//", AUTH, b"{}"),
    ]

    async def main() -> list[Any]:
        answers = await _send(build_app(guard), requests)
        await guard.close()
        return answers

    answers = asyncio.run(main())
    assert [a[0] for a in answers] == [405, 405, 405, 405, 404, 404]
    assert all(a[1] == "application/json" and "error" in json.loads(a[3]) for a in answers)
    lines = [ActionLine.model_validate_json(x) for x in actions.read_text().splitlines()]
    assert [(x.tool, x.decision, x.category) for x in lines] == [
        (path, "refuse", "request") for _, path, _, _ in requests
    ]
    assert "not allowed" in lines[0].reason and "no such path" in lines[4].reason
    assert upstream.requests == []


@pytest.mark.parametrize(
    "answer",
    [
        Answer(200, b'{"ok":true}'),
        Answer(413, b"{}", close=True),
        Answer(405, b"", extra=[(b"allow", b"POST")]),
        Answer(400, b"x" * 1000, close=True, extra=[(b"allow", b"GET, HEAD")]),
    ],
)
def test_an_answer_s_field_lines_are_its_fields_written_out(answer: Answer) -> None:
    """The guard's own protocol writes the fields ASGI is given, in the same order."""
    written = b"".join(name + b": " + value + b"\r\n" for name, value in answer.fields())
    assert answer.field_lines() == written
