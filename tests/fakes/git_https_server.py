"""A fake git host for egress tests (stdlib and git only; runs in its own container).

`git http-backend` (git's own smart-HTTP server, as CGI) behind a TLS server on 8443,
serving /srv/git/repo.git: one commit whose README says `hello-from-git`, push enabled
(`http.receivepack`), so only the guard stands between a step's `git push` and the
repository. Every request is printed (`request <method> <path> <content type>
<body bytes>`) before it is served, so a test reads from the container's log exactly
what arrived. The certificate is /srv/tls/server.pem (certificate and key).
"""

from __future__ import annotations

import contextlib
import os
import ssl
import subprocess
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

ROOT = "/tmp/srv"
BACKEND = "/usr/lib/git-core/git-http-backend"


def make_repository() -> None:
    env = {**os.environ, "HOME": "/tmp", "GIT_AUTHOR_NAME": "a", "GIT_AUTHOR_EMAIL": "a@b"}
    env |= {"GIT_COMMITTER_NAME": "a", "GIT_COMMITTER_EMAIL": "a@b"}

    def git(*args: str, cwd: str = "/tmp") -> None:
        subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True)

    git("init", "-q", "-b", "main", "/tmp/work")
    with open("/tmp/work/README", "w") as handle:
        handle.write("hello-from-git\n")
    git("add", "README", cwd="/tmp/work")
    git("commit", "-qm", "init", cwd="/tmp/work")
    os.makedirs(ROOT)
    git("clone", "-q", "--bare", "/tmp/work", f"{ROOT}/repo.git")
    git("config", "http.receivepack", "true", cwd=f"{ROOT}/repo.git")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        return

    def _body(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            body = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    return body
                body += self.rfile.read(size)
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _cgi(self) -> None:
        body = self._body()
        path, _, query = self.path.partition("?")
        content_type = self.headers.get("Content-Type") or "-"
        print(f"request {self.command} {self.path} {content_type} {len(body)}", flush=True)
        env = {
            "GIT_PROJECT_ROOT": ROOT,
            "GIT_HTTP_EXPORT_ALL": "1",
            "REQUEST_METHOD": self.command,
            "PATH_INFO": path,
            "QUERY_STRING": query,
            "CONTENT_TYPE": self.headers.get("Content-Type") or "",
            "CONTENT_LENGTH": str(len(body)),
            "REMOTE_ADDR": self.client_address[0],
            "REMOTE_USER": "step",
            "HOME": "/tmp",
        }
        for name, value in self.headers.items():
            key = "HTTP_" + name.upper().replace("-", "_")
            if key not in ("HTTP_CONTENT_TYPE", "HTTP_CONTENT_LENGTH"):
                env[key] = value
        done = subprocess.run([BACKEND], input=body, env=env, capture_output=True, check=False)
        head, _, payload = done.stdout.partition(b"\r\n\r\n")
        if not _:
            head, _, payload = done.stdout.partition(b"\n\n")
        status, headers = 200, []
        for line in head.decode("latin-1").splitlines():
            name, _, value = line.partition(":")
            if name.lower() == "status":
                status = int(value.split()[0])
            elif name:
                headers.append((name, value.strip()))
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = _cgi
    do_POST = _cgi


class TLSServer(ThreadingHTTPServer):
    """TLS per connection, its handshake in that connection's own thread: one peer
    that stalls mid-handshake never holds up the others."""

    context: ssl.SSLContext

    def finish_request(self, request: Any, client_address: Any) -> None:
        request.settimeout(60)
        with contextlib.suppress(OSError):
            request = self.context.wrap_socket(request, server_side=True)
            super().finish_request(request, client_address)


def main() -> None:
    make_repository()
    server = TLSServer(("0.0.0.0", 8443), Handler)
    server.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.context.load_cert_chain("/srv/tls/server.pem")
    print("ready", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
