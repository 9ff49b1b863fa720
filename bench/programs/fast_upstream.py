# The job-board example's tools (its JobBoard, unchanged) behind a lean asyncio HTTP/1.1
# front, as the bench's fake upstream. The example's own server (a thread per connection,
# http.server parsing) was itself the limit of the bench's baseline (about 2,750 calls/s
# direct, 1,250 under load): a guard faster than that could not be seen. Serves
# POST /v1/tools/call and /reset, GET /health and /state, keep-alive, Content-Length only.
import argparse
import asyncio
import json
import socket
import sys
import time

sys.path.insert(0, "/srv")
import server  # the example's module, mounted read-only at /srv

MAX_HEAD = 64 * 1024
BOARD = server.JobBoard()


def reply(status, payload):
    data = json.dumps(payload).encode()
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 413: "Too Large"}[status]
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    return head + data  # one send: one segment, no wait on a delayed ACK


def tool_call(raw, run_kind):
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if not isinstance(body, dict) or not isinstance(body.get("tool"), str):
        BOARD.record({"malformed": True, "run_kind_header": run_kind, "time": time.time()})
        return reply(400, {"error": "body must be a JSON object with a string 'tool'"})
    args = body.get("arguments")
    args = args if isinstance(args, dict) else {}
    who = {key: body.get(key) for key in server.IDENTITY_FIELDS}
    entry = {"tool": body["tool"], "arguments": args, **who, "run_kind_header": run_kind}
    BOARD.record({**entry, "time": time.time()})
    return reply(200, BOARD.call(body["tool"], args, who))


async def serve(reader, writer):
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                return
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = [*lines[0].split(" "), "", ""][:3]
            fields = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                fields[name.strip().lower()] = value.strip()
            length = fields.get("content-length", "0")
            if not length.isdigit() or int(length) > server.MAX_BODY_BYTES:
                writer.write(reply(413, {"error": "bad or too large Content-Length"}))
                await writer.drain()
                return
            body = await reader.readexactly(int(length)) if int(length) else b""
            if method == "POST" and path == "/v1/tools/call":
                out = tool_call(body, fields.get(server.RUN_KIND_HEADER.lower()))
            elif method == "POST" and path == "/reset":
                BOARD.reset()
                out = reply(200, {"ok": True})
            elif method == "GET" and path == "/health":
                out = reply(200, {"ok": True})
            elif method == "GET" and path == "/state":
                out = reply(200, BOARD.snapshot())
            else:
                out = reply(404, {"error": f"no such path: {path}"})
            writer.write(out)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        return
    finally:
        writer.close()


async def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8080)
    opts = parser.parse_args()
    srv = await asyncio.start_server(serve, opts.host, opts.port, limit=MAX_HEAD, backlog=512)
    async with srv:
        await srv.serve_forever()


asyncio.run(main())
