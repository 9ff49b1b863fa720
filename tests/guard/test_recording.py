"""The recorder's caps and content addressing, and the replay's checks (no engine)."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from sandbox.contracts.recording import (
    BLOBS_DIR,
    INDEX_FILE,
    IndexLine,
    RecordingSettings,
    ReplaySettings,
    key_of,
)
from sandbox.guard import recording
from sandbox.guard.recording import Recorder, Replay

MIB = 1024 * 1024


def index(root: Path) -> list[IndexLine]:
    text = (root / INDEX_FILE).read_text()
    return [IndexLine.model_validate_json(line) for line in text.splitlines()]


def disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / BLOBS_DIR).iterdir())


def test_a_body_past_the_per_answer_cap_is_hashed_whole_and_not_kept(tmp_path: Path) -> None:
    recorder = Recorder(tmp_path, RecordingSettings(cap_bytes=64 * MIB, body_cap_bytes=4 * MIB))
    tap = recorder.tap(key_of("egress", method="GET", url="u", body_sha256=""), "egress", "GET u")
    block, whole = b"x" * MIB, hashlib.sha256()
    for _ in range(100):  # 100 MiB, streamed
        tap.feed(block)
        whole.update(block)
        assert disk_bytes(tmp_path) <= 4 * MIB
    tap.close()
    (line,) = index(tmp_path)
    assert not line.kept and line.bytes == 100 * MIB and line.sha256 == whole.hexdigest()
    assert "per-answer cap" in line.why_not
    assert disk_bytes(tmp_path) == 0 and recorder.used == 0


def test_the_recording_cap_holds_over_many_answers(tmp_path: Path) -> None:
    recorder = Recorder(tmp_path, RecordingSettings(cap_bytes=3 * MIB, body_cap_bytes=2 * MIB))
    for n in range(5):
        tap = recorder.tap(key_of("bridge", tool="t", arguments={"n": n}), "bridge", f"t {n}")
        tap.feed(bytes([n]) * MIB)
        tap.close()
    lines = index(tmp_path)
    assert [line.kept for line in lines] == [True, True, True, False, False]
    assert all("recording's cap" in line.why_not for line in lines[3:])
    assert disk_bytes(tmp_path) == 3 * MIB


def test_same_answer_is_kept_once_and_a_cut_answer_not_at_all(tmp_path: Path) -> None:
    recorder = Recorder(tmp_path, RecordingSettings())
    for key in ("a" * 64, "b" * 64):
        tap = recorder.tap(key, "mcp", "same")
        tap.feed(b"the same answer")
        tap.close()
    cut = recorder.tap("c" * 64, "egress", "cut")
    cut.feed(b"half")
    cut.close(complete=False)
    lines = index(tmp_path)
    assert [line.kept for line in lines] == [True, True, False]
    assert lines[2].why_not == "the answer was cut short"
    assert len(os.listdir(tmp_path / BLOBS_DIR)) == 1
    assert recorder.used == len(b"the same answer")


def test_replay_serves_only_whole_blobs_and_keys_ignore_argument_order(tmp_path: Path) -> None:
    recorder = Recorder(tmp_path, RecordingSettings())
    key = key_of("bridge", tool="t", arguments={"a": 1, "b": [1, 2]})
    assert key == key_of("bridge", arguments={"b": [1, 2], "a": 1}, tool="t")
    tap = recorder.tap(key, "bridge", "t")
    tap.feed(b'{"text": "answer"}')
    tap.close()
    recorder.close()
    replay = Replay(ReplaySettings(dir=str(tmp_path)))
    assert replay.answer(key) == b'{"text": "answer"}'
    assert replay.answer(key_of("bridge", tool="t", arguments={"a": 2})) is None
    (blob,) = (tmp_path / BLOBS_DIR).iterdir()
    blob.write_bytes(b'{"text": "forged!!"}')  # same size, other content
    assert replay.answer(key) is None


def test_a_rest_that_cannot_be_kept_is_given_up_before_it_arrives(tmp_path: Path) -> None:
    """What lets the relay splice a large body: the tap stops before the bytes come."""
    recorder = Recorder(tmp_path, RecordingSettings(cap_bytes=64 * MIB, body_cap_bytes=4 * MIB))
    tap = recorder.tap("d" * 64, "egress", "GET big")
    tap.feed(b"HTTP/1.1 200 OK\r\n\r\n")
    assert tap.keeping and not tap.rest_unseen(MIB)
    assert tap.rest_unseen(100 * MIB) and not tap.keeping
    tap.close()
    (line,) = index(tmp_path)
    assert not line.kept and line.sha256 is None and line.bytes == 100 * MIB + 19
    assert "per-answer cap" in line.why_not and recorder.used == 0


def test_a_recorder_without_its_guard_folder_makes_nothing_and_says_so(tmp_path: Path) -> None:
    recorder = Recorder(tmp_path / "missing" / "recording", RecordingSettings())
    tap = recorder.tap("e" * 64, "bridge", "t")
    assert recorder.unavailable.startswith("the recording could not be opened")
    tap.feed(b"answer")
    tap.close()
    assert not tap.keeping and not (tmp_path / "missing").exists()


def test_a_run_without_reads_leaves_no_recording(tmp_path: Path) -> None:
    Recorder(tmp_path / "recording", RecordingSettings()).close()
    assert list(tmp_path.iterdir()) == []


def test_the_index_stops_at_what_the_host_reads_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(recording, "MAX_INDEX_BYTES", recording.INDEX_RESERVE + 2000)
    recorder = Recorder(tmp_path, RecordingSettings())
    for n in range(50):
        tap = recorder.tap(key_of("bridge", tool="t", arguments={"n": n}), "bridge", f"t {n}")
        tap.feed(b"%d" % n)
        tap.close()
    lines = index(tmp_path)
    assert 1 < len(lines) < 50 and lines[-1].why_not == "index full"
    assert (tmp_path / INDEX_FILE).stat().st_size <= recording.INDEX_RESERVE + 2000
    assert all(line.kept for line in lines[:-1])


def _sequence(recorder: Recorder, whole: bool) -> list[IndexLine]:
    """The same answers, as whole ones (`Tap.whole`) or streamed (`feed`, `close`)."""
    answers = [b"same", b"other", b"same", b"same", b"x" * 600]
    for n, data in enumerate(answers):
        tap = recorder.tap(key_of("bridge", tool="t", arguments={"n": n}), "bridge", f"t {n}")
        if whole:
            tap.whole(data)
        else:
            tap.feed(data)
            tap.close()
    return index(recorder.root)


@pytest.mark.parametrize("cap", [64 * MIB, 12])
def test_a_whole_answer_is_recorded_as_a_streamed_one_is(tmp_path: Path, cap: int) -> None:
    """The same index lines, caps, blobs and bytes in use, whichever way an answer comes
    (with a cap of 12 bytes a repeat is refused for the cap, kept answer or not)."""
    settings = RecordingSettings(cap_bytes=cap, body_cap_bytes=500)
    whole = Recorder(tmp_path / "whole", settings)
    streamed = Recorder(tmp_path / "streamed", settings)
    for recorder in (whole, streamed):
        recorder.root.mkdir()
    assert _sequence(whole, True) == _sequence(streamed, False)
    assert whole.used == streamed.used
    assert sorted(os.listdir(whole.root / BLOBS_DIR)) == sorted(
        os.listdir(streamed.root / BLOBS_DIR)
    )


def test_a_whole_answer_kept_already_opens_no_file(tmp_path: Path, opened_paths: list[str]) -> None:
    """One answer asked many times (a bridge call repeated) costs one copy, and no file
    written and removed for each repeat."""
    recorder = Recorder(tmp_path, RecordingSettings())
    for n in range(5):
        recorder.tap(key_of("bridge", tool="t", arguments={"n": n}), "bridge", "t").whole(b"same")
    blob_opens = [
        path for path in opened_paths if os.path.dirname(path) == str(tmp_path / BLOBS_DIR)
    ]
    assert len(blob_opens) == 1
    lines = index(tmp_path)
    assert len(lines) == 5 and all(line.kept for line in lines)
    assert {line.sha256 for line in lines} == {hashlib.sha256(b"same").hexdigest()}
    assert os.listdir(tmp_path / BLOBS_DIR) == [hashlib.sha256(b"same").hexdigest()]


def test_a_streamed_answer_kept_already_opens_no_file_and_a_large_one_is_written_as_it_comes(
    tmp_path: Path, opened_paths: list[str]
) -> None:
    """The same small read again (an answer relayed in pieces, its copy kept already)
    writes no file only to remove it; an answer past what is held in memory is written
    as it comes, and both are kept whole and listed as kept."""
    recorder = Recorder(tmp_path, RecordingSettings())
    large = b"L" * (256 * 1024)  # past what a tap holds in memory (64 KiB)
    for n in range(3):
        for answer in (b"head|body", large):
            tap = recorder.tap(key_of("egress", n=n, size=len(answer)), "egress", "GET")
            tap.feed(answer[:4])
            tap.feed(memoryview(answer)[4:])
            tap.close()
    blob_opens = [
        path for path in opened_paths if os.path.dirname(path) == str(tmp_path / BLOBS_DIR)
    ]
    assert len(blob_opens) == 1 + 3  # the small answer's first copy; the large one's each time
    lines = index(tmp_path)
    assert len(lines) == 6 and all(line.kept for line in lines)
    digests = {hashlib.sha256(b"head|body").hexdigest(), hashlib.sha256(large).hexdigest()}
    assert sorted(os.listdir(tmp_path / BLOBS_DIR)) == sorted(digests)
    assert (tmp_path / BLOBS_DIR / hashlib.sha256(large).hexdigest()).read_bytes() == large
    assert recorder.used == len(b"head|body") + len(large)


class _CountedSha256:
    """`hashlib` as `sandbox.guard.recording` sees it, counting the digests it makes."""

    def __init__(self) -> None:
        self.made = 0

    def sha256(self, data: bytes = b"") -> hashlib._Hash:
        self.made += 1
        return hashlib.sha256(data)


def test_an_answer_is_hashed_once_and_its_line_names_its_digest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One digest per answer (none made per tap only to be dropped), and every kind of
    answer's index line as before: the digest of the bytes relayed (the empty one's for
    an answer without bytes), none for an answer given up before its rest arrived."""
    counted = _CountedSha256()
    monkeypatch.setattr(recording, "hashlib", counted)
    recorder = Recorder(tmp_path, RecordingSettings(body_cap_bytes=100))
    sha = {data: hashlib.sha256(data).hexdigest() for data in (b"", b"answer", b"stream")}

    def tap(n: int) -> recording.Tap:
        return recorder.tap(key_of("bridge", tool="t", arguments={"n": n}), "bridge", "t")

    made = []
    tap(1).whole(b"answer")  # new: hashed, kept
    made.append(counted.made)
    tap(2).whole(b"answer")  # kept already: hashed, listed
    made.append(counted.made)
    streamed = tap(3)
    for piece in (b"st", b"re", b"am"):
        streamed.feed(piece)
    streamed.close()
    made.append(counted.made)
    tap(4).close()  # no bytes at all
    made.append(counted.made)
    given_up = tap(5)
    given_up.feed(b"x")
    assert given_up.rest_unseen(1000)
    given_up.feed(b"y" * 1000)
    given_up.close()
    made.append(counted.made)
    assert made == [1, 2, 3, 3, 4]
    lines = [(line.kept, line.bytes, line.sha256, line.why_not) for line in index(tmp_path)]
    assert lines == [
        (True, 6, sha[b"answer"], ""),
        (True, 6, sha[b"answer"], ""),
        (True, 6, sha[b"stream"], ""),
        (True, 0, sha[b""], ""),
        (False, 1001, None, "over the per-answer cap of 100 bytes"),
    ]


