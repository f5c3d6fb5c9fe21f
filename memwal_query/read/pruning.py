"""Predicates for region pruning, read from DataFusion's pushed-down filter.

DataFusion hands the provider its filter as a ``pyarrow.compute.Expression``, which has
no public visitor API, so :func:`predicates_from_expression` reads its serialized tree
(:func:`decode`) into a conjunction of simple predicates
``(column, op, value)`` with ``op`` in ``= != < <= > >= in``. Anything it does not
understand is dropped from the conjunction, which only means *less* pruning: pruning
never depends on a predicate it could not read. ``OR`` of equalities on one column
becomes ``in``.

The predicates are then checked against each region's value with
:meth:`memwal_query.regions.spec.RegionSpec.may_match` (transform-aware, in the manner of
PyIceberg's ``project``).

The same filter is also evaluated by pyarrow on rows that Lance does not filter (flushed
generations, MemTables, and base rows when Lance refuses the expression). pyarrow
compares floats the IEEE way while DataFusion (and Lance, which runs DataFusion) orders
NaN above every other value and equal to itself; :func:`decode` reads the expression
tree losslessly and :func:`datafusion_semantics` rewrites the float comparisons so
that every source answers as DataFusion would.
"""

from __future__ import annotations

import ctypes
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc


class _Unknown(Exception):
    """An expression-tree node :func:`decode` does not know."""


_FLIP = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "=": "=", "!=": "!="}

Predicate = tuple[str, str, Any]


def predicates_from_expression(expr: Any) -> list[Predicate]:
    """Conjunction of simple predicates implied by a pyarrow filter expression.

    Read from the expression tree (:func:`decode`), whose literals keep their exact
    value: the canonical text cannot be trusted for strings, which pyarrow prints
    without escaping (``'x", "y'`` in an ``IN`` list would read as two values, and
    pruning on them would skip the region that holds the real one). An expression that
    cannot be decoded gives no predicate (less pruning, never a wrong one).
    """
    if expr is None or not isinstance(expr, pc.Expression):
        return []
    node = decode(expr)
    return [] if node is None else _tree_conjuncts(node)


_TREE_OPS = {
    "equal": "=",
    "not_equal": "!=",
    "less": "<",
    "less_equal": "<=",
    "greater": ">",
    "greater_equal": ">=",
}
_NO_VALUE = object()  # a literal without an exact Python value: no predicate from it


