"""``memwal demo``, ``memwal init`` and ``memwal ingest``: creating tables and loading rows."""

from __future__ import annotations

import time
from typing import Any

import click

from memwal_query.cli.app import _handle_errors, _open, _progress, main
from memwal_query.cli.options import deprecated_option
from memwal_query.exceptions import (
    AlreadyInitializedError,
    MemWalError,
    RegionSpecError,
    SchemaError,
    WrongRegionError,
)
from memwal_query.format.rowfile import aligned
from memwal_query.write.routing import DEFAULT_BUFFER_ROWS


@main.command()
@click.argument("directory", required=False)
@click.option("--rows", default=20_000, show_default=True, help="Base table rows.")
@_handle_errors
def demo(directory: str | None, rows: int) -> None:
    """Create a table (temp dir or DIRECTORY), stream upserts, flush, merge, run SQL."""
    from memwal_query.cli.demo import run

    run(directory, rows=rows)


def _spec_from_options(
    uri: str,
    bucket: str | None,
    identity: str | None,
    expression: str | None,
    columns: str | None,
    result_type: str,
    spec_id: int = 1,
):
    import lance

    from memwal_query.regions.spec import RegionField, RegionSpec

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
    return RegionSpec(spec_id, [field])


def spec_options(command: Any) -> Any:
    """The options that describe a region spec (``init``, ``spec set``):
    ``--bucket``, ``--identity``, ``--expression`` with ``--columns`` and
    ``--result-type`` (see :func:`_spec_from_options`)."""
    options = [
        click.option("--bucket", help="Region spec bucket(COLUMN, N), as COLUMN:N."),
        click.option("--identity", help="Region spec identity(COLUMN)."),
        click.option(
            "--expression", help="Region spec as a DataFusion SQL expression over col0, col1..."
        ),
        click.option("--columns", help="Source columns of --expression (comma-separated)."),
        click.option(
            "--result-type", default="int64", show_default=True, help="Type of --expression."
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


@main.command()
@click.argument("uri")
@click.option(
    "--primary-key",
    "primary_key",
    help="Comma-separated key columns (default: the key the Lance table declares).",
)
@spec_options
@click.option(
    "--maintained-indexes",
    multiple=True,
    help="Base indexes to build for every flushed generation too (comma-separated, repeatable).",
)
@deprecated_option("--maintain", "--maintained-indexes", multiple=True)
@click.option(
    "--reset",
    is_flag=True,
    help="Remove the regions an earlier MemWAL of this table left in _mem_wal/ first.",
)
@_handle_errors
def init(
    uri: str,
    primary_key: str | None,
    bucket,
    identity,
    expression,
    columns,
    result_type,
    maintained_indexes: tuple[str, ...],
    maintain: tuple[str, ...],
    reset: bool,
) -> None:
    """Initialize the MemWAL on an existing Lance table at URI.

    Every option is checked before the table is touched: a rejected ``init`` leaves
    the table unchanged. Without a region option every key goes to one region (one
    writer at a time); ``--bucket`` spreads keys over N regions for parallel writers.
    Regions left in ``_mem_wal/`` by an earlier MemWAL of the table (it was overwritten
    with Lance) are refused unless ``--reset`` removes them.
    """
    import lance
    import pyarrow as pa

    maintain = tuple(
        name.strip()
        for value in (*maintained_indexes, *maintain)
        for name in value.split(",")
        if name.strip()
    )

    from memwal_query.format import index as mwindex
    from memwal_query.format.schema import require_primary_key
    from memwal_query.storage.factory import file_io_for
    from memwal_query.table import MemWalTable
    from memwal_query.table_init import check_key_columns, key_names

    try:
        ds = lance.dataset(uri)
    except Exception as e:  # noqa: BLE001
        raise click.ClickException(f"no Lance table at {uri}: {e}") from None
    if primary_key is None:
        keys = require_primary_key(ds.schema, uri)
    else:
        keys = key_names(primary_key)
        check_key_columns(ds.schema, keys, uri)
    if mwindex.read_index(file_io_for(uri), ds) is not None:
        raise AlreadyInitializedError(f"{uri}: the table already has a MemWAL index")
    from memwal_query.table_init import check_no_leftover_regions

    check_no_leftover_regions(file_io_for(uri), uri, reset)
    spec = _spec_from_options(uri, bucket, identity, expression, columns, result_type)
    if spec is not None:
        # Evaluate it on one all-NULL row: compiles an expression and type-checks the
        # transforms now, rather than failing at the first write after initializing.
        probe = pa.table([pa.nulls(1, f.type) for f in ds.schema], schema=ds.schema)
        try:
            spec.evaluate(probe, ds.lance_schema)
        except MemWalError:
            raise
        except Exception as e:  # noqa: BLE001
            raise RegionSpecError(f"region spec {spec}: {e}") from e
    existing = {i.name for i in ds.describe_indices()}
    absent = [m for m in maintain if m not in existing]
    if absent:
        raise click.BadParameter(f"no index {absent} on {uri} (existing: {sorted(existing)})")
    t = MemWalTable.initialize(
        uri, region_spec=spec, maintained_indexes=list(maintain), reset=reset, primary_key=keys
    )
    spec = t.region_spec
    shown = "one region" if spec is None else spec.describe(t.catalog.lance_schema)
    key = ", ".join(t.primary_key)
    click.echo(f"initialized {t.uri}: primary key {key}, region spec {shown}")


def _read_file(path: str, schema=None):
    """A Parquet/CSV/JSON-lines/Arrow IPC file as a table. CSV and JSON columns named
    like table columns are parsed as the table's types (``007`` stays a string in a
    string column) rather than inferred; a value that does not parse is a SchemaError."""
    import pyarrow as pa
    import pyarrow.csv as pcsv
    import pyarrow.json as pjson
    import pyarrow.parquet as pq

    def table_types(*kinds) -> dict:
        if schema is None:
            return {}
        scalar = (pa.types.is_primitive, pa.types.is_string, pa.types.is_large_string)
        return {f.name: f.type for f in schema if any(k(f.type) for k in scalar + kinds)}

    lower = path.lower()
    try:
        if lower.endswith(".parquet"):
            return pq.read_table(path)
        if lower.endswith(".csv"):
            # an empty unquoted field is NULL, a quoted one ("") the empty string: what
            # `memwal sql --format csv` writes
            convert = pcsv.ConvertOptions(
                column_types=table_types(pa.types.is_binary),
                strings_can_be_null=True,
                quoted_strings_can_be_null=False,
            )
            return pcsv.read_csv(path, convert_options=convert)
        if lower.endswith((".json", ".jsonl", ".ndjson")):
            types = table_types()
            parse = pjson.ParseOptions(
                explicit_schema=pa.schema(types) if types else None,
                unexpected_field_behavior="infer",
            )
            return pjson.read_json(path, parse_options=parse)
        if lower.endswith((".arrow", ".ipc", ".feather")):
            with pa.memory_map(path) as source:
                try:
                    return aligned(pa.ipc.open_file(source).read_all())
                except pa.ArrowInvalid:
                    source.seek(0)
                    return aligned(pa.ipc.open_stream(source).read_all())
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:  # e.g. a value not of its column's type
        raise SchemaError(f"cannot read it: {e}") from e
    raise click.BadParameter(f"{path}: unknown file type (parquet, csv, jsonl, arrow)")


@main.command()
@click.argument("uri")
@click.argument("files", nargs=-1, required=True)
@click.option("--region", help="Write every row to this region id (no routing).")
@click.option(
    "--buffer-rows",
    default=DEFAULT_BUFFER_ROWS,
    show_default=True,
    type=click.IntRange(min=1),
    help="Rows per put (one durable WAL entry each).",
)
@deprecated_option("--batch-rows", "--buffer-rows", type=click.IntRange(min=1))
@click.option("--flush/--no-flush", default=True, show_default=True, help="Flush at the end.")
@click.option(
    "--partial",
    is_flag=True,
    help="Partial update: columns missing from the files keep each key's current value.",
)
@click.option(
    "--schema-mode",
    type=click.Choice(["merge"]),
    default=None,
    help="merge: add the files' columns the table lacks (nullable) before writing.",
)
@_handle_errors
def ingest(
    uri: str,
    files: tuple[str, ...],
    region: str | None,
    buffer_rows: int,
    batch_rows: int | None,
    flush: bool,
    partial: bool,
    schema_mode: str | None,
) -> None:
    """Upsert rows from Parquet/CSV/JSON-lines/Arrow FILES (routed by the region spec).

    Every file is read and checked against the table schema (and, with ``--region``,
    the region spec) before the first row is written: a rejected ingest changes nothing.
    Each batch is durable once written; interrupted (Ctrl-C, SIGTERM), it says how many
    rows were made durable, and running it again converges to the same table (upserts
    are idempotent).
    """
    import pyarrow as pa

    from memwal_query.format.schema import coerce_partial_rows, extra_columns
    from memwal_query.storage.paths import validate_region_id
    from memwal_query.write.routing import split_by_region

    if batch_rows is not None:
        buffer_rows = batch_rows
    t = _open(uri)
    tables = []
    missing_by_file: list[list[str]] = []
    schema = t.schema  # with the columns --schema-mode merge adds, once all files pass
    for f in files:
        try:
            raw = _read_file(f, schema)
            if schema_mode == "merge":
                schema = pa.schema([*schema, *extra_columns(raw.schema, schema)], schema.metadata)
            tb, missing = coerce_partial_rows(raw, schema, t.primary_key)
        except SchemaError as e:  # name the file (PrimaryKeyError is a SchemaError)
            raise type(e)(f"{f}: {e}") from e
        if missing and not partial:
            raise SchemaError(
                f"{f}: column(s) {missing} are missing: an upsert replaces whole rows; "
                "give them, or pass --partial to keep their current values"
            )
        tables.append(tb.select(schema.names) if not missing else tb)
        missing_by_file.append(missing)
    added = [f for f in schema if t.schema.get_field_index(f.name) < 0]
    if added:
        t.alter.add_columns(added)
        click.echo(f"added column(s) {', '.join(f'{f.name} {f.type}' for f in added)}", err=True)
    if region:
        region = validate_region_id(region)
        spec = t.region_spec
        if spec is not None:
            for tb in tables:
                for values, _ in split_by_region(spec, tb, t.catalog.lance_schema):
                    if t.catalog.region_id_for(values) != region:
                        raise WrongRegionError(
                            f"rows with region value {values} belong to region "
                            f"{t.catalog.region_id_for(values)}, not {region}"
                        )
    total = sum(tb.num_rows for tb in tables)
    writer = t.writer(region) if region else None
    started = time.perf_counter()
    done = 0

    def rate(_: Any) -> str:
        return f"{done / max(time.perf_counter() - started, 1e-9):,.0f} rows/s"

    import signal

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        with _progress(length=total, label="ingesting", show_pos=True, item_show_func=rate) as bar:
            for tb, missing in zip(tables, missing_by_file):
                for batch in tb.to_batches(max_chunksize=buffer_rows):
                    part = pa.Table.from_batches([batch])
                    if writer is not None:
                        writer.put(part.drop_columns(missing), partial=bool(missing))
                    elif missing:
                        t.write(part.drop_columns(missing), partial=True)
                    else:
                        t.write(part)
                    done += batch.num_rows
                    bar.update(batch.num_rows, batch)
    except KeyboardInterrupt:
        click.echo(
            f"error: interrupted: {done:,} of {total:,} rows are durable (the batch being written "
            "may be too); run the same ingest again to finish: it converges to the same "
            "table",
            err=True,
        )
        raise SystemExit(130) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    if writer is not None:
        writer.close(flush=flush)
    else:
        if flush:
            t.flush()
        t.close(flush=False)
    secs = time.perf_counter() - started
    click.echo(f"{done:,} rows in {secs:.2f}s ({done / max(secs, 1e-9):,.0f} rows/s)")
