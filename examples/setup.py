"""Materialize the examples' workflow DBs from their committed seed SQL.

Binary DB files are not committed; `make demo` and the tests call this. It only
creates a DB that does not exist yet, so a second call changes nothing.
"""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent


def ensure_db(workflow_dir: Path) -> Path | None:
    seed = workflow_dir / "db" / "seed.sql"
    db_path = workflow_dir / "db" / "db.sqlite"
    if not seed.is_file() or db_path.exists():
        return db_path if db_path.exists() else None
    con = sqlite3.connect(db_path)
    try:
        con.execute("PRAGMA journal_mode=WAL")
        con.executescript(seed.read_text())
        con.commit()
    finally:
        con.close()
    return db_path


def main() -> int:
    for workflow in sorted(p for p in EXAMPLES.iterdir() if (p / "workflow.toml").is_file()):
        ensure_db(workflow)
    return 0


if __name__ == "__main__":
    sys.exit(main())
