"""Every Python code block of README.md and docs/*.md runs as written.

The blocks of one page run in order, in one fresh Python process whose working
directory is a temporary directory: a page defines what its examples use (a later block
may use what an earlier one of the same page made). A block right after an HTML comment
``<!-- test: spark -->`` needs PySpark (it runs in the slow lane, on its own: such blocks
start their own session); ``<!-- test: s3 -->`` needs an S3 store (its credentials are
placeholders: skipped). ``<!-- test: skip REASON -->`` skips a block that only sketches
(e.g. a fragment of a larger program). A block that runs must also print no Lance ERROR
or WARN log line and no ``DeprecationWarning`` on stderr.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
_MARK = re.compile(r"<!--\s*test:\s*(\w+)[^>]*-->\s*$")


@dataclass
class Block:
    page: pathlib.Path
    line: int
    code: str
    mark: str | None


def blocks(page: pathlib.Path) -> list[Block]:
    text = page.read_text()
    out = []
    for m in _FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = _MARK.search(before)
        line = text.count("\n", 0, m.start()) + 1
        out.append(Block(page, line, m.group(1), mark.group(1) if mark else None))
    return out


# What a reader of the docs must not meet when an example runs as written: Lance's log
# lines (an example asking for more IVF partitions than its rows can train warns) and
# deprecated spellings.
_NOISE = re.compile(r"^\[\S+ (ERROR|WARN) |DeprecationWarning", re.MULTILINE)


def run(code: str, cwd: pathlib.Path, what: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "LANCE_LOG"}  # the user's default
    env["PYTHONPATH"] = str(ROOT)
    p = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert p.returncode == 0, f"{what} failed:\n{p.stderr[-3000:]}"
    noise = [line for line in p.stderr.splitlines() if _NOISE.search(line)]
    assert not noise, f"{what} printed:\n" + "\n".join(noise[:10])


def _script(bs: list[Block]) -> str:
    # each block starts where it stands in the page (line numbers in tracebacks match)
    return "\n".join(f"# {b.page.name}:{b.line}\n{b.code}" for b in bs)


PAGED = [p for p in PAGES if any(b.mark is None for b in blocks(p))]


@pytest.mark.parametrize("page", PAGED, ids=[p.name for p in PAGED])
def test_page_python_blocks_run(page, tmp_path):
    plain = [b for b in blocks(page) if b.mark is None]
    run(_script(plain), tmp_path, f"{page.name} (blocks at lines {[b.line for b in plain]})")


SPARK = [b for p in PAGES for b in blocks(p) if b.mark == "spark"]


@pytest.mark.slow
@pytest.mark.parametrize("block", SPARK, ids=[f"{b.page.name}:{b.line}" for b in SPARK])
def test_spark_blocks_run(block, tmp_path):
    run(block.code, tmp_path, f"{block.page.name}:{block.line}")


def test_every_block_is_run_or_says_why_not():
    marks = {b.mark for p in PAGES for b in blocks(p)}
    assert marks <= {None, "spark", "s3", "skip"}, marks
    assert sum(len(blocks(p)) for p in PAGES) >= 10


def test_quick_start_runs_twice_in_a_row(tmp_path):
    (quick,) = [b for b in blocks(ROOT / "README.md") if "MemWalTable.create" in b.code]
    for attempt in (1, 2):  # the same working directory: nothing left behind gets in the way
        run(quick.code, tmp_path, f"README.md:{quick.line}, run {attempt}")


# The spellings docs/api.md lists as deprecated, written as a user would call them.
_DEPRECATED = re.compile(
    r"\bt\.(maintain|gc|merge|status|check|refresh_snapshots|catch_up_indexes|"
    r"set_region_spec|register_consumer|drop_consumer|write_retries|lance_schema|"
    r"region_specs|maintained_indexes)\b(?!\.)|\bt\.(dataset|index|consumers)\(\)"
)


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_pages_use_the_current_spellings(page):
    lines = page.read_text().splitlines()
    if page.name == "api.md":  # its table of deprecated spellings names them on purpose
        lines = [line for line in lines if not line.startswith("| `t.")]
    found = [
        f"{page.name}:{i}: {line}" for i, line in enumerate(lines, 1) if _DEPRECATED.search(line)
    ]
    assert not found, "\n".join(found)
