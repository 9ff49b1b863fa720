"""What the CLI prints is escaped exactly as the per-character rule says, fast path or not."""

from __future__ import annotations

import unicodedata

from hypothesis import given
from hypothesis import strategies as st

from sandbox.termsafe import _escape, clean


def by_the_rule(text: str, keep_newlines: bool) -> str:
    """The rule, one character at a time: C0/C1 controls, DEL, format characters,
    surrogates and the line/paragraph separators escaped; newline and tab kept if asked."""
    return "".join(
        c
        if keep_newlines and c in "\n\t"
        else _escape(c)
        if unicodedata.category(c) in ("Cc", "Cf", "Cs", "Zl", "Zp")
        else c
        for c in text
    )


@given(st.text(), st.booleans())
def test_clean_is_the_per_character_rule(text: str, keep_newlines: bool) -> None:
    assert clean(text, keep_newlines=keep_newlines) == by_the_rule(text, keep_newlines)


@given(
    st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"])),
    st.sampled_from(["\x1b", "\u202e", "\u200b", "\x00", "\x7f", "\x9b", "\u2028", "\u2029"]),
    st.booleans(),
)
def test_one_dangerous_character_anywhere_is_escaped(text: str, bad: str, keep: bool) -> None:
    out = clean(text + bad + text, keep_newlines=keep)
    assert bad not in out and _escape(bad) in out


def test_kept_and_escaped_examples() -> None:
    assert clean('{\n\t"a": "b\\u001b"\n}') == '{\n\t"a": "b\\u001b"\n}'
    assert clean("a\nb\tc", keep_newlines=False) == "a\\x0ab\\x09c"
    assert clean("title\x1b]0;pwned\x07") == "title\\x1b]0;pwned\\x07"
    assert clean("caf\u00e9 \u00a0 \ue000") == "caf\u00e9 \u00a0 \ue000"  # NBSP, private use kept
    assert clean("left\u202eright") == "left\\u202eright"
