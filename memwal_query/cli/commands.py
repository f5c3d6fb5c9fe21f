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

from memwal_query.exceptions import (
    AlreadyInitializedError,
    MemWalError,
    NotInitializedError,
    RegionSpecError,
    SchemaError,
    WrongRegionError,
)


def _handle_errors(fn: Callable) -> Callable:
    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        ctx = click.get_current_context()
        try:
            return fn(*args, **kwargs)
        except (click.ClickException, BrokenPipeError):
            raise
        except (MemWalError, OSError, ValueError, RuntimeError, Exception) as e:  # noqa: BLE001
            if (ctx.find_root().obj or {}).get("debug"):
                raise
            click.echo(
                f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else e}", err=True
            )
            sys.exit(1)

    return wrapper


class _OneLineErrorGroup(click.Group):
    """A command group whose usage errors also print one line and exit non-zero.

    Click's own rendering of a usage error (bad option value, unknown command, missing
    argument) is three lines; here it is ``error: <message> (see 'memwal CMD -h')`` on
    stderr with click's exit status (2). ``memwal`` without a command prints the help.
    """

    def main(self, args: Any = None, *rest: Any, **kwargs: Any) -> Any:
        """Run the command line; exit with its status (see the class docs).

        ``--debug`` is accepted anywhere before a ``--`` (``memwal sql --debug URI``): it
        is moved in front of the subcommand, where the group reads it. A closed output
        pipe (``memwal sql ... | head``) ends the command quietly.
        """
        args = _debug_first(list(sys.argv[1:] if args is None else args))
        if kwargs.get("standalone_mode", True) is False:
            return super().main(args, *rest, **kwargs)
        kwargs["standalone_mode"] = False
        try:
            rv = super().main(args, *rest, **kwargs)
        except BrokenPipeError:
            _quiet_broken_pipe()
        except click.exceptions.NoArgsIsHelpError as e:
            e.show()
            sys.exit(e.exit_code)
        except click.ClickException as e:
            hint = ""
            ctx = getattr(e, "ctx", None)
            if isinstance(e, click.UsageError) and ctx is not None:
                hint = f" (see '{ctx.command_path} -h')"
            click.echo(f"error: {e.format_message()}{hint}", err=True)
            sys.exit(e.exit_code)
        except click.Abort:
            click.echo("error: interrupted", err=True)
            sys.exit(130)
        sys.exit(rv if isinstance(rv, int) else 0)


def _debug_first(args: list[str]) -> list[str]:
    """``args`` with every ``--debug`` before a ``--`` moved to the front."""
    end = args.index("--") if "--" in args else len(args)
    head = [a for a in args[:end] if a != "--debug"]
    if len(head) == end:
        return args
    return ["--debug", *head, *args[end:]]


