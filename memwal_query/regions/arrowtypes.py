"""Arrow type names of region values, and the array helpers every transform uses.

A region field's ``result_type`` is stored as a type name (:func:`arrow_type_from_name`
reads pyarrow, Arrow/DataFusion Rust and a few SQL spellings; :func:`arrow_type_name`
writes the canonical one). :func:`plain` is the input form every transform works on:
one contiguous array, dictionary-decoded, extension types unwrapped to their storage.
"""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa

from memwal_query.exceptions import RegionSpecError

__all__ = [
    "arrow_type_from_name",
    "arrow_type_name",
    "cast_result",
    "int_numpy",
    "is_binary_type",
    "is_string_type",
    "plain",
    "valid_mask",
]

# -- type names --------------------------------------------------------------------------
_SIMPLE_TYPES: dict[str, pa.DataType] = {
    "null": pa.null(),
    "bool": pa.bool_(),
    "boolean": pa.bool_(),
    "int8": pa.int8(),
    "tinyint": pa.int8(),
    "int16": pa.int16(),
    "smallint": pa.int16(),
    "int32": pa.int32(),
    "int": pa.int32(),
    "integer": pa.int32(),
    "int64": pa.int64(),
    "bigint": pa.int64(),
    "long": pa.int64(),
    "uint8": pa.uint8(),
    "uint16": pa.uint16(),
    "uint32": pa.uint32(),
    "uint64": pa.uint64(),
    "float16": pa.float16(),
    "halffloat": pa.float16(),
    "float32": pa.float32(),
    "float": pa.float32(),
    "real": pa.float32(),
    "float64": pa.float64(),
    "double": pa.float64(),
    "utf8": pa.string(),
    "string": pa.string(),
    "str": pa.string(),
    "varchar": pa.string(),
    "text": pa.string(),
    "largeutf8": pa.large_string(),
    "large_utf8": pa.large_string(),
    "large_string": pa.large_string(),
    "largestring": pa.large_string(),
    "utf8view": pa.string_view(),
    "utf8_view": pa.string_view(),
    "string_view": pa.string_view(),
    "binary": pa.binary(),
    "bytea": pa.binary(),
    "largebinary": pa.large_binary(),
    "large_binary": pa.large_binary(),
    "binaryview": pa.binary_view(),
    "binary_view": pa.binary_view(),
    "date32": pa.date32(),
    "date32[day]": pa.date32(),
    "date": pa.date32(),
    "date64": pa.date64(),
    "date64[ms]": pa.date64(),
}
_UNITS = {
    "s": "s",
    "second": "s",
    "ms": "ms",
    "millisecond": "ms",
    "us": "us",
    "microsecond": "us",
    "ns": "ns",
    "nanosecond": "ns",
}
_TS_RE = re.compile(r"^timestamp[\[(]([a-z]+)(?:,(.*))?[\])]$", re.IGNORECASE)
_UNIT_TYPE_RE = re.compile(r"^(time32|time64|duration)[\[(]([a-z]+)[\])]$", re.IGNORECASE)
_DECIMAL_RE = re.compile(r"^(decimal|decimal128|decimal256)\((\d+),(-?\d+)\)$", re.IGNORECASE)
_FIXED_RE = re.compile(r"^(?:fixed_size_binary\[|fixedsizebinary\()(\d+)[\])]$", re.IGNORECASE)


