# POSTs over keep-alive connections from `procs` forked clients; prints latencies (us).
import http.client
import json
import os
import sys
import time
import traceback

cfg = json.loads(sys.argv[1])
BODY = json.dumps(cfg["body"]).encode()
HEADERS = {"Content-Type": "application/json", **cfg["headers"]}
EXPECT = cfg["expect"]


def check(status, data):
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {data[:300]!r}")
    reply = json.loads(data)
    if EXPECT == "result":
        if reply.get("is_error"):
            raise RuntimeError("upstream error: {}".format(reply.get("text")))
    elif reply.get("decision") != EXPECT or not reply.get("ok"):
        raise RuntimeError("decision {}: {}".format(reply.get("decision"), reply.get("reason")))


def worker(ready_w, go_r, out_w):
    conn = http.client.HTTPConnection(cfg["host"], cfg["port"], timeout=60)

    def one():
        conn.request("POST", cfg["path"], BODY, HEADERS)
        resp = conn.getresponse()
        check(resp.status, resp.read())

    for _ in range(cfg["warmup"]):
        one()
    os.write(ready_w, b"r")
    os.read(go_r, 1)
    # the wait for the others may outlast the server's keep-alive timeout: start afresh
    conn.close()
    lat = []
    start = time.monotonic()
    for _ in range(cfg["n"]):
        t = time.perf_counter()
        one()
        lat.append(round((time.perf_counter() - t) * 1e6))
    end = time.monotonic()
    with os.fdopen(out_w, "wb") as f:
        f.write(json.dumps({"start": start, "end": end, "lat_us": lat}).encode())


def main():
    procs = cfg["procs"]
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    children = []
    for _ in range(procs):
        out_r, out_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.close(out_r)
                worker(ready_w, go_r, out_w)
            except BaseException:
                traceback.print_exc()
                os.write(ready_w, b"x")
                code = 1
            os._exit(code)
        os.close(out_w)
        children.append((pid, out_r))
    got = b""
    while len(got) < procs:
        got += os.read(ready_r, procs - len(got))
    os.write(go_w, b"g" * procs)
    parts, failed = [], False
    for pid, out_r in children:
        with os.fdopen(out_r, "rb") as f:
            data = f.read()
        _, status = os.waitpid(pid, 0)
        if status != 0 or not data:
            failed = True
        else:
            parts.append(json.loads(data))
    if failed:
        sys.exit(1)
    lat = [x for p in parts for x in p["lat_us"]]
    wall = max(p["end"] for p in parts) - min(p["start"] for p in parts)
    print(json.dumps({"procs": procs, "calls": len(lat), "wall_s": wall, "lat_us": lat}))


main()
