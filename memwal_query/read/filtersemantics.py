"""Filters evaluated by pyarrow answer as DataFusion would.

A provider's filter is evaluated by pyarrow on rows that Lance does not filter (flushed
generations, MemTables, and base rows when Lance refuses the expression). pyarrow
compares floats the IEEE way while DataFusion (and Lance, which runs DataFusion) orders
NaN above every other value and equal to itself; :func:`datafusion_semantics` rewrites
a decoded filter (:mod:`memwal_query.read.exprtree`) so that every source answers as
DataFusion would: float comparisons in DataFusion's order, SQL ``IN`` semantics for
NULL, ``-0.0`` equal to ``0.0``.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from memwal_query.read.exprtree import Node
from memwal_query.read.exprtree import call as _call

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
    """``node`` with its float comparisons rewritten to DataFusion's order (module docstring)."""
    return _rewrite(node, schema)
