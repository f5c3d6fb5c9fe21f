"""The hashing transforms ``bucket`` and ``multi_bucket``, and pylance's ``unsharded``.

See :mod:`memwal_query.regions.murmur3` for the bytes hashed per type.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from memwal_query.exceptions import RegionSpecError
from memwal_query.regions.arrowtypes import is_binary_type, is_string_type
from memwal_query.regions.murmur3 import buckets, concat_prefixed, encode, murmur3_bytes
from memwal_query.regions.predicates import Predicate
from memwal_query.regions.sources import Source
from memwal_query.regions.transform import (
    ColumnPredicates,
    MultiSourceTransform,
    SingleSourceTransform,
    Transform,
)

__all__ = ["BucketTransform", "MultiBucketTransform", "UnshardedTransform", "hashable"]


def hashable(source_type: pa.DataType) -> bool:
    """Whether murmur3 hashes values of this type (see :mod:`murmur3`)."""
    t = source_type
    if isinstance(t, pa.BaseExtensionType):
        t = t.storage_type
    if pa.types.is_dictionary(t):
        t = t.value_type
    return bool(
        pa.types.is_null(t)
        or pa.types.is_boolean(t)
        or pa.types.is_integer(t)
        or pa.types.is_floating(t)
        or pa.types.is_decimal(t)
        or pa.types.is_date(t)
        or pa.types.is_timestamp(t)
        or pa.types.is_time(t)
        or is_string_type(t)
        or is_binary_type(t)
        or pa.types.is_fixed_size_binary(t)
    )


class BucketTransform(SingleSourceTransform):
    """``bucket(N)``: ``abs(murmur3(col0)) % N`` as int32 (abs in int64, so the bucket is
    always in ``[0, N)``); NULL for NULL. Prunes only on ``=``/``in``."""

    name = "bucket"
    fixed_type = pa.int32()

    int_params = ("num_buckets",)

    @property
    def num_buckets(self) -> int:
        """The ``num_buckets`` parameter."""
        return self.ints["num_buckets"]

    def can_transform(self, source_type: pa.DataType) -> bool:
        """See :func:`hashable`."""
        return hashable(source_type)

    def transform(self, array: pa.Array) -> pa.Array:
        """See :class:`BucketTransform`."""
        enc = encode(array, self.field_id)
        return buckets(enc.hash(), enc.valid, self.num_buckets)


class MultiBucketTransform(MultiSourceTransform):
    """``multi_bucket(N)``: ``abs(murmur3_multi(col0, col1, ...)) % N`` as int32.

    The hash input of a row is ``len(b0) || b0 || len(b1) || b1 ...`` over its non-NULL
    inputs in ``source_ids`` order (each length a 4-byte little-endian unsigned int, each
    ``b`` the value's murmur3 bytes); NULL only when every input is NULL.
    """

    name = "multi_bucket"
    fixed_type = pa.int32()

    int_params = ("num_buckets",)

    @property
    def num_buckets(self) -> int:
        """The ``num_buckets`` parameter."""
        return self.ints["num_buckets"]

    def check_sources(self, num_sources: int) -> None:
        """One or more sources."""
        if not num_sources:
            raise RegionSpecError(f"region field {self.field_id!r}: multi_bucket needs source ids")

    def can_transform(self, source_type: pa.DataType) -> bool:
        """See :func:`hashable` (every source must be)."""
        return hashable(source_type)

    def transform_columns(self, arrays: Sequence[pa.Array], n: int) -> pa.Array:
        """See :class:`MultiBucketTransform`."""
        encoded = [encode(a, self.field_id) for a in arrays]
        valid = np.logical_or.reduce([e.valid for e in encoded])
        hashes = murmur3_bytes(*concat_prefixed(encoded))
        return buckets(hashes, valid, self.num_buckets)


class UnshardedTransform(Transform):
    """``unsharded``: pylance's one-region spec; no source, every row int32 ``0``."""

    name = "unsharded"
    fixed_type = pa.int32()

    def check_sources(self, num_sources: int) -> None:
        """No source."""
        if num_sources:
            raise RegionSpecError(
                f"region field {self.field_id!r}: transform 'unsharded' takes no source"
            )

    def can_transform(self, source_type: pa.DataType) -> bool:
        """No source column is read."""
        return True

    def transform_columns(self, arrays: Sequence[pa.Array], n: int) -> pa.Array:
        """``n`` zeros."""
        return pa.array(np.zeros(n, np.int32))

    def project(self, by_column: ColumnPredicates, sources: Sequence[Source]) -> list[Predicate]:
        """One region: nothing to prune."""
        return []
