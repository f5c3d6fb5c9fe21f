"""Opening a region's writer: choosing the region, its spec and values, then claiming it.

:class:`WriterOpener` is what :meth:`memwal_query.table.MemWalTable.writer` and the
routed writers of :mod:`memwal_query.write.routing` call: it resolves which region a
writer writes (from region values, a region id, or the one region of an unsharded spec),
under which spec, and whether the region is one the current spec owns (new rows) or only
a recovery claim (replay, flush and close). The dependencies it needs from layers above
(the partial-update lookup, completing a pending spec change) are given to it as typed
callables (:class:`PartialLookup`, :class:`SpecChangeCompleter`), so the write layer
never calls up.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Protocol

from memwal_query.catalog import one_region
from memwal_query.exceptions import RegionSpecError, SpecChangedError
from memwal_query.storage import paths
from memwal_query.write.liveness import DEFAULT_HEARTBEAT_INTERVAL
from memwal_query.write.writer import RegionWriter
from memwal_query.write.writer_state import (
    DEFAULT_MAX_MEMTABLE_AGE,
    DEFAULT_MAX_MEMTABLE_BYTES,
    DEFAULT_MAX_MEMTABLE_ROWS,
    DEFAULT_MAX_UNFLUSHED_MEMTABLES,
    DEFAULT_MAX_WAL_BUFFER_BYTES,
    DEFAULT_MAX_WAL_ENTRIES,
    DEFAULT_WAL_FLUSH_INTERVAL,
    DictionaryValues,
    PartialLookup,
)

if TYPE_CHECKING:
    from memwal_query.catalog import Catalog

__all__ = ["PartialLookup", "SpecChangeCompleter", "WriterOpener", "WriterOptions"]


class SpecChangeCompleter(Protocol):
    """Seals and merges the regions of older specs when the current spec replaced them
    (:func:`memwal_query.maintain.specs.complete_spec_change`): run before a writer of
    the current spec claims its region."""

    def __call__(self, catalog: Catalog) -> object: ...


@dataclasses.dataclass(frozen=True)
class WriterOptions:
    """The options of a :class:`~memwal_query.write.writer.RegionWriter` (see there for
    each one's meaning); the defaults are the writer's."""

    durable: bool = True
    max_memtable_rows: int = DEFAULT_MAX_MEMTABLE_ROWS
    max_memtable_bytes: int = DEFAULT_MAX_MEMTABLE_BYTES
    max_wal_buffer_bytes: int = DEFAULT_MAX_WAL_BUFFER_BYTES
    wal_flush_interval: float = DEFAULT_WAL_FLUSH_INTERVAL
    max_unflushed_memtables: int = DEFAULT_MAX_UNFLUSHED_MEMTABLES
    backpressure_timeout: float | None = None
    max_wal_entries: int = DEFAULT_MAX_WAL_ENTRIES
    max_memtable_age: float = DEFAULT_MAX_MEMTABLE_AGE
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL

    def as_kwargs(self) -> dict[str, Any]:
        """The options as keyword arguments of ``RegionWriter``."""
        return dataclasses.asdict(self)


class WriterOpener:
    """Opens the writers of one table.

    Parameters
    ----------
    catalog : Catalog
        The table.
    lookup : PartialLookup, optional
        Current rows for partial updates; None: writers refuse partial updates.
    complete_spec_change : SpecChangeCompleter, optional
        Run before claiming a region of the current spec while a spec change is
        pending; None: a pending change is left to whoever completes it.
    dictionary_values : DictionaryValues, optional
        The table's values of its dictionary columns of 8- or 16-bit indices, which a
        writer's new values must fit with; None: a writer counts only its own rows.
    """

    def __init__(
        self,
        catalog: Catalog,
        *,
        lookup: PartialLookup | None = None,
        complete_spec_change: SpecChangeCompleter | None = None,
        dictionary_values: DictionaryValues | None = None,
    ) -> None:
        self.catalog = catalog
        self.dictionary_values = dictionary_values
        self.lookup = lookup
        self.complete_spec_change = complete_spec_change

    def open(
        self,
        region_id: str | None = None,
        *,
        region_values: dict[str, Any] | None = None,
        spec_id: int | None = None,
        options: WriterOptions | None = None,
    ) -> RegionWriter:
        """Claim a region and return its writer (fencing any previous writer).

        Parameters and errors are those of
        :meth:`memwal_query.table.MemWalTable.writer`; ``options`` default to
        :class:`WriterOptions`'s.

        Raises
        ------
        RegionSpecError, LeftoverRegionsError, SpecChangedError
        """
        from memwal_query.regions.spec import is_unsharded

        cat = self.catalog
        cat.refresh_index()
        spec = cat.routing_spec()
        if spec_id is not None and spec_id != spec.spec_id:
            raise SpecChangedError(cat.uri, spec_id, spec.spec_id)
        entries: tuple[tuple[str, bytes], ...]
        if region_values is None and region_id is None:
            if not is_unsharded(spec):
                raise RegionSpecError(
                    f"{cat.uri}: region spec {spec.spec_id} has several regions; pass "
                    "region_values (or use MemWalTable.write to route rows)"
                )
            region_values = one_region(spec)
        if region_values is None:
            assert region_id is not None
            region_id = paths.validate_region_id(region_id)
            known = cat.region_values(region_id)
            if known is not None and known[0] == spec.spec_id:
                spec_id, region_values = known
                entries = cat.field_entries(region_values)
            elif cat.region_manifest(region_id) is not None:
                spec_id, entries = 0, ()  # not the spec's: recovery only (rows refused)
            elif is_unsharded(spec) and region_id == cat.region_id_for(one_region(spec)):
                spec_id, region_values = spec.spec_id, one_region(spec)
                entries = cat.field_entries(region_values)
            else:
                raise RegionSpecError(
                    f"{cat.uri}: there is no region {region_id}; regions are created "
                    "from the region spec (pass region_values, or use MemWalTable.write)"
                )
        else:
            derived = cat.region_id_for(region_values)
            if region_id is not None and paths.validate_region_id(region_id) != derived:
                raise RegionSpecError(
                    f"region {region_id} is not the region of values {region_values} ({derived})"
                )
            region_id = derived
            spec_id = spec.spec_id
            entries = cat.field_entries(region_values)
        if (
            spec_id == spec.spec_id
            and cat.spec_change_pending
            and self.complete_spec_change is not None
        ):
            self.complete_spec_change(cat)
        return RegionWriter(
            cat,
            region_id,
            region_values=region_values,
            region_spec_id=spec_id,
            region_field_entries=entries,
            lookup=self.lookup,
            dictionary_values=self.dictionary_values,
            **(options or WriterOptions()).as_kwargs(),
        )
