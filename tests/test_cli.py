"""The memwal command line (success and error paths), driven in-process through click's
``CliRunner``; :func:`test_real_process_smoke` runs the installed command as a real
process once, and the interactive prompt runs on a pseudo-terminal (a real process: it
needs a terminal).

Every command has a success test and error tests; an error must be one line on stderr
(``error: ...``), a non-zero exit status and no traceback (unless ``--debug``), and a
rejected command must leave the table's directory tree byte-for-byte unchanged.
"""

import json
import os
import select
import subprocess
import sys
import time
import traceback
import uuid
from dataclasses import dataclass

import lance
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from memwal_query.cli.commands import main

from helpers import basic_rows, default_region


@dataclass
class Ran:
    """What a run of ``memwal`` left: exit status, stdout and stderr."""

    returncode: int
    stdout: str
    stderr: str


def memwal(*args: str, check: bool = True, input: str | None = None) -> Ran:
    """Run ``memwal *args`` in this process (click's CliRunner).

    An exception that escapes the command is added to stderr as the traceback Python
    would print, so the one-line-error checks see what a user of the real command sees.
    """
    result = CliRunner().invoke(main, list(args), input=input, prog_name="memwal")
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(*result.exc_info))
    ran = Ran(result.exit_code, result.stdout, stderr)
    if check and ran.returncode != 0:
        raise AssertionError(f"memwal {args} failed:\n{ran.stdout}\n{ran.stderr}")
    return ran


def tree(path):
    """Every file (with its bytes) and directory under ``path``."""
    out = {}
    for root, dirs, files in os.walk(path):
        for d in dirs:
            out[os.path.relpath(os.path.join(root, d), path) + "/"] = None
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, path)] = fh.read()
    return out


def assert_one_line_error(proc, needle=None):
    """Exit status non-zero, exactly one ``error: ...`` line on stderr, no traceback."""
    lines = proc.stderr.splitlines()
    assert proc.returncode != 0, proc
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    if needle is not None:
        assert needle in lines[0], lines[0]


@pytest.fixture
def plain_uri(tmp_path):
    uri = str(tmp_path / "plain")
    rows = basic_rows(range(50))
    lance.write_dataset(rows.cast(pa.schema([pa.field(f.name, f.type) for f in rows.schema])), uri)
    return uri


