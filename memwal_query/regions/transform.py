"""The base class of region transforms (modelled on PyIceberg's ``transforms.py``).

A :class:`Transform` is bound to one region field: its id (named in every error), its
parameters (validated when the transform is built) and its declared result type. Every
transform offers

* :meth:`Transform.can_transform` - whether a source column type is accepted;
* :meth:`Transform.result_type` - the Arrow type of the region value for a source type;
* ``transform`` - the region values of Arrow arrays, vectorised (pyarrow.compute, numpy;
  no per-row Python), :meth:`Transform.apply` adding the cast to the declared type;
* :meth:`Transform.project` - PyIceberg's *inclusive projection*: predicates on the
  source columns turned into predicates on the region value that every matching row's
  region value satisfies (region pruning).

Single-source transforms derive from :class:`SingleSourceTransform`; transforms of
several columns (``multi_bucket``, SQL expressions) from :class:`MultiSourceTransform`,
which prunes only when every source column is pinned by ``=`` / ``in``. The registry of
transform names lives in :mod:`memwal_query.regions.transforms`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa

from memwal_query.exceptions import RegionSpecError
from memwal_query.regions.arrowtypes import cast_result
from memwal_query.regions.murmur3 import INT32_MAX
from memwal_query.regions.predicates import Predicate, equality_values, to_source_array
from memwal_query.regions.sources import Source

__all__ = [
    "ColumnPredicates",
    "MultiSourceTransform",
    "SingleSourceTransform",
    "Transform",
    "positive_int_param",
]

ColumnPredicates = Mapping[str, list[tuple[str, Any]]]
"""``{column name: [(op, value), ...]}``: the ANDed simple predicates of a query."""
MAX_COMBINATIONS = 1024  # pruning of multi-column fields: at most this many value tuples


def positive_int_param(field_id: str, parameters: Mapping[str, str], name: str) -> int:
    """The positive int32 parameter ``name`` (RegionSpecError naming the field if not)."""
    raw = parameters.get(name)
    if raw is None:
        raise RegionSpecError(f"region field {field_id!r}: missing parameter {name!r}")
    text = str(raw).strip()
    if not text.isdigit() or not 0 < int(text) <= INT32_MAX:
        raise RegionSpecError(
            f"region field {field_id!r}: parameter {name!r} must be a positive int32, got {raw!r}"
        )
    return int(text)


class Transform(ABC):
    """A region transform bound to one region field.

    Parameters
    ----------
    field_id : str
        The region field's id (named in errors).
    num_sources : int
        Number of source columns of the field (checked against the transform's arity).
    parameters : mapping of str to str
        The field's parameters (``num_buckets``, ``width``...), validated here.
    declared : pyarrow.DataType or None
        The field's declared result type; the transform's values are cast to it.

    Raises
    ------
    RegionSpecError
        If the number of sources or a parameter is invalid.
    """

    name: ClassVar[str] = ""
    """The transform's name in the spec (``RegionField.transform`` in the proto)."""
    fixed_type: ClassVar[pa.DataType | None] = None
    """The result type when it does not depend on the source (int32 for hash, date-part
    and unsharded transforms)."""
    int_params: ClassVar[tuple[str, ...]] = ()
    """Required positive int32 parameters (``num_buckets``, ``width``), in :attr:`ints`."""

    def __init__(
        self,
        field_id: str,
        num_sources: int,
        parameters: Mapping[str, str],
        declared: pa.DataType | None,
    ) -> None:
        self.field_id = field_id
        self.parameters = dict(parameters)
        self.declared = declared
        self.check_sources(num_sources)
        self.ints = {p: positive_int_param(field_id, self.parameters, p) for p in self.int_params}

    def check_sources(self, num_sources: int) -> None:
        """RegionSpecError unless the transform takes ``num_sources`` source columns."""
        if num_sources != 1:
            raise RegionSpecError(
                f"region field {self.field_id!r}: transform {self.name!r} takes exactly one "
                f"source, got {num_sources}"
            )

    @abstractmethod
    def can_transform(self, source_type: pa.DataType) -> bool:
        """Whether a source column of this Arrow type is accepted."""

    def result_type(self, source_type: pa.DataType) -> pa.DataType:
        """The Arrow type of the region value for a source of ``source_type``.

        The declared type when the field has one, else the fixed type of the transform,
        else the type its values have for that source.
        """
        if self.declared is not None:
            return self.declared
        if self.fixed_type is not None:
            return self.fixed_type
        return self.natural_type(source_type)

    def natural_type(self, source_type: pa.DataType) -> pa.DataType:
        """The type of the transform's values before any declared cast."""
        return source_type

    @abstractmethod
    def transform_columns(self, arrays: Sequence[pa.Array], n: int) -> pa.Array:
        """The region values of ``n`` rows whose source columns are ``arrays``."""

    def apply(self, arrays: Sequence[pa.Array], n: int) -> pa.Array:
        """:meth:`transform_columns` cast to the declared result type."""
        out = self.transform_columns(arrays, n)
        if self.declared is not None:
            out = cast_result(out, self.declared, self.field_id)
        return out

    def map_values(self, values: list[Any], sources: Sequence[Source]) -> list[Any] | None:
        """The region values of Python value tuples (``values`` of the single source), or
        None when they do not convert losslessly to the source type or fail."""
        arr = to_source_array(values, sources[0].type)
        if arr is None:
            return None
        try:
            return list(self.apply([arr], len(arr)).to_pylist())
        except (RegionSpecError, pa.ArrowException):
            return None

    @abstractmethod
    def project(self, by_column: ColumnPredicates, sources: Sequence[Source]) -> list[Predicate]:
        """Predicates on the region value implied by ``by_column`` (inclusive projection).

        Parameters
        ----------
        by_column : mapping of column name to list of (op, value)
            ANDed predicates, ``op`` in ``= in < <= > >=``.
        sources : sequence of Source
            The field's resolved source columns (all with a name).

        Returns
        -------
        list of (field_id, op, value)
            Empty when nothing can be inferred.
        """


class SingleSourceTransform(Transform):
    """A transform of one source column: implement :meth:`transform` (and, for range
    pruning, :meth:`project_range` / :meth:`project_ranges`)."""

    @abstractmethod
    def transform(self, array: pa.Array) -> pa.Array:
        """The region values of one source array (vectorised; NULL stays NULL)."""

    def transform_columns(self, arrays: Sequence[pa.Array], n: int) -> pa.Array:
        """See :meth:`Transform.transform_columns`."""
        return self.transform(arrays[0])

    def project(self, by_column: ColumnPredicates, sources: Sequence[Source]) -> list[Predicate]:
        """``=``/``in`` map each value through the transform; ranges per
        :meth:`project_range` and :meth:`project_ranges`."""
        source = sources[0]
        fid = self.field_id
        out: list[Predicate] = []
        ranges: list[tuple[str, Any]] = []
        for op, value in by_column.get(source.name or "", []):
            if op in ("=", "in"):
                values = equality_values(op, value)
                if values is None:
                    continue
                if not values:
                    if op == "in":
                        out.append((fid, "in", []))
                    continue
                mapped = self.map_values(values, sources)
                if mapped is not None:
                    out.append((fid, "in", [m for m in mapped if m is not None]))
                continue
            if value is None:
                continue
            ranges.append((op, value))
            out.extend(self.project_range(op, value, source))
        if ranges:
            out.extend(self.project_ranges(ranges, source))
        return out

    def project_range(self, op: str, value: Any, source: Source) -> list[Predicate]:
        """Predicates implied by ``column op value`` (``op`` in ``< <= > >=``); none by
        default (a transform that is not monotone, such as bucket)."""
        return []

    def project_ranges(self, ranges: list[tuple[str, Any]], source: Source) -> list[Predicate]:
        """Predicates implied by all range predicates together; none by default."""
        return []

    def project_monotone(self, op: str, value: Any, source: Source) -> list[Predicate]:
        """For a monotone non-decreasing transform: ``col >= v`` / ``col > v`` give
        ``region >= t(v)``, ``col <= v`` / ``col < v`` give ``region <= t(v)``."""
        mapped = self.map_values([value], [source])
        if mapped is None or mapped[0] is None:
            return []
        return [(self.field_id, ">=" if op in (">", ">=") else "<=", mapped[0])]


class MultiSourceTransform(Transform):
    """A transform of one or more source columns; prunes only with every source pinned by
    ``=``/``in`` (at most :data:`MAX_COMBINATIONS` value tuples, evaluated like rows)."""

    def project(self, by_column: ColumnPredicates, sources: Sequence[Source]) -> list[Predicate]:
        """See :class:`MultiSourceTransform`."""
        choices: list[pa.Array] = []
        for source in sources:
            best: pa.Array | None = None
            for op, value in by_column.get(source.name or "", []):
                values = equality_values(op, value)
                if values is None:
                    continue
                if not values:
                    return [(self.field_id, "in", [])]
                arr = to_source_array(values, source.type)
                if arr is not None and (best is None or len(arr) < len(best)):
                    best = arr
            if best is None:
                return []
            choices.append(best)
        if math.prod(len(c) for c in choices) > MAX_COMBINATIONS:
            return []
        grids = np.meshgrid(*[np.arange(len(c)) for c in choices], indexing="ij")
        arrays = [c.take(pa.array(g.reshape(-1))) for c, g in zip(choices, grids, strict=True)]
        try:
            mapped = self.apply(arrays, len(arrays[0])).to_pylist()
        except (RegionSpecError, pa.ArrowException):
            return []
        return [(self.field_id, "in", mapped)]
