"""Named crash points for fault-injection tests.

``point("wal.after_write")`` kills the process with SIGKILL when the environment
variable ``MEMWAL_CRASH_AT`` names that point (optionally ``name:N`` to crash at its
N-th hit). Free when the variable is unset. Points: ``wal.after_write``,
``manifest.before_commit``, ``manifest.after_commit``, ``flush.mid``,
``merge.before_commit``, ``merge.after_update`` (the merger's own Update committed, not
yet checked for a batch merged meanwhile), ``merge.between_commits`` (a batch's deletes,
or its rows, committed, its progress not yet), ``merge.after_commit``, ``catchup.mid``
(indexes extended, progress not recorded yet), ``gc.mid``.
"""

from __future__ import annotations

import os
import signal

_ENV = "MEMWAL_CRASH_AT"
POINTS = (
    "wal.after_write",
    "manifest.before_commit",
    "manifest.after_commit",
    "flush.mid",
    "merge.before_commit",
    "merge.after_update",
    "merge.between_commits",
    "merge.after_commit",
    "catchup.mid",
    "gc.mid",
)
_hits: dict[str, int] = {}


def point(name: str) -> None:
    """Crash here if ``MEMWAL_CRASH_AT`` selects this point."""
    target = os.environ.get(_ENV)
    if not target:
        return
    want, _, nth = target.partition(":")
    if want != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] >= int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
