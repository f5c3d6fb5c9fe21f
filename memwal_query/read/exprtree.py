"""The tree of a ``pyarrow.compute.Expression``, read from its serialized form.

pyarrow has no public visitor for an Expression (the filter DataFusion hands a
provider). :func:`decode` reads it losslessly (literals keep their Arrow type and exact
value) into nested tuples, :func:`encode` turns such a tree back into an Expression;
:func:`fields_of`, :func:`substitute` and :func:`same` inspect and rewrite trees.
"""

from __future__ import annotations

import ctypes
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc


class _Unknown(Exception):
    """An expression-tree node :func:`decode` does not know."""


# pyarrow pickles an Expression as an Arrow IPC file (arrow::compute::Serialize): the
# literals and call options are the columns of a one-row batch, and the tree, in prefix
# order, is the schema's key/value metadata: ("call", name), the arguments,
# ("options", column) when the call has options, ("end", name); ("field_ref", name);
# ("literal", column). ``Schema.metadata`` is a dict, which drops repeated keys, so the
# pairs are read in order through the Arrow C data interface.
Node = tuple[Any, ...]  # ("field", name) | ("lit", pa.Scalar) | ("call", name, args, options)


class _CArrowSchema(ctypes.Structure):
    _fields_ = [
        ("format", ctypes.c_char_p),
        ("name", ctypes.c_char_p),
        ("metadata", ctypes.c_void_p),
        ("flags", ctypes.c_int64),
        ("n_children", ctypes.c_int64),
        ("children", ctypes.c_void_p),
        ("dictionary", ctypes.c_void_p),
        ("release", ctypes.c_void_p),
        ("private_data", ctypes.c_void_p),
    ]


_RELEASE = ctypes.CFUNCTYPE(None, ctypes.POINTER(_CArrowSchema))


def _metadata_pairs(schema: pa.Schema) -> list[tuple[str, str]]:
    """Schema metadata as ordered (key, value) pairs, repeated keys kept."""
    c = _CArrowSchema()
    schema._export_to_c(ctypes.addressof(c))
    try:
        out: list[tuple[str, str]] = []
        if not c.metadata:
            return out
        pos = c.metadata
        n = ctypes.c_int32.from_address(pos).value
        pos += 4
        for _ in range(n):
            pair = []
            for _ in range(2):
                size = ctypes.c_int32.from_address(pos).value
                pair.append(ctypes.string_at(pos + 4, size).decode())
                pos += 4 + size
            out.append((pair[0], pair[1]))
        return out
    finally:
        if c.release:
            _RELEASE(c.release)(ctypes.pointer(c))


def decode(expr: pc.Expression) -> Node | None:
    """The tree of a filter expression (literals keep their Arrow type), None if unknown."""
    try:
        reduced = expr.__reduce__()
        reader = pa.ipc.open_file(reduced[1][0])
        batch = reader.get_batch(0) if reader.num_record_batches else None
        pairs = _metadata_pairs(reader.schema)
    except Exception:  # noqa: BLE001 - an unexpected pyarrow: no tree, callers fall back
        return None

    def column(i: str) -> pa.Scalar:
        assert batch is not None
        return batch.column(int(i))[0]

    def parse(i: int) -> tuple[Node, int]:
        key, value = pairs[i]
        if key == "field_ref":
            return ("field", value), i + 1
        if key == "literal":
            return ("lit", column(value)), i + 1
        if key != "call":
            raise _Unknown
        args: list[Node] = []
        options = None
        i += 1
        while pairs[i][0] not in ("end", "options"):
            arg, i = parse(i)
            args.append(arg)
        if pairs[i][0] == "options":
            options = column(pairs[i][1])
            i += 1
        if pairs[i] != ("end", value):
            raise _Unknown
        return ("call", value, tuple(args), options), i + 1

    try:
        node, end = parse(0)
    except (_Unknown, IndexError, ValueError, KeyError, AssertionError):
        return None
    return node if end == len(pairs) else None


def encode(node: Node) -> pc.Expression:
    """The pyarrow expression of a tree from :func:`decode`."""
    kind = node[0]
    if kind == "field":
        return pc.field(node[1])
    if kind == "lit":
        return pc.scalar(node[1])
    _, name, args, options = node
    opts = None
    if options is not None:
        batch = pa.record_batch([pa.array([options.as_py()], options.type)], names=[""])
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, batch.schema) as w:
            w.write_batch(batch)
        opts = pc.FunctionOptions.deserialize(sink.getvalue())
    return pc.Expression._call(name, [encode(a) for a in args], opts)


def fields_of(node: Node) -> set[str]:
    """Names of the fields a tree reads."""
    if node[0] == "field":
        return {node[1]}
    if node[0] == "call":
        return set().union(*(fields_of(a) for a in node[2])) if node[2] else set()
    return set()


def call(name: str, *args: Node) -> Node:
    """The tree of the call ``name(*args)`` without options."""
    return ("call", name, args, None)


def substitute(node: Node, values: dict[str, pa.Scalar]) -> Node:
    """``node`` with the fields named in ``values`` replaced by those literals."""
    if node[0] == "field":
        return ("lit", values[node[1]]) if node[1] in values else node
    if node[0] == "call":
        _, name, args, options = node
        return ("call", name, tuple(substitute(a, values) for a in args), options)
    return node


def same(a: Any, b: Any) -> bool:
    """Whether two trees are the same (literals compared by identity)."""
    if a is b:
        return True
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, pa.Scalar) or isinstance(b, pa.Scalar):
        return a is b
    return a == b
