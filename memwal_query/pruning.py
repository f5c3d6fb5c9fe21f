"""Predicates for region pruning, read from DataFusion's pushed-down filter.

DataFusion hands the provider its filter as a ``pyarrow.compute.Expression``, which has
no public visitor API, so :func:`predicates_from_expression` parses its canonical text
(``((a == 5) and is_in(s, {value_set=...}))``) into a conjunction of simple predicates
``(column, op, value)`` with ``op`` in ``= != < <= > >= in``. Anything it does not
understand is dropped from the conjunction, which only means *less* pruning: pruning
never depends on a predicate it could not read. ``OR`` of equalities on one column
becomes ``in``.

The predicates are then checked against each region's value with
:meth:`memwal_query.regionspec.RegionSpec.may_match` (transform-aware, in the manner of
PyIceberg's ``project``).
"""

from __future__ import annotations

import datetime as dt
import json
import re
from typing import Any

_TOKEN = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<ts>\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2}(?:\.\d+)?Z?)
  | (?P<date>\d{4}-\d{2}-\d{2})
  | (?P<num>-?(?:\d+\.\d*|\d*\.\d+|\d+)(?:[eE][+-]?\d+)?)
  | (?P<str>"(?:[^"\\]|\\.)*")
  | (?P<op>==|!=|<=|>=|<|>)
  | (?P<punct>[(){}\[\],=:])
  | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<other>.)
    """,
    re.VERBOSE,
)
_FLIP = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "=": "=", "!=": "!="}

Predicate = tuple[str, str, Any]


class _Unknown(Exception):
    pass


def _tokens(text: str) -> list[tuple[str, str]]:
    out = []
    for m in _TOKEN.finditer(text):
        kind = m.lastgroup
        if kind == "ws":
            continue
        out.append((kind, m.group()))
    return out


class _Parser:
    def __init__(self, text: str) -> None:
        self.toks = _tokens(text)
        self.i = 0

    def peek(self) -> tuple[str, str] | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, value: str | None = None) -> tuple[str, str]:
        tok = self.peek()
        if tok is None or (value is not None and tok[1] != value):
            raise _Unknown
        self.i += 1
        return tok

    def node(self) -> Any:
        tok = self.peek()
        if tok is None:
            raise _Unknown
        if tok[1] == "(":
            self.take("(")
            left = self.node()
            nxt = self.peek()
            if nxt is not None and nxt[1] == ")":
                self.take(")")
                return left
            if nxt is None:
                raise _Unknown
            op = self.take()[1]
            right = self.node()
            self.take(")")
            if op in ("and", "or"):
                return (op, left, right)
            if op in ("==", "!=", "<", "<=", ">", ">="):
                return ("cmp", "=" if op == "==" else op, left, right)
            return ("unknown",)
        if tok[0] == "ident" and self.toks[self.i + 1 : self.i + 2] == [("punct", "(")]:
            return self.call()
        return self.atom()

    def atom(self) -> Any:
        kind, text = self.take()
        if kind == "ident":
            if text in ("true", "false"):
                return ("lit", text == "true")
            if text == "null":
                return ("lit", None)
            return ("field", text)
        if kind == "num":
            return ("lit", float(text) if any(c in text for c in ".eE") else int(text))
        if kind == "str":
            return ("lit", json.loads(text))
        if kind == "date":
            return ("lit", dt.date.fromisoformat(text))
        if kind == "ts":
            tz = text.endswith("Z")
            value = dt.datetime.fromisoformat(text.rstrip("Z").replace(" ", "T"))
            return ("lit", value.replace(tzinfo=dt.timezone.utc) if tz else value)
        raise _Unknown

    def call(self) -> Any:
        name = self.take()[1]
        self.take("(")
        if name == "is_in":
            field = self.node()
            self.take(",")
            self.take("{")
            self.take("value_set")
            self.take("=")
            self.take()  # type name
            if self.peek() == ("punct", ":"):
                self.take(":")
            self.take("[")
            values = []
            while self.peek() != ("punct", "]"):
                values.append(self.atom()[1])
                if self.peek() == ("punct", ","):
                    self.take(",")
            self.take("]")
            self._skip_to_close()  # the options' "}"
            self._skip_to_close()  # the call's ")"
            return ("in", field, values)
        self._skip_to_close()
        return ("unknown",)

    def _skip_to_close(self) -> None:
        depth = 1
        while depth:
            tok = self.take()
            if tok[1] in ("(", "{", "["):
                depth += 1
            elif tok[1] in (")", "}", "]"):
                depth -= 1


def _conjuncts(node: Any) -> list[Predicate]:
    kind = node[0]
    if kind == "and":
        return _conjuncts(node[1]) + _conjuncts(node[2])
    if kind == "cmp":
        _, op, left, right = node
        if left[0] == "field" and right[0] == "lit":
            return [(left[1], op, right[1])]
        if left[0] == "lit" and right[0] == "field":
            return [(right[1], _FLIP[op], left[1])]
        return []
    if kind == "in" and node[1][0] == "field":
        return [(node[1][1], "in", list(node[2]))]
    if kind == "or":
        col, values = _equalities(node)
        if col is not None:
            return [(col, "in", values)]
    return []


def _equalities(node: Any) -> tuple[str | None, list]:
    """``a = 1 or a = 2 or a in (3)`` -> ``("a", [1, 2, 3])``; otherwise ``(None, [])``."""
    if node[0] == "or":
        c1, v1 = _equalities(node[1])
        c2, v2 = _equalities(node[2])
        if c1 is not None and c1 == c2:
            return c1, v1 + v2
        return None, []
    preds = _conjuncts(node)
    if len(preds) == 1 and preds[0][1] in ("=", "in"):
        col, op, value = preds[0]
        return col, (list(value) if op == "in" else [value])
    return None, []


def predicates_from_expression(expr: Any) -> list[Predicate]:
    """Conjunction of simple predicates implied by a pyarrow filter expression."""
    if expr is None:
        return []
    try:
        parser = _Parser(str(expr))
        node = parser.node()
        if parser.peek() is not None:
            return []
    except (_Unknown, ValueError, IndexError):
        return []
    return [p for p in _conjuncts(node) if p[2] is not None or p[1] == "in"]


def referenced_columns(expr: Any, names: list[str]) -> list[str]:
    """Columns of ``names`` that a filter expression may read (a superset)."""
    if expr is None:
        return []
    idents = {text for kind, text in _tokens(str(expr)) if kind == "ident"}
    if any(n not in idents for n in names) and any(not n.isidentifier() for n in names):
        return list(names)  # a name the tokenizer cannot see: be safe
    return [n for n in names if n in idents]
