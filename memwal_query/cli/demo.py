"""The demo behind ``memwal demo``: a live LSM table and SQL answers in seconds.

Creates a Lance base table ``events(id, user_id, amount, ts)`` in a temporary directory
(or ``DIR``), initializes the MemWAL with a ``bucket(id, 4)`` region spec, streams upserts
and deletes through one writer per region with a progress bar, flushes, merges part of
it, and prints SQL answers that show last-write-wins (with the ``_gen`` column: 0 = base
table, 1.. = flushed generations or MemTables). It also leaves the other tables the
repository's ``sql_examples/`` use, ``users(user_id, name)`` (a plain Lance table) and
``logs(day, seq, level)`` (a MemWAL table with ``identity(day)`` regions), and prints the
command that runs the examples on them. Running it again on the same ``DIR`` starts over.
"""

from __future__ import annotations

import os
import shlex
import tempfile
import time

import click
import datafusion
import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

PK = {"lance-schema:unenforced-primary-key": "true"}
SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False, metadata=PK),
        pa.field("user_id", pa.int32()),
        pa.field("amount", pa.float64()),
        pa.field("ts", pa.timestamp("us")),
    ]
)
USERS = 20
"""Users ``0..USERS-1`` (``events.user_id``, ``users.user_id``)."""
LOGS = pa.schema(
    [
        pa.field("day", pa.date32(), nullable=False, metadata=PK),
        pa.field("seq", pa.int64(), nullable=False, metadata=PK),
        pa.field("level", pa.int32()),
    ]
)


def _rows(ids: np.ndarray, rng: np.random.Generator, version: int) -> pa.Table:
    start = np.datetime64("2026-01-01T00:00:00", "us")
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "user_id": pa.array(rng.integers(0, USERS, len(ids)), pa.int32()),
            "amount": pa.array(np.round(rng.random(len(ids)) * 100 + version * 1000, 2)),
            "ts": pa.array(start + rng.integers(0, 86_400_000_000 * 60, len(ids))),
        },
        schema=SCHEMA,
    )


def _show(ctx: datafusion.SessionContext, title: str, sql: str) -> None:
    click.secho(f"\n-- {title}", fg="cyan")
    click.echo(sql)
    click.echo(ctx.sql(sql).to_pandas().to_string(index=False))


def _write_new(data: pa.Table, uri: str) -> None:
    """``data`` as the Lance table at ``uri`` (replacing one an earlier demo left)."""
    lance.write_dataset(data, uri, mode="overwrite" if os.path.exists(uri) else "create")


def _side_tables(root: str, rng: np.random.Generator) -> dict[str, str]:
    """The ``users`` and ``logs`` tables of ``sql_examples/``: ``{name: uri}``."""
    import memwal_query as mq

    users = os.path.join(root, "users")
    _write_new(
        pa.table(
            {
                "user_id": pa.array(np.arange(USERS), pa.int32()),
                "name": pa.array([f"user{u}" for u in range(USERS)]),
            }
        ),
        users,
    )
    logs = os.path.join(root, "logs")
    again = os.path.exists(logs)
    days = np.datetime64("2026-01-01") + np.arange(60) % 6
    rows = pa.table(
        {
            "day": pa.array(days, pa.date32()),
            "seq": pa.array(np.arange(60), pa.int64()),
            "level": pa.array(rng.integers(0, 5, 60), pa.int32()),
        },
        schema=LOGS,
    )
    _write_new(rows, logs)
    spec = mq.identity_spec(lance.dataset(logs).lance_schema, "day")
    table = mq.MemWalTable.initialize(logs, region_spec=spec, reset=again)
    updated = rows.filter(pc.equal(pc.bit_wise_and(rows["seq"], 3), 0))
    level = pa.array(np.full(updated.num_rows, 9), pa.int32())
    table.write(updated.set_column(2, LOGS.field("level"), level))
    table.close()  # flushes: every process sees the new levels
    return {"users": users, "logs": logs}


