"""Region specs: how rows map to regions, evaluated on Arrow data, and region pruning.

A :class:`RegionSpec` (MemWAL spec, "Region Spec") is a list of :class:`RegionField`; each
field derives one *region value* from one or more source columns, named by their Lance
field ids (``source_ids``), either with a well-known *transform* or with a DataFusion SQL
*expression* over ``col0, col1, ...``. :meth:`RegionSpec.evaluate` computes the region
values of every row of a batch, vectorised; :meth:`RegionSpec.may_match` and
:meth:`RegionSpec.pruner` decide, from simple predicates on the *source* columns,
whether a region can hold matching rows (never False for a region that can). The
package layout and the pruning rules are in ``docs/regions.md``; every decision where
the spec is silent or contradicts itself (and the differences from pylance and Iceberg)
in ``docs/compatibility.md``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from memwal_query.exceptions import RegionSpecError
from memwal_query.format._proto import memwal_pb2 as pb
from memwal_query.regions.arrowtypes import arrow_type_from_name, arrow_type_name
from memwal_query.regions.expression import (
    EXPRESSION_FUNCTIONS,
    MAX_EXPRESSION_CHARS,
    MAX_REGION_VALUE_BYTES,
)
from memwal_query.regions.field import RegionField
from memwal_query.regions.murmur3 import (
    bucket_values,
    buckets,
    hash_column,
    murmur3_hash,
    murmur3_int64,
    murmur3_multi_hash,
)
from memwal_query.regions.predicates import (
    Lookups,
    Predicate,
    satisfies_projected,
    set_lookups,
)
from memwal_query.regions.sources import Resolver, field_id_of
from memwal_query.regions.transforms import TEMPORAL_TRANSFORMS, TRANSFORMS

__all__ = [
    "EXPRESSION_FUNCTIONS",
    "MAX_EXPRESSION_CHARS",
    "MAX_REGION_VALUE_BYTES",
    "TEMPORAL_TRANSFORMS",
    "TRANSFORMS",
    "Predicate",
    "RegionField",
    "RegionSpec",
    "arrow_type_from_name",
    "arrow_type_name",
    "bucket_spec",
    "bucket_values",
    "check_partial_sources",
    "expression_spec",
    "field_id_of",
    "hash_column",
    "identity_spec",
    "is_unsharded",
    "multi_bucket_spec",
    "murmur3_hash",
    "murmur3_int64",
    "murmur3_multi_hash",
    "temporal_spec",
    "truncate_spec",
    "unsharded_spec",
]

_buckets = buckets  # the name tests used before the split


@dataclass
class RegionSpec:
    """Specification of how rows divide into regions (a MemWAL region spec).

    Parameters
    ----------
    spec_id : int
        Positive id of the spec, unique within the MemWAL index, never reused.
    fields : list of RegionField
        Region fields, with unique ``field_id`` s; a region is one combination of values.

    Raises
    ------
    RegionSpecError
        If the spec id is not positive, there is no field, or field ids repeat.
    """

    spec_id: int
    fields: list[RegionField]

    def __post_init__(self) -> None:
        if isinstance(self.spec_id, bool) or not isinstance(self.spec_id, int | np.integer):
            raise RegionSpecError(f"region spec id must be an int, got {self.spec_id!r}")
        if not 0 < int(self.spec_id) < 2**32:
            raise RegionSpecError(f"region spec id must be positive, got {self.spec_id}")
        self.spec_id = int(self.spec_id)
        if isinstance(self.fields, RegionField) or not isinstance(self.fields, Sequence):
            raise RegionSpecError(f"region spec {self.spec_id}: fields must be a list")
        self.fields = list(self.fields)
        if not self.fields:
            raise RegionSpecError(f"region spec {self.spec_id} has no field")
        seen: set[str] = set()
        for f in self.fields:
            if not isinstance(f, RegionField):
                raise RegionSpecError(f"region spec {self.spec_id}: {f!r} is not a RegionField")
            if f.field_id in seen:
                raise RegionSpecError(
                    f"region spec {self.spec_id}: duplicate region field id {f.field_id!r}"
                )
            seen.add(f.field_id)

    def __getstate__(self) -> dict[str, Any]:
        # caches (projections holding schema objects) are not part of the value
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # -- constructors ------------------------------------------------------------------
    @classmethod
    def bucket(
        cls, source_id: int, num_buckets: int, *, field_id: str = "bucket", spec_id: int = 1
    ) -> RegionSpec:
        """A spec with one bucket field.

        Parameters
        ----------
        source_id : int
            Lance field id of the source column.
        num_buckets : int
            Positive number of buckets.
        field_id : str
            Region field id.
        spec_id : int
            Positive spec id.

        Returns
        -------
        RegionSpec
        """
        return cls(spec_id, [RegionField.bucket(field_id, source_id, num_buckets)])

    @classmethod
    def identity(
        cls, source_id: int, *, field_id: str, result_type: str = "", spec_id: int = 1
    ) -> RegionSpec:
        """A spec with one identity field.

        Parameters
        ----------
        source_id : int
            Lance field id of the source column.
        field_id : str
            Region field id.
        result_type : str, optional
            Arrow type name to cast to; ``""`` keeps the source type.
        spec_id : int
            Positive spec id.

        Returns
        -------
        RegionSpec
        """
        return cls(spec_id, [RegionField.identity(field_id, source_id, result_type)])

    # -- protobuf ----------------------------------------------------------------------
    def to_proto(self) -> pb.RegionSpec:
        """This spec as a ``lance.table.RegionSpec`` protobuf message."""
        return pb.RegionSpec(spec_id=self.spec_id, fields=[f.to_proto() for f in self.fields])

    @classmethod
    def from_proto(cls, msg: pb.RegionSpec) -> RegionSpec:
        """Build (and validate) a spec from a ``lance.table.RegionSpec`` message."""
        return cls(spec_id=msg.spec_id, fields=[RegionField.from_proto(f) for f in msg.fields])

    # -- evaluation --------------------------------------------------------------------
    @property
    def field_ids(self) -> list[str]:
        """The region field ids, in order."""
        return [f.field_id for f in self.fields]

    def evaluate(self, batch: pa.RecordBatch | pa.Table, schema: Any = None) -> pa.RecordBatch:
        """Region values of every row.

        Parameters
        ----------
        batch : pyarrow.RecordBatch or pyarrow.Table
            Rows holding the source columns (others are ignored).
        schema : LanceSchema, pyarrow.Schema or None
            Resolves the ``source_ids``: a ``lance.schema.LanceSchema`` (or a
            ``LanceDataset``), a ``pyarrow.Schema`` whose fields carry ``lance:field_id``
            metadata (without any such metadata, fields are numbered depth-first from 0,
            as Lance numbers a new dataset's fields: the column position for a flat
            schema), or None, in which case a field id is a top-level column position of
            ``batch``. Columns are then looked up in ``batch`` by name (``a.b`` for a
            struct child). A field id not in the schema or a column not in the batch
            reads as NULL.

        Returns
        -------
        pyarrow.RecordBatch
            One column per region field, named by its ``field_id``, of its result type.

        Raises
        ------
        RegionSpecError
            If a transform does not apply to a column type, an expression fails, or a
            value does not fit the declared result type.
        """
        if not isinstance(batch, pa.RecordBatch | pa.Table):
            raise RegionSpecError(f"expected a pyarrow RecordBatch or Table, got {type(batch)}")
        resolver = Resolver(schema)
        arrays = [f._evaluate(batch, resolver) for f in self.fields]
        schema_out = pa.schema([pa.field(f.field_id, a.type) for f, a in zip(self.fields, arrays)])
        return pa.RecordBatch.from_arrays(arrays, schema=schema_out)

    def source_columns(self, schema: Any) -> dict[str, list[str]]:
        """Source column names of every field.

        Parameters
        ----------
        schema : LanceSchema, pyarrow.Schema or None
            As for :meth:`evaluate` (None gives ``#id`` names).

        Returns
        -------
        dict of str to list of str
            ``{field_id: [column name, ...]}``; ``#id`` for an id not in ``schema``.
        """
        resolver = Resolver(schema)
        out = {}
        for f in self.fields:
            sources = f._sources(resolver)
            out[f.field_id] = [
                s.name if s is not None and s.name is not None else f"#{i}"
                for s, i in zip(sources, f.source_ids)
            ]
        return out

    def describe(self, schema: Any = None) -> str:
        """The spec as a person reads it: ``bucket(id, 4)``, ``identity(day)``, ...

        Parameters
        ----------
        schema : LanceSchema, pyarrow.Schema or None
            Names the source columns (as for :meth:`source_columns`).

        Returns
        -------
        str
            One ``transform(columns, parameters)`` per field, comma-separated; an
            expression field reads ``expr AS type`` with its ``colN`` names resolved;
            the one-region spec reads ``one region``.
        """
        if is_unsharded(self):
            return "one region"
        columns = self.source_columns(schema)
        parts = []
        for f in self.fields:
            names = columns[f.field_id]
            if f.expression is not None:
                text = f.expression
                for i in reversed(range(len(names))):  # col10 before col1
                    text = text.replace(f"col{i}", names[i])
                parts.append(f"({text}) AS {f.result_type}")
                continue
            args = [*names, *f.parameters.values()]
            parts.append(f"{f.transform}({', '.join(args)})")
        return ", ".join(parts)

    # -- pruning -----------------------------------------------------------------------
    def project(self, predicates: Sequence[Predicate], schema: Any) -> list[Predicate]:
        """Predicates on region values implied by ``predicates`` on source columns.

        See :meth:`RegionField.project`; the result concatenates every field's.
        """
        if schema is None or not predicates:
            return []
        resolver = Resolver(schema)
        return [p for f in self.fields for p in f._project(predicates, resolver)]

    def pruner(
        self, predicates: Sequence[Predicate], schema: Any
    ) -> Callable[[Mapping[str, Any]], bool]:
        """A reusable :meth:`may_match` for many regions (projects the predicates once).

        Parameters
        ----------
        predicates : sequence of (column, op, value)
            As for :meth:`may_match`.
        schema : LanceSchema or pyarrow.Schema
            As for :meth:`may_match`.

        Returns
        -------
        callable
            ``pruner(region_values) -> bool``.
        """
        projected, lookups = self._projected(predicates, schema)
        return functools.partial(satisfies_projected, projected=projected, lookups=lookups)

    def _projected(
        self, predicates: Sequence[Predicate], schema: Any
    ) -> tuple[list[Predicate], Lookups | None]:
        """:meth:`project` of ``predicates`` and its :func:`set_lookups`, kept for the
        16 most recent predicates (pruning many regions projects them once)."""
        if schema is None or not predicates:
            return [], None
        cache: dict[tuple[str, str, int], tuple[Any, list[Predicate], Lookups | None]]
        cache = self.__dict__.setdefault("_projections", {})
        key = (repr(self.fields), repr(list(predicates)), id(schema))
        hit = cache.get(key)
        if hit is None or hit[0] is not schema:
            projected = self.project(predicates, schema)
            hit = (schema, projected, set_lookups(projected))
            cache[key] = hit  # holding the schema keeps its id() unique while cached
            try:
                while len(cache) > 16:
                    cache.pop(next(iter(cache)))
            except (KeyError, RuntimeError, StopIteration):  # a concurrent trim
                pass
        return hit[1], hit[2]

    def may_match(
        self,
        region_values: Mapping[str, Any],
        predicates: Sequence[Predicate],
        schema: Any = None,
    ) -> bool:
        """Whether a region with these values can hold rows matching ``predicates``.

        Parameters
        ----------
        region_values : mapping of field_id to value
            The region's values (Python scalars, as :meth:`evaluate` ``.as_py()``).
        predicates : sequence of (column, op, value)
            ANDed predicates on source columns by name; ``op`` in ``= in < <= > >=``.
        schema : LanceSchema or pyarrow.Schema
            Resolves source field ids to column names and types; None never prunes.

        Returns
        -------
        bool
            False only when no row of the region can match. Unknown columns, ops or
            values, missing or NULL region values always give True.

        Examples
        --------
        With ``bucket(user_id, 10)``, ``user_id = 123`` only matches bucket 4::

            spec.may_match({"bucket": 4}, [("user_id", "=", 123)], schema)  # True
            spec.may_match({"bucket": 5}, [("user_id", "=", 123)], schema)  # False
        """
        if schema is None or not predicates:
            return True
        projected, lookups = self._projected(predicates, schema)
        return satisfies_projected(region_values, projected, lookups)


# -- specs from column names -----------------------------------------------------------------
def _result_type_of(schema: Any, field_id: int) -> str:
    """The source's type name for result_type, or "" (= the source's type) when the name
    is not a plain pyarrow alias (time-zoned timestamps, decimals...)."""
    source = Resolver(schema).lookup(field_id)
    if source is None or source.type is None:
        return ""
    try:
        name = arrow_type_name(source.type)
        return name if pa.type_for_alias(name) == source.type else ""
    except (RegionSpecError, ValueError, KeyError):
        return ""


def bucket_spec(
    schema: Any, column: str, num_buckets: int, spec_id: int = 1, field_id: str = "bucket"
) -> RegionSpec:
    """A spec with one ``bucket(column, num_buckets)`` field.

    Parameters
    ----------
    schema : LanceSchema, LanceDataset or pyarrow.Schema (ids as in RegionSpec.evaluate)
        Resolves ``column`` to its field id.
    column : str
        Source column (``a.b`` for a struct child).
    num_buckets : int
        Positive number of buckets.
    spec_id : int
        Positive spec id.
    field_id : str
        Region field id (Lance's own bucket specs use ``"bucket"``).

    Returns
    -------
    RegionSpec
    """
    return RegionSpec(
        spec_id, [RegionField.bucket(field_id, field_id_of(schema, column), num_buckets)]
    )


def multi_bucket_spec(
    schema: Any,
    columns: Sequence[str],
    num_buckets: int,
    spec_id: int = 1,
    field_id: str = "bucket",
) -> RegionSpec:
    """A spec with one ``multi_bucket(columns..., num_buckets)`` field.

    Parameters
    ----------
    schema : LanceSchema, LanceDataset or pyarrow.Schema (ids as in RegionSpec.evaluate)
    columns : sequence of str
        Source columns, in hashing order.
    num_buckets : int
        Positive number of buckets.
    spec_id : int
        Positive spec id.
    field_id : str
        Region field id.

    Returns
    -------
    RegionSpec
    """
    ids = [field_id_of(schema, c) for c in columns]
    return RegionSpec(spec_id, [RegionField.multi_bucket(field_id, ids, num_buckets)])


def identity_spec(
    schema: Any, column: str, spec_id: int = 1, field_id: str | None = None
) -> RegionSpec:
    """A spec with one ``identity(column)`` field, typed as the column.

    Parameters
    ----------
    schema : LanceSchema, LanceDataset or pyarrow.Schema (ids as in RegionSpec.evaluate)
    column : str
        Source column.
    spec_id : int
        Positive spec id.
    field_id : str, optional
        Region field id; defaults to the column name.

    Returns
    -------
    RegionSpec
    """
    fid = field_id_of(schema, column)
    result_type = _result_type_of(schema, fid)
    return RegionSpec(spec_id, [RegionField.identity(field_id or column, fid, result_type)])


def truncate_spec(
    schema: Any, column: str, width: int, spec_id: int = 1, field_id: str | None = None
) -> RegionSpec:
    """A spec with one ``truncate(column, width)`` field, typed as the column.

    Parameters
    ----------
    schema : LanceSchema, LanceDataset or pyarrow.Schema (ids as in RegionSpec.evaluate)
    column : str
        Source (string, binary or integer) column.
    width : int
        Positive width.
    spec_id : int
        Positive spec id.
    field_id : str, optional
        Region field id; defaults to ``{column}_trunc``.

    Returns
    -------
    RegionSpec
    """
    fid = field_id_of(schema, column)
    result_type = _result_type_of(schema, fid)
    if result_type in ("int8", "int16"):  # promoted, as Iceberg (see TruncateTransform)
        result_type = "int32"
    field_ = RegionField.truncate(field_id or f"{column}_trunc", fid, width, result_type)
    return RegionSpec(spec_id, [field_])


def temporal_spec(
    schema: Any, column: str, unit: str, spec_id: int = 1, field_id: str | None = None
) -> RegionSpec:
    """A spec with one ``year|month|day|hour(column)`` field (int32).

    Parameters
    ----------
    schema : LanceSchema, LanceDataset or pyarrow.Schema (ids as in RegionSpec.evaluate)
    column : str
        Source date or timestamp column.
    unit : {"year", "month", "day", "hour"}
    spec_id : int
        Positive spec id.
    field_id : str, optional
        Region field id; defaults to ``{column}_{unit}``.

    Returns
    -------
    RegionSpec
    """
    fid = field_id_of(schema, column)
    return RegionSpec(spec_id, [RegionField.temporal(field_id or f"{column}_{unit}", fid, unit)])


def expression_spec(
    schema: Any,
    columns: Sequence[str],
    sql: str,
    result_type: str,
    spec_id: int = 1,
    field_id: str = "expr",
) -> RegionSpec:
    """A spec with one expression field: ``sql`` over ``col0..`` = ``columns`` in order.

    Parameters
    ----------
    schema : LanceSchema, LanceDataset or pyarrow.Schema (ids as in RegionSpec.evaluate)
    columns : sequence of str
        Source columns; ``columns[i]`` is ``col{i}`` in ``sql``.
    sql : str
        DataFusion SQL expression, e.g. ``"col0 % 4"``.
    result_type : str
        Arrow type name of the region value.
    spec_id : int
        Positive spec id.
    field_id : str
        Region field id.

    Returns
    -------
    RegionSpec
    """
    if isinstance(columns, str):
        columns = [columns]
    ids = [field_id_of(schema, c) for c in columns]
    return RegionSpec(spec_id, [RegionField.from_expression(field_id, ids, sql, result_type)])


def unsharded_spec(spec_id: int = 1, field_id: str = "bucket") -> RegionSpec:
    """The one-region spec: every row in region ``{field_id: 0}``.

    The default of :meth:`MemWalTable.initialize` when no spec is given, and what
    pylance's ``initialize_mem_wal(unsharded=True)`` records (spec id 1, field
    ``"bucket"``, transform ``unsharded``, result ``int32``), so either library routes
    every key of such a table to the same single region.

    Parameters
    ----------
    spec_id : int
    field_id : str
        The region field's id.

    Returns
    -------
    RegionSpec
    """
    return RegionSpec(
        spec_id,
        [RegionField(field_id=field_id, source_ids=[], transform="unsharded", result_type="int32")],
    )


def is_unsharded(spec: RegionSpec) -> bool:
    """Whether ``spec`` puts every row in one region (only ``unsharded`` fields)."""
    return all(f.transform == "unsharded" for f in spec.fields)


def check_partial_sources(spec: RegionSpec, missing: Sequence[str], schema: Any) -> None:
    """SchemaError when a partial update lacks a column the region spec reads: the
    rows' region could not be computed (and a key must never change region)."""
    if not missing:
        return
    needed = {
        name.split(".")[0] for names in spec.source_columns(schema).values() for name in names
    }
    lacking = sorted(needed & set(missing))
    if lacking:
        from memwal_query.exceptions import SchemaError

        raise SchemaError(
            f"a partial update must give the column(s) {lacking} that region spec "
            f"{spec.spec_id} reads: without them the rows' region is unknown"
        )
