"""Adding columns through the table API while writers, readers and the merger run:
``t.alter.add_columns`` and ``write(..., schema_mode="merge")``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import datafusion
import lance
import pandas as pd
import pyarrow as pa
import pytest

import memwal_query as mq


def _create(uri) -> mq.MemWalTable:
    return mq.MemWalTable.create(
        uri, pd.DataFrame({"id": [1, 2, 3], "v": [1.0, 2.0, 3.0]}), primary_key="id"
    )


def _rows(t: mq.MemWalTable, **kw) -> dict[int, dict]:
    return {r["id"]: r for r in t.to_table(**kw).to_pylist()}


def test_added_column_reads_null_for_every_older_row(tmp_path):
    uri = str(tmp_path / "t")
    t = _create(uri)
    t.write(pd.DataFrame({"id": [4], "v": [4.0]}))
    t.flush()  # a generation without the column
    t.write(pd.DataFrame({"id": [5], "v": [5.0]}))  # a WAL entry / MemTable without it
    t.close(flush=False)
    stale = mq.MemWalTable.open(uri)  # opened before the change (merges below)
    schema = t.alter.add_columns(pa.field("tag", pa.string()))
    assert schema.names == ["id", "v", "tag"] and t.schema.names == ["id", "v", "tag"]
    assert lance.dataset(uri).schema.field("tag").type == pa.string()
    t.write(pd.DataFrame({"id": [2, 6], "v": [20.0, 6.0], "tag": ["b", "f"]}))

    fresh = mq.MemWalTable.open(uri)
    expected = {
        1: None,
        2: "b",
        3: None,
        4: None,
        5: None,
        6: "f",
    }
    for reader in (t, fresh):
        assert {k: r["tag"] for k, r in _rows(reader, consistency="latest").items()} == expected
    ctx = datafusion.SessionContext()
    ctx.register_table("t", fresh.provider(consistency="latest"))
    got = ctx.sql("SELECT id, tag FROM t WHERE tag IS NOT NULL ORDER BY id").to_pylist()
    assert got == [{"id": 2, "tag": "b"}, {"id": 6, "tag": "f"}]
    found = fresh.lookup(pa.table({"id": [5, 6]}), consistency="latest").sort_by("id")
    assert found.column("tag").to_pylist() == [None, "f"]
    feed = fresh.changes(consistency="latest").table
    assert "tag" in feed.column_names
    assert {r["id"]: r["tag"] for r in feed.to_pylist()} == {4: None, 5: None, 2: "b", 6: "f"}

    t.flush()
    stale.maintenance.merge()  # generations from before and after the change
    base = {r["id"]: r["tag"] for r in lance.dataset(uri).to_table().to_pylist()}
    assert base == expected
    assert {k: r["tag"] for k, r in _rows(mq.MemWalTable.open(uri)).items()} == expected


@pytest.mark.parametrize(
    "fields, message",
    [
        (pa.field("v", pa.int64()), "exists already"),
        (pa.field("n", pa.int64(), nullable=False), "not nullable"),
        (pa.field("_tombstone", pa.bool_()), "reserved"),
        ({"n": pa.null()}, "no type"),
        ([pa.field("n", pa.int8()), pa.field("n", pa.int8())], "twice"),
        ([], "no column"),
        ({"n": "int"}, "no Arrow type named 'int'"),
        ({"n": 3}, "pyarrow.DataType"),
    ],
)
def test_add_columns_refuses_bad_fields_unchanged(tmp_path, fields, message):
    uri = str(tmp_path / "t")
    t = _create(uri)
    version = lance.dataset(uri).version
    with pytest.raises(mq.SchemaError, match=message):
        t.alter.add_columns(fields)
    assert lance.dataset(uri).version == version and t.schema.names == ["id", "v"]


def test_extra_column_is_refused_unless_schema_mode_merge(tmp_path):
    uri = str(tmp_path / "t")
    t = _create(uri)
    rows = pd.DataFrame({"id": [1], "v": [1.5], "score": [0.5]})
    with pytest.raises(mq.SchemaError, match=r"alter\.add_columns.*schema_mode='merge'"):
        t.write(rows)
    with pytest.raises(ValueError, match="schema_mode"):
        t.write(rows, schema_mode="overwrite")
    assert t.schema.names == ["id", "v"]
    t.write(rows, schema_mode="merge")
    assert t.schema.field("score").type == pa.float64()
    assert _rows(t)[1] == {"id": 1, "v": 1.5, "score": 0.5}
    # the same rows again: nothing more to add
    t.write(rows, schema_mode="merge")
    # a whole-row upsert must now give the column (or write partially)
    with pytest.raises(mq.SchemaError, match="score"):
        t.write(pd.DataFrame({"id": [2], "v": [2.5]}))
    t.write(pd.DataFrame({"id": [1], "v": [9.0]}), partial=True)
    assert _rows(t)[1] == {"id": 1, "v": 9.0, "score": 0.5}


def test_object_opened_before_takes_a_column_another_process_added(tmp_path):
    """A table object opened before the change: rows with the new column are written
    (it takes the new schema); its writer opened before is replaced, no value lost."""
    uri = str(tmp_path / "t")
    old = _create(uri)
    old.write(pd.DataFrame({"id": [1], "v": [10.0]}))  # its writer is open
    mq.MemWalTable.open(uri).alter.add_columns({"tag": pa.string()})
    old.write(pd.DataFrame({"id": [2], "v": [20.0], "tag": ["x"]}))
    assert old.schema.names == ["id", "v", "tag"]
    got = _rows(mq.MemWalTable.open(uri), consistency="latest")
    assert got[1] == {"id": 1, "v": 10.0, "tag": None}
    assert got[2] == {"id": 2, "v": 20.0, "tag": "x"}


def test_writer_opened_after_the_change_by_a_stale_object_is_refused(tmp_path):
    uri = str(tmp_path / "t")
    stale = _create(uri)
    mq.MemWalTable.open(uri).alter.add_columns({"tag": pa.string()})
    with pytest.raises(mq.SchemaChangedError, match=r"\['tag'\].*MemWalTable\.open"):
        stale.writer()
    # through write(): the object takes the new schema, and whole rows need the column
    with pytest.raises(mq.SchemaError, match=r"\['tag'\] are missing"):
        stale.write(pd.DataFrame({"id": [1], "v": [1.0]}))
    stale.write(pd.DataFrame({"id": [1], "v": [1.0], "tag": ["a"]}))
    assert _rows(stale)[1]["tag"] == "a"
    again = _create(str(tmp_path / "u"))
    mq.MemWalTable.open(again.uri).alter.add_columns({"tag": pa.string()})
    again.delete(pd.DataFrame({"id": [2]}))  # deletes take the new schema too
    assert sorted(_rows(mq.MemWalTable.open(again.uri), consistency="latest")) == [1, 3]


_WORKER = textwrap.dedent(
    """
    import json, sys
    import pandas as pd
    import memwal_query as mq

    t = mq.MemWalTable.open(sys.argv[1])
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            t.write(pd.DataFrame(cmd["rows"]), partial=cmd.get("partial", False))
            out = {"ok": True, "columns": t.schema.names}
        except mq.MemWalError as e:
            out = {"ok": False, "error": type(e).__name__, "message": str(e)}
        print(json.dumps(out), flush=True)
    t.close()
    """
)


class _Worker:
    """A writer process with an open MemWalTable, driven one write at a time."""

    def __init__(self, uri: str) -> None:
        env = dict(os.environ)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER, uri],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    def write(self, rows: dict, partial: bool = False) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"rows": rows, "partial": partial}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        assert self.proc.wait(timeout=60) == 0


def test_writer_process_running_across_add_columns(tmp_path):
    """A writer process opened before the change keeps writing whole rows without the
    column until another writer writes the column (fencing it); then a whole row
    without the column is refused (it would drop the value), a partial update keeps
    the value, and a row with the column is written."""
    uri = str(tmp_path / "t")
    _create(uri).close()
    w = _Worker(uri)
    try:
        assert w.write({"id": [1], "v": [1.0]})["ok"]
        here = mq.MemWalTable.open(uri)
        here.alter.add_columns({"tag": pa.string()})
        # its writer is open and not fenced: its rows come before every row with a tag
        assert w.write({"id": [2], "v": [2.0]}) == {"ok": True, "columns": ["id", "v"]}
        here.write(pd.DataFrame({"id": [1, 2], "v": [1.5, 2.5], "tag": ["a", "b"]}))
        here.close()
        refused = w.write({"id": [1], "v": [100.0]})
        assert refused["ok"] is False and refused["error"] == "SchemaError"
        assert "['tag'] are missing" in refused["message"]
        assert w.write({"id": [1], "v": [100.0]}, partial=True)["ok"]
        done = w.write({"id": [3], "v": [3.0], "tag": ["c"]})
        assert done == {"ok": True, "columns": ["id", "v", "tag"]}
    finally:
        w.close()
    got = _rows(mq.MemWalTable.open(uri))
    assert got[1] == {"id": 1, "v": 100.0, "tag": "a"}
    assert got[2] == {"id": 2, "v": 2.5, "tag": "b"}
    assert got[3] == {"id": 3, "v": 3.0, "tag": "c"}


def test_column_added_while_a_writer_claims_is_seen_after_the_claim(tmp_path, monkeypatch):
    """The schema change lands between the writer's first schema check and its claim:
    the check after the claim refuses it (the claim cannot hide the change)."""
    from memwal_query.format.manifest import RegionManifestStore

    uri = str(tmp_path / "t")
    stale = _create(uri)
    other = mq.MemWalTable.open(uri)
    claim = RegionManifestStore.claim

    def add_then_claim(self, *args, **kwargs):
        monkeypatch.setattr(RegionManifestStore, "claim", claim)
        other.alter.add_columns({"tag": pa.string()})
        return claim(self, *args, **kwargs)

    monkeypatch.setattr(RegionManifestStore, "claim", add_then_claim)
    with pytest.raises(mq.SchemaChangedError, match="the region was claimed"):
        stale.writer()
    assert stale.schema.names == ["id", "v"]


def test_cli_ingest_schema_mode_merge(tmp_path):
    from click.testing import CliRunner

    from memwal_query.cli import main

    uri = str(tmp_path / "t")
    _create(uri).close()
    path = str(tmp_path / "rows.parquet")
    pd.DataFrame({"id": [7], "v": [7.0], "tag": ["g"]}).to_parquet(path)
    runner = CliRunner()
    refused = runner.invoke(main, ["ingest", uri, path])
    assert refused.exit_code == 1 and "--schema-mode merge" in refused.output
    assert mq.MemWalTable.open(uri).schema.names == ["id", "v"]
    done = runner.invoke(main, ["ingest", uri, path, "--schema-mode", "merge"])
    assert done.exit_code == 0, done.output
    assert _rows(mq.MemWalTable.open(uri))[7] == {"id": 7, "v": 7.0, "tag": "g"}


def test_lance_refuses_type_changes_on_a_memwal_table(tmp_path):
    """Why the table offers no type widening (docs/schema.md): Lance refuses to change a
    column's type once a MemWAL is attached. Should that change, widening can be
    offered through t.alter."""
    t = mq.MemWalTable.create(
        tmp_path / "t", pa.table({"id": [1], "n": pa.array([1], pa.int32())}), primary_key="id"
    )
    with pytest.raises(OSError, match="MemWAL attached"):
        t.catalog.dataset().alter_columns({"path": "n", "data_type": pa.int64()})
    assert lance.dataset(t.uri).schema.field("n").type == pa.int32()


def test_add_columns_retries_when_a_merge_commits_first(tmp_path, monkeypatch):
    """A merge commits between add_columns reading the base and committing (Lance:
    "preempted by concurrent transaction"): add_columns checks again and retries; the
    merged rows and the column are both there."""
    uri = str(tmp_path / "t")
    t = _create(uri)
    t.write(pd.DataFrame({"id": [4], "v": [4.0]}))
    t.flush()
    merger = mq.MemWalTable.open(uri)
    add = lance.LanceDataset.add_columns
    calls = []

    def merge_first(self, *args, **kwargs):
        calls.append(self.version)
        if len(calls) == 1:
            merger.maintenance.merge()  # commits a newer version of the base
        return add(self, *args, **kwargs)

    monkeypatch.setattr(lance.LanceDataset, "add_columns", merge_first)
    monkeypatch.setattr("memwal_query.maintain.merger._backoff", lambda attempt: 0.0)
    t.alter.add_columns({"tag": pa.string()})
    assert len(calls) == 2 and calls[1] > calls[0]
    base = lance.dataset(uri)
    assert base.schema.field("tag").type == pa.string()
    assert sorted(r["id"] for r in base.to_table().to_pylist()) == [1, 2, 3, 4]
