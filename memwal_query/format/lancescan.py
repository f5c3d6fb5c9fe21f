"""How many batches a Lance scan of memwal_query decodes at once.

Lance decodes at most ``batch_readahead`` batches of a scan concurrently, and its
default is the number of its compute threads: the machine's CPUs less the ones it
reserves for I/O (``LANCE_IO_CORE_RESERVATION``, default 2), at least one. On a machine
of one to three CPUs that is one batch at a time, so a scan of local data (in the page
cache, where decoding is the work) runs on one core while the others wait: on 2 cores,
Lance's own scan of a 10M-row base took 0.31 s of wall time for 0.34 s of CPU, and
0.20 s with four batches decoded at once (the same CPU). The reader's scans of a base
table's rows, when their columns are narrow (numbers, strings), and the merger's scan
of the base's keys ask for :func:`batch_readahead` batches: :data:`MIN_BATCH_READAHEAD`
where Lance's default is fewer, Lance's default elsewhere. Scans of wide columns
(vectors, lists, binary values: a batch of 65,536 rows of 1,536-d vectors is 400 MB)
keep Lance's default.
"""

from __future__ import annotations

import math
import os

MIN_BATCH_READAHEAD = 4
"""The batches a scan decodes at once where Lance's default is fewer (what Lance's own
default is on a machine of six CPUs)."""

_CGROUP_FILES = (
    ("/sys/fs/cgroup/cpu.max", None),  # cgroup v2: "<quota> <period>" or "max <period>"
    ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us"),  # v1
)


def _cgroup_cpus() -> int | None:
    """The CPUs the process's cgroup quota allows (rounded up), or None when no quota
    is set or readable."""
    for quota_file, period_file in _CGROUP_FILES:
        try:
            with open(quota_file) as f:
                fields = f.read().split()
            if period_file is not None:
                with open(period_file) as f:
                    fields.append(f.read().strip())
            quota, period = fields[0], fields[1]
            if quota in ("max", "-1"):
                return None
            return max(1, math.ceil(int(quota) / int(period)))
        except (OSError, ValueError, IndexError):
            continue
    return None


_CPUS: list[int] = []  # counted once per process, as Lance does


def cpus() -> int:
    """The CPUs this process may use (:func:`count_cpus`), counted on the first call
    and remembered, as Lance counts them once per process (no read of the cgroup files
    on every scan)."""
    if not _CPUS:
        _CPUS.append(count_cpus())
    return _CPUS[0]


def count_cpus() -> int:
    """The CPUs this process may use: those it may run on (its affinity), at most what
    its cgroup's CPU quota allows (a container's CPU limit), as Lance counts them."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        n = os.cpu_count() or 1
    quota = _cgroup_cpus()
    return max(1, min(n, quota) if quota is not None else n)


def lance_default_readahead() -> int:
    """Lance's default ``batch_readahead`` where ``LANCE_CPU_THREADS`` is not set: its
    compute threads, the CPUs less ``LANCE_IO_CORE_RESERVATION`` (default 2), at least
    one."""
    try:
        reserved = int(os.environ.get("LANCE_IO_CORE_RESERVATION") or 2)
    except ValueError:
        reserved = 2
    n = cpus()
    return n - reserved if n > reserved else 1


def batch_readahead() -> int | None:
    """The ``batch_readahead`` of memwal_query's scans of narrow columns:
    :data:`MIN_BATCH_READAHEAD` where Lance's default (:func:`lance_default_readahead`)
    is fewer, else None (Lance's default: never more batches in memory than Lance
    itself decodes at once on a machine of six CPUs or more). None too where the
    environment sets Lance's thread count (``LANCE_CPU_THREADS``): the user's choice.

    Returns
    -------
    int or None
    """
    if os.environ.get("LANCE_CPU_THREADS"):
        return None
    if lance_default_readahead() < MIN_BATCH_READAHEAD:
        return MIN_BATCH_READAHEAD
    return None
