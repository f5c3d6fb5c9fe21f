"""The value-preserving transforms: ``identity`` and ``truncate``."""

from __future__ import annotations

import decimal
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_query.exceptions import RegionSpecError
from memwal_query.regions.arrowtypes import (
    int_numpy,
    is_binary_type,
    is_string_type,
    plain,
    valid_mask,
)
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


_FLOAT_REFUSAL = (
    "truncate is not defined for floating-point columns: most decimal literals (0.1, 2.675) "
    "have no exact binary value, so the truncation of the stored value and of the literal a "
    "query compares with can disagree at a width boundary, and pruning would be wrong (Iceberg "
    "defines truncate only for int, long, decimal, string and binary); use a decimal column, "
    "or a region expression such as 'floor(col0 / W) * W'"
)


def _promoted(t: pa.DataType) -> pa.DataType:
    """int8 and int16 widen to int32 (Iceberg has no narrower integer)."""
    return pa.int32() if t in (pa.int8(), pa.int16()) else t


class TruncateTransform(SingleSourceTransform):
    """``truncate(W)``, Iceberg's truncate.

    * strings keep their first W unicode characters (code points), binaries their first
      W bytes;
    * integers: ``v - (((v % W) + W) % W)`` (floor semantics, as Iceberg:
      ``truncate(-1, 10) = -10``, where SQL's ``col0 - (col0 % W)`` gives 0); int8 and
      int16 are promoted to int32 first (as Iceberg, which has no narrower integer), so
      the result always fits; an int32/int64 result below the type's minimum raises;
    * decimals: the same floor formula on the *unscaled* value, so W counts units of the
      column's scale (``truncate(50, 10.65)`` of a ``decimal(9, 2)`` is ``10.50``); the
      result keeps the column's type, and one that needs more digits than its precision
      raises;
    * floats are refused (see :data:`_FLOAT_REFUSAL`).

    Monotone, so ranges project.
    """

    name = "truncate"
    int_params = ("width",)

    @property
    def width(self) -> int:
        """The ``width`` parameter."""
        return self.ints["width"]

    def can_transform(self, source_type: pa.DataType) -> bool:
        """Strings, binaries (not fixed-size), integers and decimals."""
        t = source_type
        return bool(
            pa.types.is_null(t)
            or is_string_type(t)
            or is_binary_type(t)
            or pa.types.is_integer(t)
            or pa.types.is_decimal(t)
        )

    def natural_type(self, source_type: pa.DataType) -> pa.DataType:
        """The source type, int8/int16 promoted to int32."""
        return _promoted(source_type)

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
        if pa.types.is_decimal(t):
            return truncate_decimals(arr, width, self.field_id)
        if pa.types.is_floating(t):
            raise RegionSpecError(f"region field {self.field_id!r}: {_FLOAT_REFUSAL} (got {t})")
        raise RegionSpecError(
            f"region field {self.field_id!r}: truncate needs a string, binary, integer or "
            f"decimal column, got {t}"
        )

    def _truncate_integers(self, arr: pa.Array) -> pa.Array:
        t = arr.type
        out_type = _promoted(t)
        valid = valid_mask(arr)
        values = int_numpy(arr)
        if pa.types.is_unsigned_integer(t):
            v = values.astype(np.uint64)
            out = v - v % np.uint64(self.width)
        else:
            v = values.astype(np.int64)
            with np.errstate(over="ignore"):
                out = v - np.mod(v, np.int64(self.width))
            bad = valid & ((out > v) | (out < np.iinfo(out_type.to_pandas_dtype()).min))
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise RegionSpecError(
                    f"region field {self.field_id!r}: truncate({self.width}) of {int(v[i])} "
                    f"does not fit in {t}"
                )
        return pa.array(out.astype(out_type.to_pandas_dtype()), out_type, mask=~valid)

    def project_range(self, op: str, value: Any, source: Source) -> list[Predicate]:
        """Monotone: see :meth:`SingleSourceTransform.project_monotone`."""
        return self.project_monotone(op, value, source)


def truncate_decimals(arr: pa.Array, width: int, field_id: str) -> pa.Array:
    """Iceberg's decimal truncate: ``u - (((u % W) + W) % W)`` of the unscaled values
    ``u``, vectorised over the 64-bit limbs of the two's-complement values.

    Raises
    ------
    RegionSpecError
        When a result needs more digits than the column's precision.
    """
    t = arr.type
    n = len(arr)
    if t.byte_width < 16:  # decimal32 / decimal64: through decimal128 of the same scale
        wide = truncate_decimals(arr.cast(pa.decimal128(t.precision, t.scale)), width, field_id)
        return wide.cast(t)
    if n == 0:
        return arr
    limbs = t.byte_width // 8
    raw = np.frombuffer(arr.buffers()[1], dtype=np.uint64)
    raw = raw[arr.offset * limbs : (arr.offset + n) * limbs].reshape(n, limbs)
    base = (1 << 64) % width  # u = sum(limb_k * 2**(64 k)), the top limb signed
    rem = np.mod(raw[:, -1].view(np.int64), np.int64(width))
    for k in range(limbs - 2, -1, -1):  # each step < 2**62: no overflow
        rem = (rem * np.int64(base) + (raw[:, k] % np.uint64(width)).astype(np.int64)) % width
    out = raw.copy()
    sub = rem.astype(np.uint64)
    for k in range(limbs):  # subtract the remainder, borrowing across limbs
        borrow = (out[:, k] < sub).astype(np.uint64)
        out[:, k] = out[:, k] - sub
        sub = borrow
    values = pa.Array.from_buffers(t, n, [None, pa.py_buffer(out.tobytes())])
    result = pc.if_else(arr.is_valid(), values, pa.scalar(None, t))
    exact = decimal.Context(prec=t.precision + 1)
    minimum = pa.scalar(decimal.Decimal(1 - 10**t.precision).scaleb(-t.scale, exact), t)
    low = pc.less(result, minimum).fill_null(False)
    if pc.any(low).as_py():
        i = int(np.flatnonzero(low.to_numpy(zero_copy_only=False))[0])
        raise RegionSpecError(
            f"region field {field_id!r}: truncate({width}) of {arr[i].as_py()} does not fit in {t}"
        )
    return result
