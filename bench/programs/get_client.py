# GETs through an HTTP proxy or straight to the server; a new connection per GET (both ways).
import http.client
import json
import sys
import time
from urllib.parse import urlsplit

cfg = json.loads(sys.argv[1])


def get(url, expect):
    u = urlsplit(url)
    if cfg["proxy"]:
        conn = http.client.HTTPConnection(cfg["proxy"][0], cfg["proxy"][1], timeout=120)
        conn.request("GET", url)
    else:
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
        conn.request("GET", u.path)
    resp = conn.getresponse()
    n = 0
    while True:
        chunk = resp.read(1 << 20)
        if not chunk:
            break
        n += len(chunk)
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
t = time.perf_counter()
get(cfg["big_url"], cfg["big_bytes"])
big_s = time.perf_counter() - t
print(json.dumps({"lat_us": lat, "big_s": big_s}))
