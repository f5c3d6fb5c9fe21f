"""``memwal changes``: print or write the change feed of a table (see
:mod:`memwal_query.read.changes`).

::

    memwal changes /data/events                        # every change still kept, JSON lines
    memwal changes /data/events --since mwc1.eyJs...   # after a cursor
    memwal changes /data/events --since 12 --format parquet --output c.parquet
    memwal changes /data/events --consumer etl --follow  # resume, commit, keep polling

Rows go to standard output (or ``--output``); the cursor to continue from goes to
standard error (``cursor: mwc1...``), to ``--cursor-file`` and, with ``--consumer``, to
the consumer's registration (so GC keeps what it has not consumed yet).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import click

from memwal_query.cli.app import _handle_errors, _open, record_done
from memwal_query.cli.sql import _emit, _write_atomically


@click.command(name="changes")
@click.argument("uri")
@click.option(
    "--since",
    default=None,
    help="A cursor from an earlier call, a base version, or an ISO timestamp "
    "(default: the consumer's cursor, else the earliest change still kept).",
)
@click.option(
    "--consumer",
    default=None,
    help="Registered consumer: start from its cursor and commit the new cursor after "
    "each batch (GC keeps what it has not consumed).",
)
@click.option(
    "--cursor-file", default=None, help="Read --since from / write the cursor to this file."
)
@click.option(
    "--consistency",
    type=click.Choice(["latest", "strong"]),
    default="latest",
    show_default=True,
    help="latest: every acknowledged change (also durable WAL entries not flushed "
    "yet); strong: flushed changes only.",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["json", "table", "csv", "arrow", "parquet"]),
    default="json",
    show_default=True,
    help="json: JSON lines; arrow: an Arrow IPC stream; parquet needs --output.",
)
@click.option("--output", default=None, help="Write the rows to this file.")
@click.option("--follow", is_flag=True, help="Keep polling for new changes (Ctrl-C stops).")
@click.option("--interval", default=1.0, show_default=True, help="--follow: seconds between polls.")
@click.option("--max-rows", type=int, default=None, help="At most about this many rows per batch.")
@click.option("--polls", type=int, default=None, hidden=True, help="--follow: stop after N polls.")
@_handle_errors
def changes(
    uri: str,
    since: str | None,
    consumer: str | None,
    cursor_file: str | None,
    consistency: str,
    fmt: str,
    output: str | None,
    follow: bool,
    interval: float,
    max_rows: int | None,
    polls: int | None,
) -> None:
    """Print the changes of the table at URI after --since (see docs/changes.md)."""
    if follow and fmt == "parquet":
        raise click.UsageError("--follow writes a stream: use --format json, csv, table or arrow")
    if fmt == "parquet" and output is None:
        raise click.UsageError("--format parquet needs --output FILE")
    t = _open(uri)
    if since is None and cursor_file is not None:
        try:
            with open(cursor_file) as f:
                since = f.read().strip() or None
        except FileNotFoundError:
            since = None
    if since is None and consumer is not None:
        since = t.consumers.list().get(consumer)
    sink = _ArrowSink(output) if fmt == "arrow" else None
    done = rows = 0
    interrupted = False
    try:
        while True:
            batch = t.changes(since=since, consistency=consistency, max_rows=max_rows)
            if sink is not None:
                sink.write(batch.table)
            elif batch.num_rows or (not follow and fmt != "json"):  # no blank JSON line
                if follow and output is not None:
                    _append(batch.table, fmt, output)
                else:
                    _emit(batch.table, fmt, output)
            since = batch.cursor
            _commit(t, since, consumer, cursor_file)
            done += 1
            rows += batch.num_rows
            if not follow and batch.complete:
                break
            if follow and (polls is not None and done >= polls):
                break
            if follow and batch.complete:
                time.sleep(interval)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if sink is not None:
            sink.close()
    click.echo(f"cursor: {since}", err=True)
    if interrupted:  # exit 130 saying what was written and committed
        kept = f" (committed for consumer {consumer!r})" if consumer else ""
        kept += f" (saved in {cursor_file})" if cursor_file else ""
        record_done(f"{rows:,} change row(s) written, up to cursor {since}{kept}")
        raise KeyboardInterrupt


def _commit(t: Any, cursor: str, consumer: str | None, cursor_file: str | None) -> None:
    if consumer is not None:
        t.consumers.register(consumer, cursor)
    if cursor_file is not None:

        def write(path: str) -> None:
            with open(path, "w") as f:
                f.write(cursor + "\n")

        _write_atomically(cursor_file, write)


def _append(table: Any, fmt: str, output: str) -> None:
    """--follow with --output: append each batch (JSON lines / CSV rows)."""
    import io
    import json

    if fmt == "csv":
        import pyarrow.csv as pcsv

        from memwal_query.cli import fmt as clifmt

        buf = io.BytesIO()
        pcsv.write_csv(clifmt.csv_ready(table), buf)
        text = buf.getvalue().decode()
    else:
        from memwal_query.cli import fmt as clifmt

        rows = clifmt.json_safe(table).to_pylist()  # NaN and infinities: null
        text = "".join(json.dumps(r, default=str, allow_nan=False) + "\n" for r in rows)
    with open(output, "a") as f:
        f.write(text)


class _ArrowSink:
    """One Arrow IPC stream (standard output or a file) over every batch."""

    def __init__(self, output: str | None) -> None:
        self.output = output
        self._writer: Any = None
        self._file: Any = None

    def write(self, table: Any) -> None:
        import pyarrow as pa

        if self._writer is None:
            self._file = open(self.output, "wb") if self.output else sys.stdout.buffer
            self._writer = pa.ipc.new_stream(self._file, table.schema)
        self._writer.write_table(table)
        self._file.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._file is not None and self.output:
            self._file.close()
