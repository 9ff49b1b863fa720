"""Text made safe for a terminal: what the CLI prints never drives the user's terminal.

Tool names, server text, a step's output and file names are chosen by the step or by
third-party servers; printed raw, an ANSI or OSC escape could rewrite the screen, set
the window title, hide lines or (on some terminals) write files, and a NUL or a bidi
override hides text. `clean` escapes every C0/C1 control character, DEL and Unicode
format character (bidi overrides, zero-width marks) as a visible `\\x..`/`\\u....`;
newlines and tabs stay when asked to.
"""

from __future__ import annotations

import unicodedata


def _escape(char: str) -> str:
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def clean(text: str, *, keep_newlines: bool = True) -> str:
    """``text`` with every control and format character escaped."""
    # Most text has none (a record's JSON escapes its own): `str.isprintable` is False
    # for every character of the categories escaped below (and for a few more, which the
    # loop keeps as they are), so True means there is nothing to escape, found at C speed.
    probe = text.replace("\n", "").replace("\t", "") if keep_newlines else text
    if probe.isprintable():
        return text
    out = []
    for char in text:
        if keep_newlines and char in "\n\t":
            out.append(char)
        elif unicodedata.category(char) in ("Cc", "Cf", "Cs", "Zl", "Zp"):
            out.append(_escape(char))
        else:
            out.append(char)
    return "".join(out)
