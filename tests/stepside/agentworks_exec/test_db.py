"""The executor's workflow DB tools (`db.py`): reads read-only, rows capped, no file created.

Each test starts the executor as a real subprocess and calls it over real HTTP.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from tests.stepside.agentworks_exec.executor import (
    Exec,
    ExecFactory,
)


def test_query_workflow_db(ex: Exec) -> None:
    reply = ex.call("query_workflow_db", sql="SELECT id, v, b FROM t WHERE id >= ?", params=[1])
    assert reply["is_error"] is False, reply
    assert reply["data"] == {
        "columns": ["id", "v", "b"],
        "rows": [[1, "one", "00ff"], [2, "two", None]],
        "truncated": False,
    }
    assert reply["text"].splitlines()[0] == "id | v | b"
    assert "2 rows" in reply["text"]


def test_query_workflow_db_is_read_only(ex: Exec, tmp_path: Path) -> None:
    reply = ex.call("query_workflow_db", sql="INSERT INTO t (v) VALUES ('sneaky')")
    assert reply["is_error"] is True
    assert "readonly" in reply["text"]
    con = sqlite3.connect(tmp_path / "db.sqlite")
    assert con.execute("SELECT count(*) FROM t").fetchone() == (2,)
    con.close()
    two = ex.call("query_workflow_db", sql="SELECT 1; SELECT 2")
    assert two["is_error"] is True


def test_query_rows_are_capped(ex: Exec) -> None:
    sql = (
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n LIMIT 1500) SELECT i FROM n"
    )
    reply = ex.call("query_workflow_db", sql=sql)
    assert len(reply["data"]["rows"]) == 1000
    assert reply["data"]["truncated"] is True


@pytest.mark.parametrize("tool", ["mutate_workflow_db", "agentworks_db"])
def test_mutate_workflow_db(ex: Exec, tool: str, tmp_path: Path) -> None:
    reply = ex.call(tool, sql="INSERT INTO t (v) VALUES (?)", params=["three"])
    assert reply["is_error"] is False, reply
    assert reply["data"] == {"rowcount": 1, "lastrowid": 3}
    reply = ex.call(tool, sql="UPDATE t SET v = :v WHERE id = 1 RETURNING id, v", params={"v": "z"})
    assert reply["data"]["rows"] == [[1, "z"]]
    con = sqlite3.connect(tmp_path / "db.sqlite")
    assert con.execute("SELECT v FROM t ORDER BY id").fetchall() == [("z",), ("two",), ("three",)]
    con.close()
    attach = ex.call(tool, sql=f"ATTACH DATABASE '{tmp_path / 'other.db'}' AS o")
    assert attach["is_error"] is True
    assert ex.call(tool, sql="SELEC nonsense")["is_error"] is True


def test_db_tools_without_db(start_exec: ExecFactory) -> None:
    ex = start_exec()
    for tool in ["query_workflow_db", "mutate_workflow_db", "agentworks_db"]:
        reply = ex.call(tool, sql="SELECT 1")
        assert reply["is_error"] is True
        assert "no DB in this test run" in reply["text"]


def test_db_missing_file_is_not_created(start_exec: ExecFactory, tmp_path: Path) -> None:
    ex = start_exec(db_path=tmp_path / "absent.sqlite")
    assert ex.call("mutate_workflow_db", sql="CREATE TABLE x (a)")["is_error"] is True
    assert not (tmp_path / "absent.sqlite").exists()
