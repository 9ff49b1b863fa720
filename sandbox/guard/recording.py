"""The run's recorded reads: every allowed read's answer kept in the guard's folder,
content-addressed and capped, and the recording a replay serves from.

The guard is the only writer. An answer streams through a `Tap` (hash and write,
bounded): past the per-answer cap or the recording's cap it stops keeping, drops
what it wrote and the index says what was not kept; the answer itself is always
relayed whole. A failed write only loses the copy, never the answer. An answer
already whole in memory (a bridge or MCP result) whose blob this recorder kept
already is listed without writing its bytes again.
(recording.spec.md: the key, the caps, the limits.)
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import os
import threading
from pathlib import Path

from pydantic import ValidationError

from sandbox.contracts.recording import (
    BLOBS_DIR,
    EMPTY_SHA256,
    INDEX_FILE,
    MAX_INDEX_BYTES,
    RECORDING_DIR,
    SHA256,
    IndexLine,
    Kind,
    MissMode,
    RecordingSettings,
    ReplaySettings,
    index_line_json,
)

INDEX_RESERVE = 4096  # room for the line that says the index is full
# Blobs this recorder remembers having kept, so the same whole answer again (a bridge
# call asked twice) writes no file: at most this many (then a repeat is written and
# found on disk, as a streamed one always is).
MAX_KEPT_MEMO = 4096
# A streamed answer is held in memory up to this many bytes and written only past it
# or once it ended, so that a small answer kept already (the same read again) writes
# no file only to remove it.
HOLD_BYTES = 64 * 1024
# Whole answers waiting for the keeper's thread, in bytes at most; past it a caller
# waits for room (memory stays bounded when the disk falls behind, the order kept).
MAX_LATER_BYTES = 16 * 1024 * 1024
GATHER_S = 0.050  # how long the keeper's thread gathers answers before a round


class Recorder:
    """One run's recording: `blobs/<sha256>` and `index.jsonl` under `root`."""

    def __init__(self, root: Path, settings: RecordingSettings) -> None:
        self.root = root
        self.blobs = os.path.join(root, BLOBS_DIR)  # a string: joined to once per answer
        self.settings = settings
        self.used = 0  # bytes kept or being written, never above settings.cap_bytes
        self._serial = 0
        self._lock = threading.Lock()  # the MCP proxy's SDK may call from a thread
        self._index_fd = -1
        self._index_bytes = 0
        self._opened = False  # made at the first answer: a run without reads leaves nothing
        self._kept: set[str] = set()  # digests of blobs kept (at most MAX_KEPT_MEMO)
        self.unavailable = "" if settings.enabled else "recording is off"
        self._later = _Keeper(self)

    def _open(self) -> None:
        """The folder and the index, at the first answer (under the lock)."""
        if self._opened or self.unavailable:
            return
        self._opened = True
        try:
            # the guard's own folder must exist: nothing is made above it
            self.root.mkdir(mode=0o700, exist_ok=True)
            (self.root / BLOBS_DIR).mkdir(mode=0o700, exist_ok=True)
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
            self._index_fd = os.open(self.root / INDEX_FILE, flags, 0o600)
        except OSError as exc:  # the answers still go out; the record says none was kept
            self.unavailable = f"the recording could not be opened ({exc.strerror or exc})"

    def tap(self, key: str, kind: Kind, what: str, *, replay: str = "") -> Tap:
        """A tap for one answer, fed as it is relayed and closed once it ended."""
        with self._lock:
            if not self._opened:
                self._open()
            self._serial += 1
            serial = self._serial
        return Tap(self, key, kind, what[:600], serial, replay)

    def note(self, data: bytes, kind: Kind) -> None:
        """One index line's JSON (`index_line_json`; the guard's: a failed write loses the
        line, not the answer). The index stops short of what the host reads back: its
        last line says it is full, and later answers are neither kept nor listed."""
        data += b"\n"
        with self._lock:
            if not self._opened:
                self._open()
            if self._index_fd < 0:
                return
            if self._index_bytes + len(data) > MAX_INDEX_BYTES - INDEX_RESERVE:
                full = IndexLine(
                    key="0" * 64,
                    kind=kind,
                    what="the index is full: later answers were neither kept nor listed",
                    kept=False,
                    bytes=0,
                    why_not="index full",
                )
                data = (full.model_dump_json() + "\n").encode()
                self.unavailable = "the recording's index is full"
            try:
                os.write(self._index_fd, data)
                self._index_bytes += len(data)
            except OSError:
                pass
            if self.unavailable:
                os.close(self._index_fd)
                self._index_fd = -1

    def note_miss(self, key: str, kind: Kind, what: str) -> None:
        """A read a replay did not have (answered with the stub, or sent live)."""
        self.note(
            index_line_json(key=key, kind=kind, what=what[:600], kept=False, size=0, replay="miss"),
            kind,
        )

    def remember(self, digest: str) -> None:
        """A blob with this digest is kept (in the folder, whole)."""
        with self._lock:
            if len(self._kept) < MAX_KEPT_MEMO:
                self._kept.add(digest)

    def knows(self, digest: str) -> bool:
        """Whether this recorder kept a blob with this digest (whole, in the folder)."""
        with self._lock:
            return digest in self._kept

    def kept_already(self, digest: str, size: int) -> bool:
        """Whether an answer of `size` bytes whose blob this recorder kept already would
        be kept again now: within both caps, exactly as a new copy would have to be."""
        settings = self.settings
        with self._lock:
            return (
                digest in self._kept
                and size <= settings.body_cap_bytes
                and self.used + size <= settings.cap_bytes
            )

    def reserve(self, size: int) -> bool:
        with self._lock:
            if self.used + size > self.settings.cap_bytes:
                return False
            self.used += size
            return True

    def release(self, size: int) -> None:
        with self._lock:
            self.used -= size

    def keep_later(self, key: str, kind: Kind, what: str, data: bytes, *, replay: str = "") -> None:
        """`tap(...).whole(data)` on the keeper's thread: the hash, the index line and
        the blob's file are off the caller's request path (a disk that is slow to
        create or append, beside another writer, does not hold a reply). In the order
        given; done by `close`. Past MAX_LATER_BYTES waiting, the caller waits until the
        thread has kept enough of the answers ahead of it; once stopped, done here
        (after every answer queued before it)."""
        if not self._later.put((key, kind, what, data, replay)):
            self.tap(key, kind, what, replay=replay).whole(data)

    def close(self) -> None:
        """Keep what waits for the keeper's thread, then close the index."""
        self._later.stop()
        if self._index_fd >= 0:
            os.close(self._index_fd)
            self._index_fd = -1


