"""How many batches a Lance scan of memwal_query decodes at once.

Lance decodes at most ``batch_readahead`` batches of a scan concurrently, and its
default is the number of its compute threads: the machine's CPUs less the two it
reserves for I/O (``LANCE_IO_CORE_RESERVATION``), at least one. On a machine of one
to three CPUs that is one batch at a time, so a scan of local data (in the page cache,
where decoding is the work) runs on one core while the others wait: a 10M-row base read
whole took 0.31 s of wall time for 0.34 s of CPU, and 0.20 s with four batches decoded
at once (the same CPU). memwal_query's scans of a base table's rows ask for
:func:`batch_readahead` batches, which is never fewer than Lance's default, when their
columns are narrow (numbers, strings); scans of wide columns (vectors, lists, binary
values: a batch of 65,536 rows of 1,536-d vectors is 400 MB) keep Lance's default.
"""

from __future__ import annotations

import os

MIN_BATCH_READAHEAD = 4
"""The fewest batches a scan decodes at once (:func:`batch_readahead`)."""


def _cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def batch_readahead() -> int | None:
    """The ``batch_readahead`` of memwal_query's Lance scans: the larger of
    :data:`MIN_BATCH_READAHEAD` and the process's CPUs, or None (Lance's own default)
    when the environment sets Lance's thread count (``LANCE_CPU_THREADS``).

    Returns
    -------
    int or None
    """
    if os.environ.get("LANCE_CPU_THREADS"):
        return None
    return max(MIN_BATCH_READAHEAD, _cpus())
