"""git's smart-HTTP fetch (`POST .../git-upload-pack`) is a read: through the real
proxy, against a fake host on loopback, it is forwarded with its body and its reply
relayed; a push (`git-receive-pack`) and every POST that only resembles a fetch are
stubbed, recorded, and never reach the host."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from pathlib import Path

import pytest

from sandbox.policy import HttpKind, http_kind, stub_reply
from tests.guard.egress.proxyparts import Host, actions_file, allowing_proxy, http_lines, through

FETCH_TYPE = "application/x-git-upload-pack-request"
PACK = b"HTTP/1.1 200 OK\r\nContent-Type: application/x-git-upload-pack-result\r\n"
PACK += b"Content-Length: 8\r\n\r\n0008NAK\n"
WANT = b"0032want 0123456789012345678901234567890123456789\n00000009done\n"


class BodyHost(Host):
    """A host that reads each request's whole Content-Length body before it answers."""

    def _serve(self, conn: socket.socket, number: int) -> None:
        with conn, contextlib.suppress(ConnectionError):
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            while len(body) < length:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                body += chunk
            self.received.append(data if not body else head + b"\r\n\r\n" + body)
            conn.sendall(self.reply)


def _post(port: int, path: str, content_type: str | None, body: bytes = WANT) -> bytes:
    authority = f"127.0.0.1:{port}"
    lines = [f"POST http://{authority}{path} HTTP/1.1", f"Host: {authority}"]
    if content_type is not None:
        lines.append(f"Content-Type: {content_type}")
    lines += [f"Content-Length: {len(body)}", "Connection: close"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def test_a_git_fetch_is_forwarded_with_its_body_and_its_pack_relayed(tmp_path: Path) -> None:
    with actions_file(tmp_path) as actions:
        host = BodyHost(actions, PACK)
        try:
            proxy = allowing_proxy(actions, host.port)
            payload = _post(host.port, "/repo.git/git-upload-pack", FETCH_TYPE)
            answer = asyncio.run(through(proxy, payload))
        finally:
            host.close()
            # the outcome line may still be with the log's writer (a sync was under way
            # when it came): closing the log writes it
            proxy.log.close()
        assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b"0008NAK\n")
        (received,) = host.received
        assert received.startswith(b"POST /repo.git/git-upload-pack HTTP/1.1\r\n")
        assert received.endswith(b"\r\n\r\n" + WANT)
        start, outcome = http_lines(actions)
        assert start["decision"] == "allow" and "git fetch" in start["reason"]
        assert start["detail"]["git"] == "upload-pack"
        assert outcome["detail"]["status"] == 200


ABUSES = [
    ("/repo.git/git-receive-pack", "application/x-git-receive-pack-request"),  # a push
    ("/x/git-upload-pack", "application/json"),
    ("/x/git-upload-pack", "application/x-git-upload-pack-request; charset=utf-8"),
    ("/x/git-upload-pack", None),
    ("/x/git-upload-pack/hook", FETCH_TYPE),
    ("/x/git-upload-pack.php", FETCH_TYPE),
    ("/x/git-upload-pack?then=delete", FETCH_TYPE),
    ("/x/not-git-upload-pack", FETCH_TYPE),
]


@pytest.mark.parametrize(("path", "content_type"), ABUSES)
def test_a_post_that_only_resembles_a_git_fetch_is_stubbed_and_never_arrives(
    tmp_path: Path, path: str, content_type: str | None
) -> None:
    with actions_file(tmp_path) as actions:
        host = BodyHost(actions, PACK)
        try:
            proxy = allowing_proxy(actions, host.port)
            answer = asyncio.run(through(proxy, _post(host.port, path, content_type)))
        finally:
            host.close()
        assert answer.startswith(b"HTTP/1.1 403 ")
        assert host.received == []
        (line,) = http_lines(actions)
        assert line["decision"] == "stub"
        push = path.endswith("/git-receive-pack")
        reason = (
            "git push (git-receive-pack) changes the repository; only fetches pass"
            if push
            else "HTTP POST can have effects; only GET and HEAD pass"
        )
        assert line["reason"] == reason
        assert stub_reply("HTTP POST", reason).encode() in answer
        assert line["detail"].get("git") == ("receive-pack" if push else None)


def test_the_policy_names_git_fetch_and_push_and_nothing_else() -> None:
    assert http_kind("GET", "/repo.git/info/refs?service=git-upload-pack", None) is HttpKind.READ
    assert http_kind("POST", "/r/git-upload-pack", FETCH_TYPE) is HttpKind.GIT_FETCH
    assert http_kind("POST", "/r/git-upload-pack", FETCH_TYPE.upper()) is HttpKind.GIT_FETCH
    assert http_kind("PUT", "/r/git-upload-pack", FETCH_TYPE) is HttpKind.EFFECT
    assert http_kind("POST", "/r/git-receive-pack", FETCH_TYPE) is HttpKind.GIT_PUSH
    for path, content_type in ABUSES[1:]:
        assert http_kind("POST", path, content_type) is HttpKind.EFFECT, path
