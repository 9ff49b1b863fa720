"""Copying one open file into another, fastest way first (stdlib only).

Used by the tree copy, the DB snapshot helper (a subprocess that must start
fast, so nothing here may import more than the standard library) and the DB
diff.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from typing import Final

_CHUNK: Final = 64 * 1024**2

# errnos that mean "this fast path does not work here, use the next one".
_FALLBACK_ERRNOS: Final = frozenset(
    {errno.ENOSYS, errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP, errno.ETXTBSY, errno.EBADF}
)


def copy_fd(src_fd: int, dst_fd: int, limit: int | None = None) -> int:
    """Copy ``src_fd`` from offset 0 to ``dst_fd`` (at offset 0), at most ``limit`` bytes.

    Tries ``os.copy_file_range`` (may reflink), then ``os.sendfile``, then pread/write. Stops at
    end of file or at ``limit``; returns the bytes copied. Neither fd's file position is used
    for reading, so the source fd may be shared with other users (e.g. lock holders).
    """
    copied = 0

    def remaining() -> int:
        return _CHUNK if limit is None else min(_CHUNK, limit - copied)

    def until_done(step: Callable[[int], int]) -> bool:
        """Copy with `step` to the end or the limit; False when it does not work here."""
        nonlocal copied
        try:
            while (want := remaining()) > 0:
                n = step(want)
                if n == 0:
                    return True
                copied += n
            return True
        except OSError as exc:
            if exc.errno not in _FALLBACK_ERRNOS:
                raise
            return False

    def by_copy_file_range(want: int) -> int:
        return os.copy_file_range(src_fd, dst_fd, want, copied, copied)

    def by_sendfile(want: int) -> int:
        os.lseek(dst_fd, copied, os.SEEK_SET)
        return os.sendfile(dst_fd, src_fd, copied, want)

    if hasattr(os, "copy_file_range") and until_done(by_copy_file_range):
        return copied
    if until_done(by_sendfile):
        return copied
    while (want := remaining()) > 0:
        data = os.pread(src_fd, min(want, 1024**2), copied)
        if not data:
            break
        view = memoryview(data)
        while view:
            written = os.pwrite(dst_fd, view, copied)
            view = view[written:]
            copied += written
    return copied
