"""The guard's bounded memo (`sandbox.guard.memo.remember`): whatever is asked, it
never holds more than its entries, nor a key longer than its bound."""

from __future__ import annotations

from sandbox.guard.memo import remember


def test_a_memo_never_holds_more_than_its_entries_and_empties_when_full() -> None:
    memo: dict[bytes, int] = {}
    for n in range(10):
        remember(memo, b"k%d" % n, n, entries=4, longest=8)
        assert len(memo) <= 4
        assert memo[b"k%d" % n] == n  # the answer just given is always kept
    # emptied when full, not evicted one by one: after 10 keys into 4, keys 8 and 9
    assert memo == {b"k8": 8, b"k9": 9}


def test_a_key_longer_than_its_bound_is_not_kept() -> None:
    memo: dict[str, None] = {"a": None}
    remember(memo, "x" * 9, None, entries=4, longest=8)
    assert memo == {"a": None}  # nothing added, nothing emptied
    remember(memo, "x" * 8, None, entries=4, longest=8)
    assert "x" * 8 in memo
