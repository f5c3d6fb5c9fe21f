"""Docstrings state contracts: the public API documents its parameters and results
(numpydoc sections), and no code, test or page refers to issue numbers."""

from __future__ import annotations

import inspect
import pathlib
import re

import pytest

import memwal_query
from memwal_query import session, table

ROOT = pathlib.Path(__file__).resolve().parent.parent
_ISSUE = re.compile(r"\bissues? ?#?\d+", re.IGNORECASE)


def _texts() -> list[pathlib.Path]:
    out = [ROOT / "README.md"]
    for folder in ("memwal_query", "tests", "docs", "benchmarks"):
        out += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md")]
    return out


def test_no_issue_numbers_in_code_tests_or_docs():
    found = [
        f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
        for p in _texts()
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if _ISSUE.search(line) and p.name != "test_docstrings.py"
    ]
    assert not found, "\n".join(found)


def _public_callables() -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = [("memwal_query.register", session.register)]
    for cls in (table.MemWalTable, table.Maintenance, table.Alter, table.Consumers):
        for name, member in vars(cls).items():
            if name.startswith("_") or isinstance(member, property):
                continue
            if isinstance(member, (staticmethod, classmethod)):
                member = member.__func__
            if inspect.isfunction(member):
                out.append((f"{cls.__name__}.{name}", member))
    return out


@pytest.mark.parametrize("name, func", [pytest.param(n, f, id=n) for n, f in _public_callables()])
def test_public_api_documents_parameters_and_returns(name, func):
    doc = inspect.getdoc(func) or ""
    sig = inspect.signature(func)
    params = [p for p in sig.parameters if p not in ("self", "cls")]
    if params:
        assert "Parameters\n----------" in doc, f"{name}: no Parameters section"
        for p in params:
            assert re.search(rf"\b{re.escape(p)}\b", doc), f"{name}: {p!r} undocumented"
    if sig.return_annotation not in (None, "None", inspect.Signature.empty):
        assert "Returns\n-------" in doc, f"{name}: no Returns section"


def test_the_checks_see_the_public_api():
    names = {name for name, _ in _public_callables()}
    assert {"MemWalTable.write", "Maintenance.maintain", "Consumers.register"} <= names
    assert memwal_query.register is session.register
