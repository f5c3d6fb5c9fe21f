"""Simple predicates ``(column, op, value)`` and the comparisons region pruning needs.

Pruning compares region values with literals only where the comparison is reliable:
:func:`compare` returns None for values of unlike kinds, NaN, naive vs aware datetimes...,
and an unreliable comparison never prunes.
"""

from __future__ import annotations

import datetime as dt
import decimal
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa

__all__ = [
    "OPS",
    "Predicate",
    "compare",
    "equality_values",
    "satisfies",
    "satisfies_all",
    "to_source_array",
]

Predicate = tuple[str, str, Any]
"""A simple predicate ``(column, op, value)``; ``op`` in ``= in < <= > >=``."""
OPS = ("=", "in", "<", "<=", ">", ">=")
"""The operators region pruning understands (``==`` is read as ``=``)."""


def equality_values(op: str, value: Any) -> list[Any] | None:
    """The non-NULL values an ``=`` / ``in`` predicate pins, or None for other predicates
    (an ``in`` whose value is not a collection included)."""
    if op == "=":
        values = [value]
    elif op == "in" and isinstance(value, list | tuple | set | frozenset):
        values = list(value)
    else:
        return None
    return [v for v in values if v is not None]  # NULL never equals


def same(a: Any, b: Any) -> bool:
    return compare(a, b) == 0


def to_source_array(values: list[Any], typ: pa.DataType | None) -> pa.Array | None:
    """``values`` as an array of the source type, or None unless lossless."""
    if typ is not None:
        if isinstance(typ, pa.ExtensionType):
            typ = typ.storage_type
        if pa.types.is_dictionary(typ):
            typ = typ.value_type
    if typ is not None and pa.types.is_timestamp(typ):
        values = [as_datetime(v, typ.tz is not None) for v in values]
    try:
        if typ is None:
            arr = pa.array(values)
        else:
            try:
                arr = pa.array(values, type=typ)
            except (pa.ArrowException, TypeError, ValueError, OverflowError):
                arr = pa.array(values).cast(typ, safe=True)
        back = arr.to_pylist()
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        return None
    if len(back) != len(values) or not all(same(a, b) for a, b in zip(back, values)):
        return None
    return arr


def as_datetime(value: Any, aware: bool) -> Any:
    """A date literal as midnight, and for a time-zoned column a naive literal as UTC
    (DataFusion's default session time zone), so that they convert losslessly."""
    if isinstance(value, dt.date) and not isinstance(value, dt.datetime):
        value = dt.datetime.combine(value, dt.time())
    if aware and isinstance(value, dt.datetime) and value.tzinfo is None:
        value = value.replace(tzinfo=dt.timezone.utc)
    return value


NUMBER = (int, float, decimal.Decimal)


def compare(a: Any, b: Any) -> int | None:
    """-1/0/1, or None when the two values are not reliably comparable."""
    a = a.item() if isinstance(a, np.generic) else a
    b = b.item() if isinstance(b, np.generic) else b
    if a is None or b is None:
        return None
    if isinstance(a, NUMBER) and isinstance(b, NUMBER):
        if any(isinstance(x, float) and math.isnan(x) for x in (a, b)):
            return None
        if any(isinstance(x, decimal.Decimal) and not x.is_finite() for x in (a, b)):
            return None
    elif isinstance(a, str) and isinstance(b, str):
        pass
    elif isinstance(a, bytes | bytearray | memoryview) and isinstance(
        b, bytes | bytearray | memoryview
    ):
        a, b = bytes(a), bytes(b)
    elif isinstance(a, dt.datetime) and isinstance(b, dt.datetime):
        if (a.tzinfo is None) != (b.tzinfo is None):
            return None
    elif type(a) is dt.date and type(b) is dt.date:
        pass
    elif isinstance(a, dt.time) and isinstance(b, dt.time):
        if a.tzinfo is not None or b.tzinfo is not None:
            return None
    elif isinstance(a, dt.timedelta) and isinstance(b, dt.timedelta):
        pass
    else:
        return None
    try:
        return int((a > b) - (a < b))
    except TypeError:
        return None


def satisfies(value: Any, op: str, target: Any) -> bool:
    if op == "in":
        return any(compare(value, t) in (0, None) for t in target)
    c = compare(value, target)
    if c is None:
        return True
    return {"=": c == 0, "<": c < 0, "<=": c <= 0, ">": c > 0, ">=": c >= 0}.get(op, True)


def satisfies_all(region_values: Mapping[str, Any], projected: list[Predicate]) -> bool:
    for field_id, op, target in projected:
        value = region_values.get(field_id)
        if value is None:
            continue
        if not satisfies(value, op, target):
            return False
    return True


Lookups = dict[str, tuple[type, frozenset[Any]]]


def set_lookups(projected: list[Predicate]) -> Lookups | None:
    """``{field_id: (type, allowed values)}`` when every predicate of ``projected`` is
    ``=`` or a non-empty ``IN`` on integers or on strings (one predicate per field, all
    values of one type), else None. A region value of that exact type then satisfies
    them exactly when it is in the set (:func:`satisfies_projected`)."""
    out: Lookups = {}
    for field_id, op, target in projected:
        values = [target] if op == "=" else list(target) if op == "in" else None
        if not values or field_id in out:
            return None
        kind = type(values[0])
        if kind not in (int, str) or any(type(v) is not kind for v in values):
            return None
        out[field_id] = (kind, frozenset(values))
    return out


def satisfies_projected(
    region_values: Mapping[str, Any], projected: list[Predicate], lookups: Lookups | None
) -> bool:
    """:func:`satisfies_all`, answered by the set lookups of :func:`set_lookups` when
    there are some (a region value of another type: :func:`satisfies_all` decides)."""
    if lookups is None:
        return satisfies_all(region_values, projected)
    for field_id, (kind, allowed) in lookups.items():
        v = region_values.get(field_id)
        if v is None:
            continue
        if type(v) is not kind:  # another type: compare() decides
            return satisfies_all(region_values, projected)
        if v not in allowed:
            return False
    return True
