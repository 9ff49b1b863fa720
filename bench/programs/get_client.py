# GETs through an HTTP proxy or straight to the server: a new connection per GET, or
# (keepalive) one connection for all of them; then, when asked, `big_n` big GETs (each
# timed, each on a new connection).
import http.client
import json
import sys
import time
from urllib.parse import urlsplit

cfg = json.loads(sys.argv[1])
kept = None


def connection(host):
    global kept
    if cfg.get("keepalive"):
        if kept is None:
            kept = http.client.HTTPConnection(host[0], host[1], timeout=120)
        return kept
    return http.client.HTTPConnection(host[0], host[1], timeout=120)


def get(url, expect):
    u = urlsplit(url)
    if cfg["proxy"]:
        conn = connection(cfg["proxy"])
        conn.request("GET", url)
    else:
        conn = connection((u.hostname, u.port))
        conn.request("GET", u.path)
    resp = conn.getresponse()
    n = 0
    while True:
        chunk = resp.read(1 << 20)
        if not chunk:
            break
        n += len(chunk)
    if not cfg.get("keepalive") or resp.will_close:
        conn.close()
    if resp.status != 200 or n != expect:
        raise SystemExit(f"GET {url}: HTTP {resp.status}, {n} bytes (expected {expect})")


for _ in range(cfg["warmup"]):
    get(cfg["small_url"], cfg["small_bytes"])
lat = []
for _ in range(cfg["n"]):
    t = time.perf_counter()
    get(cfg["small_url"], cfg["small_bytes"])
    lat.append(round((time.perf_counter() - t) * 1e6))
big_s = []  # one sample per big GET, each on a new connection
if cfg.get("big_url"):
    for _ in range(cfg.get("big_n", 1)):
        t = time.perf_counter()
        get(cfg["big_url"], cfg["big_bytes"])
        big_s.append(time.perf_counter() - t)
print(json.dumps({"lat_us": lat, "big_s": big_s}))
