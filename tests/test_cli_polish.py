"""The memwal CLI as a new user meets it: NULL vs NaN, CSV with vectors, ``| head``,
``--version``, ``--debug`` anywhere, help on every option, ``-f FILE`` and ``--table``,
``gc`` explaining what it keeps. In-process through click's CliRunner (the closed pipe
of ``| head`` is in test_cli.py's one real-process smoke test)."""

from __future__ import annotations

import json
import os

import click
import lance
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import memwal_query as mq
from memwal_query.cli.commands import _split_statements, _write_atomically, main
from memwal_query.cli.fmt import json_text

from helpers import PK

SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), False, PK),
        pa.field("x", pa.float64()),
        pa.field("name", pa.string()),
        pa.field("vec", pa.list_(pa.float32(), 2)),
    ]
)


@pytest.fixture
def uri(tmp_path):
    uri = str(tmp_path / "events")
    rows = pa.table(
        {
            "id": [1, 2, 3, 4],
            "x": [1.5, float("nan"), None, 4.0],
            "name": ["a", None, 'q"uote', "d"],
            "vec": [[1.0, 2.0], [3.0, float("nan")], None, [0.5, -1.0]],
        },
        schema=SCHEMA,
    )
    lance.write_dataset(rows, uri)
    mq.MemWalTable.initialize(uri)
    return uri


def run(*args, ok=True):
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    if ok:
        assert result.exit_code == 0, result.output
    return result


def test_null_prints_as_null_and_nan_as_nan(uri):
    out = run("sql", uri, "SELECT id, x, name FROM t ORDER BY id").output.splitlines()
    assert out[0].split() == ["id", "x", "name"]
    assert out[2].split() == ["2", "NaN", "NULL"]
    assert out[3].split() == ["3", "NULL", 'q"uote']


def test_csv_with_vectors_is_json_text(uri, tmp_path):
    target = tmp_path / "out.csv"
    run("sql", uri, "SELECT id, vec FROM t ORDER BY id", "--format", "csv", "--output", str(target))
    lines = target.read_text().splitlines()
    assert lines[0] == '"id","vec"'
    assert lines[1] == '1,"[1.0, 2.0]"'
    assert lines[2] == '2,"[3.0, null]"'  # JSON text: NaN is null
    assert lines[3] == "3,"  # NULL vector: empty field
    assert json.loads(lines[4].split(",", 1)[1].strip('"')) == [0.5, -1]


