"""One region field: a transform (or SQL expression) of source columns.

:class:`RegionField` validates its definition when built (binding its transform from
:mod:`memwal_query.regions.transforms`), evaluates region values of Arrow batches and
projects query predicates onto its region value for pruning.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from memwal_query.exceptions import RegionSpecError
from memwal_query.format._proto import memwal_pb2 as pb
from memwal_query.regions.arrowtypes import arrow_type_from_name, plain
from memwal_query.regions.expression import ExpressionTransform
from memwal_query.regions.predicates import OPS, Predicate
from memwal_query.regions.sources import Resolver, Source, column_of
from memwal_query.regions.transform import Transform
from memwal_query.regions.transforms import TEMPORAL_TRANSFORMS, bind_transform

__all__ = ["RegionField"]


@dataclass
class RegionField:
    """Defines one region field: how one region value derives from source columns.

    Parameters
    ----------
    field_id : str
        Unique identifier of the region field (also the name of its evaluated column).
    source_ids : list of int
        Lance field ids of the source columns (``col0``, ``col1``, ... in this order).
    transform : str, optional
        Well-known transform name (see :data:`TRANSFORMS`); exclusive with ``expression``.
    expression : str, optional
        DataFusion SQL expression over ``col0, col1, ...``; exclusive with ``transform``.
    result_type : str
        Arrow type name of the region value (see :func:`arrow_type_from_name`); required
        with ``expression``; ``""`` or ``"int32"`` for bucket, multi_bucket and date parts;
        optional (defaults to the source type) for identity and truncate.
    parameters : dict of str to str, optional
        Transform parameters: ``num_buckets`` (bucket, multi_bucket), ``width``
        (truncate). Others are kept but ignored.

    Raises
    ------
    RegionSpecError
        If the definition is invalid (the message names the field).
    """

    field_id: str
    source_ids: list[int]
    transform: str | None = None
    expression: str | None = None
    result_type: str = ""
    parameters: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        fid = self.field_id
        if not isinstance(fid, str) or not fid:
            raise RegionSpecError(f"region field id must be a non-empty string, got {fid!r}")
        if isinstance(self.source_ids, int | str | bytes) or not isinstance(
            self.source_ids, Sequence
        ):
            raise RegionSpecError(f"region field {fid!r}: source_ids must be a list of ints")
        ids = list(self.source_ids)
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int | np.integer) or not 0 <= i <= 2**31:
                raise RegionSpecError(f"region field {fid!r}: invalid source field id {i!r}")
        self.source_ids = [int(i) for i in ids]
        self.transform = self.transform or None
        self.expression = self.expression or None
        self.parameters = {str(k): str(v) for k, v in (self.parameters or {}).items()}
        self.result_type = self.result_type or ""
        if (self.transform is None) == (self.expression is None):
            raise RegionSpecError(
                f"region field {fid!r}: exactly one of transform and expression must be set"
            )
        try:
            declared = arrow_type_from_name(self.result_type) if self.result_type else None
        except RegionSpecError as e:
            raise RegionSpecError(f"region field {fid!r}: bad result_type: {e}") from e
        impl: Transform
        if self.expression is not None:
            impl = ExpressionTransform(fid, len(ids), self.expression, declared)
        else:
            t = self.transform
            if not isinstance(t, str):
                raise RegionSpecError(f"region field {fid!r}: transform must be a name, got {t!r}")
            impl = bind_transform(t, fid, len(ids), self.parameters, declared)
            if impl.fixed_type is not None and declared not in (None, impl.fixed_type):
                raise RegionSpecError(
                    f"region field {fid!r}: transform {t!r} yields {impl.fixed_type}, "
                    f"not result_type {self.result_type!r}"
                )
        self._impl = impl

    @property
    def impl(self) -> Transform:
        """The field's transform (or expression), bound to its parameters and type."""
        return self._impl

    # -- constructors ------------------------------------------------------------------
    @classmethod
    def identity(cls, field_id: str, source_id: int, result_type: str = "") -> RegionField:
        """Region value = the source value.

        Parameters
        ----------
        field_id : str
            Region field id.
        source_id : int
            Lance field id of the source column.
        result_type : str, optional
            Arrow type name to cast to; ``""`` keeps the source type.

        Returns
        -------
        RegionField
        """
        return cls(field_id, [source_id], transform="identity", result_type=result_type)

    @classmethod
    def bucket(cls, field_id: str, source_id: int, num_buckets: int) -> RegionField:
        """Region value = ``abs(murmur3(col0)) % num_buckets`` (int32).

        Parameters
        ----------
        field_id : str
            Region field id.
        source_id : int
            Lance field id of the source column.
        num_buckets : int
            Positive number of buckets.

        Returns
        -------
        RegionField
        """
        return cls(
            field_id,
            [source_id],
            transform="bucket",
            result_type="int32",
            parameters={"num_buckets": str(num_buckets)},
        )

    @classmethod
    def multi_bucket(
        cls, field_id: str, source_ids: Sequence[int], num_buckets: int
    ) -> RegionField:
        """Region value = ``abs(murmur3_multi(col0, col1, ...)) % num_buckets`` (int32).

        Parameters
        ----------
        field_id : str
            Region field id.
        source_ids : sequence of int
            Lance field ids of the source columns, in hashing order.
        num_buckets : int
            Positive number of buckets.

        Returns
        -------
        RegionField
        """
        return cls(
            field_id,
            list(source_ids),
            transform="multi_bucket",
            result_type="int32",
            parameters={"num_buckets": str(num_buckets)},
        )

    @classmethod
    def truncate(
        cls, field_id: str, source_id: int, width: int, result_type: str = ""
    ) -> RegionField:
        """Region value = ``left(col0, width)`` or ``col0 - (col0 % width)`` (floor).

        Parameters
        ----------
        field_id : str
            Region field id.
        source_id : int
            Lance field id of the source (string, binary or integer) column.
        width : int
            Positive width: characters, bytes or the integer step.
        result_type : str, optional
            Arrow type name to cast to; ``""`` keeps the source type.

        Returns
        -------
        RegionField
        """
        return cls(
            field_id,
            [source_id],
            transform="truncate",
            result_type=result_type,
            parameters={"width": str(width)},
        )

    @classmethod
    def temporal(cls, field_id: str, source_id: int, unit: str) -> RegionField:
        """Region value = ``date_part(unit, col0)`` (int32, UTC for time-zoned columns).

        Parameters
        ----------
        field_id : str
            Region field id.
        source_id : int
            Lance field id of the date or timestamp column.
        unit : {"year", "month", "day", "hour"}

        Returns
        -------
        RegionField
        """
        if unit not in TEMPORAL_TRANSFORMS:
            raise RegionSpecError(f"region field {field_id!r}: unknown date part {unit!r}")
        return cls(field_id, [source_id], transform=unit, result_type="int32")

    @classmethod
    def from_expression(
        cls, field_id: str, source_ids: Sequence[int], expression: str, result_type: str
    ) -> RegionField:
        """Region value = a DataFusion SQL ``expression`` over ``col0, col1, ...``.

        Parameters
        ----------
        field_id : str
            Region field id.
        source_ids : sequence of int
            Lance field ids; ``source_ids[i]`` is ``col{i}``.
        expression : str
            Deterministic, stateless DataFusion SQL expression, e.g. ``"col0 % 4"``.
        result_type : str
            Arrow type name the result is cast to.

        Returns
        -------
        RegionField
        """
        return cls(field_id, list(source_ids), expression=expression, result_type=result_type)

    # -- protobuf ----------------------------------------------------------------------
    def to_proto(self) -> pb.RegionField:
        """This field as a ``lance.table.RegionField`` protobuf message."""
        msg = pb.RegionField(
            field_id=self.field_id,
            source_ids=self.source_ids,
            result_type=self.result_type,
            parameters=self.parameters,
        )
        if self.transform is not None:
            msg.transform = self.transform
        if self.expression is not None:
            msg.expression = self.expression
        return msg

    @classmethod
    def from_proto(cls, msg: pb.RegionField) -> RegionField:
        """Build (and validate) a field from a ``lance.table.RegionField`` message."""
        return cls(
            field_id=msg.field_id,
            source_ids=list(msg.source_ids),
            transform=msg.transform if msg.HasField("transform") else None,
            expression=msg.expression if msg.HasField("expression") else None,
            result_type=msg.result_type,
            parameters=dict(msg.parameters),
        )

    # -- evaluation --------------------------------------------------------------------
    @property
    def declared_type(self) -> pa.DataType | None:
        """The Arrow type of the region value, when it does not depend on the source."""
        if self._impl.fixed_type is not None:
            return self._impl.fixed_type
        return arrow_type_from_name(self.result_type) if self.result_type else None

    def _compute(self, arrays: list[pa.Array], n: int) -> pa.Array:
        """The region values of rows whose source columns are ``arrays``."""
        return self._impl.apply(arrays, n)

    def _sources(self, resolver: Resolver) -> list[Source | None]:
        return [resolver.lookup(i) for i in self.source_ids]

    def _inputs(self, data: pa.RecordBatch | pa.Table, resolver: Resolver) -> list[pa.Array]:
        arrays = []
        for source in self._sources(resolver):
            col = None if source is None else column_of(data, source)
            if col is None:  # column removal resistance: read as NULL
                typ = source.type if source is not None and source.type is not None else None
                col = pa.nulls(data.num_rows, typ or pa.null())
            arrays.append(col)
        return arrays

    def evaluate(
        self, data: pa.RecordBatch | pa.Table | Sequence[pa.Array], schema: Any = None
    ) -> pa.Array:
        """Region values of every row.

        Parameters
        ----------
        data : pyarrow.RecordBatch, pyarrow.Table or sequence of pyarrow.Array
            Rows holding the source columns (resolved as in :meth:`RegionSpec.evaluate`),
            or directly the source columns ``[col0, col1, ...]`` (``schema`` unused).
        schema : LanceSchema, pyarrow.Schema or None
            See :meth:`RegionSpec.evaluate`.

        Returns
        -------
        pyarrow.Array
            The region values, of the field's result type.
        """
        if isinstance(data, pa.RecordBatch | pa.Table):
            return self._evaluate(data, Resolver(schema))
        arrays = [plain(a) for a in data]
        if len(arrays) != len(self.source_ids) or len({len(a) for a in arrays}) > 1:
            raise RegionSpecError(
                f"region field {self.field_id!r}: expected {len(self.source_ids)} source "
                "arrays of equal length"
            )
        return self._compute(arrays, len(arrays[0]) if arrays else 0)

    def _evaluate(self, data: pa.RecordBatch | pa.Table, resolver: Resolver) -> pa.Array:
        return self._compute(self._inputs(data, resolver), data.num_rows)

    # -- pruning -----------------------------------------------------------------------
    def project(self, predicates: Sequence[Predicate], schema: Any) -> list[Predicate]:
        """Project predicates on source columns to predicates on this region value.

        Inclusive projection (as PyIceberg's ``project``): every row matching
        ``predicates`` has a region value matching the result, so a region whose value
        fails it holds no matching row.

        Parameters
        ----------
        predicates : sequence of (column, op, value)
            ANDed simple predicates on source columns; ``op`` in ``= in < <= > >=``
            (``value`` is a list for ``in``). Other ops and columns are ignored.
        schema : LanceSchema or pyarrow.Schema
            Resolves ``source_ids`` to column names and types. With None nothing prunes.

        Returns
        -------
        list of (field_id, op, value)
            Predicates on the region value (``op`` in ``= in < <= > >=``); empty when
            nothing can be inferred.
        """
        if schema is None or not predicates:
            return []
        return self._project(predicates, Resolver(schema))

    def _project(self, predicates: Sequence[Predicate], resolver: Resolver) -> list[Predicate]:
        sources = self._sources(resolver)
        named = [s for s in sources if s is not None and s.name is not None]
        if not sources or len(named) != len(sources):
            return []  # unsharded: one region, nothing to prune
        by_column: dict[str, list[tuple[str, Any]]] = {}
        for pred in predicates:
            if not isinstance(pred, tuple | list) or len(pred) != 3:
                continue
            column, op, value = pred
            op = "=" if op == "==" else op
            if op in OPS:
                by_column.setdefault(column, []).append((op, value))
        return self._impl.project(by_column, named)
