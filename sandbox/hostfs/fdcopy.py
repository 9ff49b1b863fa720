"""Copying one open file into another, fastest way first, holes kept (stdlib only).

Used by the tree copies (into and out of the step's disk), the DB snapshot helper
(a subprocess that must start fast, so nothing here may import more than the standard
library) and the DB diff's private copies.

Guarantees: only the source's data extents are read and written (``SEEK_DATA`` /
``SEEK_HOLE``), so a file that is mostly hole stays mostly hole in the copy: a sparse
1 GiB file costs the destination what it costs the source, not 1 GiB; the copy never
writes more than ``limit`` bytes of data, and the destination's size is the source's
(or ``limit``, whichever is smaller). Limits: on a file system without ``SEEK_DATA`` the
whole file is one extent (copied densely, still within ``limit``); extents are read
from offsets, so neither fd's position matters and the source fd may be shared.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator
from typing import Final

_CHUNK: Final = 64 * 1024**2

# errnos that mean "this fast path does not work here, use the next one".
_FALLBACK_ERRNOS: Final = frozenset(
    {errno.ENOSYS, errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP, errno.ETXTBSY, errno.EBADF}
)


def data_extents(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """``(offset, length)`` of each data region of the first ``size`` bytes of ``fd``."""
    offset = 0
    while offset < size:
        try:
            start = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # only hole from here to the end
                return
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):  # no SEEK_DATA here
                yield offset, size - offset
                return
            raise
        if start >= size:
            return
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        yield start, end - start
        offset = end


def _copy_range(src_fd: int, dst_fd: int, offset: int, length: int) -> int:
    """Copy ``length`` bytes at ``offset`` to the same offset; bytes copied (less at EOF)."""
    copied = 0

    def until_done(step: Callable[[int, int], int]) -> bool:
        nonlocal copied
        try:
            while copied < length:
                n = step(offset + copied, min(_CHUNK, length - copied))
                if n == 0:
                    return True
                copied += n
            return True
        except OSError as exc:
            if exc.errno not in _FALLBACK_ERRNOS:
                raise
            return False

    def by_copy_file_range(at: int, want: int) -> int:
        return os.copy_file_range(src_fd, dst_fd, want, at, at)

    def by_sendfile(at: int, want: int) -> int:
        os.lseek(dst_fd, at, os.SEEK_SET)
        return os.sendfile(dst_fd, src_fd, at, want)

    if hasattr(os, "copy_file_range") and until_done(by_copy_file_range):
        return copied
    if until_done(by_sendfile):
        return copied
    while copied < length:
        data = os.pread(src_fd, min(length - copied, 1024**2), offset + copied)
        if not data:
            break
        view = memoryview(data)
        while view:
            written = os.pwrite(dst_fd, view, offset + copied)
            view = view[written:]
            copied += written
    return copied


def copy_fd(
    src_fd: int, dst_fd: int, limit: int | None = None, *, src_size: int | None = None
) -> int:
    """Copy ``src_fd`` into the empty ``dst_fd``, holes kept, at most ``limit`` bytes long.

    Returns the bytes of data copied (holes not counted). The destination ends as long as
    the source was when it was measured (capped at ``limit``), so trailing holes survive.
    ``src_size``: the source's size from the caller's own ``fstat`` of ``src_fd`` (saves
    asking again; a tree copy of many small files makes one call per file fewer).
    """
    size = os.fstat(src_fd).st_size if src_size is None else src_size
    if limit is not None:
        size = min(size, limit)
    copied = 0
    end = 0  # where the last data written ends: the destination's size so far
    for offset, length in data_extents(src_fd, size):
        n = _copy_range(src_fd, dst_fd, offset, length)
        copied += n
        end = offset + n
    # A trailing hole (or a source that shrank): the size is set, not copied.
    if end < size and os.fstat(dst_fd).st_size < size:
        os.ftruncate(dst_fd, size)
    return copied
