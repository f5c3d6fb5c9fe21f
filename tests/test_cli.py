"""The memwal command line, driven as a subprocess (success and error paths)."""

import json
import os
import subprocess
import sys

import lance
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import basic_rows


def memwal(*args, check=True, input=None):
    proc = subprocess.run(
        [sys.executable, "-m", "memwal_query", *args],
        capture_output=True,
        text=True,
        input=input,
        timeout=300,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"memwal {args} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture
def plain_uri(tmp_path):
    uri = str(tmp_path / "plain")
    rows = basic_rows(range(50))
    lance.write_dataset(rows.cast(pa.schema([pa.field(f.name, f.type) for f in rows.schema])), uri)
    return uri


def test_demo(tmp_path):
    out = memwal("demo", str(tmp_path / "d"), "--rows", "5000").stdout
    assert "last write wins" in out and "live rows" in out


def test_init_ingest_sql_status_flush_merge_gc(tmp_path, plain_uri):
    memwal("init", plain_uri, "--primary-key", "id", "--bucket", "id:4")
    # init twice is an error, one line, non-zero
    again = memwal("init", plain_uri, "--primary-key", "id", check=False)
    assert again.returncode == 1 and again.stderr.count("\n") == 1
    assert "already" in again.stderr
    f1 = tmp_path / "a.parquet"
    pq.write_table(basic_rows([1, 2, 100], val=[-1.0, -2.0, 100.0]), f1)
    f2 = tmp_path / "b.csv"
    f2.write_text("id,val,name\n3,-3.0,c\n101,101.0,x\n")
    f3 = tmp_path / "c.jsonl"
    f3.write_text('{"id": 4, "val": -4.0, "name": "d"}\n')
    out = memwal("ingest", plain_uri, str(f1), str(f2), str(f3)).stdout
    assert "6 rows" in out
    got = memwal(
        "sql", plain_uri, "SELECT id, val FROM t WHERE val < 0 ORDER BY id", "--format", "json"
    )
    rows = [json.loads(line) for line in got.stdout.splitlines()]
    assert rows == [{"id": i, "val": -float(i)} for i in (1, 2, 3, 4)]
    csv = memwal("sql", plain_uri, "SELECT count(*) AS n FROM t", "--format", "csv").stdout
    assert csv.splitlines()[-1] == "52"
    dirname = os.path.basename(plain_uri)  # the table is also named after its directory
    csv = memwal("sql", plain_uri, f"SELECT count(*) AS n FROM {dirname}", "--format", "csv")
    assert csv.stdout.splitlines()[-1] == "52"
    out_file = tmp_path / "out.parquet"
    memwal("sql", plain_uri, "SELECT * FROM t", "--format", "parquet", "--output", str(out_file))
    assert pq.read_table(out_file).num_rows == 52
    status = json.loads(memwal("status", plain_uri, "--json").stdout)
    assert len(status["regions"]) >= 2
    assert all(r["flushed_generations"] for r in status["regions"].values())
    text = memwal("status", plain_uri).stdout
    assert "epoch" in text
    dry = memwal("merge", plain_uri, "--dry-run").stdout
    assert "would merge" in dry
    memwal("merge", plain_uri)
    status = json.loads(memwal("status", plain_uri, "--json").stdout)
    assert all(r["merged_generation"] == 1 for r in status["regions"].values())
    gc = memwal("gc", plain_uri, "--dry-run").stdout
    assert "path(s)" in gc
    assert memwal("flush", plain_uri, "--dry-run").returncode == 0
    assert "region(s)" in memwal("refresh-snapshots", plain_uri).stdout
    assert memwal("catch-up", plain_uri, "--dry-run").returncode == 0
    # interactive prompt, fed from stdin
    session = memwal("sql", plain_uri, input="SELECT count(*) AS n\nFROM t;\n\\q\n").stdout
    assert "52" in session


def test_flush_recovers_unflushed_wal(tmp_path, plain_uri):
    memwal("init", plain_uri, "--primary-key", "id")
    f = tmp_path / "a.parquet"
    pq.write_table(basic_rows([7]), f)
    memwal("ingest", plain_uri, str(f), "--no-flush")
    status = json.loads(memwal("status", plain_uri, "--json").stdout)
    (region,) = status["regions"].values()
    assert region["unflushed_rows"] == 1
    memwal("flush", plain_uri)
    status = json.loads(memwal("status", plain_uri, "--json").stdout)
    (region,) = status["regions"].values()
    assert region["unflushed_rows"] == 0 and region["flushed_generations"] == [1]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["status", "/nonexistent/table"], "TableNotFoundError"),
        (["sql", "/nonexistent/table", "SELECT 1"], "TableNotFoundError"),
        (["init", "/nonexistent/table", "--primary-key", "id"], "no Lance table"),
        (["merge", "/nonexistent/table"], "TableNotFoundError"),
    ],
)
def test_errors_are_one_line(args, needle):
    proc = memwal(*args, check=False)
    assert proc.returncode != 0
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_options(tmp_path, plain_uri):
    proc = memwal("init", plain_uri, "--primary-key", "nope", check=False)
    assert proc.returncode != 0 and "nope" in proc.stderr
    proc = memwal("init", plain_uri, "--primary-key", "id", "--bucket", "id:x", check=False)
    assert proc.returncode != 0 and "--bucket" in proc.stderr
    memwal("init", plain_uri, "--primary-key", "id")
    bad = tmp_path / "bad.txt"
    bad.write_text("x")
    proc = memwal("ingest", plain_uri, str(bad), check=False)
    assert proc.returncode != 0 and "unknown file type" in proc.stderr
    proc = memwal("sql", plain_uri, "SELECT nope FROM t", check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    proc = memwal("--debug", "sql", plain_uri, "SELECT nope FROM t", check=False)
    assert "Traceback" in proc.stderr
