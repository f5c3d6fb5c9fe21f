"""``memwal sql``: queries, scripts (``-f``), the interactive prompt and output formats."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

import click

from memwal_query.cli.app import _handle_errors, error_text, main
from memwal_query.cli.setup import _read_file
from memwal_query.exceptions import NotInitializedError, PrimaryKeyError


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
    rows = clifmt.json_safe(table).to_pylist()  # NaN and infinities: null
    lines = "\n".join(json.dumps(r, default=str, allow_nan=False) for r in rows)
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
    Lance dataset (read into memory), or a Parquet/CSV/JSON-lines/Arrow file. Returns
    the name."""
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
    except (NotInitializedError, PrimaryKeyError):  # a Lance table without a MemWAL: as it is
        import lance

        # DataFusion's pyarrow-dataset scan does not drive Lance's fragments: its rows
        # are read once, into memory (such side tables are small: users, dimensions)
        ctx.from_arrow(lance.dataset(uri).to_table(), name=name)
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
    type=click.Choice(["latest", "strong", "eventual"]),
    default="latest",
    show_default=True,
    help="latest: every acknowledged write (region manifests plus every region's "
    "durable, unflushed WAL entries); strong: flushed rows only (region manifests); "
    "eventual: region snapshots in the MemWAL index.",
)
@click.option(
    "--allow-write",
    is_flag=True,
    help="Allow statements that write files or change the session (COPY, CREATE, SET...).",
)
@click.option(
    "--as-of",
    default=None,
    help="Time travel: read the table at URI as it was at this base version or ISO "
    "timestamp (see docs/changes.md).",
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
    as_of: str | None = None,
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
            try:
                register(ctx, n, uri, consistency=consistency, as_of=as_of)
            except (NotInitializedError, PrimaryKeyError) as e:
                hint = f"; to query it as a plain Lance table: --table {n}={uri}"
                raise type(e)(f"{e}{hint}") from e
    names += [_register_extra(ctx, spec, consistency) for spec in tables]
    if not allow_write:
        ctx = _ReadOnlySql(ctx)  # type: ignore[assignment]  # same .sql() surface
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
                click.echo(f"error: {error_text(e)}", err=True)
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
