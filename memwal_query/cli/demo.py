"""The demo behind ``memwal demo``: a live LSM table and SQL answers in seconds.

Creates a Lance base table in a temporary directory (or ``DIR``), initializes the MemWAL
with a ``bucket(id, 4)`` region spec, streams upserts and deletes through one writer per
region with a progress bar, flushes, merges part of it, and prints SQL answers that show
last-write-wins (with the ``_gen`` column: 0 = base table, 1.. = flushed generations or
MemTables).
"""

from __future__ import annotations

import os
import tempfile
import time

import click
import datafusion
import lance
import numpy as np
import pyarrow as pa

PK = {"lance-schema:unenforced-primary-key": "true"}
SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False, metadata=PK),
        pa.field("user", pa.string()),
        pa.field("amount", pa.float64()),
        pa.field("ts", pa.timestamp("us")),
    ]
)


def _rows(ids: np.ndarray, rng: np.random.Generator, version: int) -> pa.Table:
    start = np.datetime64("2026-01-01T00:00:00", "us")
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "user": pa.array([f"user{u}" for u in rng.integers(0, 20, len(ids))]),
            "amount": pa.array(np.round(rng.random(len(ids)) * 100 + version * 1000, 2)),
            "ts": pa.array(start + rng.integers(0, 86_400_000_000 * 60, len(ids))),
        },
        schema=SCHEMA,
    )


def _show(ctx: datafusion.SessionContext, title: str, sql: str) -> None:
    click.secho(f"\n-- {title}", fg="cyan")
    click.echo(sql)
    click.echo(ctx.sql(sql).to_pandas().to_string(index=False))


def run(directory: str | None = None, rows: int = 20_000, batches: int = 40) -> str:
    """Run the demo; returns the table URI."""
    import memwal_query as mq
    from memwal_query.regions.spec import RegionField, RegionSpec

    started = time.perf_counter()
    root = directory or tempfile.mkdtemp(prefix="memwal-demo-")
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
    click.echo(f"flushed generations: { {r[:8]: g for r, g in flushed.items()} }")
    click.echo(
        f"merged into the base table: {[(m.region_id[:8], m.generation) for m in merged.merged]}"
    )

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
        "SELECT user, count(*) AS n, round(sum(amount), 2) AS total FROM events "
        "WHERE ts >= '2026-02-01' GROUP BY user ORDER BY total DESC LIMIT 5",
    )
    n = ctx.sql("SELECT count(*) FROM events").to_arrow_table().column(0)[0].as_py()
    table.close()
    click.secho(
        f"\n{n:,} live rows; demo finished in {time.perf_counter() - started:.1f}s", bold=True
    )
    return uri
