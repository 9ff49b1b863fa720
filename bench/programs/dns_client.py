# A queries over UDP to the address the step's resolver has (127.0.0.11:53), one at a
# time, each timed from send to answer: as the step's uid they land on the guard's own
# DNS (the firewall redirects them), as the guard's uid on the engine's resolver.
import json
import socket
import struct
import sys
import time

cfg = json.loads(sys.argv[1])
qname = b"".join(bytes([len(p)]) + p.encode() for p in cfg["name"].split(".")) + b"\0"
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.settimeout(10)
lat = []
for i in range(cfg["warmup"] + cfg["n"]):
    query = struct.pack("!HHHHHH", i & 0xFFFF, 0x0100, 1, 0, 0, 0) + qname + b"\0\1\0\1"
    t = time.perf_counter()
    sock.sendto(query, ("127.0.0.11", 53))
    try:
        reply = sock.recv(4096)
    except TimeoutError:
        raise SystemExit(f"query {i} for {cfg['name']}: no answer in 10 s") from None
    took = round((time.perf_counter() - t) * 1e6)
    if reply[:2] != query[:2] or reply[3] & 0xF or not struct.unpack("!H", reply[6:8])[0]:
        raise SystemExit(f"query {i}: no answer (rcode {reply[3] & 0xF})")
    if i >= cfg["warmup"]:
        lat.append(took)
print(json.dumps({"lat_us": lat}))
