"""What Lance accepts, per Arrow type: the one rule every layer asks.

``lance_filterable``: whether pylance's scanner accepts a pushed-down filter (a
comparison or ``is_in`` as a ``pyarrow.compute`` expression, converted to Substrait) on
a column of that type. Filters on other types are evaluated in Arrow after the scan.
Checked against the installed pylance by ``tests/test_lancetypes.py`` (a pylance upgrade
that widens or narrows the set fails that test).

``btree_indexable``: whether Lance builds a BTREE scalar index over a column of that type
(memwal_query then indexes a flushed generation's primary-key column(s) with it); also
checked against the installed pylance by ``tests/test_lancetypes.py``.
"""

from __future__ import annotations

import pyarrow as pa


def lance_filterable(t: pa.DataType) -> bool:
    """Whether Lance filters a column of type ``t`` itself (comparisons and ``is_in``):
    signed integers, floats, ``string``, ``binary``, ``fixed_size_binary``, booleans,
    ``date32``, ``decimal128`` and timestamps of unit s/ms/us (any time zone). Refused
    by pylance's Substrait conversion: unsigned integers, large strings and binaries,
    ``date64``, ``decimal256``, nanosecond timestamps, times, and nested types."""
    if pa.types.is_timestamp(t):
        return t.unit != "ns"
    return (
        pa.types.is_signed_integer(t)
        or pa.types.is_floating(t)
        or pa.types.is_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_fixed_size_binary(t)
        or pa.types.is_boolean(t)
        or pa.types.is_date32(t)
        or pa.types.is_decimal128(t)
    )


def btree_indexable(t: pa.DataType) -> bool:
    """Whether Lance builds a BTREE scalar index over a column of type ``t`` (pylance's
    rule, from its error message: "int, float, bool, str, large_str, binary,
    large_binary, decimal, fixed-size-binary, or temporal"): memwal_query then builds
    the primary-key index of a flushed generation on it. Nested types (lists,
    structs...) and dictionaries are refused."""
    return (
        pa.types.is_integer(t)
        or pa.types.is_floating(t)
        or pa.types.is_boolean(t)
        or pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_fixed_size_binary(t)
        or pa.types.is_decimal(t)
        or pa.types.is_temporal(t)
    )
