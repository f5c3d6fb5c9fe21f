"""The merger: flushed generations into the base table, in order, exactly once.

Per region, generations above ``merged_generations[region]`` are merged strictly in
ascending order, one Lance ``merge_insert`` commit per generation:

- the generation's rows are reduced to the last write per key (highest ``_rowaddr``);
- upserts: ``when_matched_update_all`` + ``when_not_matched_insert_all``;
- tombstones: ``when_not_matched_by_source_delete(<key IN (...)>)`` in the *same*
  operation (a tombstoned key is not among the upserts, so it is "not matched by
  source");
- ``mark_sstables_as_compacted([(region, generation)])`` records
  ``merged_generations[region] = generation`` in the same commit as the data.

So data and progress are one transaction: never two commits. The commit is made with
``conflict_retries(0)``; on a conflict the merger re-reads the latest version and its
MemWAL index and retries the same operation (bounded): if another merger already
merged the generation it moves on (spec, Appendix 2, scenario 1), and a crash after a
commit leaves progress that the next merger reads and skips (scenario 2). Lance itself
refuses a stale progress marker (a generation not above the recorded one), so progress
never goes backwards.
"""

from __future__ import annotations

import datetime as dt
import decimal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
from lance.mem_wal import CompactedSsTable

from . import crashpoints, sources
from .dedup import newest_per_key
from .exceptions import CommitConflictError, MemWalError
from .locking import index_lock
from .schema import GEN_COLUMN, ROWADDR_COLUMN, TOMBSTONE

if TYPE_CHECKING:
    from .table import MemWalTable

DEFAULT_MAX_RETRIES = 20


@dataclass(frozen=True)
class MergeResult:
    """One merged generation."""

    region_id: str
    generation: int
    upserted: int
    deleted: int
    seconds: float


def _sql_literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float | decimal.Decimal):
        return repr(value) if not isinstance(value, decimal.Decimal) else str(value)
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    if isinstance(value, dt.datetime):
        return f"TIMESTAMP '{value.isoformat(sep=' ')}'"
    if isinstance(value, dt.date):
        return f"DATE '{value.isoformat()}'"
    if isinstance(value, bytes):
        return f"X'{value.hex()}'"
    raise MemWalError(f"cannot express delete key value {value!r} in SQL")


def _quote(name: str) -> str:
    # Lance's filter dialect quotes identifiers with backticks.
    return "`" + name.replace("`", "``") + "`"


def delete_predicate(keys: pa.Table) -> str:
    """SQL predicate matching exactly the given primary keys."""
    cols = keys.column_names
    if len(cols) == 1:
        values = ", ".join(_sql_literal(v) for v in keys.column(0).to_pylist())
        return f"{_quote(cols[0])} IN ({values})"
    rows = keys.to_pylist()
    terms = [
        "(" + " AND ".join(f"{_quote(c)} = {_sql_literal(r[c])}" for c in cols) + ")" for r in rows
    ]
    return " OR ".join(terms)


def _is_conflict(err: Exception) -> bool:
    text = str(err).lower()
    return any(s in text for s in ("concurrent", "conflict", "stale sstable", "retryable"))


def merge_region(
    table: MemWalTable,
    region_id: str,
    max_generations: int | None = None,
    max_retries: int = DEFAULT_MAX_RETRIES,
) -> list[MergeResult]:
    """Merge the region's unmerged generations in order; return what this call merged."""
    done: list[MergeResult] = []
    conflicts = 0
    while max_generations is None or len(done) < max_generations:
        ds = table.dataset()
        index = table.index(ds)
        merged = index.merged_generations().get(region_id, 0)
        manifest = table.region_manifest(region_id)
        if manifest is None:
            break
        pending = sorted(
            (g for g in manifest.flushed_generations if g.generation > merged),
            key=lambda g: g.generation,
        )
        if not pending:
            break
        gen = pending[0]
        started = time.perf_counter()
        ref = sources.GenerationRef(
            region_id, gen.generation, table_generation_uri(table, region_id, gen.path)
        )
        rows = sources.read_generation(ref, table.schema, table.storage_options)
        newest = newest_per_key(rows, table.primary_key)
        tomb = newest.column(TOMBSTONE)
        upserts = newest.filter(pc.invert(tomb)).drop_columns(
            [TOMBSTONE, GEN_COLUMN, ROWADDR_COLUMN]
        )
        upserts = upserts.cast(table.schema).combine_chunks()
        deletes = newest.filter(tomb).select(table.primary_key)
        builder = (
            ds.merge_insert(table.primary_key)
            .when_matched_update_all()
            .when_not_matched_insert_all()
        )
        if deletes.num_rows:
            builder = builder.when_not_matched_by_source_delete(delete_predicate(deletes))
        builder = builder.mark_sstables_as_compacted(
            [CompactedSsTable(region_id, gen.generation)]
        ).conflict_retries(0)
        crashpoints.point("merge.before_commit")
        try:
            with index_lock(table.uri, table.io):
                builder.execute(upserts)
        except OSError as e:
            if not _is_conflict(e):
                raise
            conflicts += 1
            if conflicts > max_retries:
                raise CommitConflictError(
                    f"{table.uri}: merging generation {gen.generation} of region "
                    f"{region_id} lost {conflicts} commit races"
                ) from e
            continue  # re-read: maybe another merger merged it (Appendix 2)
        crashpoints.point("merge.after_commit")
        done.append(
            MergeResult(
                region_id,
                gen.generation,
                upserts.num_rows,
                deletes.num_rows,
                time.perf_counter() - started,
            )
        )
    return done


def table_generation_uri(table: MemWalTable, region_id: str, gen_dir: str) -> str:
    """Absolute URI of a generation directory (validated)."""
    from . import paths

    return paths.generation_path(table.uri, region_id, gen_dir)


def merge(
    table: MemWalTable,
    region_id: str | None = None,
    max_generations: int | None = None,
    max_retries: int = DEFAULT_MAX_RETRIES,
) -> list[MergeResult]:
    """Merge one region (or all regions, one after another)."""
    regions = [region_id] if region_id is not None else table.region_ids()
    out: list[MergeResult] = []
    for rid in regions:
        out.extend(merge_region(table, rid, max_generations, max_retries))
    return out
