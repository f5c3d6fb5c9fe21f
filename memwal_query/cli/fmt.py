"""Text renderings of query results for the ``memwal`` command line (vectorised).

- :func:`json_text`: every value of an Arrow array as JSON text (lists and vectors as
  JSON arrays, structs as objects, NaN/Infinity as Python's ``json`` writes them), built
  with pyarrow.compute kernels rather than per-row Python;
- :func:`finite_or_null`: NaN and infinities (also inside lists, vectors and structs) as
  NULL, so ``--format json`` writes valid JSON (``null``);
- :func:`csv_ready`: a table whose nested columns (lists, vectors, structs, maps) are
  JSON text (NaN and infinities in them ``null``), which is what CSV can hold; top-level
  floats are written by Arrow's CSV writer (``nan``, ``inf``, ``-inf``);
- :func:`render`: the aligned text table of ``--format table``, where a SQL NULL prints
  as ``NULL`` and a float NaN as ``NaN``.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc

NULL_TEXT = "NULL"


def _nested(t: pa.DataType) -> bool:
    return (
        pa.types.is_list(t)
        or pa.types.is_large_list(t)
        or pa.types.is_fixed_size_list(t)
        or pa.types.is_struct(t)
        or pa.types.is_map(t)
        or getattr(pa.types, "is_list_view", lambda _: False)(t)
    )


def _float_text(arr: pa.Array) -> pa.Array:
    """Floats as Python's ``json`` writes them: ``1.0``, ``NaN``, ``Infinity``..."""
    text = pc.cast(arr, pa.string())
    integral = pc.match_substring_regex(text, "^-?[0-9]+$")  # 1.0 prints as 1.0, not 1
    text = pc.if_else(integral, pc.binary_join_element_wise(text, ".0", ""), text)
    nan = pc.is_nan(arr)
    text = pc.if_else(nan, "NaN", text)
    text = pc.if_else(pc.and_(pc.is_inf(arr), pc.greater(arr, 0)), "Infinity", text)
    return pc.if_else(pc.and_(pc.is_inf(arr), pc.less(arr, 0)), "-Infinity", text)


def _quoted(text: pa.Array) -> pa.Array:
    """Strings as JSON string literals (backslash, quote and control characters escaped)."""
    for old, new in (("\\", "\\\\"), ('"', '\\"'), ("\n", "\\n"), ("\r", "\\r"), ("\t", "\\t")):
        text = pc.replace_substring(text, old, new)
    if pc.any(pc.match_substring_regex(text, "[\\x00-\\x1f]")).as_py():
        text = pc.replace_substring_regex(text, "[\\x00-\\x1f]", "?")
    return pc.binary_join_element_wise('"', text, '"', "")


def _list_parts(arr: pa.Array) -> tuple[pa.Array, pa.Array]:
    """(offsets, flat values) of a list-like array, fixed-size lists included."""
    if pa.types.is_fixed_size_list(arr.type):
        n = arr.type.list_size
        flat = arr.values.slice(arr.offset * n, len(arr) * n)
        offsets = pa.array(range(0, (len(arr) + 1) * n, n), pa.int32()) if n else None
        if offsets is None:
            offsets = pa.array([0] * (len(arr) + 1), pa.int32())
        return offsets, flat
    offsets = pc.subtract(arr.offsets, arr.offsets[0])
    return offsets, arr.flatten()


