# The --load hog: "cpu" spins on one CPU, "disk" rewrites 1 MiB blocks of a 256 MiB file
# with an fdatasync after each; either ends by itself after its seconds.
import os
import sys
import time

kind, seconds, path = sys.argv[1], float(sys.argv[2]), sys.argv[3]
deadline = time.monotonic() + seconds
if kind == "cpu":
    x = 0
    while time.monotonic() < deadline:
        for _ in range(100_000):
            x += 1
else:
    block = os.urandom(1 << 20)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        n = 0
        while time.monotonic() < deadline:
            os.pwrite(fd, block, (n % 256) << 20)
            os.fdatasync(fd)
            n += 1
    finally:
        os.close(fd)
        os.unlink(path)
