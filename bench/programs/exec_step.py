# The executor bench's step. From this one step, over one keep-alive connection to the
# bridge, one of each in turn: a stubbed call (answered in the guard), a DB query, a
# file read and a shell command (routed to the executor in this container); and in this
# process the same query on the DB copy, the same read and the same command started and
# waited for, as the executor does them (their own time, the floor's second part).
# Prints each kind's latency figures (ms) as one JSON line (the record keeps only the
# last 8,000 characters of stdout: no raw samples).
import http.client
import json
import math
import os
import sqlite3
import statistics
import subprocess
import sys
import time
import urllib.parse

cfg = json.loads(sys.argv[1])
url = urllib.parse.urlsplit(os.environ["AGENTWORKS_BRIDGE_URL"])
HEADERS = {
    "Content-Type": "application/json",
    "Authorization": "Bearer " + os.environ["AGENTWORKS_BRIDGE_TOKEN"],
}
SQL = "SELECT id, name, done FROM items WHERE id <= 10 ORDER BY id"
FILE = "bench-notes.txt"
with open(FILE, "w") as f:
    f.write("a line of notes the agent reads back\n" * 40)
CALLS = {
    "stub": ({"tool": "notify_user", "arguments": {"text": "bench"}}, ("stub",)),
    "db": ({"tool": "query_workflow_db", "arguments": {"sql": SQL}}, ("redirect",)),
    "file": ({"tool": "read_file", "arguments": {"path": FILE}}, ("allow",)),
    "shell": ({"tool": "execute_shell_command", "arguments": {"command": "true"}}, ("allow",)),
}
conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)


def call(kind):
    body, expect = CALLS[kind]
    conn.request("POST", "/v1/tools/call", json.dumps(body), HEADERS)
    resp = conn.getresponse()
    reply = json.loads(resp.read())
    if resp.status != 200 or reply.get("decision") not in expect or not reply.get("ok"):
        raise RuntimeError(f"{kind}: HTTP {resp.status}: {reply}")
    if kind != "stub" and reply["result"].get("is_error"):
        raise RuntimeError(f"{kind}: {reply['result'].get('text')}")


def sqlite_alone(_kind):
    # What the executor's query_workflow_db does with the DB copy (agentworks_exec/db.py).
    db = sqlite3.connect(f"file:{os.environ['DB_PATH']}?mode=ro", uri=True, timeout=10)
    try:
        db.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
        db.execute("PRAGMA query_only = ON")
        stop_at = time.monotonic() + 60
        db.set_progress_handler(lambda: int(time.monotonic() > stop_at), 10_000)
        cursor = db.execute(SQL, [])
        [d[0] for d in cursor.description]
        cursor.fetchmany(1001)
    finally:
        db.close()


def read_alone(_kind):
    fd = os.open(FILE, os.O_RDONLY | os.O_NOFOLLOW)
    with open(fd, encoding="utf-8", errors="replace", newline="\n") as handle:
        "".join(handle)


def spawn_alone(_kind):
    # What the executor's execute_shell_command does (agentworks_exec/shell.py): /bin/sh -c
    # in its own session, output through a pipe, waited for.
    proc = subprocess.Popen(
        ["/bin/sh", "-c", "true"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    proc.stdout.read()
    proc.stdout.close()
    if proc.wait() != 0:
        raise RuntimeError("true failed")


def timed(func, kind):
    t = time.perf_counter()
    func(kind)
    return round((time.perf_counter() - t) * 1e6, 1)


blocks = [
    ("stub", call),
    ("db", call),
    ("file", call),
    ("shell", call),
    ("sqlite", sqlite_alone),
    ("read", read_alone),
    ("spawn", spawn_alone),
]
for _ in range(cfg["warmup"]):
    for name, func in blocks:
        timed(func, name)
# One of each kind in turn, the first of the turn rotating: a slow moment of the
# machine (a busy disk under the log's sync) falls on every kind alike.
out = {name: [] for name, _ in blocks}
for i in range(cfg["calls"]):
    turn = blocks[i % len(blocks) :] + blocks[: i % len(blocks)]
    for name, func in turn:
        out[name].append(timed(func, name))


def stats(lat_us):
    ms = sorted(v / 1000 for v in lat_us)

    def rank(q):  # nearest rank, as bench.results.percentile
        return ms[max(1, min(len(ms), math.ceil(q / 100 * len(ms)))) - 1]

    return {
        "n": len(ms),
        "median_ms": round(statistics.median(ms), 4),
        "p90_ms": round(rank(90), 4),
        "p99_ms": round(rank(99), 4),
        "mean_ms": round(statistics.fmean(ms), 4),
    }


print(json.dumps({name: stats(values) for name, values in out.items()}))
