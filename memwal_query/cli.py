"""The ``memwal`` command line.

Every error a user can cause prints one line (``error: ...``) and exits with status 1;
``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from functools import wraps
from typing import Any

import click

from .exceptions import MemWalError


def _handle_errors(fn: Callable) -> Callable:
    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        ctx = click.get_current_context()
        try:
            return fn(*args, **kwargs)
        except click.ClickException:
            raise
        except (MemWalError, OSError, ValueError, RuntimeError, Exception) as e:  # noqa: BLE001
            if (ctx.find_root().obj or {}).get("debug"):
                raise
            click.echo(
                f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else e}", err=True
            )
            sys.exit(1)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show tracebacks.")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """memwal: LSM (MemWAL) tables on Lance, queried with SQL."""
    ctx.obj = {"debug": debug}


@main.command()
@click.argument("directory", required=False)
@click.option("--rows", default=20_000, show_default=True, help="Base table rows.")
@_handle_errors
def demo(directory: str | None, rows: int) -> None:
    """Create a table (temp dir or DIRECTORY), stream upserts, flush, merge, run SQL."""
    from .demo import run

    run(directory, rows=rows)


def _open(uri: str):
    from .table import MemWalTable

    return MemWalTable.open(uri)


def _spec_from_options(
    uri: str,
    bucket: str | None,
    identity: str | None,
    expression: str | None,
    columns: str | None,
    result_type: str,
):
    import lance

    from .regionspec import RegionField, RegionSpec

    chosen = [x for x in (bucket, identity, expression) if x]
    if len(chosen) > 1:
        raise click.UsageError("choose one of --bucket, --identity, --expression")
    if not chosen:
        return None
    schema = lance.dataset(uri).lance_schema

    def fid(name: str) -> int:
        f = schema.field(name)
        if f is None:
            raise click.BadParameter(f"no column {name!r} in {uri}")
        return f.id()

    if bucket:
        col, _, n = bucket.partition(":")
        if not n.isdigit() or int(n) <= 0:
            raise click.BadParameter(f"--bucket wants COLUMN:N with N > 0, got {bucket!r}")
        field = RegionField(
            "bucket", [fid(col)], "bucket", result_type="int32", parameters={"num_buckets": n}
        )
    elif identity:
        field = RegionField(identity, [fid(identity)], "identity")
    else:
        if not columns:
            raise click.UsageError("--expression needs --columns a,b (they become col0, col1)")
        ids = [fid(c.strip()) for c in columns.split(",")]
        field = RegionField("expr", ids, expression=expression, result_type=result_type)
    return RegionSpec(1, [field])


@main.command()
@click.argument("uri")
@click.option("--primary-key", "primary_key", required=True, help="Comma-separated key columns.")
@click.option("--bucket", help="Region spec bucket(COLUMN, N), as COLUMN:N.")
@click.option("--identity", help="Region spec identity(COLUMN).")
@click.option("--expression", help="Region spec as a DataFusion SQL expression over col0, col1...")
@click.option("--columns", help="Source columns of --expression (comma-separated).")
@click.option("--result-type", default="int64", show_default=True, help="Type of --expression.")
@click.option("--maintain", multiple=True, help="Base index to maintain in generations.")
@_handle_errors
def init(
    uri: str, primary_key: str, bucket, identity, expression, columns, result_type, maintain
) -> None:
    """Initialize the MemWAL on an existing Lance table at URI."""
    import lance

    from .schema import PK_METADATA_KEY, primary_key_columns
    from .table import MemWalTable

    try:
        ds = lance.dataset(uri)
    except Exception as e:  # noqa: BLE001
        raise click.ClickException(f"no Lance table at {uri}: {e}") from None
    keys = [k.strip() for k in primary_key.split(",") if k.strip()]
    missing = [k for k in keys if ds.schema.get_field_index(k) < 0]
    if missing:
        raise click.BadParameter(f"no column(s) {missing} in {uri}")
    if primary_key_columns(ds.schema) != keys:
        nullable = [k for k in keys if ds.schema.field(k).nullable]
        if nullable:
            nulls = ds.to_table(
                columns=nullable, filter=" OR ".join(f"{k} IS NULL" for k in nullable)
            )
            if nulls.num_rows:
                raise click.ClickException(
                    f"primary-key column(s) {nullable} hold {nulls.num_rows} NULL value(s)"
                )
            for k in nullable:  # Lance requires non-nullable primary-key columns
                ds.alter_columns({"path": k, "nullable": False})
            ds = lance.dataset(uri)
        ds.update_field_metadata({k: {PK_METADATA_KEY.decode(): "true"} for k in keys})
    spec = _spec_from_options(uri, bucket, identity, expression, columns, result_type)
    t = MemWalTable.initialize(uri, region_spec=spec, maintained_indexes=list(maintain))
    click.echo(f"initialized {t.uri}: primary key {t.primary_key}, region spec {spec}")


def _read_file(path: str):
    import pyarrow as pa
    import pyarrow.csv as pcsv
    import pyarrow.json as pjson
    import pyarrow.parquet as pq

    lower = path.lower()
    if lower.endswith(".parquet"):
        return pq.read_table(path)
    if lower.endswith(".csv"):
        return pcsv.read_csv(path)
    if lower.endswith((".json", ".jsonl", ".ndjson")):
        return pjson.read_json(path)
    if lower.endswith((".arrow", ".ipc", ".feather")):
        with pa.memory_map(path) as source:
            try:
                return pa.ipc.open_file(source).read_all()
            except pa.ArrowInvalid:
                source.seek(0)
                return pa.ipc.open_stream(source).read_all()
    raise click.BadParameter(f"{path}: unknown file type (parquet, csv, jsonl, arrow)")


@main.command()
@click.argument("uri")
@click.argument("files", nargs=-1, required=True)
@click.option("--region", help="Write every row to this region id (no routing).")
@click.option("--batch-rows", default=50_000, show_default=True)
@click.option("--flush/--no-flush", default=True, show_default=True, help="Flush at the end.")
@_handle_errors
def ingest(
    uri: str, files: tuple[str, ...], region: str | None, batch_rows: int, flush: bool
) -> None:
    """Upsert rows from Parquet/CSV/JSON-lines/Arrow FILES (routed by the region spec)."""
    t = _open(uri)
    tables = [(f, _read_file(f)) for f in files]
    total = sum(tb.num_rows for _, tb in tables)
    writer = t.writer(region) if region else None
    started = time.perf_counter()
    done = 0
    with click.progressbar(length=total, label="ingesting", show_pos=True) as bar:
        for _, tb in tables:
            for batch in tb.to_batches(max_chunksize=batch_rows):
                if writer is not None:
                    writer.put(batch)
                else:
                    t.write(batch)
                done += batch.num_rows
                bar.update(batch.num_rows)
    if writer is not None:
        writer.close(flush=flush)
    else:
        if flush:
            t.flush()
        t.close(flush=False)
    secs = time.perf_counter() - started
    click.echo(f"{done:,} rows in {secs:.2f}s ({done / max(secs, 1e-9):,.0f} rows/s)")


def _emit(table, fmt: str, output: str | None) -> None:
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    if fmt == "table":
        text = table.to_pandas().to_string(index=False) if table.num_rows else "(no rows)"
        if output is None:
            click.echo(text)
        else:
            with open(output, "w") as f:
                f.write(text + "\n")
        return
    if fmt == "parquet":
        if output is None:
            raise click.UsageError("--format parquet needs --output FILE")
        pq.write_table(table, output)
        return
    if fmt == "csv":
        if output is None:
            import io

            buf = io.BytesIO()
            pcsv.write_csv(table, buf)
            click.echo(buf.getvalue().decode(), nl=False)
        else:
            pcsv.write_csv(table, output)
        return
    lines = "\n".join(json.dumps(r, default=str) for r in table.to_pylist())
    if output is None:
        click.echo(lines)
    else:
        with open(output, "w") as f:
            f.write(lines + "\n")


@main.command()
@click.argument("uri")
@click.argument("query", required=False)
@click.option(
    "--name",
    default=None,
    help="Table name in SQL (default: the table directory's name, e.g. 'events'; 't' works too).",
)
@click.option(
    "--format", "fmt", type=click.Choice(["table", "csv", "json", "parquet"]), default="table"
)
@click.option("--output", help="Write the result to this file.")
@click.option("--consistency", type=click.Choice(["strong", "eventual"]), default="strong")
@_handle_errors
def sql(
    uri: str, query: str | None, name: str | None, fmt: str, output: str | None, consistency: str
) -> None:
    """Run QUERY against the table; no QUERY: an interactive prompt.

    The table is named after its directory (``/data/events`` -> ``events``) and also
    ``t``, unless ``--name`` is given.
    """
    import datafusion

    from .session import register

    ctx = datafusion.SessionContext()
    names = [name] if name else _default_sql_names(uri)
    for n in names:
        register(ctx, n, uri, consistency=consistency)
    name = names[0]
    if query:
        _emit(ctx.sql(query).to_arrow_table(), fmt, output)
        return
    try:
        import readline

        history = os.path.expanduser("~/.memwal_history")
        if os.path.exists(history):
            readline.read_history_file(history)
    except Exception:  # noqa: BLE001
        readline = None  # type: ignore[assignment]
    click.echo(f"memwal SQL on {uri} as '{name}'; end with ';', quit with \\q or Ctrl-D")
    buf: list[str] = []
    while True:
        try:
            line = input("memwal> " if not buf else "   ...> ")
        except EOFError:
            break
        if line.strip() in ("\\q", "quit", "exit"):
            break
        buf.append(line)
        if line.rstrip().endswith(";"):
            text = "\n".join(buf).rstrip().rstrip(";")
            buf = []
            try:
                _emit(ctx.sql(text).to_arrow_table(), fmt, None)
            except Exception as e:  # noqa: BLE001
                click.echo(f"error: {str(e).splitlines()[0]}", err=True)
    if readline is not None:
        try:
            readline.write_history_file(history)
        except OSError:
            pass


def _default_sql_names(uri: str) -> list[str]:
    """``[directory name, "t"]`` (the name only when it is a plain SQL identifier)."""
    base = os.path.basename(uri.rstrip("/"))
    for suffix in (".lance",):
        base = base.removesuffix(suffix)
    names = [base] if base.isidentifier() and base.lower() != "t" else []
    return [*names, "t"]


@main.command()
@click.argument("uri")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_handle_errors
def status(uri: str, as_json: bool) -> None:
    """One row per region: epoch, generations, WAL span, unflushed rows, bytes."""
    s = _open(uri).status()
    if as_json:
        click.echo(json.dumps(s, indent=2, default=str))
        return
    click.echo(
        f"{s['uri']}  base version {s['base_version']}  {s['base_rows']:,} rows  "
        f"primary key {s['primary_key']}"
    )
    header = (
        f"{'region':36}  {'values':>14}  epoch  cur  flushed        merged  wal_span   "
        "unflushed  bytes"
    )
    click.echo(header)
    for rid, r in s["regions"].items():
        first, last = r["replay_after_wal_entry_position"] + 1, r["wal_last_position"]
        wal = f"{first}-{last}" if last >= first else "-"  # unflushed WAL entries
        gens = ",".join(map(str, r["flushed_generations"])) or "-"
        vals = ",".join(f"{v}" for v in (r["region_values"] or {}).values()) or "-"
        click.echo(
            f"{rid:36}  {vals:>14}  {r['writer_epoch']:5}  {r['current_generation']:3}  "
            f"{gens:13}  {r['merged_generation']:6}  {wal:9}  {r['unflushed_rows']:9}  "
            f"{r['generation_bytes'] + r['wal_bytes']}"
        )


@main.command()
@click.argument("uri")
@click.option("--region", help="Only this region.")
@click.option("--dry-run", is_flag=True, help="Only show what would be flushed.")
@_handle_errors
def flush(uri: str, region: str | None, dry_run: bool) -> None:
    """Replay each region's unflushed WAL and flush it as a generation."""
    t = _open(uri)
    regions = [region] if region else t.region_ids()
    st = t.status()["regions"]
    with click.progressbar(regions, label="flushing") as bar:
        for rid in bar:
            if st.get(rid, {}).get("unflushed_rows", 0) == 0:
                continue
            if dry_run:
                click.echo(f"\nwould flush {rid}: {st[rid]['unflushed_rows']} rows")
                continue
            w = t.writer(rid)
            gen = w.flush()
            w.close(flush=False)
            click.echo(f"\n{rid}: generation {gen}")


