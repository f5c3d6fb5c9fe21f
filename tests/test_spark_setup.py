"""Spark as installed: the first Spark snippet (docs/spark.md, "A first run") runs as
written in a clean environment.

The subprocess gets only PATH (without this interpreter's directory, so a worker started
as ``python3`` from PATH would be the system's, without our packages), HOME, JAVA_HOME if
set, and PYTHONPATH standing in for the editable install of this checkout. It must
print the deduplicated rows and no Python warning (pandas >= 3, lance's fork warning).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pyspark")

ROOT = Path(__file__).resolve().parent.parent


def readme_spark_snippet() -> str:
    text = (ROOT / "docs" / "spark.md").read_text()
    section = text[text.index("## A first run") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def clean_env() -> dict[str, str]:
    here = os.path.dirname(sys.executable)
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != here]
    env = {"PATH": os.pathsep.join(path), "HOME": os.environ.get("HOME", "/tmp")}
    if os.environ.get("JAVA_HOME"):
        env["JAVA_HOME"] = os.environ["JAVA_HOME"]
    env["PYTHONPATH"] = str(ROOT)
    return env


@pytest.mark.slow
def test_readme_spark_snippet_runs_in_clean_env(tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(readme_spark_snippet())
    proc = subprocess.run(
        [sys.executable, str(script)],
        env=clean_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ids = re.findall(r"^\|\s*(\d+)\|\s*7\|$", proc.stdout, re.M)
    assert ids == ["1", "2", "4"], proc.stdout
    warnings = re.findall(r"\w+Warning\b.*", proc.stderr)
    assert warnings == [], warnings


def test_worker_python_defaults_to_this_interpreter(monkeypatch):
    from memwal_query.spark._common import WORKER_PYTHON_ENV, default_worker_python

    monkeypatch.delenv(WORKER_PYTHON_ENV, raising=False)
    assert default_worker_python() == sys.executable
    assert os.environ[WORKER_PYTHON_ENV] == sys.executable
    monkeypatch.setenv(WORKER_PYTHON_ENV, "/opt/cluster/python3")
    assert default_worker_python() == "/opt/cluster/python3"  # an explicit choice stays