class _Keeper:
    """The recorder's thread for `keep_later`, started at the first answer given to it.
    Woken by the first answer after it went idle, it gathers for GATHER_S and then
    keeps everything queued in one round: a few wake-ups a second however many calls,
    not one each (each wake-up is a futex and a turn at the interpreter's lock).

    At most MAX_LATER_BYTES wait (or one answer larger than that, alone): a caller
    whose answer would go past it waits until the thread has kept enough of those
    ahead of it (the thread then keeps at once rather than gathering), and callers
    that wait are queued in the order they came, so the index's order is the order
    the answers were given whatever the disk's pace."""

    def __init__(self, recorder: Recorder) -> None:
        self._recorder = recorder
        self._items: collections.deque[tuple[str, Kind, str, bytes, str]] = collections.deque()
        lock = threading.Lock()
        self._ready = threading.Condition(lock)  # the thread waits for answers
        self._room = threading.Condition(lock)  # callers wait for room, and for the end
        self._bytes = 0  # of the answers queued or being kept
        self._thread: threading.Thread | None = None
        self._idle = False  # the thread waits for a first answer (a put wakes it)
        self._hurry = False  # a caller waits for room: no gathering
        self._tickets = 0  # callers that waited for room, by arrival
        self._turn = 0  # the ticket whose answer goes in next
        self._ended = False  # the thread kept everything and ended
        self._stopped = False

    def put(self, item: tuple[str, Kind, str, bytes, str]) -> bool:
        """Queued, once there is room and after every caller that waited before it
        (False: stopped, every queued answer kept: the caller keeps it, after them)."""
        size = len(item[3])
        with self._ready:
            if self._tickets != self._turn or (
                self._bytes and self._bytes + size > MAX_LATER_BYTES
            ):
                self._wait_for_room(size)
            if self._stopped or self._ended:  # ended without a stop: it cannot keep more
                while self._thread is not None and not self._ended:
                    self._room.wait()
                return False
            self._bytes += size
            self._items.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="recording", daemon=True)
                self._thread.start()
            elif self._idle:
                self._idle = False
                self._ready.notify()
        return True

    def _wait_for_room(self, size: int) -> None:
        """Wait (the lock held) until this caller's turn has come and its answer fits,
        or the keeper stopped (or its thread ended)."""
        ticket = self._tickets
        self._tickets += 1
        self._hurry = True
        self._ready.notify()  # cut a round's gathering short
        while (
            not self._stopped
            and not self._ended
            and (ticket != self._turn or (self._bytes and self._bytes + size > MAX_LATER_BYTES))
        ):
            self._room.wait()
        self._turn += 1
        if self._turn == self._tickets:
            self._hurry = False
        self._room.notify_all()  # the next ticket's turn

    def _run(self) -> None:
        try:
            self._keep_all()
        finally:
            with self._ready:
                self._ended = True
                self._room.notify_all()

    def _keep_all(self) -> None:
        while True:
            with self._ready:
                while not self._items and not self._stopped:
                    self._idle = True
                    self._ready.wait()
                self._idle = False
                if not self._stopped and not self._hurry:
                    self._ready.wait(GATHER_S)  # only a stop or a waiting caller ends it early
                batch = list(self._items)
                self._items.clear()
                if not batch:
                    return  # stopped, nothing left
            for key, kind, what, data, replay in batch:
                # Tap loses a copy on a failed write, never raises for it; anything else
                # must not end the thread with answers still queued behind this one.
                # A statement, not `contextlib.suppress`: no object per answer.
                try:  # noqa: SIM105
                    self._recorder.tap(key, kind, what, replay=replay).whole(data)
                except Exception:
                    pass
                with self._ready:
                    self._bytes -= len(data)
                    if self._hurry:
                        self._room.notify_all()

    def stop(self) -> None:
        """Keep every answer queued, then end the thread (blocks until it has)."""
        with self._ready:
            self._stopped = True
            self._ready.notify()
            self._room.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()


