"""The SQL classifier of the effects table: what a piece of SQLite SQL does to the DB.

`classify_sql` reads SQL as SQLite's tokenizer would (comments and literals out before
any keyword is read) and answers READ, WRITE, MIGRATION or FORBIDDEN; whatever it
cannot classify is FORBIDDEN, never READ. Pure, like the table it serves
(`sandbox.policy`, which re-exports both names); it decides verdicts, so its file is
part of the policy's version (`sandbox.prepare.contenthash.policy_version`).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from types import MappingProxyType
from typing import Final

__all__ = ["SqlKind", "classify_sql"]


class SqlKind(StrEnum):
    """What a piece of SQL does, ordered from harmless to escape attempt."""

    READ = "read"
    WRITE = "write"
    MIGRATION = "migration"
    FORBIDDEN = "forbidden"


_SQL_RANK: Final[Mapping[SqlKind, int]] = MappingProxyType(
    {SqlKind.READ: 0, SqlKind.WRITE: 1, SqlKind.MIGRATION: 2, SqlKind.FORBIDDEN: 3}
)

# Words that make any statement an escape attempt, wherever they appear (outside
# literals): attaching files, loading native code, file I/O and pointer tricks.
_FORBIDDEN_WORDS: Final = frozenset(
    {"ATTACH", "DETACH", "LOAD_EXTENSION", "READFILE", "WRITEFILE", "FTS3_TOKENIZER"}
)
_READ_HEADS: Final = frozenset({"SELECT", "VALUES"})
_WRITE_HEADS: Final = frozenset(
    {"INSERT", "REPLACE", "UPDATE", "DELETE"}
    | {"BEGIN", "COMMIT", "END", "ROLLBACK", "SAVEPOINT", "RELEASE"}
)
_MIGRATION_HEADS: Final = frozenset({"CREATE", "ALTER", "DROP", "REINDEX", "ANALYZE", "VACUUM"})
# PRAGMAs that only report, when queried without a value.
_READ_PRAGMAS: Final = frozenset(
    {
        "application_id",
        "auto_vacuum",
        "cache_size",
        "collation_list",
        "compile_options",
        "data_version",
        "database_list",
        "encoding",
        "foreign_key_check",
        "foreign_key_list",
        "foreign_keys",
        "freelist_count",
        "function_list",
        "integrity_check",
        "journal_mode",
        "module_list",
        "page_count",
        "page_size",
        "pragma_list",
        "quick_check",
        "schema_version",
        "table_list",
        "user_version",
    }
)
# PRAGMAs whose parenthesised argument names what to report on.
_READ_PRAGMAS_WITH_ARG: Final = frozenset(
    {
        "foreign_key_check",
        "foreign_key_list",
        "index_info",
        "index_list",
        "index_xinfo",
        "integrity_check",
        "quick_check",
        "table_info",
        "table_list",
        "table_xinfo",
    }
)

# Placeholder tokens (never words): a string or blob literal, a quoted
# identifier, a number, a bound parameter.
_LITERAL: Final = "'"
_QUOTED_IDENT: Final = '"'
_NUMBER: Final = "0"
_PARAM: Final = "?"
_SQL_SPACE: Final = frozenset(" \t\n\v\f\r")


def _is_id_start(c: str) -> bool:
    return (c.isascii() and (c.isalpha() or c == "_")) or ord(c) >= 0x80


def _is_id_char(c: str) -> bool:
    return (c.isascii() and (c.isalnum() or c in "_$")) or ord(c) >= 0x80


def _is_word(token: str) -> bool:
    return _is_id_start(token[0])


def _tokenize(sql: str) -> list[list[str]] | None:
    """Split SQL into statements of tokens, as SQLite's tokenizer would.

    Comments are dropped; literals, quoted identifiers, numbers and parameters
    become placeholder tokens; bare words are upper-cased (ASCII only, as SQLite
    keywords are ASCII). Returns None when the SQL cannot be tokenized (an
    unterminated literal or quoted identifier, a NUL byte).
    """
    if "\x00" in sql:
        return None
    statements: list[list[str]] = [[]]
    i, n = 0, len(sql)
    while i < n:
        c = sql[i]
        if c in _SQL_SPACE:
            i += 1
        elif sql.startswith("--", i):
            end = sql.find("\n", i)
            i = n if end < 0 else end + 1
        elif sql.startswith("/*", i):
            end = sql.find("*/", i + 2)
            i = n if end < 0 else end + 2  # SQLite: an open comment runs to the end
        elif c in "'\"`":
            j = i + 1
            while True:
                j = sql.find(c, j)
                if j < 0:
                    return None
                if j + 1 < n and sql[j + 1] == c:  # doubled quote is an escaped quote
                    j += 2
                    continue
                break
            statements[-1].append(_LITERAL if c == "'" else _QUOTED_IDENT)
            i = j + 1
        elif c == "[":
            j = sql.find("]", i + 1)
            if j < 0:
                return None
            statements[-1].append(_QUOTED_IDENT)
            i = j + 1
        elif c == ";":
            statements.append([])
            i += 1
        elif (c.isascii() and c.isdigit()) or (
            c == "." and i + 1 < n and sql[i + 1] in "0123456789"
        ):
            j = i + 1
            while j < n and (sql[j].isascii() and (sql[j].isalnum() or sql[j] in "._")):
                j += 1
            statements[-1].append(_NUMBER)
            i = j
        elif c in "?:@$#" and i + 1 < n and _is_id_char(sql[i + 1]):
            j = i + 1
            while j < n and _is_id_char(sql[j]):
                j += 1
            statements[-1].append(_PARAM)
            i = j
        elif c == "?":
            statements[-1].append(_PARAM)
            i += 1
        elif _is_id_start(c):
            j = i + 1
            while j < n and _is_id_char(sql[j]):
                j += 1
            word = sql[i:j]
            statements[-1].append(word.upper() if word.isascii() else word)
            i = j
        else:
            statements[-1].append(c)
            i += 1
    return [s for s in statements if s]


def _main_verb_after_with(tokens: list[str]) -> str | None:
    """The statement verb after a WITH clause's CTEs (the first one at depth 0)."""
    depth = 0
    for tok in tokens[1:]:
        if tok == "(":
            depth += 1
        elif tok == ")":
            depth -= 1
            if depth < 0:
                return None
        elif depth == 0 and tok in _READ_HEADS | {"INSERT", "REPLACE", "UPDATE", "DELETE"}:
            return tok
    return None


