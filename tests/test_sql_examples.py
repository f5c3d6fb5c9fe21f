"""Every sql_examples/*.sql runs on the LSM tables and equals the same SQL on the model."""

import datetime as dt
import pathlib

import datafusion
import lance
import numpy as np
import pyarrow as pa
import pytest

import memwal_query as mq

from helpers import PK

EXAMPLES = sorted((pathlib.Path(__file__).parent.parent / "sql_examples").glob("*.sql"))
EVENTS = pa.schema(
    [
        pa.field("id", pa.int64(), False, PK),
        pa.field("user_id", pa.int32()),
        pa.field("amount", pa.float64()),
    ]
)
LOGS = pa.schema(
    [
        pa.field("day", pa.date32(), False, PK),
        pa.field("seq", pa.int64(), False, PK),
        pa.field("level", pa.int32()),
    ]
)


def events_rows(ids, rng):
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "user_id": pa.array(rng.integers(0, 5, len(ids)), pa.int32()),
            "amount": pa.array(np.round(rng.random(len(ids)) * 1000, 2)),
        },
        schema=EVENTS,
    )


@pytest.fixture(scope="module")
def contexts(tmp_path_factory):
    rng = np.random.default_rng(3)
    root = tmp_path_factory.mktemp("sql")
    model: dict[int, dict] = {}
    base = events_rows(np.arange(1000), rng)
    for r in base.to_pylist():
        model[r["id"]] = r
    lance.write_dataset(base, str(root / "events"))
    spec = mq.bucket_spec(lance.dataset(str(root / "events")).lance_schema, "id", 4)
    events = mq.MemWalTable.initialize(str(root / "events"), region_spec=spec)
    for i in range(6):
        rows = events_rows(np.unique(rng.integers(0, 2000, 300)), rng)
        events.write(rows)
        for r in rows.to_pylist():
            model[r["id"]] = r
        gone = np.unique(rng.integers(0, 2000, 30))
        events.delete(pa.table({"id": pa.array(gone, pa.int64())}))
        for k in gone:
            model.pop(int(k), None)
        if i in (1, 3):
            events.flush()
        if i == 3:
            events.maintenance.merge(max_generations=1)

    days = [dt.date(2026, 1, d) for d in range(1, 7)]
    logs_base = pa.table(
        {
            "day": pa.array([days[i % 6] for i in range(60)], pa.date32()),
            "seq": pa.array(np.arange(60), pa.int64()),
            "level": pa.array(rng.integers(0, 5, 60), pa.int32()),
        },
        schema=LOGS,
    )
    lance.write_dataset(logs_base, str(root / "logs"))
    ls = lance.dataset(str(root / "logs")).lance_schema
    logs = mq.MemWalTable.initialize(
        str(root / "logs"),
        region_spec=mq.RegionSpec(1, [mq.RegionField("day", [ls.field("day").id()], "identity")]),
    )
    logs_model = {(r["day"], r["seq"]): r for r in logs_base.to_pylist()}
    upd = pa.table(
        {
            "day": pa.array([days[i % 6] for i in range(0, 60, 4)], pa.date32()),
            "seq": pa.array(np.arange(0, 60, 4), pa.int64()),
            "level": pa.array([9] * 15, pa.int32()),
        },
        schema=LOGS,
    )
    logs.write(upd)
    for r in upd.to_pylist():
        logs_model[(r["day"], r["seq"])] = r
    logs.flush()

    users = pa.table(
        {"user_id": pa.array(range(5), pa.int32()), "name": [f"u{i}" for i in range(5)]}
    )
    ours = datafusion.SessionContext()
    providers = {"events": events.provider(), "logs": logs.provider()}
    for name, provider in providers.items():
        ours.register_table(name, provider)
    ours.from_arrow(users, name="users")
    ref = datafusion.SessionContext()
    ref.from_arrow(pa.Table.from_pylist(list(model.values()), schema=EVENTS), name="events")
    ref.from_arrow(pa.Table.from_pylist(list(logs_model.values()), schema=LOGS), name="logs")
    ref.from_arrow(users, name="users")
    yield ours, ref, providers
    events.close(flush=False)
    logs.close(flush=False)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_sql_example(contexts, path):
    ours, ref, providers = contexts
    sql = path.read_text()
    got = ours.sql(sql).to_arrow_table()
    want = ref.sql(sql).to_arrow_table()
    assert got.num_rows > 0
    assert got.to_pylist() == want.to_pylist()
    if "time_range" in path.name:  # identity(day) regions outside the range are skipped
        plan = providers["logs"].last_plan
        assert len(plan.pruned) == 2 and len(plan.regions) == 1
        assert "pruned region" in providers["logs"].explain()


def test_examples_exist():
    assert len(EXAMPLES) >= 5


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_sql_example_through_the_cli(contexts, path, tmp_path):
    """``memwal sql -f FILE --table ...`` runs each example file as written."""
    import json

    import pyarrow.parquet as pq
    from click.testing import CliRunner

    from memwal_query.cli.commands import main

    _, ref, providers = contexts
    users = tmp_path / "users.parquet"
    pq.write_table(ref.table("users").to_arrow_table(), users)
    args = ["sql", "-f", str(path), "--format", "json", "--table", f"users={users}"]
    for name, provider in providers.items():
        for w in provider.writers:  # another process sees flushed rows (not our MemTables)
            w.flush()
        args += ["--table", f"{name}={provider.table.uri}"]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    got = [json.loads(line) for line in result.output.splitlines()]
    want = json.loads(
        json.dumps(ref.sql(path.read_text()).to_arrow_table().to_pylist(), default=str)
    )
    assert got == want and len(got) > 0


def test_every_example_runs_on_the_demo_tables(tmp_path):
    """``memwal demo DIR`` leaves events, users and logs and prints the command that runs
    every example on them; that command answers each one (click's runner: in-process)."""
    import json
    import shlex

    from click.testing import CliRunner

    from memwal_query.cli.commands import main

    def memwal(*args):
        result = CliRunner().invoke(main, list(args), catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return result

    demo = tmp_path / "demo"
    out = memwal("demo", str(demo), "--rows", "2000").stdout
    (loop,) = [line.strip() for line in out.splitlines() if "sql_examples/*.sql" in line]
    args = shlex.split(loop.split('memwal sql -f "$f"', 1)[1].split(";", 1)[0])
    assert sorted(a.split("=")[0] for a in args if a != "--table") == ["events", "logs", "users"]
    for path in EXAMPLES:
        got = memwal("sql", "-f", str(path), *args, "--format", "json")
        rows = [json.loads(line) for line in got.stdout.splitlines()]
        assert rows and not got.stderr, (path.name, got.stderr)
    again = memwal("demo", str(demo), "--rows", "2000")  # a second run starts over
    assert "live rows" in again.stdout