class Tap:
    """One answer on its way to the step: hashed whole, kept while within the caps."""

    def __init__(
        self, recorder: Recorder, key: str, kind: Kind, what: str, serial: int, replay: str
    ) -> None:
        self._recorder = recorder
        self.key, self.kind, self.what, self.replay = key, kind, what, replay
        # The answer's digest, made at its first bytes: a whole answer (`whole`) is
        # hashed once, with no digest made per tap only to be dropped. None after that
        # while `_unseen` is set: given up (`rest_unseen`), or listed (`whole`).
        self._hash: hashlib._Hash | None = None
        self._unseen = False
        self.size = 0
        self._written = 0
        self._why_not = recorder.unavailable
        self._fd = -1
        self._held = bytearray()  # the bytes kept so far while no file is open (HOLD_BYTES)
        self._serial = serial
        self._closed = False

    @property
    def _temp(self) -> str:
        """Where the copy is written until it is whole (made only when one is written)."""
        return os.path.join(self._recorder.blobs, f".part-{self._serial}")

    @property
    def keeping(self) -> bool:
        """Whether the answer is still being kept (else it need not pass through `feed`)."""
        return not self._why_not

    def rest_unseen(self, length: int) -> bool:
        """The rest of the answer is `length` bytes: when that cannot be kept (past a
        cap), the tap gives up now and the rest need not pass through Python (the
        relay splices it); the index then has its size, and no digest. Whether the tap
        gave up."""
        settings = self._recorder.settings
        if self._why_not:
            pass
        elif self.size + length > settings.body_cap_bytes:
            self._drop(f"over the per-answer cap of {settings.body_cap_bytes} bytes")
        elif self._recorder.used + length > settings.cap_bytes:
            self._drop(f"over the recording's cap of {settings.cap_bytes} bytes")
        else:
            return False
        self._hash, self._unseen = None, True
        self.size += length
        return True

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self._unseen:
            return  # given up (`rest_unseen`): the size is counted already
        if self._hash is None:
            self._hash = hashlib.sha256(data)
        else:
            self._hash.update(data)
        self._keep_bytes(data)

    def _keep_bytes(self, data: bytes | bytearray | memoryview) -> None:
        """`feed` once `data` is hashed: counted, and written while within the caps."""
        self.size += len(data)
        if self._why_not:
            return
        settings = self._recorder.settings
        if self.size > settings.body_cap_bytes:
            self._drop(f"over the per-answer cap of {settings.body_cap_bytes} bytes")
            return
        if not self._recorder.reserve(len(data)):
            self._drop(f"over the recording's cap of {settings.cap_bytes} bytes")
            return
        self._written += len(data)
        if self._fd < 0 and self._written <= HOLD_BYTES:
            self._held += data
            return
        try:
            self._write(data)
        except OSError as exc:
            self._drop(f"the copy could not be written ({exc.strerror or exc})")

    def _write(self, data: bytes | bytearray | memoryview) -> None:
        """`data` after what is held, into the copy (its file made at the first write)."""
        if self._fd < 0:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            self._fd = os.open(self._temp, flags, 0o600)
            held, self._held = self._held, bytearray()
            if held:
                self._write(held)
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]

    def whole(self, data: bytes) -> None:
        """`feed(data)` and `close()` for an answer already whole in memory (a bridge or
        MCP result): the same index line and the same caps, but an answer whose blob
        this recorder kept already is not written again only to be removed (one
        answer asked many times costs no file per call)."""
        if self.size or self._closed or self._why_not or self._unseen or self._hash is not None:
            self.feed(data)
            self.close()
            return
        hashed = hashlib.sha256(data)
        digest = hashed.hexdigest()
        if not self._recorder.kept_already(digest, len(data)):
            self._hash = hashed  # hashed once: what `feed` would have made of it
            self._keep_bytes(data)
            self.close()
            return
        self._closed = True
        self._hash, self._unseen = None, True
        self.size = len(data)
        self._note(kept=True, digest=digest)

    def close(self, *, complete: bool = True) -> None:
        """The answer ended (`complete` False: cut short, which is not kept)."""
        if self._closed:
            return
        self._closed = True
        if not complete and not self._why_not:
            self._drop("the answer was cut short")
        if self._unseen:
            digest = None
        else:  # no bytes at all: the empty answer's digest
            digest = self._hash.hexdigest() if self._hash is not None else EMPTY_SHA256
        kept = False
        if not self._why_not and digest is not None:
            kept = self._commit(digest)
        self._note(kept=kept, digest=digest)

    def _note(self, *, kept: bool, digest: str | None) -> None:
        line = index_line_json(
            key=self.key,
            kind=self.kind,
            what=self.what,
            kept=kept,
            size=self.size,
            sha256=digest,
            why_not="" if kept else self._why_not,
            replay=self.replay,
        )
        self._recorder.note(line, self.kind)

    def _commit(self, digest: str) -> bool:
        if self._fd < 0 and self._recorder.knows(digest):
            # held whole and kept already: no file written only to be removed
            self._held = bytearray()
            self._recorder.release(self._written)
            return True
        blob = os.path.join(self._recorder.blobs, digest)
        try:
            if self._fd < 0:  # held whole (or empty): written now
                self._write(b"")
            os.close(self._fd)
            self._fd = -1
            temp = self._temp
            if os.path.exists(blob):  # the same answer kept already: one copy
                os.unlink(temp)
                self._recorder.release(self._written)
            else:
                os.rename(temp, blob)
            self._recorder.remember(digest)
            return True
        except OSError as exc:
            self._drop(f"the copy could not be kept ({exc.strerror or exc})")
            return False

    def _drop(self, why: str) -> None:
        self._why_not = why
        self._held = bytearray()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._written:
            self._recorder.release(self._written)
            self._written = 0
        with contextlib.suppress(OSError):
            os.unlink(self._temp)