def _literal_value(scalar: pa.Scalar) -> Any:
    """Exact Python value of a literal; None for NULL, ``_NO_VALUE`` if not exact."""
    if not scalar.is_valid:
        return None
    t = scalar.type
    if pa.types.is_dictionary(t):
        return _literal_value(scalar.value)
    unit = getattr(t, "unit", None)
    if unit == "ns" and (pa.types.is_timestamp(t) or pa.types.is_duration(t)):
        # as_py() would give a pandas object, or drop the nanoseconds
        nanos = scalar.cast(pa.int64()).as_py()
        if nanos % 1000:
            return _NO_VALUE
        coarse = pa.timestamp("us", t.tz) if pa.types.is_timestamp(t) else pa.duration("us")
        return pa.scalar(nanos // 1000, pa.int64()).cast(coarse).as_py()
    if pa.types.is_time64(t) and unit == "ns":
        nanos = scalar.cast(pa.int64()).as_py()
        if nanos % 1000:
            return _NO_VALUE
        return pa.scalar(nanos // 1000, pa.int64()).cast(pa.time64("us")).as_py()
    try:
        return scalar.as_py()
    except (pa.ArrowException, ValueError, OverflowError):
        return _NO_VALUE


def _tree_conjuncts(node: Node) -> list[Predicate]:
    """:func:`_conjuncts` of a decoded tree (see :func:`predicates_from_expression`)."""
    if node[0] != "call":
        return []
    _, name, args, options = node
    if name in ("and", "and_kleene") and len(args) == 2:
        return _tree_conjuncts(args[0]) + _tree_conjuncts(args[1])
    if name in _TREE_OPS and len(args) == 2:
        a, b = args
        op = _TREE_OPS[name]
        if a[0] == "field" and b[0] == "lit":
            column, lit = a[1], b[1]
        elif a[0] == "lit" and b[0] == "field":
            column, lit, op = b[1], a[1], _FLIP[op]
        else:
            return []
        value = _literal_value(lit)
        return [] if value is None or value is _NO_VALUE else [(column, op, value)]
    if name == "is_in" and len(args) == 1 and args[0][0] == "field" and options is not None:
        try:
            value_set = options["value_set"].values
        except (KeyError, AttributeError, TypeError):
            return []
        if value_set is None:
            return []
        # one Python value per literal of the IN list (not per data row)
        values = [_literal_value(value_set[i]) for i in range(len(value_set))]
        if any(v is _NO_VALUE for v in values):
            return []
        return [(args[0][1], "in", values)]
    if name in ("or", "or_kleene"):
        column, values = _tree_equalities(node)
        if column is not None:
            return [(column, "in", values)]
    return []


def _tree_equalities(node: Node) -> tuple[str | None, list]:
    """``a = 1 or a = 2 or a in (3)`` -> ``("a", [1, 2, 3])``; otherwise ``(None, [])``."""
    if node[0] == "call" and node[1] in ("or", "or_kleene") and len(node[2]) == 2:
        c1, v1 = _tree_equalities(node[2][0])
        c2, v2 = _tree_equalities(node[2][1])
        if c1 is not None and c1 == c2:
            return c1, v1 + v2
        return None, []
    preds = _tree_conjuncts(node)
    if len(preds) == 1 and preds[0][1] in ("=", "in"):
        column, op, value = preds[0]
        return column, (list(value) if op == "in" else [value])
    return None, []


def referenced_columns(expr: Any, names: list[str]) -> list[str]:
    """Columns of ``names`` that a filter expression reads (a superset if undecodable)."""
    if expr is None:
        return []
    node = decode(expr) if isinstance(expr, pc.Expression) else None
    if node is not None:
        used = fields_of(node)
        return [n for n in names if n in used]
    return list(names)  # cannot be read: every column may be referenced


# -- the expression tree -----------------------------------------------------------------
# pyarrow pickles an Expression as an Arrow IPC file (arrow::compute::Serialize): the
# literals and call options are the columns of a one-row batch, and the tree, in prefix
# order, is the schema's key/value metadata: ("call", name), the arguments,
# ("options", column) when the call has options, ("end", name); ("field_ref", name);
# ("literal", column). ``Schema.metadata`` is a dict, which drops repeated keys, so the
# pairs are read in order through the Arrow C data interface.
Node = tuple  # ("field", name) | ("lit", pa.Scalar) | ("call", name, args, options)


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


def _call(name: str, *args: Node) -> Node:
    return ("call", name, args, None)


# Boolean helpers that fold the constants True/False (Kleene logic: NULL AND FALSE is
# FALSE, NULL OR TRUE is TRUE, so folding never changes a NULL result).
Cond = Node | bool


def _and(x: Cond, y: Cond) -> Cond:
    if x is False or y is False:
        return False
    if x is True:
        return y
    if y is True:
        return x
    return _call("and_kleene", x, y)


def _or(x: Cond, y: Cond) -> Cond:
    if x is True or y is True:
        return True
    if x is False:
        return y
    if y is False:
        return x
    return _call("or_kleene", x, y)


def _not(x: Cond) -> Cond:
    return (not x) if isinstance(x, bool) else _call("invert", x)


def _is_float(node: Node, schema: pa.Schema) -> bool:
    kind = node[0]
    if kind == "field":
        i = schema.get_field_index(node[1])
        return i >= 0 and pa.types.is_floating(schema.field(i).type)
    if kind == "lit":
        return pa.types.is_floating(node[1].type)
    if node[1] == "cast" and node[3] is not None:
        return pa.types.is_floating(node[3].type.field("to_type").type)
    return False


def _nan(node: Node, schema: pa.Schema) -> Cond:
    """Is ``node`` NaN: a constant for literals and non-float operands, else ``is_nan``."""
    if node[0] == "lit":
        v = node[1]
        return bool(v.is_valid and pa.types.is_floating(v.type) and v.as_py() != v.as_py())
    return _call("is_nan", node) if _is_float(node, schema) else False


def _valid(node: Node) -> Cond:
    if node[0] == "lit":
        return bool(node[1].is_valid)
    return _call("is_valid", node)


def _df_compare(name: str, a: Node, b: Node, schema: pa.Schema) -> Node:
    """``a <name> b`` under DataFusion's float order: NaN = NaN, NaN above all else.

    pyarrow already agrees on every pair without a NaN (-0.0 = 0.0 included); the extra
    terms only decide the NaN cases, and keep NULL where either side is NULL (Kleene
    logic), so that a NOT around the comparison stays right.
    """
    cmp = _call(name, a, b)
    nan_a, nan_b = _nan(a, schema), _nan(b, schema)
    if name == "equal":
        extra = _and(nan_a, nan_b)  # NaN = NaN
        out = _or(cmp, extra)
    elif name == "not_equal":
        out = _and(cmp, _not(_and(nan_a, nan_b)))
    else:
        if name in ("less", "less_equal"):  # a < b  <=>  b > a
            small, nan_big, nan_small = a, nan_b, nan_a
        else:
            small, nan_big, nan_small = b, nan_a, nan_b
        if name in ("less", "greater"):  # NaN > x for every non-NULL, non-NaN x
            other = _and(_valid(small), _not(nan_small))
        else:  # NaN >= x for every non-NULL x
            other = _valid(small)
        out = _or(cmp, _and(nan_big, other))
    if isinstance(out, bool):  # only with two literals; DataFusion folds those itself
        return cmp
    return out


_INCONCLUSIVE = 3  # arrow::compute::SetLookupOptions::NullMatchingBehavior::INCONCLUSIVE
_COMPARISONS = ("equal", "not_equal", "less", "less_equal", "greater", "greater_equal")


def _rewrite(node: Node, schema: pa.Schema) -> Node:
    if node[0] != "call":
        return node
    _, name, args, options = node
    args = tuple(_rewrite(a, schema) for a in args)
    if name in _COMPARISONS and len(args) == 2:
        if _is_float(args[0], schema) or _is_float(args[1], schema):
            return _df_compare(name, args[0], args[1], schema)
    if name == "is_in" and len(args) == 1 and options is not None:
        value = options.as_py()
        # SQL's IN: NULL IN (...) is NULL, and so is a miss when the list holds a NULL
        # (so that NOT IN drops them too); DataFusion pushes is_in with MATCH, where NULL
        # IN (1, 2) is false and NOT IN keeps the row.
        value["null_matching_behavior"] = _INCONCLUSIVE
        if _is_float(args[0], schema):
            # pyarrow's hash lookup tells -0.0 from 0.0. So does DataFusion's for IN
            # lists of 4+ values, but not for shorter ones (ORs of =), nor Lance, which
            # filters the base table: follow = by adding +0.0 to both sides (-0.0 + 0.0
            # = +0.0; NaN still matches NaN).
            args = (_call("add", args[0], ("lit", pa.scalar(0.0, pa.float64()))),)
            value_set = options["value_set"].values
            if pa.types.is_floating(value_set.type):
                value["value_set"] = pc.add(value_set, pa.scalar(0.0, value_set.type)).to_pylist()
        options = pa.scalar(value, options.type)
    return ("call", name, args, options)


def datafusion_semantics(node: Node, schema: pa.Schema) -> Node:
    """``node`` with its float comparisons rewritten to DataFusion's order (module docs)."""
    return _rewrite(node, schema)


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
