# The guard benchmark's step: checks the path a real script takes (agentworks_bridge, a new
# connection per call), says "ready", then holds the run open until the bench releases it.
import json
import os
import statistics
import sys
import time

import agentworks_bridge

lat = []
for _ in range(int(sys.argv[1])):
    t = time.perf_counter()
    reply = agentworks_bridge.call(sys.argv[2], {"prompt": "bench-step"})
    lat.append((time.perf_counter() - t) * 1000)
    if reply.get("decision") != "allow" or not reply.get("ok"):
        sys.exit(f"unexpected reply: {reply}")
open("ready", "w").close()
deadline = time.monotonic() + float(sys.argv[3])
while not os.path.exists("release"):
    if time.monotonic() > deadline:
        sys.exit("never released")
    time.sleep(0.02)
lat = sorted(lat[20:]) or [0.0]
print(
    json.dumps(
        {"n": len(lat), "median_ms": statistics.median(lat), "p90_ms": lat[int(len(lat) * 0.9) - 1]}
    )
)