def _quiet_broken_pipe() -> None:
    """The reader of our stdout went away (``| head``): exit 0 without a traceback (and
    without Python's complaint when it flushes stdout at exit)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no real stdout (e.g. CliRunner): nothing to silence
        pass
    sys.exit(0)


@click.group(cls=_OneLineErrorGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show tracebacks (accepted anywhere).")
@click.version_option(package_name="memwal_query", prog_name="memwal")
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
    from memwal_query.cli.demo import run

    run(directory, rows=rows)


def _open(uri: str):
    from memwal_query.table import MemWalTable

    return MemWalTable.open(uri)


def _regions(table: Any, region: str | None) -> list[str]:
    """Every region of ``table``, or just ``region`` (a valid id of an existing region)."""
    from memwal_query.storage.paths import validate_region_id

    existing = table.region_ids()
    if region is None:
        return existing
    region = validate_region_id(region)
    if region not in existing:
        raise click.BadParameter(f"no region {region} in {table.uri}", param_hint="--region")
    return [region]


def _progress(iterable: Any = None, **kwargs: Any) -> Any:
    """A click progress bar on stderr, shown on a terminal only (stdout stays data)."""
    return click.progressbar(iterable, file=sys.stderr, hidden=not sys.stderr.isatty(), **kwargs)


def _spec_from_options(
    uri: str,
    bucket: str | None,
    identity: str | None,
    expression: str | None,
    columns: str | None,
    result_type: str,
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
@click.option(
    "--reset",
    is_flag=True,
    help="Remove the regions an earlier MemWAL of this table left in _mem_wal/ first.",
)
@_handle_errors
def init(
    uri: str,
    primary_key: str,
    bucket,
    identity,
    expression,
    columns,
    result_type,
    maintain,
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

    from memwal_query.format import index as mwindex
    from memwal_query.format.schema import PK_METADATA_KEY, primary_key_columns
    from memwal_query.storage.io import file_io_for
    from memwal_query.table import MemWalTable

    try:
        ds = lance.dataset(uri)
    except Exception as e:  # noqa: BLE001
        raise click.ClickException(f"no Lance table at {uri}: {e}") from None
    keys = [k.strip() for k in primary_key.split(",") if k.strip()]
    missing = [k for k in keys if ds.schema.get_field_index(k) < 0]
    if missing:
        raise click.BadParameter(f"no column(s) {missing} in {uri}")
    if mwindex.read_index(file_io_for(uri), ds) is not None:
        raise AlreadyInitializedError(f"{uri}: the table already has a MemWAL index")
    from memwal_query.table import check_no_leftover_regions

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
    t = MemWalTable.initialize(
        uri, region_spec=spec, maintained_indexes=list(maintain), reset=reset
    )
    click.echo(f"initialized {t.uri}: primary key {t.primary_key}, region spec {t.region_spec}")


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
            convert = pcsv.ConvertOptions(column_types=table_types(pa.types.is_binary))
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
                    return pa.ipc.open_file(source).read_all()
                except pa.ArrowInvalid:
                    source.seek(0)
                    return pa.ipc.open_stream(source).read_all()
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:  # e.g. a value not of its column's type
        raise SchemaError(f"cannot read it: {e}") from e
    raise click.BadParameter(f"{path}: unknown file type (parquet, csv, jsonl, arrow)")


@main.command()
@click.argument("uri")
@click.argument("files", nargs=-1, required=True)
@click.option("--region", help="Write every row to this region id (no routing).")
@click.option(
    "--batch-rows",
    default=50_000,
    show_default=True,
    type=click.IntRange(min=1),
    help="Rows per put (one durable WAL entry each).",
)
@click.option("--flush/--no-flush", default=True, show_default=True, help="Flush at the end.")
@click.option(
    "--partial",
    is_flag=True,
    help="Partial update: columns missing from the files keep each key's current value.",
)
@_handle_errors
def ingest(
    uri: str,
    files: tuple[str, ...],
    region: str | None,
    batch_rows: int,
    flush: bool,
    partial: bool,
) -> None:
    """Upsert rows from Parquet/CSV/JSON-lines/Arrow FILES (routed by the region spec).

    Every file is read and checked against the table schema (and, with ``--region``,
    the region spec) before the first row is written: a rejected ingest changes nothing.
    Each batch is durable once written; interrupted (Ctrl-C, SIGTERM), it says how many
    rows were made durable, and running it again converges to the same table (upserts
    are idempotent).
    """
    from memwal_query.format.schema import coerce_partial_rows
    from memwal_query.storage.paths import validate_region_id
    from memwal_query.table import split_by_region

    t = _open(uri)
    tables = []
    missing_by_file: list[list[str]] = []
    for f in files:
        try:
            tb, missing = coerce_partial_rows(_read_file(f, t.schema), t.schema, t.primary_key)
        except SchemaError as e:  # name the file (PrimaryKeyError is a SchemaError)
            raise type(e)(f"{f}: {e}") from e
        if missing and not partial:
            raise SchemaError(
                f"{f}: column(s) {missing} are missing: an upsert replaces whole rows; "
                "give them, or pass --partial to keep their current values"
            )
        tables.append(tb.select(t.schema.names) if not missing else tb)
        missing_by_file.append(missing)
    if region:
        region = validate_region_id(region)
        spec = t.region_spec
        if spec is not None:
            for tb in tables:
                for values, _ in split_by_region(spec, tb, t.lance_schema):
                    if t.region_id_for(values) != region:
                        raise WrongRegionError(
                            f"rows with region value {values} belong to region "
                            f"{t.region_id_for(values)}, not {region}"
                        )
    total = sum(tb.num_rows for tb in tables)
    writer = t.writer(region) if region else None
    started = time.perf_counter()
    done = 0

    def rate(_: Any) -> str:
        return f"{done / max(time.perf_counter() - started, 1e-9):,.0f} rows/s"

    import signal

    import pyarrow as pa

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        with _progress(length=total, label="ingesting", show_pos=True, item_show_func=rate) as bar:
            for tb, missing in zip(tables, missing_by_file):
                for batch in tb.to_batches(max_chunksize=batch_rows):
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
            f"interrupted: {done:,} of {total:,} rows are durable (the batch being written "
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


def _write_atomically(output: str, write: Callable[[str], None]) -> None:
    """Call ``write(path)`` on a temporary file beside ``output``, then rename it into
    place: a failed write leaves no partial (or empty) ``output`` behind."""
    directory = os.path.dirname(os.path.abspath(output))
    tmp = os.path.join(directory, f".{os.path.basename(output)}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, output)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _write_text(output: str | None, text: str) -> None:
    if output is None:
        click.echo(text)
        return

    def write(path: str) -> None:
        with open(path, "w") as f:
            f.write(text + "\n")

    _write_atomically(output, write)


def _emit(table, fmt: str, output: str | None) -> None:
    """Print ``table`` (or write it to ``output``) as ``fmt``. A file is written under a
    temporary name and renamed once complete; nested columns (vectors, lists, structs)
    are JSON text in CSV and in the text table, where a SQL NULL prints as NULL and a
    NaN as NaN."""
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    from memwal_query.cli import fmt as clifmt

    if fmt == "table":
        _write_text(output, clifmt.render(table))
        return
    if fmt == "parquet":
        if output is None:
            raise click.UsageError("--format parquet needs --output FILE")
        _write_atomically(output, lambda path: pq.write_table(table, path))
        return
    if fmt == "csv":
        table = clifmt.csv_ready(table)
        if output is None:
            import io

            buf = io.BytesIO()
            pcsv.write_csv(table, buf)
            click.echo(buf.getvalue().decode(), nl=False)
        else:
            _write_atomically(output, lambda path: pcsv.write_csv(table, path))
        return
    lines = "\n".join(json.dumps(r, default=str) for r in table.to_pylist())
    _write_text(output, lines)


def _split_statements(text: str) -> list[str]:
    """SQL statements of a script, split at ``;`` outside quotes and comments; a
    statement made only of comments is dropped."""
    out: list[str] = []
    buf: list[str] = []
    code = False  # the current statement has something besides comments and blanks
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "-" and text.startswith("--", i):  # comment to the end of the line
            j = text.find("\n", i)
            j = n if j < 0 else j
            buf.append(text[i:j])
            i = j
            continue
        if c == "/" and text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            buf.append(text[i:j])
            i = j
            continue
        if c in "'\"":  # a quoted literal or identifier ('' and "" escape themselves)
            j = i + 1
            while j < n and not (text[j] == c and not text.startswith(c * 2, j)):
                j += 2 if text.startswith(c * 2, j) else 1
            buf.append(text[i : j + 1])
            code = True
            i = j + 1
            continue
        if c == ";":
            if code:
                out.append("".join(buf).strip())
            buf, code = [], False
        else:
            buf.append(c)
            code = code or not c.isspace()
        i += 1
    if code:
        out.append("".join(buf).strip())
    return out


def _register_extra(ctx: Any, spec: str, consistency: str) -> str:
    """Register one ``--table NAME=URI``: a MemWAL table (deduplicated view), a plain
    Lance dataset, or a Parquet/CSV/JSON-lines/Arrow file. Returns the name."""
    from memwal_query.exceptions import NotInitializedError
    from memwal_query.session import register

    name, sep, uri = spec.partition("=")
    name, uri = name.strip(), uri.strip()
    if not sep or not name.isidentifier() or not uri:
        raise click.BadParameter(f"want NAME=URI, got {spec!r}", param_hint="--table")
    if os.path.isfile(uri):
        ctx.from_arrow(_read_file(uri), name=name)
        return name
    try:
        register(ctx, name, uri, consistency=consistency)
    except NotInitializedError:  # a Lance table without a MemWAL: as it is
        import lance

        ctx.register_dataset(name, lance.dataset(uri))
    return name


@main.command(context_settings={"ignore_unknown_options": True})
@click.argument("uri", required=False)
@click.argument("query", required=False)
@click.option(
    "-f",
    "--file",
    "script",
    type=click.File("r"),
    help="Run the SQL statements of this file ('-': standard input), separated by ';'.",
)
@click.option(
    "--table",
    "tables",
    multiple=True,
    metavar="NAME=URI",
    help="Also register a table as NAME (repeatable): a MemWAL table, a plain Lance "
    "dataset or a Parquet/CSV/JSON-lines/Arrow file. With --table, a lone argument "
    "is the query.",
)
@click.option(
    "--name",
    default=None,
    help="Table name in SQL (default: the table directory's name, e.g. 'events'; 't' works too).",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["table", "csv", "json", "parquet"]),
    default="table",
    show_default=True,
    help="Output format (csv: vectors and lists as JSON text; parquet needs --output).",
)
@click.option("--output", help="Write the result to this file (created only on success).")
@click.option(
    "--consistency",
    type=click.Choice(["strong", "eventual", "latest"]),
    default="strong",
    show_default=True,
    help="strong: region manifests; eventual: region snapshots in the MemWAL index; "
    "latest: strong plus every region's durable, unflushed WAL entries.",
)
@click.option(
    "--allow-write",
    is_flag=True,
    help="Allow statements that write files or change the session (COPY, CREATE, SET...).",
)
@_handle_errors
def sql(
    uri: str | None,
    query: str | None,
    script: Any,
    tables: tuple[str, ...],
    name: str | None,
    fmt: str,
    output: str | None,
    consistency: str,
    allow_write: bool = False,
) -> None:
    """Run QUERY (or the statements of -f FILE) against the table at URI; neither: an
    interactive prompt.

    The table is named after its directory (``/data/events`` -> ``events``) and also
    ``t``, unless ``--name`` is given. ``--table NAME=URI`` registers more tables (the
    sql_examples/ need several): ``memwal sql -f q.sql --table events=/data/events
    --table users=users.parquet``. Read-only unless ``--allow-write``: DDL (CREATE
    EXTERNAL TABLE, CREATE VIEW, DROP), DML (COPY ... TO, INSERT) and statements (SET)
    are refused with ReadOnlySqlError.
    """
    import datafusion

    from memwal_query.session import register

    for arg in (uri, query):  # a query may start with a comment ("-- ..."): not an option
        if arg is not None and arg.startswith("-") and not any(c.isspace() for c in arg):
            raise click.NoSuchOption(arg.split("=")[0])
    if tables and query is None and script is None and uri is not None:
        uri, query = None, uri  # memwal sql --table a=... "SELECT ..."
    if query is not None and script is not None:
        raise click.UsageError("give a QUERY or -f FILE, not both")
    if uri is None and not tables:
        raise click.UsageError("give a table URI or --table NAME=URI")
    ctx = datafusion.SessionContext()
    names = []
    if uri is not None:
        names = [name] if name else _default_sql_names(uri)
        for n in names:
            register(ctx, n, uri, consistency=consistency)
    names += [_register_extra(ctx, spec, consistency) for spec in tables]
    if not allow_write:
        ctx = _ReadOnlySql(ctx)
    statements = _split_statements(script.read()) if script is not None else []
    if query is not None:
        statements = [query]
    if statements:
        if output is not None and len(statements) > 1:
            raise click.UsageError("--output takes the result of one statement")
        for text in statements:
            _emit(ctx.sql(text).to_arrow_table(), fmt, output)
        return
    _prompt(ctx, uri or ", ".join(names), names[0], fmt)


HISTORY_FILE = "~/.memwal_history"
"""Where the interactive prompt keeps its history (``$HOME`` of the user)."""


def _prompt(ctx: Any, uri: str, name: str, fmt: str) -> None:
    """The interactive SQL prompt: statements end with ``;``, history in HISTORY_FILE.

    On a terminal, each statement is one history entry (arrow keys recall it) and the
    history is saved on exit; piped input (``memwal sql URI < script.sql``) is not
    recorded.

    An error in a statement prints one line and the prompt goes on; Ctrl-C drops the
    statement being typed; ``\\q``, ``quit``, ``exit`` or Ctrl-D leave.
    """
    history = os.path.expanduser(HISTORY_FILE)
    try:
        import readline
    except ImportError:  # e.g. Windows without pyreadline
        readline = None  # type: ignore[assignment]
    interactive = sys.stdin.isatty()
    if readline is not None:
        readline.set_history_length(1000)
        readline.set_auto_history(False)  # one entry per statement, not per line
        try:
            readline.read_history_file(history)
        except OSError:  # no history yet (or unreadable): start empty
            pass
    click.echo(f"memwal SQL on {uri} as '{name}'; end with ';', quit with \\q or Ctrl-D")
    buf: list[str] = []
    while True:
        try:
            line = input("memwal> " if not buf else "   ...> ")
        except EOFError:
            break
        except KeyboardInterrupt:
            click.echo()
            buf = []
            continue
        if not buf and line.strip() in ("\\q", "quit", "exit"):
            break
        if not buf and not line.strip():
            continue
        buf.append(line)
        if line.rstrip().endswith(";"):
            text = "\n".join(buf).rstrip().rstrip(";")
            if readline is not None and interactive:
                readline.add_history(" ".join(x.strip() for x in buf))
            buf = []
            try:
                _emit(ctx.sql(text).to_arrow_table(), fmt, None)
            except Exception as e:  # noqa: BLE001
                click.echo(f"error: {str(e).splitlines()[0] if str(e) else e!r}", err=True)
    if readline is not None and interactive:
        try:
            readline.write_history_file(history)
        except OSError as e:
            click.echo(f"warning: history not saved: {e}", err=True)


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
    """Replay each region's unflushed WAL and flush it as a generation.

    This claims each region with unflushed rows (epoch + 1): meant for regions whose
    writer is gone; a live writer of such a region is fenced.
    """
    t = _open(uri)
    regions = _regions(t, region)
    st = t.status()["regions"]
    todo = [rid for rid in regions if st.get(rid, {}).get("unflushed_rows", 0)]
    if dry_run:
        for rid in todo:
            click.echo(f"would flush {rid}: {st[rid]['unflushed_rows']} rows")
        click.echo(f"{len(todo)} region(s) would be flushed")
        return
    lines = []
    with _progress(todo, label="flushing") as bar:
        for rid in bar:
            w = t.writer(rid)
            gen = w.flush()
            w.close(flush=False)
            lines.append(f"{rid}: generation {gen}")
    for line in lines:
        click.echo(line)
    click.echo(f"{len(lines)} region(s) flushed")


@main.command()
@click.argument("uri")
@click.option("--region", help="Only this region.")
@click.option("--max-generations", type=click.IntRange(min=1), help="Per region.")
@click.option("--dry-run", is_flag=True, help="Only list the generations to merge.")
@_handle_errors
def merge(uri: str, region: str | None, max_generations: int | None, dry_run: bool) -> None:
    """Merge flushed generations into the base table, in order."""
    t = _open(uri)
    regions = _regions(t, region)
    merged = t.index().merged_generations()
    if dry_run:
        for rid in regions:
            m = t.region_manifest(rid)
            todo = [
                g.generation for g in m.flushed_generations if g.generation > merged.get(rid, 0)
            ]
            click.echo(f"{rid}: would merge {todo[:max_generations] if max_generations else todo}")
        return
    lines = []
    with _progress(regions, label="merging") as bar:
        for rid in bar:
            done = t.merge(rid, max_generations)
            if done:
                lines.append(f"{rid}: merged {[g for _, g in done]}")
    for line in lines:
        click.echo(line)


@main.command()
@click.argument("uri")
@click.option("--dry-run", is_flag=True, help="Only list what would be removed.")
@click.option(
    "--cleanup-older-than", type=float, help="First remove base versions older than N hours."
)
@_handle_errors
def gc(uri: str, dry_run: bool, cleanup_older_than: float | None) -> None:
    """Delete merged, caught-up generations and their WAL entries, then say what kept
    each remaining generation (not merged, a retained base version, an index)."""
    import datetime as dt

    t = _open(uri)
    older = None if cleanup_older_than is None else dt.timedelta(hours=cleanup_older_than)
    with _progress(length=0, label="collecting", show_pos=True) as bar:

        def step(done: int, total: int) -> None:
            bar.length = total
            bar.update(done - bar.pos)

        removed = t.gc(dry_run=dry_run, cleanup_older_than=older, progress=step)
    if dry_run and older is not None:
        click.echo(
            "note: a dry run removes no base versions, so generations that only those "
            "versions still need are not listed",
            err=True,
        )
    for p in removed:
        click.echo(("would remove " if dry_run else "removed ") + p)
    click.echo(f"{len(removed)} path(s)")
    from memwal_query.maintain.gcreasons import kept_generations

    for k in kept_generations(t):
        click.echo(f"kept {k.region_id} generation {k.generation}: {'; '.join(k.reasons)}")


@main.command(name="catch-up")
@click.argument("uri")
@click.option("--index", "names", multiple=True, help="Index names (default: maintained).")
@click.option("--dry-run", is_flag=True, help="Only show what would be caught up.")
@_handle_errors
def catch_up(uri: str, names: tuple[str, ...], dry_run: bool) -> None:
    """Extend base indexes over merged data and record index catch-up progress."""
    t = _open(uri)
    chosen = list(names) or t.maintained_indexes
    existing = {d.name for d in t.dataset().describe_indices()}
    missing = [n for n in chosen if n not in existing]
    if missing:
        raise NotInitializedError(f"{t.uri}: no base index named {missing}")
    if dry_run:
        click.echo(f"would catch up {chosen} to {t.index().merged_generations()}")
        return
    if not chosen:
        click.echo("no maintained indexes: nothing to catch up")
        return
    progress: dict[str, dict[str, int]] = {}
    with _progress(chosen, label="catching up") as bar:
        for index_name in bar:
            progress.update(t.catch_up_indexes([index_name]))
    click.echo(json.dumps(progress, indent=2))


@main.command(name="refresh-snapshots")
@click.argument("uri")
@click.option("--dry-run", is_flag=True, help="Only list the regions a snapshot would hold.")
@_handle_errors
def refresh_snapshots(uri: str, dry_run: bool) -> None:
    """Write region snapshots into the MemWAL index (for eventual reads)."""
    t = _open(uri)
    if dry_run:
        regions = t.region_ids()
        for rid in regions:
            click.echo(f"would snapshot {rid}")
        click.echo(f"{len(regions)} region(s) would be in the snapshot")
        return
    idx = t.refresh_snapshots()
    click.echo(f"{idx.details.num_regions} region(s) in the snapshot")


# -- read-only SQL, fsck and repair (issue 18) ------------------------------------------


class _ReadOnlySql:
    """A DataFusion SessionContext whose ``sql`` refuses DDL, DML and statements.

    DataFusion's ``SQLOptions`` (``allow_ddl``/``allow_dml``/``allow_statements``
    False) reject them at planning time, before anything runs; the refusal is a
    :class:`~memwal_query.exceptions.ReadOnlySqlError` naming ``--allow-write``.
    """

    def __init__(self, ctx: Any) -> None:
        from datafusion import SQLOptions

        self._ctx = ctx
        self._options = (
            SQLOptions().with_allow_ddl(False).with_allow_dml(False).with_allow_statements(False)
        )

    def sql(self, query: str) -> Any:
        """Plan ``query`` read-only."""
        from memwal_query.exceptions import ReadOnlySqlError

        try:
            return self._ctx.sql_with_options(query, self._options)
        except Exception as e:
            text = str(e)
            if any(k in text for k in ("DDL not", "DML not", "Statement not")):
                reason = text.rsplit(": ", 2)[-2:]
                raise ReadOnlySqlError(
                    f"refused ({': '.join(reason)}): memwal sql is read-only; "
                    "pass --allow-write to run statements that write or change the session"
                ) from e
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)


@main.command()
@click.argument("uri")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_handle_errors
def fsck(uri: str, as_json: bool) -> None:
    """Check every manifest, WAL entry, generation, bloom filter and the MemWAL index.

    Prints each finding (severity, file, problem, repair command); exits 1 when
    anything is corrupt (an error), 0 when the table is clean or has warnings only.
    """
    from memwal_query.maintain.fsck import ERROR, check

    t = _open(uri)
    try:
        regions = len(t.region_ids())
    except MemWalError:  # a damaged layout: check() reports it
        regions = 1
    with _progress(length=max(1, regions), label="checking regions") as bar:
        findings = check(t, progress=lambda _rid: bar.update(1))
    if as_json:
        click.echo(json.dumps([f.to_dict() for f in findings], indent=2))
    else:
        for f in findings:
            click.echo(str(f))
        errors = sum(f.severity == ERROR for f in findings)
        click.echo(
            f"{errors} error(s), {len(findings) - errors} warning(s)"
            if findings
            else f"{t.uri}: no problems found"
        )
    if any(f.severity == ERROR for f in findings):
        sys.exit(1)


@main.command()
@click.argument("uri")
@click.option("--region", help="Only this region (default: every region).")
@click.option(
    "--accept-loss",
    is_flag=True,
    help="Move the WAL past missing or corrupt entries; the writes they held are lost.",
)
@click.option("--dry-run", is_flag=True, help="Only show what would be done.")
@_handle_errors
def repair(uri: str, region: str | None, accept_loss: bool, dry_run: bool) -> None:
    """Repair what fsck found: version hints and bloom filters (lossless) and, with
    --accept-loss, WAL holes and corrupt unflushed WAL entries (each dropped position is
    printed). Corrupt manifests and a damaged index have no automatic repair.
    """
    from memwal_query.maintain.fsck import repair as do_repair

    t = _open(uri)
    done = 0
    for rid in _regions(t, region):
        for action in do_repair(t, rid, accept_loss=accept_loss, dry_run=dry_run):
            click.echo(("would " if dry_run else "") + action)
            done += 1
    click.echo(f"{done} repair(s)" + (" (dry run)" if dry_run else ""))


# -- commands defined in their own modules ------------------------------------------------
from memwal_query.cli.maintain import COMMAND as _maintain_command  # noqa: E402 - needs the above

main.add_command(_maintain_command)
