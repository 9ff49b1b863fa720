# The same MCP server spoken to directly over stdio (newline-delimited JSON-RPC), the bytes
# the guard exchanges with it over its socket: the floor for a proxied call, and the
# server's own tools/list time.
import json
import subprocess
import sys
import time

cfg = json.loads(sys.argv[1])
proc = subprocess.Popen(
    cfg["command"],
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    stderr=subprocess.DEVNULL,
    bufsize=0,
    env={"PATH": cfg["server_path"], "HOME": "/tmp"},
)
state = {"id": 0}


def send(message):
    proc.stdin.write((json.dumps(message) + "\n").encode())
    proc.stdin.flush()


def request(method, params):
    state["id"] += 1
    send({"jsonrpc": "2.0", "id": state["id"], "method": method, "params": params})
    while True:
        line = proc.stdout.readline()
        if not line:
            raise SystemExit("the server closed its stdout")
        m = json.loads(line)
        if m.get("id") == state["id"]:
            if "error" in m:
                raise SystemExit("{}: {}".format(method, m["error"]))
            return m["result"]


request(
    "initialize",
    {
        "protocolVersion": cfg["version"],
        "capabilities": {},
        "clientInfo": {"name": "bench", "version": "1"},
    },
)
send({"jsonrpc": "2.0", "method": "notifications/initialized"})


def timed(method, params):
    lat = []
    for i in range(cfg["warmup"] + cfg["n"]):
        t = time.perf_counter()
        result = request(method, params)
        if i >= cfg["warmup"]:
            lat.append(round((time.perf_counter() - t) * 1e6))
        if result.get("isError"):
            raise SystemExit(f"tool error: {json.dumps(result)[:300]}")
    return lat


out = {
    "list_us": timed("tools/list", {}),
    "call_us": timed("tools/call", {"name": cfg["tool"], "arguments": cfg["arguments"]}),
}
proc.stdin.close()
proc.wait(10)
print(json.dumps(out))