def test_failed_output_leaves_no_file(uri, tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    target = out_dir / "out.csv"
    bad = run("sql", uri, "SELECT nosuch FROM t", "--format", "csv", "--output", str(target), ok=0)
    assert bad.exit_code == 1 and not os.listdir(out_dir)  # no empty file

    # a write that fails half-way leaves neither the file nor its temporary
    def half(path):
        with open(path, "w") as f:
            f.write("partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        _write_atomically(str(target), half)
    assert not os.listdir(out_dir)
    run("sql", uri, "SELECT id, vec FROM t", "--format", "csv", "--output", str(target))
    assert os.listdir(out_dir) == ["out.csv"] and target.read_text().count("\n") == 5


def test_json_text_matches_python_json():
    arr = pa.array([{"a": [1, None], "b": 'x"\\\n', "f": 2.0}, None, {"a": [], "f": -0.5}])
    got = json_text(arr).to_pylist()
    assert got[0] == json.dumps(arr[0].as_py())  # same text as Python's json
    assert [None if g is None else json.loads(g) for g in got] == arr.to_pylist()


def test_version_and_debug_anywhere(uri):
    assert run("--version").output.startswith("memwal, version ")
    plain = run("sql", uri, "SELECT nosuch FROM t", ok=False)
    assert plain.exit_code == 1 and "Traceback" not in plain.output
    with pytest.raises(Exception, match="nosuch"):  # --debug after the subcommand
        CliRunner().invoke(main, ["sql", uri, "SELECT nosuch FROM t", "--debug"],
                           catch_exceptions=False)  # fmt: skip


def test_every_option_has_help():
    missing = [
        f"{name} {p.name}"
        for name, cmd in main.commands.items()
        for p in cmd.params
        if isinstance(p, click.Option) and not p.help
    ]
    assert missing == []


def test_sql_file_and_extra_tables(uri, tmp_path):
    users = tmp_path / "users.parquet"
    pq.write_table(pa.table({"id": [1, 4], "who": ["ann", "dan"]}), users)
    script = tmp_path / "q.sql"
    script.write_text(
        "-- a leading comment; with a semicolon\n"
        "SELECT e.id, u.who FROM events e JOIN users u ON e.id = u.id ORDER BY e.id;\n"
        "/* second */ SELECT count(*) AS n FROM events WHERE name <> 'a;b';\n"
    )
    out = run(
        "sql", "-f", str(script), "--table", f"events={uri}", "--table", f"users={users}",
        "--format", "json",
    ).output.splitlines()  # fmt: skip
    assert [json.loads(x) for x in out] == [
        {"id": 1, "who": "ann"},
        {"id": 4, "who": "dan"},
        {"n": 3},
    ]
    lone = run("sql", "--table", f"e={uri}", "SELECT max(id) AS m FROM e", "--format", "json")
    assert json.loads(lone.output) == {"m": 4}
    bad = run("sql", "--table", "nonsense", "SELECT 1", ok=False)
    assert bad.exit_code == 2 and "NAME=URI" in bad.output


def test_query_starting_with_a_comment(uri):
    got = run("sql", uri, "-- how many?\nSELECT count(*) AS n FROM t", "--format", "json")
    assert json.loads(got.output) == {"n": 4}
    typo = run("sql", uri, "SELECT 1", "--fromat", "csv", ok=False)
    assert typo.exit_code == 2 and "--fromat" in typo.output


def test_split_statements():
    text = "-- c;\nSELECT 'a;''b' AS \"x;y\"; /* ; */ SELECT 2 -- ;\n;\n-- only a comment;\n"
    assert _split_statements(text) == ["-- c;\nSELECT 'a;''b' AS \"x;y\"", "/* ; */ SELECT 2 -- ;"]


def test_gc_says_what_kept_each_generation(uri):
    t = mq.MemWalTable.open(uri)
    with t.writer() as w:
        w.put(pa.table({"id": [1], "x": [9.0], "name": ["z"], "vec": [[0.0, 0.0]]}, schema=SCHEMA))
        w.flush()
        w.put(pa.table({"id": [5], "x": [9.0], "name": ["z"], "vec": [[0.0, 0.0]]}, schema=SCHEMA))
        w.flush()
    t.maintenance.merge(max_generations=1)
    out = run("gc", uri).output  # a summary sized for a person
    assert "removed 0 generation(s) and 0 WAL entries, 0 B" in out
    assert "kept 2 generation(s): 1 kept by retained base versions" in out
    assert "1 not merged yet (memwal merge)" in out and len(out.splitlines()) == 2
    out = run("gc", uri, "--verbose").output
    kept = [line for line in out.splitlines() if line.startswith("kept ")]
    assert len(kept) == 2
    assert "generation 1: retained base version" in kept[0] and "--cleanup-older-than" in kept[0]
    assert "generation 2: not merged yet" in kept[1]
    out = run("gc", uri, "--cleanup-older-than", "0s").output
    assert "_gen_1" not in out and "removed 1 generation(s) and" in out
    assert " 0 B" not in out.splitlines()[0] and "generation 1:" not in out


def test_progress_bars_silent_when_not_a_terminal(uri, tmp_path):
    src = tmp_path / "rows.parquet"
    pq.write_table(
        pa.table({"id": [7, 8], "x": [1.0, 2.0], "name": ["g", "h"], "vec": [[1.0, 1.0]] * 2}),
        src,
    )
    out = run("ingest", uri, str(src)).output  # stdout and stderr: not a terminal
    assert "2 rows in" in out and "ingesting" not in out
    out = run("merge", uri).output
    assert "merging" not in out


def test_a_csv_written_by_sql_ingests_back_with_its_nulls(tmp_path):
    """``memwal sql --format csv`` writes NULL as an empty field and the empty string as
    ``""``; ``memwal ingest`` of that file reads them back as they were (also a NULL
    number)."""
    uri = str(tmp_path / "t")
    rows = pa.table(
        {
            "id": pa.array([1, 2, 3, 4], pa.int64()),
            "name": ["a", None, "", " "],
            "n": pa.array([1, None, 3, None], pa.int32()),
        }
    )
    t = mq.MemWalTable.create(uri, rows, primary_key="id")
    out = tmp_path / "out.csv"
    run("sql", uri, "SELECT * FROM t ORDER BY id", "--format", "csv", "--output", str(out))
    t.delete(pa.table({"id": pa.array([1, 2, 3, 4], pa.int64())}))
    t.flush()
    assert t.count_rows() == 0
    run("ingest", uri, str(out))
    got = mq.MemWalTable.open(uri).to_table().sort_by("id")
    assert got.select(["id", "name", "n"]).equals(rows.cast(got.select(["id", "name", "n"]).schema))


def test_a_rust_panic_is_a_one_line_error(tmp_path, monkeypatch):
    """A panic of Lance's Rust side (pyo3's ``PanicException``, a ``BaseException``)
    is reported like any error: one line, exit status 1, no traceback."""

    class PanicException(BaseException):  # what pyo3 raises, by name
        pass

    uri = str(tmp_path / "t")
    mq.MemWalTable.create(uri, pa.table({"id": [1, 2]}), primary_key="id")

    def panic(self, *args, **kwargs):
        raise PanicException("Memory pointer from external source is not aligned")

    from memwal_query.table import MemWalTable

    monkeypatch.setattr(MemWalTable, "open", classmethod(lambda cls, *a, **k: panic(None)))
    result = CliRunner().invoke(main, ["status", uri])
    assert result.exit_code == 1
    assert "error: PanicException: Memory pointer" in result.output
    assert "Traceback" not in result.output
