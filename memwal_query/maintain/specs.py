"""Region spec evolution: adding a region spec, and moving keys to their new regions.

:func:`check_new_spec` validates a spec before anything changes;
:func:`set_region_spec` commits it as the current spec (the highest ``spec_id``) and
:func:`complete_spec_change` drains the regions of older specs: each is claimed
(fencing its writer), replayed, flushed, sealed and merged, then the change is
recorded complete in ``writer_config_defaults["memwal_query.spec_ready"]``.

Contract: a key is never unmerged in two regions. Writers of the new spec's regions
are claimed only once the change is complete, and a writer whose region's spec is no
longer current refuses rows with :class:`~memwal_query.exceptions.SpecChangedError`.
Readers are never blocked.

The protocol and why it is correct: docs/regions.md, "Region spec evolution".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from memwal_query.catalog import SPEC_READY_KEY
from memwal_query.exceptions import FencedError, MergeFailedError, RegionSpecError
from memwal_query.format import index as mwindex
from memwal_query.format.manifest import RegionManifest, RegionManifestStore
from memwal_query.storage.locking import index_lock

if TYPE_CHECKING:
    from memwal_query.catalog import Catalog
    from memwal_query.format._proto import memwal_pb2 as pb
    from memwal_query.regions.spec import RegionSpec

_DRAIN_ATTEMPTS = 10


def check_new_spec(table: Catalog, spec: RegionSpec) -> None:
    """RegionSpecError unless ``spec`` can become the table's current spec: a
    RegionSpec whose id is above every recorded spec id (ids are never reused), whose
    sources exist and which can evaluate the table's rows."""
    from memwal_query.regions.checks import check_spec_sources
    from memwal_query.regions.spec import RegionSpec

    if not isinstance(spec, RegionSpec):
        raise RegionSpecError(f"{table.uri}: expected a RegionSpec, got {type(spec).__name__}")
    # a table whose index records no spec is routed by the one-region default spec
    ids = [s.spec_id for s in table.index().details.region_specs]
    ids = ids or [table.routing_spec().spec_id]
    if spec.spec_id <= max(ids):
        raise RegionSpecError(
            f"{table.uri}: region spec id {spec.spec_id} is not above the table's spec ids "
            f"{sorted(ids)} (spec ids are never reused); use spec_id={max(ids) + 1}"
        )
    check_spec_sources(spec, table.lance_schema, table.uri, table.schema)


def set_region_spec(
    table: Catalog, spec: RegionSpec, progress: Callable[[int, int], None] | None = None
) -> None:
    """Add ``spec`` as the table's current region spec and move keys to it (module
    docs). Everything is checked before the index changes; a crash after the commit
    leaves the change to be completed by the next writer's claim (or a new call of
    :func:`complete_spec_change`). ``progress(done, total)`` is called as the regions
    of older specs are sealed and merged."""
    from memwal_query.regions.checks import warn_non_key_sources

    check_new_spec(table, spec)
    warn_non_key_sources(spec, table.lance_schema, table.primary_key, table.uri)
    proto = spec.to_proto()

    def add(details: pb.MemWalIndexDetails) -> None:
        ids = [s.spec_id for s in details.region_specs]
        if ids and spec.spec_id <= max(ids):  # another process added one meanwhile
            raise RegionSpecError(
                f"{table.uri}: region spec id {spec.spec_id} was taken meanwhile "
                f"(recorded ids {sorted(ids)})"
            )
        if not ids:
            # A table whose index records no spec (pylance's, or an older
            # memwal_query's) is routed by the one-region default: record it so that
            # its region's values stay readable (check_new_spec kept the ids apart).
            details.region_specs.append(table.routing_spec().to_proto())
        details.region_specs.append(proto)

    mwindex.update_details(table.io, table.uri, add, table.storage_options)
    table.refresh_index()
    complete_spec_change(table, progress)


def complete_spec_change(
    table: Catalog, progress: Callable[[int, int], None] | None = None
) -> list[str]:
    """Seal and merge every region of an older spec, then record the current spec as
    ready (steps 2-4 of the module docs); the ids of the regions sealed now. A no-op
    when nothing is pending. Runs under the table's index lock, so concurrent callers
    (writers of the new spec claiming their regions) wait for one of them.
    ``progress(done, total)`` is called after each region of an older spec."""
    from memwal_query.maintain.merger import DEFAULT_BATCH_ROWS, DEFAULT_MAX_RETRIES, merge

    with index_lock(table.uri, table.io):
        table.refresh_index()
        if not table.spec_change_pending:
            return []
        spec = table.region_spec
        assert spec is not None  # pending implies specs
        current = spec.spec_id
        sealed = []
        older = []
        for region_id in sorted(table.region_ids()):
            m = table.region_manifest(region_id)
            if m is not None and m.region_spec_id != current:
                older.append((region_id, m))
        for done, (region_id, manifest) in enumerate(older, 1):
            if not manifest.sealed:
                manifest = _drain_and_seal(table, manifest)
                sealed.append(region_id)
            merge(table, region_id, None, DEFAULT_MAX_RETRIES, DEFAULT_BATCH_ROWS)
            last = max((g.generation for g in manifest.flushed_generations), default=0)
            if table.index().merged_generations().get(region_id, 0) < last:
                raise MergeFailedError(
                    table.uri,
                    {
                        region_id: RuntimeError(
                            f"generations up to {last} of spec {manifest.region_spec_id} "
                            f"left unmerged: the change to spec {current} is not complete"
                        )
                    },
                    [],
                )
            if progress is not None:
                progress(done, len(older))

        def ready(details: pb.MemWalIndexDetails) -> None:
            details.writer_config_defaults[SPEC_READY_KEY] = str(current)

        mwindex.update_details(table.io, table.uri, ready, table.storage_options)
        table.refresh_index()
        return sealed


def _drain_and_seal(table: Catalog, manifest: RegionManifest) -> RegionManifest:
    """Claim a region (fencing its writer), replay and flush its WAL, then seal it;
    the sealed manifest. Fenced meanwhile by a claim of a stale process (which refuses
    rows there, see the module docs): done again."""
    from memwal_query.write.writer import RegionWriter

    region_id = manifest.region_id
    store = RegionManifestStore(table.io, table.uri, region_id)
    for attempt in range(_DRAIN_ATTEMPTS):
        try:
            writer = RegionWriter(
                table,
                region_id,
                region_spec_id=manifest.region_spec_id,
                region_field_entries=manifest.region_field_entries,
            )
            try:
                writer.flush()
            finally:
                writer.close(flush=False)
            latest = store.load_latest()
            assert latest is not None
            if latest.writer_epoch != writer.epoch:
                raise FencedError(region_id, writer.epoch, latest.writer_epoch)
            sealed = latest.replace(
                version=latest.version + 1, writer_epoch=latest.writer_epoch + 1, sealed=True
            )
            if store.try_commit(sealed):
                return sealed
        except FencedError:
            if attempt == _DRAIN_ATTEMPTS - 1:
                raise
    raise FencedError(region_id, 0, None)
