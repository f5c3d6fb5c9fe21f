"""Checks of a region spec against the table it is recorded on (at ``initialize``).

- :func:`check_spec_sources`: every source field id exists, and the spec can evaluate
  rows of the table (:class:`RegionSpecError` otherwise).
- :func:`warn_non_key_sources`: a :class:`RegionSpecWarning` when the spec reads columns
  outside the primary key (each key must live in exactly one region).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from memwal_query.exceptions import RegionSpecError, RegionSpecWarning

if TYPE_CHECKING:
    from memwal_query.regions.spec import RegionSpec


def check_spec_sources(
    spec: RegionSpec, lance_schema: Any, uri: str, schema: pa.Schema | None = None
) -> None:
    """RegionSpecError unless every source field exists and (with ``schema``) the spec
    can evaluate rows of the table (e.g. truncate of a decimal column cannot)."""
    known = field_ids(lance_schema)
    for f in spec.fields:
        missing = [i for i in f.source_ids if i not in known]
        if missing:
            raise RegionSpecError(
                f"{uri}: region field {f.field_id!r} refers to unknown field id(s) {missing}"
            )
    if schema is not None:
        try:
            spec.evaluate(pa.RecordBatch.from_pylist([], schema=schema), schema)
        except RegionSpecError as e:
            raise RegionSpecError(f"{uri}: {e}") from e


def warn_non_key_sources(spec: RegionSpec, lance_schema: Any, pk: list[str], uri: str) -> None:
    """RegionSpecWarning when the spec reads columns outside the primary key.

    Every key must live in exactly one region (dedup and region pruning rely on it).
    A spec over primary-key columns guarantees it; one over other columns (e.g. a time
    range on ``ts`` with key ``id``) only if a key's value in them never changes.
    """
    names = field_names(lance_schema)
    outside = sorted({names[i] for f in spec.fields for i in f.source_ids if i in names} - set(pk))
    if outside:
        warnings.warn(
            f"{uri}: region spec {spec.spec_id} reads column(s) {outside} outside the "
            f"primary key {pk}. Each key must live in exactly one region, so a key's value "
            f"in {outside} must never change once written: an upsert that changes it puts "
            "the key in a second region, and reads may then return an older version or a "
            "row that no longer matches the filter. Include these column(s) in the primary "
            "key (e.g. key (id, ts) for time-range regions) or region on key columns.",
            RegionSpecWarning,
            stacklevel=3,
        )


def field_names(lance_schema: Any) -> dict[int, str]:
    out: dict[int, str] = {}
    stack = list(lance_schema.fields())
    while stack:
        f = stack.pop()
        out[f.id()] = f.name()
        stack.extend(f.children())
    return out


def field_ids(lance_schema: Any) -> set[int]:
    ids: set[int] = set()
    stack = list(lance_schema.fields())
    while stack:
        f = stack.pop()
        ids.add(f.id())
        stack.extend(f.children())
    return ids