def arrow_type_from_name(name: str) -> pa.DataType:
    """Parse an Arrow type name, as stored in ``RegionField.result_type``.

    Parameters
    ----------
    name : str
        pyarrow names (``"int32"``, ``"string"``, ``"large_string"``, ``"double"``,
        ``"date32[day]"``, ``"timestamp[us, tz=UTC]"``, ``"decimal128(10, 2)"``,
        ``"fixed_size_binary[16]"``, ``"time64[us]"``), Arrow/DataFusion (Rust) names
        (``"Int32"``, ``"Utf8"``, ``"LargeUtf8"``, ``"Date32"``,
        ``"Timestamp(Microsecond, None)"``, ``"Decimal128(10, 2)"``) and a few SQL names
        (``"bigint"``, ``"varchar"``, ``"date"``...); case-insensitive except the time zone.

    Returns
    -------
    pyarrow.DataType

    Raises
    ------
    RegionSpecError
        If the name is not understood.
    """
    if not isinstance(name, str) or not name.strip():
        raise RegionSpecError(f"invalid Arrow type name {name!r}")
    compact = re.sub(r"\s+", "", name)
    simple = _SIMPLE_TYPES.get(compact.lower())
    if simple is not None:
        return simple
    m = _TS_RE.match(compact)
    if m:
        unit = _UNITS.get(m.group(1).lower())
        tz = (m.group(2) or "").strip()
        if tz.lower().startswith("tz="):
            tz = tz[3:]
        if tz.startswith("Some(") and tz.endswith(")"):
            tz = tz[5:-1]
        tz = tz.strip("\"'")
        if tz == "None":
            tz = ""
        if unit is not None:
            return pa.timestamp(unit, tz=tz or None)
    m = _UNIT_TYPE_RE.match(compact)
    if m:
        kind, unit = m.group(1).lower(), _UNITS.get(m.group(2).lower())
        try:
            if kind == "time32" and unit is not None:
                return pa.time32(unit)
            if kind == "time64" and unit is not None:
                return pa.time64(unit)
            if kind == "duration" and unit is not None:
                return pa.duration(unit)
        except (ValueError, pa.ArrowInvalid) as e:
            raise RegionSpecError(f"invalid Arrow type name {name!r}: {e}") from e
    m = _DECIMAL_RE.match(compact)
    if m:
        precision, scale = int(m.group(2)), int(m.group(3))
        try:
            if m.group(1).lower() == "decimal256" or precision > 38:
                return pa.decimal256(precision, scale)
            return pa.decimal128(precision, scale)
        except (ValueError, pa.ArrowInvalid) as e:
            raise RegionSpecError(f"invalid Arrow type name {name!r}: {e}") from e
    m = _FIXED_RE.match(compact)
    if m:
        return pa.binary(int(m.group(1)))
    try:  # any other pyarrow alias ("time64[us]", "duration[ms]"...)
        return pa.type_for_alias(compact.lower())
    except (ValueError, KeyError):
        pass
    raise RegionSpecError(f"unknown Arrow type name {name!r}")


def arrow_type_name(data_type: pa.DataType) -> str:
    """Canonical name of an Arrow type, accepted back by :func:`arrow_type_from_name`.

    Parameters
    ----------
    data_type : pyarrow.DataType

    Returns
    -------
    str
        ``"int32"``, ``"float64"``, ``"string"``, ``"date32"``, ``"timestamp[us, tz=UTC]"``...
    """
    special = {
        pa.float16(): "float16",
        pa.float32(): "float32",
        pa.float64(): "float64",
        pa.date32(): "date32",
        pa.date64(): "date64",
    }
    name = special.get(data_type, str(data_type))
    if arrow_type_from_name(name) != data_type:
        raise RegionSpecError(f"Arrow type {data_type} has no region type name")
    return name


def is_string_type(t: pa.DataType) -> bool:
    """string, large_string or string_view."""
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t))


def is_binary_type(t: pa.DataType) -> bool:
    """binary, large_binary or binary_view (not fixed-size)."""
    return bool(pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t))


# -- arrays ------------------------------------------------------------------------------
def plain(arr: pa.Array | pa.ChunkedArray) -> pa.Array:
    """Dictionary-decoded, contiguous array; Python-defined extension types unwrapped
    (canonical ones such as ``arrow.uuid`` are kept: see :func:`murmur3.encode`)."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if isinstance(arr.type, pa.ExtensionType):
        arr = arr.storage
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    return arr


def valid_mask(arr: pa.Array) -> np.ndarray:
    """Boolean numpy mask of the non-NULL slots."""
    if arr.null_count == 0:
        return np.ones(len(arr), dtype=bool)
    return np.asarray(arr.is_valid().to_numpy(zero_copy_only=False), dtype=bool)


def int_numpy(arr: pa.Array) -> np.ndarray:
    """Values of an integer-typed array as numpy, NULL slots as 0."""
    if arr.null_count:
        arr = arr.fill_null(0)
    return np.asarray(arr.to_numpy(zero_copy_only=False))


def cast_result(arr: pa.Array, target: pa.DataType, field_id: str) -> pa.Array:
    """``arr`` cast safely to a region field's declared type (RegionSpecError if lossy)."""
    if arr.type == target:
        return arr
    try:
        return arr.cast(target, safe=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
        raise RegionSpecError(
            f"region field {field_id!r}: cannot cast {arr.type} to result type {target}: {e}"
        ) from e
