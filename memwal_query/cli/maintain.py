"""``memwal maintain``: one maintenance pass, or one every few seconds with ``--watch``.

The pass is :func:`memwal_query.maintain.policy.maintain`; the options set the fields
of :class:`~memwal_query.maintain.policy.MaintenancePolicy` (defaults shown by
``memwal maintain -h``). Progress bars go to stderr on a terminal only; stdout gets one
line per action (or one JSON object per pass with ``--json``).
"""

from __future__ import annotations

import datetime as dt
import json
import sys
import time
from typing import Any

import click

from memwal_query.cli.app import _handle_errors, _open, _progress, error_text, record_done
from memwal_query.cli.options import Duration, deprecated_option, format_duration
from memwal_query.maintain.merger import DEFAULT_BATCH_BYTES, DEFAULT_BATCH_ROWS
from memwal_query.maintain.policy import (
    DEFAULT_ABANDONED_AFTER,
    DEFAULT_COMPACT_DELETED_SHARE,
    DEFAULT_COMPACT_FRAGMENTS,
    DEFAULT_COMPACT_REWRITE_ROWS,
    DEFAULT_MAX_GENERATIONS,
    DEFAULT_MAX_INDEX_SEGMENTS,
    DEFAULT_MAX_ROWS,
    DEFAULT_RETENTION,
    MaintenanceFailedError,
    MaintenancePolicy,
    MaintenanceReport,
)
from memwal_query.storage.heap import bound_process_heap

DEFAULT_WATCH_SECONDS = 30.0


class _StepBars:
    """``progress(step, done, total)`` drawn as one click progress bar per step."""

    def __init__(self) -> None:
        self._step: str | None = None
        self._bar: Any = None

    def __call__(self, step: str, done: int, total: int) -> None:
        if step != self._step:
            self.close()
            self._step = step
            self._bar = _progress(length=max(total, 1), label=step, show_pos=True)
            self._bar.__enter__()
        bar = self._bar
        bar.length = max(total, 1)
        bar.update(done - bar.pos)

    def close(self) -> None:
        """Finish the bar of the current step."""
        if self._bar is not None:
            self._bar.__exit__(None, None, None)
        self._bar, self._step = None, None


def _policy(
    max_generations: int,
    max_rows: int,
    batch_rows: int | None,
    retention_window: dt.timedelta | None,
    keep_versions: bool,
    catch_up: bool,
    snapshots: bool,
    gc: bool,
    compact_fragments: int | None = DEFAULT_COMPACT_FRAGMENTS,
    max_index_segments: int = DEFAULT_MAX_INDEX_SEGMENTS,
    compact_deleted_share: float | None = DEFAULT_COMPACT_DELETED_SHARE,
    abandoned_after: dt.timedelta | None = DEFAULT_ABANDONED_AFTER,
    compact_rewrite_rows: int | None = DEFAULT_COMPACT_REWRITE_ROWS,
) -> MaintenancePolicy:
    retention: dt.timedelta | None = DEFAULT_RETENTION
    if keep_versions:
        retention = None
    elif retention_window is not None:
        retention = retention_window
    return MaintenancePolicy(
        merge_over_generations=max_generations,
        merge_over_rows=max_rows,
        merge_batch_rows=batch_rows,
        compact_fragments=compact_fragments,
        compact_deleted_share=compact_deleted_share,
        compact_rewrite_rows=compact_rewrite_rows,
        max_index_segments=max_index_segments,
        catch_up=catch_up,
        refresh_snapshots=snapshots,
        gc=gc,
        retention=retention,
        abandoned_after=abandoned_after,
    )


def _show(report: MaintenanceReport, as_json: bool, stamp: bool) -> None:
    if as_json:
        click.echo(json.dumps(report.to_dict()))
        return
    prefix = time.strftime("%H:%M:%S ") if stamp else ""
    for line in report.lines():
        click.echo(prefix + line)