def test_answers_kept_later_are_the_same_lines_and_blobs_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`keep_later` is `tap(...).whole(data)` on the recorder's thread: in the order
    given, all of it done by `close`, the same index lines and blobs as kept at once."""
    answers = [
        (key_of("mcp", server="s", tool="t", arguments={"n": n}), b"%d" % n) for n in range(40)
    ]
    now = Recorder(tmp_path / "now", RecordingSettings())
    for key, data in answers:
        now.tap(key, "mcp", "mcp s/t").whole(data)
    now.close()
    later = Recorder(tmp_path / "later", RecordingSettings())
    for key, data in answers:
        later.keep_later(key, "mcp", "mcp s/t", data)
    later.close()
    assert (tmp_path / "later" / INDEX_FILE).read_bytes() == (
        tmp_path / "now" / INDEX_FILE
    ).read_bytes()
    assert sorted(os.listdir(tmp_path / "later" / BLOBS_DIR)) == sorted(
        os.listdir(tmp_path / "now" / BLOBS_DIR)
    )


def test_answers_past_the_waiting_cap_keep_the_order_they_were_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past MAX_LATER_BYTES waiting, a caller waits for room rather than keeping its
    answer at once: the index lists every answer in the order given (a caller that
    kept its own would list it before answers still queued), and no more than the cap
    (or one larger answer, alone) ever waits. The thread's gathering is made endless
    here: only a caller waiting for room (or the stop) may end it."""
    monkeypatch.setattr(recording, "MAX_LATER_BYTES", 10)
    monkeypatch.setattr(recording, "GATHER_S", 3600.0)
    recorder = Recorder(tmp_path, RecordingSettings())
    waiting: list[int] = []
    tap = Recorder.tap

    def tap_seeing_the_queue(self: Recorder, key: str, *args: Any, **kwargs: Any) -> Any:
        waiting.append(self._later._bytes)
        return tap(self, key, *args, **kwargs)

    monkeypatch.setattr(Recorder, "tap", tap_seeing_the_queue)
    answers = [
        (key_of("mcp", server="s", tool="t", arguments={"n": n}), b"%d" % n * (1 + n % 12))
        for n in range(60)
    ]
    for key, data in answers:
        recorder.keep_later(key, "mcp", "mcp s/t", data)
    recorder.close()
    assert [line.key for line in index(tmp_path)] == [key for key, _ in answers]
    assert [line.bytes for line in index(tmp_path)] == [len(data) for _, data in answers]
    largest = max(len(data) for _, data in answers)
    assert waiting and max(waiting) <= max(10, largest)


def test_a_keeper_thread_that_ended_unasked_never_holds_a_caller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A keeper's thread that ended without a stop (nothing should end it, but the
    guard's loop waits on it) lets a caller past the cap keep its answer itself
    rather than wait for room that never comes."""
    monkeypatch.setattr(recording, "MAX_LATER_BYTES", 10)
    monkeypatch.setattr(recording._Keeper, "_keep_all", lambda self: None)
    recorder = Recorder(tmp_path, RecordingSettings())
    answers = [
        (key_of("mcp", server="s", tool="t", arguments={"n": n}), b"%05d" % n) for n in range(5)
    ]

    def give() -> None:
        for key, data in answers:
            recorder.keep_later(key, "mcp", "mcp s/t", data)

    giver = threading.Thread(target=give, daemon=True)
    giver.start()
    giver.join(60.0)  # a deadline, not a pace: a caller held forever fails here
    assert not giver.is_alive()
    recorder.close()
    # those queued before the thread was seen gone (the first, and the second unless
    # it came after) wait in vain; every later one was kept, in order
    listed = [line.key for line in index(tmp_path)]
    assert listed in ([key for key, _ in answers[1:]], [key for key, _ in answers[2:]])
