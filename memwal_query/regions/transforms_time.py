"""The date-part transforms ``year``, ``month``, ``day`` and ``hour`` (int32).

``date_part(unit, col0)`` of date32, date64 and timestamp columns (any unit; ``hour``
also of time32/time64). For a timestamp *with a time zone* the parts of its **UTC**
value are used (the stored instant, as Iceberg's transforms of ``timestamptz``), so
that the region of a row never depends on a time-zone setting; ``hour`` of a date is 0.
See ``docs/compatibility.md`` for how this differs from DataFusion's ``date_part`` on such a column.

Pruning: ``year`` is monotone (``col >= v`` gives ``year >= year(v)``); month, day and
hour are month of the year, day of the month and hour of the day (cyclic, *not*
monotone), so a range projects only when a lower and an upper bound fall in the same
year / month / day.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import pyarrow as pa
import pyarrow.compute as pc

from memwal_query.exceptions import RegionSpecError
from memwal_query.regions.arrowtypes import plain
from memwal_query.regions.predicates import Predicate, to_source_array
from memwal_query.regions.sources import Source
from memwal_query.regions.transform import SingleSourceTransform

__all__ = [
    "DatePartTransform",
    "DayTransform",
    "HourTransform",
    "MonthTransform",
    "YearTransform",
    "date_part",
]

_PARTS: dict[str, Callable[[pa.Array], pa.Array]] = {
    "year": pc.year,
    "month": pc.month,
    "day": pc.day,
    "hour": pc.hour,
}


def _is_temporal(t: pa.DataType) -> bool:
    return bool(pa.types.is_date32(t) or pa.types.is_date64(t) or pa.types.is_timestamp(t))


def date_part(array: pa.Array, unit: str, field_id: str) -> pa.Array:
    """``date_part(unit, array)`` as int32 (UTC parts of time-zoned timestamps).

    Raises
    ------
    RegionSpecError
        For a column that is not a date or timestamp (naming ``field_id``).
    """
    arr = plain(array)
    t = arr.type
    if pa.types.is_null(t):
        return pa.nulls(len(arr), pa.int32())
    if pa.types.is_date32(t):
        arr = arr.cast(pa.timestamp("s"))
    elif pa.types.is_date64(t):
        arr = arr.cast(pa.timestamp("ms"))
    elif pa.types.is_timestamp(t):
        if t.tz is not None:
            arr = arr.cast(pa.timestamp(t.unit))  # the UTC wall clock
    elif pa.types.is_time(t) and unit == "hour":
        arr = arr.cast(pa.time64("us"))  # hour of the day
    else:
        raise RegionSpecError(
            f"region field {field_id!r}: transform {unit!r} needs a date or timestamp "
            f"column, got {t}"
        )
    return _PARTS[unit](arr).cast(pa.int32())


class DatePartTransform(SingleSourceTransform):
    """A date part of a date or timestamp column (see the module docs)."""

    fixed_type = pa.int32()
    parents: ClassVar[tuple[str, ...]] = ()
    """The coarser parts that must agree for a range to project (cyclic parts)."""

    def can_transform(self, source_type: pa.DataType) -> bool:
        """date32, date64, timestamp (any unit and time zone)."""
        t = source_type.value_type if pa.types.is_dictionary(source_type) else source_type
        return bool(pa.types.is_null(t) or _is_temporal(t))

    def transform(self, array: pa.Array) -> pa.Array:
        """See :func:`date_part`."""
        return date_part(array, self.name, self.field_id)

    def project_ranges(self, ranges: list[tuple[str, Any]], source: Source) -> list[Predicate]:
        """Cyclic parts: a lower and an upper bound in the same parent period give
        ``lower_part <= region <= upper_part``."""
        if not self.parents:
            return []
        lows = [v for op, v in ranges if op in (">", ">=")]
        highs = [v for op, v in ranges if op not in (">", ">=")]
        if not lows or not highs:
            return []
        arr = to_source_array([*lows, *highs], source.type)
        if arr is None:
            return []
        try:
            own = self.apply([arr], len(arr)).to_pylist()
            parts = [date_part(arr, p, self.field_id).to_pylist() for p in self.parents]
            keys = list(zip(*parts, strict=True))
        except (RegionSpecError, pa.ArrowException):
            return []
        out: list[Predicate] = []
        for i in range(len(lows)):
            for j in range(len(lows), len(own)):
                if keys[i] == keys[j] and None not in keys[i] and None not in (own[i], own[j]):
                    out.append((self.field_id, ">=", own[i]))
                    out.append((self.field_id, "<=", own[j]))
        return out


class YearTransform(DatePartTransform):
    """``year``: ``date_part('year', col0)``; monotone."""

    name = "year"

    def project_range(self, op: str, value: Any, source: Source) -> list[Predicate]:
        """Monotone: see :meth:`SingleSourceTransform.project_monotone`."""
        return self.project_monotone(op, value, source)


class MonthTransform(DatePartTransform):
    """``month``: month of the year, 1..12 (cyclic)."""

    name = "month"
    parents = ("year",)


class DayTransform(DatePartTransform):
    """``day``: day of the month, 1..31 (cyclic)."""

    name = "day"
    parents = ("year", "month")


class HourTransform(DatePartTransform):
    """``hour``: hour of the day, 0..23 (cyclic; 0 for dates). Also of ``time32`` /
    ``time64`` columns (as DataFusion's ``date_part('hour', col0)``), where it is
    monotone: ranges on a time column project like ``year``."""

    name = "hour"
    parents = ("year", "month", "day")

    def can_transform(self, source_type: pa.DataType) -> bool:
        """date32, date64, timestamp, time32 and time64."""
        return super().can_transform(source_type) or bool(pa.types.is_time(source_type))

    def project_range(self, op: str, value: Any, source: Source) -> list[Predicate]:
        """Monotone on a time column; see :meth:`DatePartTransform.project_ranges`."""
        if source.type is not None and pa.types.is_time(source.type):
            return self.project_monotone(op, value, source)
        return []

    def project_ranges(self, ranges: list[tuple[str, Any]], source: Source) -> list[Predicate]:
        """Cyclic on dates and timestamps (see the base class); none on a time column."""
        if source.type is not None and pa.types.is_time(source.type):
            return []
        return super().project_ranges(ranges, source)