def json_text(arr: pa.Array | pa.ChunkedArray) -> pa.Array:
    """Each value as JSON text (a string array; NULL stays NULL at the top level)."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks else pa.array([], arr.type)
    t = arr.type
    if pa.types.is_dictionary(t):
        return json_text(arr.dictionary_decode())
    if pa.types.is_null(t):
        return pa.nulls(len(arr), pa.string())
    if pa.types.is_boolean(t):
        return pc.if_else(arr, "true", "false")
    if pa.types.is_floating(t):
        return _float_text(arr)
    if pa.types.is_integer(t):
        return pc.cast(arr, pa.string())
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return _quoted(pc.cast(arr, pa.string()))
    if pa.types.is_struct(t):
        parts: list = ["{"]
        for i, f in enumerate(t):
            child = json_text(arr.field(i))
            parts += [json.dumps(f.name) + ": ", pc.fill_null(child, "null")]
            parts.append(", " if i < t.num_fields - 1 else "}")
        if t.num_fields == 0:
            parts.append("}")
        text = pc.binary_join_element_wise(*parts, "")
        return pc.if_else(arr.is_valid(), text, pa.scalar(None, pa.string()))
    if pa.types.is_map(t):
        keys = json_text(pc.cast(arr.keys, pa.string()))
        items = pc.fill_null(json_text(arr.items), "null")
        pairs = pc.binary_join_element_wise(keys, items, ": ")
        as_list = pa.ListArray.from_arrays(
            pc.subtract(arr.offsets, arr.offsets[0]), pairs, mask=arr.is_null()
        )
        joined = pc.binary_join(as_list, ", ")
        return pc.binary_join_element_wise("{", joined, "}", "")
    if _nested(t):
        offsets, flat = _list_parts(arr)
        items = pc.fill_null(json_text(flat), "null")
        as_list = pa.ListArray.from_arrays(offsets, items, mask=arr.is_null())
        joined = pc.binary_join(as_list, ", ")
        return pc.binary_join_element_wise("[", joined, "]", "")
    # dates, times, timestamps, decimals, durations...: their text, as a JSON string
    try:
        return _quoted(pc.cast(arr, pa.string()))
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid):  # binary and the exotic rest
        return pa.array(
            [None if v is None else json.dumps(v, default=str) for v in arr.to_pylist()],
            pa.string(),
        )


def finite_or_null(arr: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """``arr`` with every NaN and infinity replaced by NULL, at any depth of lists,
    fixed-size lists and structs (other types unchanged)."""
    if isinstance(arr, pa.ChunkedArray):
        chunks = [finite_or_null(c) for c in arr.chunks]
        return pa.chunked_array(chunks, arr.type)
    t = arr.type
    if pa.types.is_floating(t):
        if pc.all(pc.fill_null(pc.is_finite(arr), True)).as_py():
            return arr
        return pc.if_else(pc.is_finite(arr), arr, pa.scalar(None, t))
    if pa.types.is_struct(t):
        children = [finite_or_null(arr.field(i)) for i in range(t.num_fields)]
        return pa.StructArray.from_arrays(
            children, fields=list(t), mask=arr.is_null() if arr.null_count else None
        )
    if pa.types.is_fixed_size_list(t) or pa.types.is_list(t) or pa.types.is_large_list(t):
        if not _has_float(t):
            return arr
        offsets, flat = _list_parts(arr)
        values = finite_or_null(flat)
        mask = arr.is_null() if arr.null_count else None
        if pa.types.is_fixed_size_list(t):
            out = pa.FixedSizeListArray.from_arrays(values, t.list_size, mask=mask)
        elif pa.types.is_large_list(t):
            out = pa.LargeListArray.from_arrays(pc.cast(offsets, pa.int64()), values, mask=mask)
        else:
            out = pa.ListArray.from_arrays(offsets, values, mask=mask)
        return out.cast(t)
    return arr


def _has_float(t: pa.DataType) -> bool:
    if pa.types.is_floating(t):
        return True
    if pa.types.is_struct(t):
        return any(_has_float(f.type) for f in t)
    if pa.types.is_fixed_size_list(t) or pa.types.is_list(t) or pa.types.is_large_list(t):
        return _has_float(t.value_type)
    return False


def json_safe(table: pa.Table) -> pa.Table:
    """``table`` with :func:`finite_or_null` applied to every column holding floats."""
    for i, f in enumerate(table.schema):
        if _has_float(f.type):
            table = table.set_column(i, f, finite_or_null(table.column(i)))
    return table


def csv_ready(table: pa.Table) -> pa.Table:
    """``table`` with each nested column (list, vector, struct, map) as JSON text."""
    for i, f in enumerate(table.schema):
        if _nested(f.type):
            text = json_text(finite_or_null(table.column(i)))
            table = table.set_column(i, pa.field(f.name, pa.string()), text)
    return table


def _display(col: pa.ChunkedArray) -> pa.Array:
    """A column's values as display text: NULL for SQL NULL, NaN for float NaN."""
    arr = col.combine_chunks() if col.num_chunks else pa.array([], col.type)
    t = arr.type
    if pa.types.is_floating(t):
        text = _float_text(arr)
    elif pa.types.is_string(t) or pa.types.is_large_string(t):
        text = pc.cast(arr, pa.string())
    elif _nested(t) or pa.types.is_dictionary(t):
        text = json_text(arr)
    else:
        try:
            text = pc.cast(arr, pa.string())
        except (pa.ArrowNotImplementedError, pa.ArrowInvalid):
            text = json_text(arr)
    return pc.fill_null(text, NULL_TEXT)


def render(table: pa.Table) -> str:
    """``table`` as aligned text columns (right-aligned, two spaces apart)."""
    if table.num_rows == 0:
        return "(no rows)"
    columns = []
    for name, col in zip(table.column_names, table.columns):
        text = _display(col)
        width = max(len(name), pc.max(pc.utf8_length(text)).as_py() or 0)
        header = name.rjust(width)
        columns.append((header, pc.utf8_lpad(text, width)))
    lines = pc.binary_join_element_wise(*(c for _, c in columns), "  ")
    head = "  ".join(h for h, _ in columns)
    return "\n".join([head, *lines.to_pylist()])