def examples_command(tables: dict[str, str]) -> str:
    """The shell command that runs every ``sql_examples/*.sql`` on ``tables``."""
    args = " ".join(f"--table {name}={shlex.quote(uri)}" for name, uri in tables.items())
    return f'for f in sql_examples/*.sql; do echo "$f"; memwal sql -f "$f" {args}; done'


def run(directory: str | None = None, rows: int = 20_000, batches: int = 40) -> str:
    """Run the demo; returns the ``events`` table URI (``users`` and ``logs`` are beside
    it)."""
    import memwal_query as mq
    from memwal_query.regions.spec import RegionField, RegionSpec

    started = time.perf_counter()
    root = os.path.abspath(directory or tempfile.mkdtemp(prefix="memwal-demo-"))
    uri = os.path.join(root, "events")
    rng = np.random.default_rng(7)
    mode = "overwrite" if os.path.exists(uri) else "create"
    lance.write_dataset(_rows(np.arange(rows), rng, 0), uri, mode=mode)
    id_lance_field = lance.dataset(uri).lance_schema.field("id")
    assert id_lance_field is not None
    id_field = id_lance_field.id()
    spec = RegionSpec(
        spec_id=1,
        fields=[
            RegionField(
                "bucket", [id_field], "bucket", result_type="int32", parameters={"num_buckets": "4"}
            )
        ],
    )
    table = mq.MemWalTable.initialize(uri, region_spec=spec, reset=mode == "overwrite")
    click.secho(f"Base table: {uri} ({rows:,} rows), region spec bucket(id, 4)", bold=True)

    table.configure_writers(max_memtable_rows=rows // 2)
    with click.progressbar(range(batches), label="Streaming upserts and deletes") as bar:
        for i in bar:
            ids = np.unique(rng.integers(0, int(rows * 1.1), 500))  # ~10% new keys
            table.write(_rows(ids, rng, i + 1))
            if i % 4 == 3:
                gone = np.unique(rng.integers(0, rows, 20))
                table.delete(pa.table({"id": pa.array(gone[gone != 7], pa.int64())}))
    # Key 7 gets three versions: base, a flushed generation, and the live MemTable.
    table.write(_rows(np.array([7]), rng, 100))
    flushed = table.flush()
    table.write(_rows(np.array([7]), rng, 200))
    merged = table.maintenance.merge(regions=[next(iter(flushed))])
    table.maintenance.refresh_snapshots()
    shown = ", ".join(f"region {r[:8]} generation {g}" for r, g in flushed.items())
    click.echo(f"flushed: {shown}")
    shown = ", ".join(f"region {m.region_id[:8]} generation {m.generation}" for m in merged.merged)
    click.echo(f"merged into the base table: {shown}")

    ctx = datafusion.SessionContext()
    ctx.register_table("events", table.provider(meta_columns=True))  # + live MemTables
    _show(ctx, "last write wins: key 7 (base had version 0)", "SELECT * FROM events WHERE id = 7")
    _show(
        ctx,
        "rows per source generation (0 = base table)",
        "SELECT _gen, count(*) AS n FROM events GROUP BY _gen ORDER BY _gen",
    )
    _show(
        ctx,
        "an aggregation over the deduplicated view",
        "SELECT user_id, count(*) AS n, round(sum(amount), 2) AS total FROM events "
        "WHERE ts >= '2026-02-01' GROUP BY user_id ORDER BY total DESC LIMIT 5",
    )
    n = ctx.sql("SELECT count(*) FROM events").to_arrow_table().column(0)[0].as_py()
    table.close()  # flushes: other processes (memwal sql) see every row
    tables = {"events": uri, **_side_tables(root, rng)}
    click.secho(
        f"\n{n:,} live rows; demo finished in {time.perf_counter() - started:.1f}s", bold=True
    )
    click.echo(
        f"\nTables: {', '.join(f'{k} ({v})' for k, v in tables.items())}. Query them:\n"
        f'  memwal sql {shlex.quote(uri)} "SELECT count(*) FROM events"\n'
        "Run the repository's sql_examples/ on them (from the repository's directory):\n"
        f"  {examples_command(tables)}\n"
        f"Start over: memwal demo {shlex.quote(root)} (or remove {shlex.quote(root)})"
    )
    return uri