def _classify_pragma(tokens: list[str]) -> SqlKind:
    rest = tokens[1:]
    if len(rest) >= 3 and rest[1] == ".":  # schema-qualified: PRAGMA main.table_info(t)
        rest = rest[2:]
    if not rest or not _is_word(rest[0]):
        return SqlKind.FORBIDDEN
    name, args = rest[0].lower(), rest[1:]
    if not args:
        return SqlKind.READ if name in _READ_PRAGMAS else SqlKind.FORBIDDEN
    if (
        name in _READ_PRAGMAS_WITH_ARG
        and len(args) == 3
        and args[0] == "("
        and args[2] == ")"
        and args[1] != "("
    ):
        return SqlKind.READ
    return SqlKind.FORBIDDEN  # assignments and everything else change the DB or connection


def _classify_statement(tokens: list[str]) -> SqlKind:
    if any(tok in _FORBIDDEN_WORDS for tok in tokens):
        return SqlKind.FORBIDDEN
    head = tokens[0]
    if head == "EXPLAIN":
        rest = tokens[1:]
        if rest[:2] == ["QUERY", "PLAN"]:
            rest = rest[2:]
        if not rest or _classify_statement(rest) is SqlKind.FORBIDDEN:
            return SqlKind.FORBIDDEN
        return SqlKind.READ  # EXPLAIN compiles the statement; it does not run it
    if head in _READ_HEADS:
        return SqlKind.READ
    if head == "WITH":
        verb = _main_verb_after_with(tokens)
        if verb is None:
            return SqlKind.FORBIDDEN
        return SqlKind.READ if verb in _READ_HEADS else SqlKind.WRITE
    if head in _WRITE_HEADS:
        return SqlKind.WRITE
    if head == "VACUUM" and "INTO" in tokens:
        return SqlKind.FORBIDDEN  # VACUUM INTO writes a new file outside the copy
    if head in _MIGRATION_HEADS:
        return SqlKind.MIGRATION
    if head == "PRAGMA":
        return _classify_pragma(tokens)
    return SqlKind.FORBIDDEN


def classify_sql(sql: str) -> SqlKind:
    """Classify SQLite SQL as READ, WRITE, MIGRATION or FORBIDDEN, conservatively.

    Comments, string literals and quoted identifiers are removed before keywords
    are read, so ``SELECT 'DROP TABLE x'`` is a read and ``/* */ ATTACH`` is
    still seen. Several statements (split on ``;`` outside literals) get the
    worst of their kinds (READ < WRITE < MIGRATION < FORBIDDEN). ``WITH ...
    SELECT`` is a read, ``WITH ... INSERT/UPDATE/DELETE`` a write; ``EXPLAIN`` is
    a read. ATTACH/DETACH, extension loading, any PRAGMA that is not a plain
    read, ``VACUUM INTO``, empty or untokenizable SQL and unknown statements are
    FORBIDDEN. Nothing that cannot be classified is ever READ.
    """
    if not isinstance(sql, str):
        return SqlKind.FORBIDDEN
    statements = _tokenize(sql)
    if not statements:
        return SqlKind.FORBIDDEN
    return max((_classify_statement(s) for s in statements), key=_SQL_RANK.__getitem__)
