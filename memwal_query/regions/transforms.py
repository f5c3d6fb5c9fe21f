"""The registry of region transforms: the spec's transform name -> its class.

This is the one place a transform name is dispatched; everything else calls the bound
:class:`~memwal_query.regions.transform.Transform`. See the classes for each transform's
semantics, and :mod:`memwal_query.regions.murmur3` for the hashed bytes.

============  ==============  =============================================  ==============
transform     parameters      region value                                    result type
============  ==============  =============================================  ==============
identity      (none)          ``col0``                                        same as source
year          (none)          ``date_part('year', col0)``                     int32
month         (none)          ``date_part('month', col0)`` (1..12)            int32
day           (none)          ``date_part('day', col0)`` (day of month)       int32
hour          (none)          ``date_part('hour', col0)`` (0..23)             int32
bucket        num_buckets N   ``abs(murmur3(col0)) % N``                      int32
multi_bucket  num_buckets N   ``abs(murmur3_multi(col0, col1, ...)) % N``     int32
truncate      width W         ``left(col0, W)`` / ``col0 - (col0 % W)``       same as source
unsharded     (none)          ``0`` (no source: pylance's one-region spec)   int32
============  ==============  =============================================  ==============
"""

from __future__ import annotations

from collections.abc import Mapping

import pyarrow as pa

from memwal_query.exceptions import RegionSpecError
from memwal_query.regions.transform import Transform
from memwal_query.regions.transforms_hash import (
    BucketTransform,
    MultiBucketTransform,
    UnshardedTransform,
)
from memwal_query.regions.transforms_time import (
    DayTransform,
    HourTransform,
    MonthTransform,
    YearTransform,
)
from memwal_query.regions.transforms_value import IdentityTransform, TruncateTransform

__all__ = [
    "TEMPORAL_TRANSFORMS",
    "TRANSFORMS",
    "TRANSFORM_CLASSES",
    "bind_transform",
]

TRANSFORM_CLASSES: dict[str, type[Transform]] = {
    c.name: c
    for c in (
        IdentityTransform,
        YearTransform,
        MonthTransform,
        DayTransform,
        HourTransform,
        BucketTransform,
        MultiBucketTransform,
        TruncateTransform,
        UnshardedTransform,
    )
}
"""Transform name (``RegionField.transform`` in the proto) -> class."""
TEMPORAL_TRANSFORMS = ("year", "month", "day", "hour")
"""The date-part transforms (``date_part`` semantics, int32)."""
TRANSFORMS = tuple(TRANSFORM_CLASSES)
"""Names of the well-known region transforms (``unsharded``: pylance's one-region spec,
no source, every row int32 ``0``)."""


def bind_transform(
    name: str,
    field_id: str,
    num_sources: int,
    parameters: Mapping[str, str],
    declared: pa.DataType | None,
) -> Transform:
    """The transform ``name`` bound to a region field (validated).

    Raises
    ------
    RegionSpecError
        For an unknown name, a wrong number of sources or an invalid parameter.
    """
    cls = TRANSFORM_CLASSES.get(name)
    if cls is None:
        raise RegionSpecError(
            f"region field {field_id!r}: unknown transform {name!r} "
            f"(known: {', '.join(TRANSFORMS)})"
        )
    return cls(field_id, num_sources, parameters, declared)
