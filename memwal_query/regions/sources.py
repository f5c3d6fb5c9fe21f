"""Source columns of region fields: Lance field ids resolved to columns of a batch.

A region field names its source columns by Lance field id. :class:`Resolver` maps ids to
column paths and types from a ``LanceSchema`` / ``LanceDataset``, a ``pyarrow.Schema``
(``lance:field_id`` metadata, or depth-first numbering as Lance gives a new dataset), or
no schema (an id is then a top-level column position). An id or column that cannot be
found reads as NULL (the spec's column-removal resistance).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from memwal_query.exceptions import RegionSpecError

__all__ = ["Resolver", "Source", "column_of", "field_id_of"]


@dataclass(frozen=True)
class Source:
    """Where a source field lives: a name path (schema given) or a column index."""

    path: tuple[str, ...] | None
    index: int | None
    type: pa.DataType | None

    @property
    def name(self) -> str | None:
        return None if self.path is None else ".".join(self.path)


class Resolver:
    """Field ids of a LanceSchema / LanceDataset / pa.Schema (see RegionSpec.evaluate)."""

    def __init__(self, schema: Any) -> None:
        self.by_id: dict[int, tuple[tuple[str, ...], Any]] = {}
        self.schema = schema
        if schema is None:
            return
        if hasattr(schema, "lance_schema") and not isinstance(schema, pa.Schema):
            schema = schema.lance_schema
        if isinstance(schema, pa.Schema):
            self._walk_arrow(list(schema), ())
            if not self.by_id:  # no metadata: the ids Lance gives a new dataset
                self._number_arrow(list(schema), (), [0])
        elif hasattr(schema, "fields"):
            stack: list[tuple[tuple[str, ...], Any]] = [((), f) for f in schema.fields()]
            while stack:
                parent, f = stack.pop()
                path = (*parent, f.name())
                self.by_id[int(f.id())] = (path, f)
                stack.extend((path, c) for c in f.children())
        else:
            raise RegionSpecError(
                f"schema must be a LanceSchema, a pyarrow.Schema or None, got {type(schema)}"
            )

    def _walk_arrow(self, fields: list[pa.Field], parent: tuple[str, ...]) -> None:
        for f in fields:
            path = (*parent, f.name)
            meta = f.metadata or {}
            raw = meta.get(b"lance:field_id", meta.get("lance:field_id"))
            if raw is not None:
                try:
                    self.by_id[int(raw)] = (path, f)
                except ValueError as e:
                    raise RegionSpecError(f"field {f.name!r}: bad lance:field_id {raw!r}") from e
            if pa.types.is_struct(f.type):
                self._walk_arrow([f.type.field(i) for i in range(f.type.num_fields)], path)

    def _number_arrow(self, fields: list[pa.Field], parent: tuple[str, ...], n: list[int]) -> None:
        for f in fields:  # depth-first pre-order, as Lance assigns ids to a new schema
            path = (*parent, f.name)
            self.by_id[n[0]] = (path, f)
            n[0] += 1
            if pa.types.is_struct(f.type):
                self._number_arrow([f.type.field(i) for i in range(f.type.num_fields)], path, n)

    def lookup(self, field_id: int) -> Source | None:
        if self.schema is None:
            return Source(path=None, index=field_id, type=None)
        hit = self.by_id.get(field_id)
        if hit is None:
            return None
        path, f = hit
        typ = f.type if isinstance(f, pa.Field) else f.to_arrow().type
        return Source(path=path, index=None, type=typ)

    def id_of(self, column: str) -> int:
        for fid, (path, _) in self.by_id.items():
            if ".".join(path) == column:
                return fid
        raise RegionSpecError(f"column {column!r} is not in the schema")


def column_of(data: pa.RecordBatch | pa.Table, source: Source) -> pa.Array | None:
    """The column of ``data`` a source names, or None when it is absent."""
    if source.index is not None:
        if not 0 <= source.index < data.num_columns:
            return None
        col = data.column(source.index)
    elif source.path is None:
        return None
    else:
        i = data.schema.get_field_index(source.path[0])
        if i < 0:
            return None
        col = data.column(i)
        for name in source.path[1:]:
            if isinstance(col, pa.ChunkedArray):
                col = col.combine_chunks()
            if not pa.types.is_struct(col.type):
                return None
            j = col.type.get_field_index(name)
            if j < 0:
                return None
            col = pc.struct_field(col, [j])
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    return col


def field_id_of(schema: Any, column: str) -> int:
    """Lance field id of ``column`` (``a.b`` for a struct child).

    Parameters
    ----------
    schema : LanceSchema, LanceDataset or pyarrow.Schema (ids as in RegionSpec.evaluate)
    column : str

    Returns
    -------
    int

    Raises
    ------
    RegionSpecError
        If the column is not in the schema.
    """
    if schema is None:
        raise RegionSpecError("a schema is needed to resolve column names")
    return Resolver(schema).id_of(column)