class Replay:
    """The recording a replay serves from (copied in and checked by the host)."""

    def __init__(self, settings: ReplaySettings) -> None:
        self.root = Path(settings.dir)
        self.miss_mode: MissMode = settings.miss
        self._answers: dict[str, tuple[str, int]] = {}
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(self.root / INDEX_FILE, flags)
        with os.fdopen(fd, "rb") as handle:
            text = handle.read(MAX_INDEX_BYTES)
        for raw in text.splitlines():
            try:
                line = IndexLine.model_validate_json(raw)
            except ValidationError:
                continue
            if line.kept and line.sha256 is not None:
                self._answers.setdefault(line.key, (line.sha256, line.bytes))

    def __len__(self) -> int:
        return len(self._answers)

    def answer(self, key: str) -> bytes | None:
        """The recorded answer for `key` (None: a miss, or a blob that is not whole)."""
        found = self._answers.get(key)
        if found is None:
            return None
        digest, size = found
        if not SHA256.match(digest):
            return None
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(self.root / BLOBS_DIR / digest, flags)
            with os.fdopen(fd, "rb") as handle:
                data = handle.read(size + 1)
        except OSError:
            return None
        if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
            return None
        return data


class Reads:
    """The run's recording, and the recording it replays from (if it replays)."""

    def __init__(self, recorder: Recorder, replay: Replay | None) -> None:
        self.recorder, self.replay = recorder, replay

    @classmethod
    def from_config(
        cls, data_dir: str, recording: RecordingSettings, replay: ReplaySettings | None
    ) -> Reads:
        recorder = Recorder(Path(data_dir) / RECORDING_DIR, recording)
        return cls(recorder, Replay(replay) if replay is not None else None)

    def close(self) -> None:
        self.recorder.close()
