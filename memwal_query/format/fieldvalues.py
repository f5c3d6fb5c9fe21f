"""Region field values as raw Arrow scalar bytes (``RegionManifest.region_field_entries``).

The encoding is the one pylance's native writer uses for ``shard_field_entries``: the
value's little-endian fixed-width bytes (``int32``: 4 bytes, ``date32``: 4 bytes of days,
``timestamp``: 8 bytes in its unit...), or the raw bytes of ``utf8``/``binary`` values.
A NULL value has no entry.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

_ALIASES = {"utf8": "string", "large_utf8": "large_string", "bool": "bool", "boolean": "bool"}


def encode(value: Any, type_: pa.DataType) -> bytes | None:
    """Raw bytes of one value (None for NULL)."""
    if value is None:
        return None
    arr = pa.array([value], type=type_)
    if pa.types.is_string(type_) or pa.types.is_large_string(type_):
        return str(arr[0].as_py()).encode()
    if pa.types.is_binary(type_) or pa.types.is_large_binary(type_):
        return bytes(arr[0].as_py())
    if pa.types.is_boolean(type_):
        return b"\x01" if arr[0].as_py() else b"\x00"
    width = type_.bit_width // 8
    return arr.buffers()[1].to_pybytes()[:width]


def decode(raw: bytes, type_: pa.DataType) -> Any:
    """Inverse of :func:`encode`."""
    if pa.types.is_string(type_) or pa.types.is_large_string(type_):
        return raw.decode()
    if pa.types.is_binary(type_) or pa.types.is_large_binary(type_):
        return bytes(raw)
    if pa.types.is_boolean(type_):
        return raw != b"\x00"
    arr = pa.Array.from_buffers(type_, 1, [None, pa.py_buffer(raw)])
    return arr[0].as_py()