@click.command()
@click.argument("uri")
@click.option(
    "--watch",
    type=click.FloatRange(min=0),
    is_flag=False,
    flag_value=DEFAULT_WATCH_SECONDS,
    default=None,
    metavar="[SECONDS]",
    help=f"Run a pass every SECONDS (default {DEFAULT_WATCH_SECONDS:g}) until interrupted.",
)
@click.option("--dry-run", is_flag=True, help="Only show what a pass would do.")
@click.option(
    "--merge-over-generations",
    type=click.IntRange(min=0),
    default=DEFAULT_MAX_GENERATIONS,
    show_default=True,
    help="Merge a region with more unmerged generations than this.",
)
@deprecated_option("--max-generations", "--merge-over-generations", type=click.IntRange(min=0))
@click.option(
    "--merge-over-rows",
    type=click.IntRange(min=0),
    default=DEFAULT_MAX_ROWS,
    show_default=True,
    help="Merge a region with more unmerged rows than this.",
)
@deprecated_option("--max-rows", "--merge-over-rows", type=click.IntRange(min=0))
@click.option(
    "--batch-rows",
    type=click.IntRange(min=0),
    help="Rows of consecutive generations merged per commit (0: one per generation) "
    f"[default: {DEFAULT_BATCH_ROWS}, and at most {DEFAULT_BATCH_BYTES >> 20} MiB].",
)
@click.option(
    "--retention",
    type=Duration(),
    help=f"GC retention window, e.g. 30m, 24h, 7d [default: {format_duration(DEFAULT_RETENTION)}].",
)
@deprecated_option("--retention-hours", "--retention", type=click.FloatRange(min=0))
@click.option("--keep-versions", is_flag=True, help="GC removes no base versions.")
@click.option(
    "--compact-fragments",
    type=click.IntRange(min=0),
    default=DEFAULT_COMPACT_FRAGMENTS,
    show_default=True,
    help="Compact the base table's files when more of its fragments than this are small.",
)
@click.option(
    "--compact-deleted-share",
    type=click.FloatRange(min=0, max=1),
    default=DEFAULT_COMPACT_DELETED_SHARE,
    show_default=True,
    help="Rewrite the base fragments with more than this share of deleted rows "
    "(0.1: Lance's own threshold; 0: every fragment with a deletion file, each pass).",
)
@click.option(
    "--compact-rewrite-rows",
    type=click.IntRange(min=0),
    default=DEFAULT_COMPACT_REWRITE_ROWS,
    show_default=True,
    help="Rewrite every base fragment with a deletion file when they hold at most this "
    "many rows, or at most twice the rows the pass merged (0: only the latter); a "
    "pass's compaction rewrites at most that many rows, the rest waits for the next.",
)
@click.option("--no-compact", is_flag=True, help="Never compact the base table's files.")
@click.option(
    "--max-index-segments",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_INDEX_SEGMENTS,
    show_default=True,
    help="Catch-up merges a maintained index's segments when it has more than this.",
)
@click.option("--catch-up/--no-catch-up", default=True, show_default=True, help="Catch up indexes.")
@click.option(
    "--snapshots/--no-snapshots", default=True, show_default=True, help="Refresh snapshots."
)
@click.option("--gc/--no-gc", default=True, show_default=True, help="Garbage collect.")
@click.option(
    "--abandoned-after",
    type=Duration(bare_unit="s"),
    default=format_duration(DEFAULT_ABANDONED_AFTER),
    show_default=True,
    help="Recover (flush, then merge) a region with unflushed WAL entries whose writer "
    "has shown no sign of life for this long, e.g. 90s, 5m.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per pass.")
@click.option(
    "--max-passes", type=click.IntRange(min=1), help="With --watch: stop after this many passes."
)
@_handle_errors
def maintain(
    uri: str,
    watch: float | None,
    dry_run: bool,
    merge_over_generations: int,
    max_generations: int | None,
    merge_over_rows: int,
    max_rows: int | None,
    batch_rows: int | None,
    retention: dt.timedelta | None,
    retention_hours: float | None,
    keep_versions: bool,
    compact_fragments: int,
    compact_deleted_share: float,
    compact_rewrite_rows: int,
    no_compact: bool,
    max_index_segments: int,
    catch_up: bool,
    snapshots: bool,
    gc: bool,
    abandoned_after: dt.timedelta,
    as_json: bool,
    max_passes: int | None,
) -> None:
    """Merge regions over the policy, catch up indexes, refresh snapshots, GC.

    Safe to run alongside writers, readers and other maintainers. With --watch, a
    failed pass is reported and the next one runs; the exit status is that of the
    last pass.
    """
    if max_generations is not None:
        merge_over_generations = max_generations
    if max_rows is not None:
        merge_over_rows = max_rows
    if retention is None and retention_hours is not None:
        retention = dt.timedelta(hours=retention_hours)
    policy = _policy(
        merge_over_generations,
        merge_over_rows,
        batch_rows,
        retention,
        keep_versions,
        catch_up,
        snapshots,
        gc,
        None if no_compact else compact_fragments,
        max_index_segments,
        compact_deleted_share,
        abandoned_after,
        compact_rewrite_rows,
    )
    if watch is not None:
        # this process maintains for hours: its allocators give each pass's memory back
        # (docs/maintenance.md, "Memory of a long-running maintainer")
        bound_process_heap()
    t = _open(uri)
    if watch is None:
        bars = _StepBars()
        try:
            report = t.maintenance.maintain(policy, dry_run=dry_run, progress=bars)
        except MaintenanceFailedError as e:
            bars.close()
            _show(e.report, as_json, stamp=False)
            raise
        bars.close()
        _show(report, as_json, stamp=False)
        return
    passes, failed = 0, False
    try:
        while True:
            passes += 1
            bars = _StepBars()
            try:
                _show(
                    t.maintenance.maintain(policy, dry_run=dry_run, progress=bars),
                    as_json,
                    stamp=True,
                )
                failed = False
            except MaintenanceFailedError as e:
                _show(e.report, as_json, stamp=True)
                failed = True
            except Exception as e:  # noqa: BLE001 - reported; the next pass may succeed
                click.echo(f"error: {error_text(e)}", err=True)
                failed = True
            finally:
                bars.close()
            if max_passes is not None and passes >= max_passes:
                break
            time.sleep(watch)
    except KeyboardInterrupt:
        record_done(f"{passes} maintenance pass(es)")
        raise
    if failed:
        sys.exit(1)


COMMAND: click.Command = maintain
"""The ``maintain`` command, as registered on the ``memwal`` group."""