@main.command()
@click.argument("uri")
@click.option("--region", help="Only this region.")
@click.option("--max-generations", type=int, help="Per region.")
@click.option("--dry-run", is_flag=True, help="Only list the generations to merge.")
@_handle_errors
def merge(uri: str, region: str | None, max_generations: int | None, dry_run: bool) -> None:
    """Merge flushed generations into the base table, in order."""
    t = _open(uri)
    regions = [region] if region else t.region_ids()
    merged = t.index().merged_generations()
    with click.progressbar(regions, label="merging") as bar:
        for rid in bar:
            if dry_run:
                m = t.region_manifest(rid)
                todo = [
                    g.generation for g in m.flushed_generations if g.generation > merged.get(rid, 0)
                ]
                click.echo(
                    f"\n{rid}: would merge {todo[:max_generations] if max_generations else todo}"
                )
                continue
            done = t.merge(rid, max_generations)
            if done:
                click.echo(f"\n{rid}: merged {[g for _, g in done]}")


@main.command()
@click.argument("uri")
@click.option("--dry-run", is_flag=True)
@click.option(
    "--cleanup-older-than", type=float, help="First remove base versions older than N hours."
)
@_handle_errors
def gc(uri: str, dry_run: bool, cleanup_older_than: float | None) -> None:
    """Delete merged, caught-up generations and their WAL entries."""
    import datetime as dt

    t = _open(uri)
    older = None if cleanup_older_than is None else dt.timedelta(hours=cleanup_older_than)
    removed = t.gc(dry_run=dry_run, cleanup_older_than=older)
    for p in removed:
        click.echo(("would remove " if dry_run else "removed ") + p)
    click.echo(f"{len(removed)} path(s)")


@main.command(name="catch-up")
@click.argument("uri")
@click.option("--index", "names", multiple=True, help="Index names (default: maintained).")
@click.option("--dry-run", is_flag=True)
@_handle_errors
def catch_up(uri: str, names: tuple[str, ...], dry_run: bool) -> None:
    """Extend base indexes over merged data and record index catch-up progress."""
    t = _open(uri)
    chosen = list(names) or t.maintained_indexes
    if dry_run:
        click.echo(f"would catch up {chosen} to {t.index().merged_generations()}")
        return
    click.echo(json.dumps(t.catch_up_indexes(chosen or None), indent=2))


@main.command(name="refresh-snapshots")
@click.argument("uri")
@_handle_errors
def refresh_snapshots(uri: str) -> None:
    """Write region snapshots into the MemWAL index (for eventual reads)."""
    idx = _open(uri).refresh_snapshots()
    click.echo(f"{idx.details.num_regions} region(s) in the snapshot")
