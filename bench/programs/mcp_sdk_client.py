# One MCP client loop with the official `mcp` SDK's own Client, the same code for every
# target: a stdio server it starts itself ("stdio"), or a streamable-HTTP endpoint ("http":
# the guard's, with the run's bearer token, or mcp-proxy's). It connects, lists the tools once
# (as a real client does before calling one), then times `tools/call` of one tool. Runs with
# the MCP image's venv Python (/opt/mcp/py/bin/python: the SDK 2.x is there).
import json
import socket
import sys
import time
from urllib.parse import urlsplit

import anyio
import httpx2
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

cfg = json.loads(sys.argv[1])


def target():
    if cfg["transport"] == "stdio":
        command = cfg["command"]
        env = {"PATH": cfg["server_path"], "HOME": "/tmp"}
        return StdioServerParameters(command=command[0], args=command[1:], env=env)
    headers = {"Authorization": "Bearer " + cfg["token"]} if cfg.get("token") else {}
    http = httpx2.AsyncClient(headers=headers, trust_env=False, timeout=120)
    return streamable_http_client(cfg["url"], http_client=http)


def check(result):
    text = json.dumps(result.model_dump(mode="json"))
    if result.is_error or "TEST MODE" in text:
        raise SystemExit(f"not a forwarded result: {text[:300]}")


def wait_listening(url, deadline_s):
    """A peer that has just started: poll its port until it accepts, within a deadline."""
    where = urlsplit(url)
    end = time.monotonic() + deadline_s
    while True:
        try:
            socket.create_connection((where.hostname, where.port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > end:
                raise SystemExit(f"{url} did not listen within {deadline_s} s") from None
            time.sleep(0.05)


async def main():
    if cfg.get("wait_s"):
        wait_listening(cfg["url"], cfg["wait_s"])
    async with Client(target(), mode=cfg["mode"], cache=None, read_timeout_seconds=120) as client:
        listed = await client.list_tools()
        if cfg["tool"] not in [t.name for t in listed.tools]:
            raise SystemExit(f"{cfg['tool']} is not listed")
        for _ in range(cfg["warmup"]):
            check(await client.call_tool(cfg["tool"], cfg["arguments"]))
        lat = []
        for _ in range(cfg["n"]):
            t = time.perf_counter()
            result = await client.call_tool(cfg["tool"], cfg["arguments"])
            lat.append(round((time.perf_counter() - t) * 1e6))
            check(result)
        list_us = []
        if cfg.get("time_list"):
            for _ in range(cfg["n"]):
                t = time.perf_counter()
                await client.list_tools()
                list_us.append(round((time.perf_counter() - t) * 1e6))
        print(json.dumps({"call_us": lat, "list_us": list_us, "protocol": client.protocol_version}))


anyio.run(main)