@pytest.mark.slow
def test_real_process_smoke(tmp_path):
    """The one run of the installed command as real processes (every other test drives
    the click group in-process): the console script ``memwal`` (``python -m
    memwal_query`` without it), ``demo`` into a temp dir (``$TMPDIR``), then ``sql`` on
    the demo's table with a reader that goes away after one line (``| head -1``): no
    traceback, status 0. A closed pipe only exists between real processes."""
    script = os.path.join(os.path.dirname(sys.executable), "memwal")
    cmd = [script] if os.path.exists(script) else [sys.executable, "-m", "memwal_query"]
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.run(
        [*cmd, "demo", "--rows", "5000"], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert str(tmp_path) in out  # the table went into the temp dir
    assert "last write wins" in out and "live rows" in out
    # Key 7's newest version (amount ~200,000, written last, in a MemTable) wins over
    # the base row and the flushed generation, and the _gen column shows where it is.
    section = out.split("-- last write wins")[1].split("-- rows per source")[0]
    header, row = [line.split() for line in section.strip().splitlines()[-2:]]
    assert header == ["id", "user_id", "amount", "ts", "_gen", "_rowaddr"]
    # (ts prints as two words: date and time)
    assert row[0] == "7" and float(row[2]) >= 200_000 and int(row[-2]) >= 1
    assert "rows per source generation" in out
    uri = out.split("Base table: ")[1].split(" (")[0]
    # ~5,000 rows of CSV (~200 kB): more than a pipe holds, so writes after the close fail
    reader = subprocess.Popen(
        [*cmd, "sql", uri, "SELECT * FROM t", "--format", "csv"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert reader.stdout.readline().startswith(b'"id"')
    reader.stdout.close()  # what `| head -1` does
    err = reader.stderr.read().decode()
    assert reader.wait(timeout=120) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


@pytest.mark.slow
def test_demo_into_dir_and_twice(tmp_path):
    out = memwal("demo", str(tmp_path / "d"), "--rows", "5000").stdout
    assert "last write wins" in out and "5,000 rows" in out
    again = memwal("demo", str(tmp_path / "d"), "--rows", "5000").stdout  # overwrites
    assert "live rows" in again


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
    assert "would remove 0 generation(s) and 0 WAL entries" in gc
    assert memwal("drain", plain_uri, "--dry-run").returncode == 0
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
    memwal("drain", plain_uri)
    status = json.loads(memwal("status", plain_uri, "--json").stdout)
    (region,) = status["regions"].values()
    assert region["unflushed_rows"] == 0 and region["flushed_generations"] == [1]


NO_TABLE = "/nonexistent/memwal-table"


@pytest.mark.parametrize(
    "args, needle",
    [
        (["status", NO_TABLE], "TableNotFoundError"),
        (["sql", NO_TABLE, "SELECT 1"], "TableNotFoundError"),
        (["sql", NO_TABLE], "TableNotFoundError"),
        (["init", NO_TABLE, "--primary-key", "id"], "no Lance table"),
        (["ingest", NO_TABLE, "x.parquet"], "TableNotFoundError"),
        (["drain", NO_TABLE], "TableNotFoundError"),
        (["merge", NO_TABLE], "TableNotFoundError"),
        (["gc", NO_TABLE], "TableNotFoundError"),
        (["catch-up", NO_TABLE], "TableNotFoundError"),
        (["refresh-snapshots", NO_TABLE], "TableNotFoundError"),
        (["status"], "Missing argument"),
        (["no-such-command"], "No such command"),
        (["sql", NO_TABLE, "SELECT 1", "--format", "xml"], "--format"),
        (["demo", "--rows", "many"], "--rows"),
    ],
)
def test_errors_are_one_line(args, needle):
    assert_one_line_error(memwal(*args, check=False), needle)


def test_errors_on_a_table(tmp_path, plain_uri):
    # not initialized yet: every command that needs the MemWAL says so
    for cmd in ("status", "drain", "merge", "gc", "catch-up", "refresh-snapshots"):
        assert_one_line_error(memwal(cmd, plain_uri, check=False), "NotInitializedError")
    memwal("init", plain_uri, "--primary-key", "id")
    before = tree(plain_uri)
    bad_sql = memwal("sql", plain_uri, "SELECT nope FROM t", check=False)
    assert_one_line_error(bad_sql, "nope")
    parquet = memwal("sql", plain_uri, "SELECT 1", "--format", "parquet", check=False)
    assert_one_line_error(parquet, "--output")
    missing = memwal("ingest", plain_uri, str(tmp_path / "missing.parquet"), check=False)
    assert_one_line_error(missing, "missing.parquet")
    idx = memwal("catch-up", plain_uri, "--index", "nope", check=False)
    assert_one_line_error(idx, "nope")
    for cmd in ("drain", "merge"):
        region = memwal(cmd, plain_uri, "--region", "../../etc", check=False)
        assert_one_line_error(region, "InvalidPathError")
        absent = memwal(cmd, plain_uri, "--region", str(uuid.uuid4()), check=False)
        assert_one_line_error(absent, "no region")
    file_as_dir = tmp_path / "a-file"
    file_as_dir.write_text("x")
    assert_one_line_error(memwal("demo", str(file_as_dir), check=False))
    assert tree(plain_uri) == before
    # --debug shows the traceback instead
    proc = memwal("--debug", "sql", plain_uri, "SELECT nope FROM t", check=False)
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_rejected_init_changes_nothing(tmp_path, plain_uri):
    before = tree(plain_uri)
    cases = [
        ([], "no primary key"),  # the table declares none: name it
        (["--reset"], "no primary key"),
        (["--primary-key", "nope"], "nope"),
        (["--primary-key", "id", "--bucket", "id:x"], "--bucket"),
        (["--primary-key", "id", "--bucket", "nope:4"], "nope"),
        (["--primary-key", "id", "--identity", "nope"], "nope"),
        (["--primary-key", "id", "--bucket", "id:4", "--identity", "id"], "one of"),
        (["--primary-key", "id", "--expression", "col0 % 4"], "--columns"),
        (
            ["--primary-key", "id", "--expression", "no_such_fn(col0)", "--columns", "id"],
            "RegionSpecError",
        ),
        (["--primary-key", "id", "--maintained-indexes", "no_index"], "no_index"),
    ]
    for args, needle in cases:
        assert_one_line_error(memwal("init", plain_uri, *args, check=False), needle)
        assert tree(plain_uri) == before, args  # not even the primary-key metadata
    memwal("init", plain_uri, "--primary-key", "id", "--expression", "col0 % 4", "--columns", "id")
    again = memwal("init", plain_uri, "--primary-key", "id", check=False)
    assert_one_line_error(again, "already")


def test_init_takes_the_key_the_table_declares(base_uri):
    out = memwal("init", base_uri).stdout  # no --primary-key: the declared one
    assert out.strip().endswith("primary key id, region spec one region"), out


def test_ingest_formats_region_and_progress(tmp_path, plain_uri):
    memwal("init", plain_uri, "--primary-key", "id")  # no region option: one region
    f1 = tmp_path / "a.arrow"  # Arrow IPC file format
    feather.write_feather(
        basic_rows([1, 200], val=[-1.0, 200.0]), str(f1), compression="uncompressed"
    )
    f2 = tmp_path / "b.ipc"  # Arrow IPC stream format
    rows = basic_rows([201], val=[201.0])
    with pa.OSFile(str(f2), "wb") as sink, pa.ipc.new_stream(sink, rows.schema) as w:
        w.write_table(rows)
    made_up = "0a4d5ee1-5c3f-4b2e-9f5e-3a4f1b9c2d7e"  # never a region of this table
    res = memwal("ingest", plain_uri, str(f1), "--region", made_up, check=False)
    assert res.returncode == 1 and "WrongRegionError" in res.stderr
    region = default_region()
    out = memwal("ingest", plain_uri, str(f1), str(f2), "--region", region).stdout
    assert "3 rows" in out and "rows/s" in out
    status = json.loads(memwal("status", plain_uri, "--json").stdout)
    assert list(status["regions"]) == [region]
    assert status["regions"][region]["flushed_generations"] == [1]
    got = memwal("sql", plain_uri, "SELECT id, val FROM t WHERE id IN (1, 200, 201) ORDER BY id")
    assert [line.split() for line in got.stdout.splitlines()[1:]] == [
        ["1", "-1.0"],
        ["200", "200.0"],
        ["201", "201.0"],
    ]


def test_rejected_ingest_changes_nothing(tmp_path, plain_uri):
    memwal("init", plain_uri, "--primary-key", "id", "--bucket", "id:4")
    good = tmp_path / "good.parquet"
    pq.write_table(basic_rows([300, 301]), good)
    null_key = tmp_path / "null.csv"
    null_key.write_text("id,val,name\n,1.0,x\n")
    bad_type = tmp_path / "badtype.jsonl"
    bad_type.write_text('{"id": 5, "val": "abc", "name": "x"}\n')
    extra = tmp_path / "extra.csv"
    extra.write_text("id,zzz\n5,1\n")
    unknown = tmp_path / "bad.txt"
    unknown.write_text("x")
    before = tree(plain_uri)
    for f, needle in [
        (null_key, "PrimaryKeyError"),
        (bad_type, "SchemaError"),
        (extra, "zzz"),
        (unknown, "unknown file type"),
    ]:
        # the good file comes first: it must not be written either
        proc = memwal("ingest", plain_uri, str(good), str(f), check=False)
        assert_one_line_error(proc, needle)
        assert tree(plain_uri) == before, f
    # --region: a malformed id, and rows that the spec routes to other regions
    proc = memwal("ingest", plain_uri, str(good), "--region", "not-a-uuid", check=False)
    assert_one_line_error(proc, "InvalidPathError")
    other = "0a4d5ee1-5c3f-4b2e-9f5e-3a4f1b9c2d7e"
    proc = memwal("ingest", plain_uri, str(good), "--region", other, check=False)
    assert_one_line_error(proc, "WrongRegionError")
    assert tree(plain_uri) == before
    memwal("ingest", plain_uri, str(good))
    assert tree(plain_uri) != before


def test_dry_runs_change_nothing(tmp_path, plain_uri):
    lance.dataset(plain_uri).create_scalar_index("name", "BTREE", name="name_idx")
    memwal(
        "init",
        plain_uri,
        "--primary-key",
        "id",
        "--bucket",
        "id:2",
        "--maintained-indexes",
        "name_idx",
    )
    f = tmp_path / "a.parquet"
    pq.write_table(basic_rows([1, 2, 3, 500]), f)
    memwal("ingest", plain_uri, str(f))  # flushed: generation 1 per region
    memwal("ingest", plain_uri, str(f), "--no-flush")  # unflushed WAL entries
    before = tree(plain_uri)
    assert "would flush" in memwal("drain", plain_uri, "--dry-run").stdout
    assert "would merge [1]" in memwal("merge", plain_uri, "--dry-run").stdout
    catch_up = memwal("catch-up", plain_uri, "--dry-run").stdout  # nothing merged yet
    assert catch_up.startswith("nothing to do")
    snap = memwal("refresh-snapshots", plain_uri, "--dry-run").stdout
    assert "2 region(s) would be in the snapshot" in snap
    assert "would remove" in memwal("gc", plain_uri, "--dry-run").stdout
    assert tree(plain_uri) == before
    # and the real runs
    assert "generation 2" in memwal("drain", plain_uri).stdout
    assert "merged [1, 2]" in memwal("merge", plain_uri).stdout
    caught = json.loads(memwal("catch-up", plain_uri).stdout)
    assert set(caught["name_idx"].values()) == {2}
    assert "2 region(s) in the snapshot" in memwal("refresh-snapshots", plain_uri).stdout
    would_proc = memwal("gc", plain_uri, "--dry-run", "--cleanup-older-than", "0s")
    would = would_proc.stdout
    removed = memwal("gc", plain_uri, "--cleanup-older-than", "0s", "--verbose").stdout
    assert "would remove" in would and "note: a dry run" in would_proc.stderr
    assert "removed" in removed and "_gen_1" in removed
    status = json.loads(memwal("status", plain_uri, "--json").stdout)
    for r in status["regions"].values():
        assert r["merged_generation"] == 2 and r["unflushed_rows"] == 0
        assert set(r) >= {
            "writer_epoch",
            "current_generation",
            "flushed_generations",
            "replay_after_wal_entry_position",
            "wal_last_position",
            "unflushed_rows",
            "generation_bytes",
            "wal_bytes",
        }
    text = memwal("status", plain_uri).stdout.splitlines()
    assert text[1].split()[:3] == ["region", "values", "epoch"]
    assert len(text) == 2 + len(status["regions"])


def _pty_session(args, keys, env, timeout=120):
    """Run ``memwal *args`` on a pseudo-terminal; type each of ``keys`` at a new prompt.

    Returns everything the terminal showed. A real process (not CliRunner): the prompt's
    line editing and history (readline) work only when stdin is a terminal.
    """
    import pty

    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "memwal_query", *args],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env={**os.environ, **env, "TERM": "xterm"},
        close_fds=True,
    )
    os.close(slave)
    out = b""
    deadline = time.monotonic() + timeout

    def pump() -> bool:
        """Read what is there (False once the terminal is closed)."""
        nonlocal out
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                out += os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                return False
        return True

    try:
        prompts = 0
        for k in keys:
            while out.count(b"> ") <= prompts:  # wait for the next prompt
                assert time.monotonic() < deadline and pump(), out
            prompts = out.count(b"> ")
            os.write(master, k)
        while proc.poll() is None and time.monotonic() < deadline:
            pump()
        while pump() and select.select([master], [], [], 0)[0]:
            pass
        assert proc.poll() == 0, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return out.decode(errors="replace")


@pytest.mark.slow
def test_interactive_prompt_with_history(tmp_path, plain_uri):
    """On a terminal: multi-line statements, an error that does not end the session,
    and a history file from which the next session recalls a statement (arrow up)."""
    memwal("init", plain_uri, "--primary-key", "id")
    env = {"HOME": str(tmp_path)}
    first = _pty_session(
        ["sql", plain_uri],
        [b"SELECT count(*) * 1000 + 7\r", b"AS n FROM t;\r", b"SELECT nope;\r", b"\\q\r"],
        env,
    )
    assert "50007" in first and "error:" in first, first
    history = (tmp_path / ".memwal_history").read_text()
    assert "SELECT count(*) * 1000 + 7 AS n FROM t;" in history
    # arrow up twice: the failed statement, then the count; Enter runs it again
    second = _pty_session(["sql", plain_uri], [b"\x1b[A\x1b[A\r", b"\x04"], env)
    assert "50007" in second, second


def test_ingest_parses_csv_and_json_as_the_table_types(tmp_path, plain_uri):
    """A string column of digits keeps its leading zeros (not inferred as an integer)."""
    memwal("init", plain_uri, "--primary-key", "id")
    csv_file = tmp_path / "zips.csv"
    csv_file.write_text("id,val,name\n400,1.5,007\n401,2.5,0100\n")
    json_file = tmp_path / "zips.jsonl"
    json_file.write_text('{"id": 402, "val": 3, "name": "042"}\n')
    memwal("ingest", plain_uri, str(csv_file), str(json_file))
    got = memwal("sql", plain_uri, "SELECT name FROM t WHERE id >= 400 ORDER BY id")
    assert got.stdout.split()[1:] == ["007", "0100", "042"]
