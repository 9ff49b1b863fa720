"""A fake job-board API that plays the real bridge upstream for the job-board example.

Why: tests must prove that a test run's reads reach the outside world and its
effects never do. This server is that outside world. It answers the guard's
`POST /v1/tools/call` (a `sandbox.contracts.wire.UpstreamCall` body, `X-Agentworks-Run-Kind`
header) with a `ToolResult`, records every call it receives, and lets write
tools change in-memory state that `GET /state` shows, so a test asserts "no
proposal, no message, no click reached it" on real evidence.

Standard library only (it runs as `python3 server.py --port 8080` in a plain
Debian python3 container); nothing is logged per request; SIGTERM and SIGINT
stop it cleanly (exit 0). It is a test double: no auth, no persistence.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType
from typing import Any

RUN_KIND_HEADER = "X-Agentworks-Run-Kind"  # as sandbox.contracts.wire.RUN_KIND_HEADER
MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_SLEEP_S = 120.0
START_CONNECTS = 100
IDENTITY_FIELDS = ("run_id", "session", "workflow", "step", "run_kind")

JOBS: dict[int, dict[str, Any]] = {
    41: {"id": 41, "title": "Scrape a product catalog", "budget": 300, "status": "taken"},
    42: {"id": 42, "title": "Build a Flask dashboard", "budget": 500, "status": "open"},
    43: {"id": 43, "title": "Fix a Django migration", "budget": 250, "status": "open"},
}
JOB_URL = "https://jobs.example.org/{id}"

PROPOSAL_TEXT = (
    "Hello! I have built several Flask dashboards with charts, auth and a SQLite or "
    "Postgres backend. For your project I would start with a short call to pin down "
    "the metrics, deliver a first working version within a week, and iterate from "
    "there. Fixed price within your budget."
)

# agent_browser verbs that only read (the spec's list); every other verb is an action.
BROWSER_READ_VERBS = frozenset(
    {
        "status",
        "skills",
        "tab",
        "open",
        "goto",
        "navigate",
        "back",
        "forward",
        "reload",
        "snapshot",
        "get",
        "is",
        "screenshot",
        "pdf",
        "console",
        "errors",
        "wait",
        "scroll",
    }
)


def job_page_text(job: dict[str, Any]) -> str:
    return (
        f"{job['title']}\n"
        f"Budget: ${job['budget']} (fixed price)\n"
        f"Status: {job['status']}\n"
        "Description: We need an internal dashboard in Flask that shows weekly sales "
        "and signups from our SQLite DB, with login and CSV export.\n"
        "Proposals: 5 to 10\n"
        "[Submit a proposal]"
    )


class ToolFailure(Exception):
    """A tool call that answers `is_error: true` with this message."""


class JobBoard:
    """The fake world's state. One lock guards it; handlers run on many threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.calls: list[dict[str, Any]] = []
            self.proposals: list[dict[str, Any]] = []
            self.messages: list[dict[str, Any]] = []
            self.clicks: list[dict[str, Any]] = []
            self.connects = START_CONNECTS

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            copy: dict[str, Any] = json.loads(
                json.dumps(
                    {
                        "calls": self.calls,
                        "proposals": self.proposals,
                        "messages": self.messages,
                        "clicks": self.clicks,
                        "connects": self.connects,
                    }
                )
            )
        return copy

    def record(self, entry: dict[str, Any]) -> None:
        with self._lock:
            self.calls.append(entry)

    # ------------------------------------------------------------------ tools

    def call(self, tool: str, args: dict[str, Any], who: dict[str, Any]) -> dict[str, Any]:
        """Run one tool; returns a ToolResult dict. Never raises for a bad call."""
        handlers = {
            "generate_text_llm": self._generate_text_llm,
            "agent_browser": self._agent_browser,
            "web_fetch": self._web_fetch,
            "slow_read": self._slow_read,
            "upwork_submit_proposal": self._submit_proposal,
            "send_slack_message": self._message,
            "notify_user": self._message,
            "send_email": self._message,
        }
        handler = handlers.get(tool)
        if handler is None:
            return _result(f"unknown tool: {tool!r}", is_error=True)
        try:
            result: dict[str, Any] = handler(tool, args, who)
            return result
        except ToolFailure as exc:
            return _result(f"{tool}: {exc}", is_error=True)

    def _generate_text_llm(
        self, tool: str, args: dict[str, Any], who: dict[str, Any]
    ) -> dict[str, Any]:
        prompt = args.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise ToolFailure("'prompt' must be a non-empty string")
        _sleep(args.get("delay_s", 0))  # lets budget tests slow an allowed model call
        return _result(PROPOSAL_TEXT, {"model": "fake-llm", "prompt_chars": len(prompt)})

    def _agent_browser(
        self, tool: str, args: dict[str, Any], who: dict[str, Any]
    ) -> dict[str, Any]:
        command = args.get("command")
        if not isinstance(command, str) or not command.split():
            raise ToolFailure("'command' must be a non-empty string")
        verb, _, rest = command.strip().partition(" ")
        verb = verb.lower()
        job = JOBS[42]
        if verb not in BROWSER_READ_VERBS:
            with self._lock:
                self.clicks.append({"command": command, **who})
            return _result(f"Done: {command}")
        if verb in {"open", "goto", "navigate"}:
            url = rest.strip() or JOB_URL.format(id=42)
            return _result(f"Opened {url}: {job['title']}", {"url": url, "title": job["title"]})
        if verb == "get":
            return _result(job_page_text(job), {"job": job})
        if verb == "snapshot":
            snap = (
                f'- heading "{job["title"]}" [ref=e1]\n'
                f'- text "Budget: ${job["budget"]}" [ref=e2]\n'
                '- button "Submit a proposal" [ref=e3]'
            )
            return _result(snap)
        return _result(f"ok: {command}")

    def _web_fetch(self, tool: str, args: dict[str, Any], who: dict[str, Any]) -> dict[str, Any]:
        url = args.get("url")
        if not isinstance(url, str) or not url:
            raise ToolFailure("'url' must be a non-empty string")
        _sleep(args.get("delay_s", 0))
        match = re.search(r"(\d+)/?(?:[?#].*)?$", url)
        job_id = int(match.group(1)) if match else 42
        job = JOBS.get(job_id)
        if job is None:
            raise ToolFailure(f"404 no job {job_id}")
        return _result(json.dumps(job), dict(job))

    def _slow_read(self, tool: str, args: dict[str, Any], who: dict[str, Any]) -> dict[str, Any]:
        slept = _sleep(args.get("seconds", 1))
        return _result(f"slept {slept:g}s", {"seconds": slept})

    def _submit_proposal(
        self, tool: str, args: dict[str, Any], who: dict[str, Any]
    ) -> dict[str, Any]:
        job_id, text, connects = args.get("job_id"), args.get("text"), args.get("connects")
        if not isinstance(job_id, int) or job_id not in JOBS:
            raise ToolFailure(f"no such job: {job_id!r}")
        if not isinstance(text, str) or not text.strip():
            raise ToolFailure("'text' must be a non-empty string")
        if not isinstance(connects, int) or isinstance(connects, bool) or connects <= 0:
            raise ToolFailure("'connects' must be a positive integer")
        with self._lock:
            if connects > self.connects:
                raise ToolFailure(f"not enough Connects ({self.connects} left)")
            self.connects -= connects
            proposal = {
                "id": len(self.proposals) + 1,
                "job_id": job_id,
                "text": text,
                "connects": connects,
                **who,
            }
            self.proposals.append(proposal)
            left = self.connects
        return _result(
            f"Proposal {proposal['id']} submitted for job {job_id}: "
            f"{connects} Connects spent, {left} left.",
            {"proposal_id": proposal["id"], "connects_left": left},
        )

    def _message(self, tool: str, args: dict[str, Any], who: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self.messages.append({"tool": tool, "arguments": args, **who})
        return _result(f"{tool}: delivered", {"delivered": True})


def _result(text: str, data: Any = None, *, is_error: bool = False) -> dict[str, Any]:
    return {"text": text, "data": data, "is_error": is_error}


def _sleep(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ToolFailure("sleep seconds must be a non-negative number")
    seconds = min(float(value), MAX_SLEEP_S)
    if seconds:
        time.sleep(seconds)
    return seconds


class Handler(BaseHTTPRequestHandler):
    server_version = "fake-jobboard/1"
    protocol_version = "HTTP/1.1"
    # Headers and body go out in two sends; with Nagle on, each keep-alive reply
    # waits for the client's delayed ACK (about 40 ms).
    disable_nagle_algorithm = True
    board: JobBoard  # set on the subclass made by make_server

    def log_message(self, format: str, *args: Any) -> None:  # quiet: no per-request lines
        return

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send(200, {"ok": True})
        elif self.path == "/state":
            self._send(200, self.board.snapshot())
        else:
            self._send(404, {"error": f"no such path: {self.path}"})

    def do_POST(self) -> None:
        if self.path not in {"/v1/tools/call", "/reset"}:
            self._drain()
            self._send(404, {"error": f"no such path: {self.path}"})
            return
        body = self._read_body()
        if body is None:
            return
        if self.path == "/reset":
            self.board.reset()
            self._send(200, {"ok": True})
            return
        self._tool_call(body)

    def _tool_call(self, raw: bytes) -> None:
        header = self.headers.get(RUN_KIND_HEADER)
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict) or not isinstance(body.get("tool"), str):
            # Even a malformed call is evidence that something reached the outside.
            self.board.record({"malformed": True, "run_kind_header": header, "time": time.time()})
            self._send(400, {"error": "body must be a JSON object with a string 'tool'"})
            return
        tool: str = body["tool"]
        args = body.get("arguments")
        args = args if isinstance(args, dict) else {}
        who = {key: body.get(key) for key in IDENTITY_FIELDS}
        self.board.record(
            {"tool": tool, "arguments": args, **who, "run_kind_header": header, "time": time.time()}
        )
        self._send(200, self.board.call(tool, args, who))

    def _read_body(self) -> bytes | None:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length < 0 or length > MAX_BODY_BYTES:
            self.close_connection = True
            self._send(413 if length > 0 else 400, {"error": "bad or too large Content-Length"})
            return None
        return self.rfile.read(length)

    def _drain(self) -> None:
        with_body = self.headers.get("Content-Length", "0")
        if with_body.isdigit() and 0 < int(with_body) <= MAX_BODY_BYTES:
            self.rfile.read(int(with_body))
        else:
            self.close_connection = True

    def _send(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class QuietServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        return  # a client that hangs up mid-reply is not worth a traceback on stderr


def make_server(host: str, port: int, board: JobBoard | None = None) -> QuietServer:
    handler = type("BoundHandler", (Handler,), {"board": board or JobBoard()})
    return QuietServer((host, port), handler)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8080, help="0 picks a free port")
    opts = parser.parse_args(argv)
    server = make_server(opts.host, opts.port)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if not stop.is_set():
            stop.set()
            # shutdown() waits for serve_forever() to return, so not on this thread.
            threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    host, port = server.server_address[:2]
    print(f"fake job-board API listening on http://{host!s}:{port}", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
