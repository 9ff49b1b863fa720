# MCP through the guard: JSON-RPC over one keep-alive HTTP connection to the guard's endpoint.
import http.client
import json
import sys
import time

cfg = json.loads(sys.argv[1])
conn = http.client.HTTPConnection("127.0.0.1", cfg["port"], timeout=120)
state = {"sid": None, "id": 0}


def post(message):
    headers = {
        "Authorization": "Bearer " + cfg["token"],
        "Content-Type": "application/json",
        "Accept": "application/json, text/event-stream",
    }
    if state["sid"]:
        headers["Mcp-Session-Id"] = state["sid"]
        headers["Mcp-Protocol-Version"] = cfg["version"]
    conn.request("POST", cfg["path"], json.dumps(message).encode(), headers)
    resp = conn.getresponse()
    body = resp.read().decode()
    state["sid"] = resp.getheader("Mcp-Session-Id") or state["sid"]
    if resp.status >= 400:
        raise SystemExit(f"HTTP {resp.status}: {body[:300]}")
    if not body.strip():
        return []
    if (resp.getheader("Content-Type") or "").startswith("text/event-stream"):
        return [json.loads(ln[5:].strip()) for ln in body.splitlines() if ln.startswith("data:")]
    parsed = json.loads(body)
    return parsed if isinstance(parsed, list) else [parsed]


def request(method, params):
    state["id"] += 1
    for m in post({"jsonrpc": "2.0", "id": state["id"], "method": method, "params": params}):
        if m.get("id") == state["id"]:
            if "error" in m:
                raise SystemExit("{}: {}".format(method, m["error"]))
            return m["result"]
    raise SystemExit(method + ": no reply")


request(
    "initialize",
    {
        "protocolVersion": cfg["version"],
        "capabilities": {},
        "clientInfo": {"name": "bench", "version": "1"},
    },
)
post({"jsonrpc": "2.0", "method": "notifications/initialized"})


def call():
    result = request("tools/call", {"name": cfg["tool"], "arguments": cfg["arguments"]})
    if result.get("isError") or "TEST MODE" in json.dumps(result):
        raise SystemExit(f"not a forwarded result: {json.dumps(result)[:300]}")


for _ in range(cfg["warmup"]):
    call()
lat = []
for _ in range(cfg["n"]):
    t = time.perf_counter()
    call()
    lat.append(round((time.perf_counter() - t) * 1e6))
print(json.dumps({"call_us": lat}))
