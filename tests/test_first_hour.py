"""What a new user meets in the first hour with the ``memwal`` command line: one error
line with the whole cause and no library internals, hints that name commands and options
that exist, valid JSON, output sized for a person, Ctrl-C saying what was done.

In-process through click's CliRunner where that is what a user sees; real processes for
Ctrl-C (a signal) and for the stderr of a real run.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import lance
import pyarrow as pa
import pytest
from click.testing import CliRunner

import memwal_query as mq
from memwal_query.cli.commands import main

from helpers import PK

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCHEMA = pa.schema([pa.field("id", pa.int64(), False, PK), pa.field("x", pa.float64())])


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args), prog_name="memwal")
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def uri(tmp_path) -> str:
    uri = str(tmp_path / "events")
    lance.write_dataset(pa.table({"id": [1, 2, 3], "x": [1.0, 2.0, 3.0]}, schema=SCHEMA), uri)
    mq.MemWalTable.initialize(
        uri, region_spec=mq.bucket_spec(lance.dataset(uri).lance_schema, "id", 2)
    )
    return uri


def one_error_line(code: int, err: str, type_name: str) -> str:
    lines = err.splitlines()
    assert code == 1, err
    assert len(lines) == 1 and lines[0].startswith(f"error: {type_name}: "), err
    return lines[0]


def test_sql_error_keeps_its_cause(uri):
    code, _, err = run("sql", uri, "SELECT CAST('abc' AS BIGINT) + id FROM t")
    line = one_error_line(code, err, "Exception")
    assert "simplify_expressions" in line and "Cannot cast string 'abc'" in line


def test_errors_carry_no_library_build_paths(tmp_path):
    code, _, err = run("status", str(tmp_path / "nothing-here"))
    line = one_error_line(code, err, "TableNotFoundError")
    assert ".rs:" not in line and "/home/runner" not in line
    with pytest.raises(mq.MemWalError) as e:  # the Python message too
        mq.MemWalTable.open(str(tmp_path / "nothing-here"))
    assert ".rs:" not in str(e.value)


def test_uninitialized_table_names_the_command(tmp_path):
    uri = str(tmp_path / "plain")
    lance.write_dataset(pa.table({"id": [1]}), uri)
    code, _, err = run("status", uri)
    line = one_error_line(code, err, "NotInitializedError")
    assert "memwal init URI --primary-key" in line
    for declared in (False, True):  # without, then with a primary key
        code, _, err = run("sql", uri, "SELECT count(*) AS n FROM plain")
        kind = "NotInitializedError" if declared else "PrimaryKeyError"
        line = one_error_line(code, err, kind)
        assert line.endswith(f"to query it as a plain Lance table: --table plain={uri}"), line
        code, out, err = run("sql", "--table", f"plain={uri}", "SELECT count(*) AS n FROM plain")
        assert code == 0 and out.split() == ["n", "1"], err
        schema = pa.schema([pa.field("id", pa.int64(), False, PK)])
        lance.write_dataset(pa.table({"id": [1]}, schema=schema), uri, mode="overwrite")


def test_region_specs_print_as_people_write_them(tmp_path, uri):
    plain = str(tmp_path / "plain")
    lance.write_dataset(pa.table({"id": [1, 2], "day": ["a", "b"]}), plain)
    code, out, err = run("init", plain, "--primary-key", "id", "--bucket", "id:8")
    assert code == 0, err
    assert out.endswith("primary key id, region spec bucket(id, 8)\n"), out
    code, out, _ = run("spec", "show", uri)
    assert out.startswith("spec 1 (current): bucket(id, 2); regions:") and "RegionField" not in out
    code, out, err = run("spec", "set", uri, "--identity", "id")
    assert code == 0, err
    assert "region spec 2 is current (identity(id))" in out
    code, out, err = run("status", uri, "--json")
    assert code == 0, err
    assert json.loads(out)["region_spec"] == "identity(id)"
    code, out, err = run("status", plain)
    assert out.splitlines()[0].endswith("region spec bucket(id, 8)"), out


def test_json_output_is_valid_json_with_nan_as_null(uri):
    sql = (
        "SELECT CAST('NaN' AS DOUBLE) AS a, 1.0 / 0.0 AS b, [1.0, CAST('-inf' AS DOUBLE)] AS c, "
        "named_struct('x', CAST('NaN' AS DOUBLE)) AS d, 2.5 AS e"
    )
    code, out, err = run("sql", uri, sql, "--format", "json")
    assert code == 0, err
    assert json.loads(out, parse_constant=lambda c: pytest.fail(f"not JSON: {c}")) == {
        "a": None,
        "b": None,
        "c": [1.0, None],
        "d": {"x": None},
        "e": 2.5,
    }
    code, out, _ = run(
        "sql", uri, "SELECT CAST('NaN' AS DOUBLE) AS a, 1.0 / 0.0 AS b", "--format", "csv"
    )
    assert out.splitlines() == ['"a","b"', "nan,inf"]  # as docs/cli.md says


def test_gc_and_catch_up_say_it_briefly(uri):
    t = mq.MemWalTable.open(uri)
    for i in range(3):
        t.write(pa.table({"id": [10 + i, 20 + i], "x": [0.0, 1.0]}, schema=SCHEMA))
        t.flush()
    t.maintenance.merge()
    t.close()
    code, out, err = run("gc", uri, "--cleanup-older-than", "0")
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 1, out
    m = re.fullmatch(
        r".*: removed (\d+) generation\(s\) and (\d+) WAL entries, ([\d.]+) (KiB|MiB)", lines[0]
    )
    assert m is not None and int(m.group(1)) >= 3 and int(m.group(2)) >= 3, lines[0]
    code, out, _ = run("catch-up", uri, "--dry-run")
    assert out.startswith("nothing to do")


def _hints() -> list[tuple[str, str]]:
    """Every ``memwal CMD ...`` a string of the package, README.md or docs/ names."""
    texts: list[tuple[str, str]] = []
    for path in sorted((ROOT / "memwal_query").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                texts.append((str(path.relative_to(ROOT)), node.value))
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        texts.append((str(path.relative_to(ROOT)), path.read_text()))
    found = []
    for where, text in texts:
        for m in re.finditer(r"(?<![\w/.-])memwal ([a-z][a-z-]*(?:[^`)\n\"';|#]*))", text):
            found.append((where, m.group(1).strip()))
    return found


NOT_COMMANDS = {"data"}  # "memwal data source" is the Spark format's name, not a command


def test_every_hint_names_a_command_and_options_that_exist():
    hints = _hints()
    assert len(hints) > 30
    helps: dict[tuple[str, ...], str] = {}
    bad = []
    for where, hint in hints:
        words = hint.split()
        words[0] = re.match(r"[a-z-]*", words[0]).group(0)  # "catch-up\|" in a table
        if words[0] in NOT_COMMANDS:
            continue
        if words[0] not in main.commands:
            bad.append(f"{where}: memwal {hint}: no command {words[0]!r}")
            continue
        path = [words[0]]
        cmd = main.commands[words[0]]
        if hasattr(cmd, "commands") and len(words) > 1 and words[1] in cmd.commands:
            path.append(words[1])
        key = tuple(path)
        if key not in helps:
            code, out, err = run(*path, "--help")
            assert code == 0, err
            helps[key] = out + run("--help")[1]  # the group's options (--debug) count too
        for option in re.findall(r"(?<![\w-])--[a-z][a-z-]*", hint):
            if not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", helps[key]):
                bad.append(f"{where}: memwal {hint}: {' '.join(path)} has no {option}")
    assert not bad, "\n".join(bad)


def test_every_help_reads_as_text_not_restructured_text():
    def commands(group, path=()):
        for name, cmd in group.commands.items():
            yield (*path, name)
            if hasattr(cmd, "commands"):
                yield from commands(cmd, (*path, name))

    paths = list(commands(main))
    assert len(paths) > 15
    for path in [(), *paths]:
        code, out, err = run(*path, "--help")
        assert code == 0 and "``" not in out, (path, out)


def test_bloom_filter_warning_names_a_repair_that_exists(tmp_path):
    from memwal_query.exceptions import BloomFilterWarning
    from memwal_query.format import bloom
    from memwal_query.storage.factory import file_io_for

    with pytest.warns(BloomFilterWarning, match=r"`memwal repair URI`"):
        bloom.load(file_io_for(str(tmp_path)), str(tmp_path / "gen"), 1)


def _spawn(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "memwal_query", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_ctrl_c_on_changes_follow_exits_130_saying_what_was_done(uri, tmp_path):
    t = mq.MemWalTable.open(uri)
    t.write(pa.table({"id": [7, 8, 9], "x": [0.0, 1.0, 2.0]}, schema=SCHEMA))
    t.close()  # flushes
    cursor = tmp_path / "cursor"
    p = _spawn("changes", uri, "--follow", "--interval", "0.1", "--cursor-file", str(cursor))
    deadline = time.monotonic() + 60
    while not cursor.exists() and time.monotonic() < deadline:  # the first batch is out
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: interrupted; already done: 3 change row(s) written"), err
    assert f"saved in {cursor}" in last
    assert len(out.splitlines()) == 3
