"""Exact SQL predicates matching a set of primary keys, for Lance's filter dialect.

:func:`key_predicate` returns a filter that matches exactly the given keys (one
column or several) for every key type memwal_query accepts, including nanosecond and
time-zoned timestamps, decimals, NaN/inf/-0.0 floats, times, durations and binary;
:func:`quote_identifier` quotes a column name. Literal lists are built with pyarrow
compute, never row by row in Python.

How each type is written as a literal: docs/maintenance.md, "Key predicates".
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_query.exceptions import MemWalError

_HEX = (
    np.array([f"{i:02x}".encode() for i in range(256)], dtype="S2").view(np.uint8).reshape(256, 2)
)


def quote_identifier(name: str) -> str:
    """An identifier in Lance's filter dialect (backticks)."""
    return "`" + name.replace("`", "``") + "`"


def _is_temporal(t: pa.DataType) -> bool:
    return (
        pa.types.is_timestamp(t)
        or pa.types.is_date(t)
        or pa.types.is_time(t)
        or pa.types.is_duration(t)
    )


def _storage_ints(arr: pa.Array) -> pa.Array:
    """The stored integers of a temporal array, as int64."""
    width = arr.type.bit_width
    return arr.view(pa.int32() if width == 32 else pa.int64()).cast(pa.int64())


def _hex(arr: pa.Array) -> pa.Array:
    """Lower-case hex text of every value of a binary array (vectorised)."""
    if pa.types.is_fixed_size_binary(arr.type):
        arr = arr.cast(pa.binary())
    arr = arr.cast(pa.large_binary())
    offsets = np.frombuffer(arr.buffers()[1], dtype=np.int64)[
        arr.offset : arr.offset + len(arr) + 1
    ]
    data = np.frombuffer(arr.buffers()[2], dtype=np.uint8)[offsets[0] : offsets[-1]]
    text = _HEX[data].ravel()
    new_offsets = (offsets - offsets[0]) * 2
    return pa.LargeStringArray.from_buffers(
        len(arr), pa.py_buffer(new_offsets), pa.py_buffer(text.tobytes())
    ).cast(pa.string())


def _quoted(text: pa.Array) -> pa.Array:
    return pc.binary_join_element_wise("'", pc.replace_substring(text, "'", "''"), "'", "")


_INT64_MIN = -(2**63)


def _int_literals(arr: pa.Array) -> pa.Array:
    """Integer literals; int64's minimum as ``(-9223372036854775807 - 1)``: the parser
    reads ``-9223372036854775808`` as the negation of a literal that overflows int64,
    which becomes a Float64 that Lance's merge-insert refuses."""
    text = pc.cast(arr, pa.string())
    if arr.type != pa.int64():
        return text
    is_min = pc.fill_null(pc.equal(arr, pa.scalar(_INT64_MIN, pa.int64())), False)
    return pc.if_else(is_min, "(-9223372036854775807 - 1)", text)


def _literals(arr: pa.Array) -> tuple[str, pa.Array]:
    """(column expression template with ``{c}``, SQL literals) for exact equality."""
    t = arr.type
    if pa.types.is_integer(t) or pa.types.is_boolean(t):
        return "{c}", _int_literals(arr)
    if _is_temporal(t):
        return "arrow_cast({c}, 'Int64')", _int_literals(_storage_ints(arr))
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "{c}", _quoted(arr.cast(pa.string()))
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return "{c}", pc.binary_join_element_wise("X'", _hex(arr), "'", "")
    if pa.types.is_decimal(t):
        return "arrow_cast({c}, 'Utf8')", _quoted(pc.cast(arr, pa.string()))
    if pa.types.is_floating(t):
        name = {16: "Float16", 32: "Float32", 64: "Float64"}[t.bit_width]
        return "{c}", pc.binary_join_element_wise(
            "arrow_cast('", pc.cast(arr, pa.string()), f"', '{name}')", ""
        )
    raise MemWalError(f"primary key type {t} is not supported by the merger")


def _text(arr: pa.Array) -> tuple[str, pa.Array]:
    """(column expression template, pyarrow text) giving the same string for equal keys."""
    t = arr.type
    if pa.types.is_integer(t) or pa.types.is_boolean(t) or pa.types.is_decimal(t):
        return "arrow_cast({c}, 'Utf8')", pc.cast(arr, pa.string())
    if _is_temporal(t):
        return "arrow_cast(arrow_cast({c}, 'Int64'), 'Utf8')", pc.cast(
            _storage_ints(arr), pa.string()
        )
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        s = arr.cast(pa.string())
        length = pc.cast(pc.utf8_length(s), pa.string())
        return "concat(arrow_cast(character_length({c}), 'Utf8'), ':', {c})", (
            pc.binary_join_element_wise(length, s, ":")
        )
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return "encode({c}, 'hex')", _hex(arr)
    raise MemWalError(f"primary key type {t} has no text form")


def _join(parts: pa.Array, sep: str) -> str:
    return pc.binary_join(pa.array([parts], pa.list_(pa.string())), sep)[0].as_py()


def key_predicate(keys: pa.Table) -> str:
    """SQL predicate (Lance's filter dialect) matching exactly the rows of ``keys``.

    ``keys`` holds the primary-key column(s), one row per key, no NULLs.
    """
    if keys.num_rows == 0:
        return "false"
    cols = [keys.column(i).combine_chunks() for i in range(keys.num_columns)]
    names = [quote_identifier(n) for n in keys.column_names]
    if len(cols) == 1:
        template, lits = _literals(cols[0])
        return f"{template.format(c=names[0])} IN ({_join(lits, ', ')})"
    if not any(pa.types.is_floating(c.type) for c in cols):
        exprs, texts = [], []
        for name, col in zip(names, cols):
            template, text = _text(col)
            exprs.append(template.format(c=name))
            texts.append(text)
        joined = pc.binary_join_element_wise(*texts, "|")
        concat = ", '|', ".join(exprs)
        return f"concat({concat}) IN ({_join(_quoted(joined), ', ')})"
    terms = []
    for name, col in zip(names, cols):
        template, lits = _literals(col)
        terms.append(pc.binary_join_element_wise(f"{template.format(c=name)} = ", lits, ""))
    anded = pc.binary_join_element_wise(*terms, " AND ")
    return _join(pc.binary_join_element_wise("(", anded, ")", ""), " OR ")
