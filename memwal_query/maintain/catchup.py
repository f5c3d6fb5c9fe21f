"""Index catch-up: extend base-table indexes over merged data, record the progress.

``catch_up_indexes`` opens one base version ``V``, reads ``merged_generations`` *of that
version*, extends the named base indexes (default: the maintained indexes) over ``V``'s
fragments (Lance ``optimize_indices`` on ``V``), and records ``index_catchup[name] =
merged_generations`` of ``V``. A merge committed after ``V`` is neither indexed nor
recorded, so the index may cover more than recorded, never less. The indexed read plan
then switches back to base indexes for those generations, and GC may delete them.

Where the progress is stored
----------------------------
The spec keeps it in ``MemWalIndexDetails.index_catchup``, but pylance (14) strips that
field from any index commit that is not its own repair path, so a value written
through ``CreateIndex`` does not survive. memwal_query therefore records it in
``_mem_wal/_index_catchup/{bit_reversed_version}.binpb`` (a ``MemWalIndexDetails``
message holding only ``index_catchup``; versions written with put-if-not-exists and
only ever raised), and :meth:`Catalog.index` merges it into the details it returns,
so readers see it where the spec says it is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memwal_query.exceptions import NotInitializedError
from memwal_query.format._proto import memwal_pb2 as pb
from memwal_query.format.progress import record_progress
from memwal_query.storage import crashpoints, paths

if TYPE_CHECKING:
    from memwal_query.catalog import Catalog


def catch_up_indexes(
    table: Catalog, names: list[str] | None = None, max_segments: int | None = None
) -> dict[str, dict[str, int]]:
    """Rebuild/extend base indexes and record ``index_catchup``; return the progress.

    Lance extends a vector index by a new delta segment each time, and a search probes
    every segment: with ``max_segments``, when one of the indexes has more segments
    than that, its segments are merged into one by the same optimisation (Lance's
    ``num_indices_to_merge``).

    Parameters
    ----------
    table : Catalog
    names : list of str, optional
        Maintained indexes to catch up. None (default): every maintained index, and
        then every other base index that leaves rows unindexed (the primary-key BTREE
        among them) is extended too
        (:func:`memwal_query.maintain.basefiles.extend_indexes`; its segments merged
        above ``max_segments``, default the maintenance policy's), so merged rows are
        looked up through the key index.
    max_segments : int, optional
        Merge an index's segments into one when it has more than this many.

    Returns
    -------
    dict
        ``{index: {region_id: generation}}``: the recorded catch-up progress.

    Raises
    ------
    NotInitializedError
        A named index does not exist on the base table.
    """
    if names is None:
        from memwal_query.maintain.basefiles import extend_indexes, indexes_to_extend
        from memwal_query.maintain.policy import DEFAULT_MAX_INDEX_SEGMENTS

        maintained = list(table.maintained_indexes)
        progress = _catch_up(table, maintained, max_segments)
        others = indexes_to_extend(table)
        if others:
            most = DEFAULT_MAX_INDEX_SEGMENTS if max_segments is None else max_segments
            extend_indexes(table, others, most)
        # Lance's own index optimisation records progress for the index it extended
        # too: the answer is the maintained indexes' progress, as for named ones.
        return {name: gens for name, gens in progress.items() if name in maintained}
    return _catch_up(table, list(names), max_segments)


def _catch_up(
    table: Catalog, names: list[str], max_segments: int | None
) -> dict[str, dict[str, int]]:
    """:func:`catch_up_indexes` of the named maintained indexes."""
    if not names:
        return {}
    ds = table.dataset()
    existing = {d.name for d in ds.describe_indices()}
    missing = [n for n in names if n not in existing]
    if missing:
        raise NotInitializedError(f"{table.uri}: no base index named {missing}")
    # Progress of exactly the version the rebuild indexes: Lance extends the indexes
    # over the fragments of ``ds``'s version, so a merge committed after it (not
    # covered) must not be recorded as caught up (GC would delete its generation early).
    merged = table.index(ds).merged_generations()
    options = {}
    if max_segments is not None:
        most = max(len(d.segments) for d in ds.describe_indices() if d.name in names)
        if most > max_segments:
            options["num_indices_to_merge"] = most
    ds.optimize.optimize_indices(index_names=names, **options)
    crashpoints.point("catchup.mid")

    update = pb.MemWalIndexDetails()
    for name in names:
        entry = update.index_catchup.add(index_name=name)
        for region_id, gen in sorted(merged.items()):
            entry.caught_up_generations.add(
                region_id=pb.UUID(uuid=paths.region_id_to_bytes(region_id)), generation=gen
            )
    record_progress(table.io, table.uri, update)
    return table.index().index_catchup()
