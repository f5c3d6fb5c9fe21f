"""The value-preserving transforms: ``identity`` and ``truncate``."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_query.exceptions import RegionSpecError
from memwal_query.regions.arrowtypes import int_numpy, plain, valid_mask
from memwal_query.regions.predicates import Predicate
from memwal_query.regions.sources import Source
from memwal_query.regions.transform import SingleSourceTransform

__all__ = ["IdentityTransform", "TruncateTransform"]


class IdentityTransform(SingleSourceTransform):
    """``identity``: the region value is the source value (cast to a declared type).

    Any source type is accepted. Ranges keep their operator; with a declared type that
    differs from the source's (a cast: monotone, maybe lossy) they relax to ``<=``/``>=``.
    """

    name = "identity"

    def can_transform(self, source_type: pa.DataType) -> bool:
        """Every type."""
        return True

    def transform(self, array: pa.Array) -> pa.Array:
        """The values themselves (dictionary-decoded)."""
        return plain(array)

    def project_range(self, op: str, value: Any, source: Source) -> list[Predicate]:
        """See :class:`IdentityTransform`."""
        mapped = self.map_values([value], [source])
        if mapped is None or mapped[0] is None:
            return []
        if self.declared in (None, source.type):
            return [(self.field_id, op, mapped[0])]
        return [(self.field_id, ">=" if op in (">", ">=") else "<=", mapped[0])]


def _is_string(t: pa.DataType) -> bool:
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t))


def _is_binary(t: pa.DataType) -> bool:
    return bool(pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t))


class TruncateTransform(SingleSourceTransform):
    """``truncate(W)``: strings keep their first W unicode characters (code points),
    binaries their first W bytes, integers ``v - (((v % W) + W) % W)`` (floor semantics,
    as Iceberg: ``truncate(-1, 10) = -10``). Monotone, so ranges project.

    Raises
    ------
    RegionSpecError
        Without a positive int32 ``width``; for other source types; when an integer
        result does not fit the source type.
    """

    name = "truncate"

    int_params = ("width",)

    @property
    def width(self) -> int:
        """The ``width`` parameter."""
        return self.ints["width"]

    def can_transform(self, source_type: pa.DataType) -> bool:
        """Strings, binaries (not fixed-size) and integers."""
        t = source_type
        return bool(pa.types.is_null(t) or _is_string(t) or _is_binary(t) or pa.types.is_integer(t))

    def transform(self, array: pa.Array) -> pa.Array:
        """See :class:`TruncateTransform`."""
        arr = plain(array)
        t = arr.type
        width = self.width
        if pa.types.is_null(t):
            return arr
        if pa.types.is_string(t) or pa.types.is_large_string(t):
            return pc.utf8_slice_codeunits(arr, 0, width)
        if pa.types.is_string_view(t):
            return pc.utf8_slice_codeunits(arr.cast(pa.large_string()), 0, width).cast(t)
        if pa.types.is_binary(t) or pa.types.is_large_binary(t):
            return pc.binary_slice(arr, 0, width)
        if pa.types.is_binary_view(t):
            return pc.binary_slice(arr.cast(pa.large_binary()), 0, width).cast(t)
        if pa.types.is_integer(t):
            return self._truncate_integers(arr)
        raise RegionSpecError(
            f"region field {self.field_id!r}: truncate needs a string, binary or integer "
            f"column, got {t}"
        )

    def _truncate_integers(self, arr: pa.Array) -> pa.Array:
        t = arr.type
        valid = valid_mask(arr)
        values = int_numpy(arr)
        if pa.types.is_unsigned_integer(t):
            v = values.astype(np.uint64)
            out = v - v % np.uint64(self.width)
        else:
            v = values.astype(np.int64)
            with np.errstate(over="ignore"):
                out = v - np.mod(v, np.int64(self.width))
            bad = valid & ((out > v) | (out < np.iinfo(values.dtype).min))
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise RegionSpecError(
                    f"region field {self.field_id!r}: truncate({self.width}) of {int(v[i])} "
                    f"does not fit in {t}"
                )
        return pa.array(out.astype(values.dtype), t, mask=~valid)

    def project_range(self, op: str, value: Any, source: Source) -> list[Predicate]:
        """Monotone: see :meth:`SingleSourceTransform.project_monotone`."""
        return self.project_monotone(op, value, source)
