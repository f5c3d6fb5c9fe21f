"""A seeded fault campaign on an object store: durable puts, flushes, merges, GC and reads
through :class:`faultproxy.FaultProxy`, checked against a model of acknowledged rows.

``run(kind, server, seed, faults)`` drives one table on one store until ``faults`` faults
were injected (503/500/429, timeouts past the client timeout, dropped connections, each
before or after the store applied the request). Every operation either succeeds or
raises a :class:`~memwal_query.exceptions.MemWalError` (anything else, and a
``StorageError`` whose message names no object, is recorded as ``untyped``). Every
successful read must equal the model: each key's row is its last acknowledged value,
or the value of a later put whose outcome was unknown (it raised), never an older one,
never twice, and nothing else. At the end, with faults off, the writer is recovered (a
new writer replays the WAL), the table must equal the model exactly once more, and
``fsck`` (``MemWalTable.check``) must find no error.

``tests/test_store_faults.py`` runs a short form in CI (``MEMWAL_STORE_FAULTS`` faults
per store); ``benchmarks/fault_campaign.py`` the full one (at least 1,000 faults over
the stores).
"""

from __future__ import annotations

import datetime as dt
import logging
import random
import time
import traceback
import uuid
from collections import Counter
from typing import Any

import lance
import pyarrow as pa
from faultproxy import FaultProxy, RandomFaults

from helpers import basic_rows

OPS = ("put",) * 8 + ("read",) * 3 + ("flush",) * 2 + ("merge", "gc")
# the chance that a request is faulted, by operation: an operation that makes many
# requests (a merge, GC) gets a lower rate, so that every operation meets faults and
# most of them still finish
RATES = {"put": 0.3, "read": 0.08, "flush": 0.04, "merge": 0.03, "gc": 0.03, "reopen": 0.1}
KEYS = 300
# the client's timeout and the time a "timeout" fault keeps it waiting
CLIENT_TIMEOUT_S = 0.6
FAULT_DELAY_S = 0.8
# kinds drawn for random faults: timeouts cost a client timeout each, so they are rarer
FAULT_KINDS = ("503",) * 3 + ("500",) * 3 + ("429",) * 3 + ("drop",) * 3 + ("timeout",)


class CampaignFailure(AssertionError):
    """The table disagreed with the model, or an error was not typed."""


def _options(server: Any, proxy: FaultProxy) -> dict[str, str]:
    return server.storage_options(
        endpoint=proxy.endpoint,
        timeout=f"{CLIENT_TIMEOUT_S}s",
        connect_timeout=f"{CLIENT_TIMEOUT_S}s",
        client_max_retries="3",
        client_retry_timeout="10",
        memwal_lock_ttl="5",
    )


class _Model:
    """Per key, the values a reader may see: the last acknowledged one, plus values of
    later puts whose outcome is unknown (None: absent)."""

    def __init__(self, base: dict[int, float]) -> None:
        self.allowed: dict[int, set[float | None]] = {k: {v} for k, v in base.items()}

    def acked(self, ids: list[int], vals: list[float]) -> None:
        for k, v in zip(ids, vals):
            self.allowed[k] = {v}

    def in_doubt(self, ids: list[int], vals: list[float]) -> None:
        for k, v in zip(ids, vals):
            self.allowed.setdefault(k, {None}).add(v)

    def check(self, table: pa.Table, what: str) -> int:
        ids = table.column("id").to_pylist()
        vals = table.column("val").to_pylist()
        if len(set(ids)) != len(ids):
            dup = Counter(ids).most_common(1)[0]
            raise CampaignFailure(f"{what}: key {dup[0]} seen {dup[1]} times")
        seen = dict(zip(ids, vals))
        for k, allowed in self.allowed.items():
            got = seen.pop(k, None)
            if got not in allowed:
                raise CampaignFailure(f"{what}: key {k} = {got}, expected one of {allowed}")
        if seen:
            raise CampaignFailure(f"{what}: unexpected keys {sorted(seen)[:10]}")
        return len(ids)


def run(
    kind: str,
    server: Any,
    seed: int,
    faults: int,
    bucket: str = "memwal-test",
    max_ops: int = 100_000,
) -> dict[str, Any]:
    """One campaign (see the module docs); returns its figures.

    Raises
    ------
    CampaignFailure
        A read disagreed with the model, an error was not a MemWalError, or fsck found
        an error after recovery.
    """
    import memwal_query as mq
    from memwal_query.exceptions import (
        FencedError,
        MemWalError,
        StorageError,
        WriterClosedError,
    )

    rng = random.Random(seed)
    plan = RandomFaults(seed, 0.0, kinds=FAULT_KINDS)
    plan.enabled = False
    proxy = FaultProxy(server.upstream, plan=plan, delay=FAULT_DELAY_S).start()
    figures: dict[str, Any] = {
        "store": kind,
        "seed": seed,
        "ops": Counter(),
        "typed_errors": Counter(),
        "untyped": [],
        "rows_checked": 0,
        "reads_checked": 0,
    }
    op_seconds: Counter[str] = Counter()
    resolved = _Resolved()
    store_log = logging.getLogger("memwal_query.storage.objectstore")
    level = store_log.level
    store_log.addHandler(resolved)
    store_log.setLevel(logging.DEBUG)
    started = time.monotonic()
    try:
        options = _options(server, proxy)
        uri = f"{server.root(bucket)}/{uuid.uuid4().hex}/t"
        base = {i: float(i) for i in range(0, KEYS, 3)}
        lance.write_dataset(basic_rows(sorted(base)), uri, storage_options=options)
        t = mq.MemWalTable.initialize(uri, storage_options=options)
        model = _Model(base)
        w = t.writer()
        seq = 0
        plan.enabled = True

        def attempt(op: str, fn: Any) -> Any:
            proxy.phase = op
            plan.rate = RATES.get(op, 0.0)
            figures["ops"][op] += 1
            began = time.monotonic()
            try:
                return True, fn()
            except MemWalError as e:
                figures["typed_errors"][(op, type(e).__name__)] += 1
                if isinstance(e, StorageError) and "://" not in str(e):
                    figures["untyped"].append(f"{op}: names no object: {e}")
                return False, e
            except Exception as e:  # noqa: BLE001 - recorded, the campaign fails
                figures["untyped"].append(f"{op}: {type(e).__name__}: {e}")
                figures["untyped_trace"] = traceback.format_exc()
                return False, e
            finally:
                op_seconds[op] += time.monotonic() - began

        ops = 0
        kinds = set(OPS)
        while ops < max_ops and (
            proxy.faults < faults or any(figures["ops"][op] < 1 for op in kinds)
        ):
            ops += 1
            op = rng.choice(OPS)
            if op == "put":
                ids = rng.sample(range(KEYS), 4)
                vals = [float(1_000_000 + seq * 10 + j) for j in range(len(ids))]
                seq += 1
                rows = basic_rows(ids, vals)
                ok, err = attempt("put", lambda rows=rows, w=w: w.put(rows))
                if ok:
                    model.acked(ids, vals)
                else:
                    model.in_doubt(ids, vals)
                    if isinstance(err, (FencedError, WriterClosedError)):
                        w = _reopen(t, w, attempt)
            elif op == "flush":
                attempt("flush", w.flush)
            elif op == "merge":
                attempt("merge", t.maintenance.merge)
            elif op == "gc":
                attempt("gc", lambda: t.maintenance.gc(cleanup_older_than=dt.timedelta(seconds=0)))
            else:
                ok, got = attempt("read", lambda w=w: t.to_table(writers=[w]))
                if ok:
                    figures["rows_checked"] += model.check(got, f"read {ops}")
                    figures["reads_checked"] += 1
        plan.enabled = False
        proxy.phase = "recovery"
        for _ in range(3):  # a close that failed under faults leaves the writer closed
            ok, _ = attempt("close", lambda: w.close())
            if ok:
                break
        fresh = mq.MemWalTable.open(uri, storage_options=options)
        recovered = fresh.writer(w.region_id)  # claims the region, replays the WAL
        got = fresh.to_table(writers=[recovered])
        figures["rows_checked"] += model.check(got, "after recovery")
        recovered.close()
        final = mq.MemWalTable.open(uri, storage_options=options)
        figures["rows_checked"] += model.check(final.to_table(), "after recovery, reopened")
        errors = [f for f in final.maintenance.fsck().findings if f.severity == "error"]
        if errors:
            raise CampaignFailure(f"fsck after the campaign: {errors}")
        figures["fsck_findings"] = len(final.maintenance.fsck().findings)
    finally:
        proxy.stop()
        store_log.removeHandler(resolved)
        store_log.setLevel(level)
    figures["lost_answers_resolved"] = resolved.count
    if figures["untyped"]:
        raise CampaignFailure(
            f"untyped errors: {figures['untyped'][:5]}\n{figures.get('untyped_trace', '')}"
        )
    figures["faults"] = proxy.faults
    figures["faults_by"] = Counter(proxy.counts)
    figures["requests"] = proxy.requests
    figures["retried_requests"] = proxy.retries
    figures["seconds"] = time.monotonic() - started
    figures["op_seconds"] = {op: round(s, 1) for op, s in op_seconds.items()}
    return figures


class _Resolved(logging.Handler):
    """Counts the puts that landed but whose answer was lost (resolved by reading back)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "answer lost" in record.getMessage():
            self.count += 1


def _reopen(t: Any, w: Any, attempt: Any) -> Any:
    """A new writer of ``w``'s region (claims it, replays the WAL), tried until it opens."""
    for _ in range(20):
        ok, got = attempt("reopen", lambda: t.writer(w.region_id))
        if ok:
            return got
    raise CampaignFailure(f"could not reopen a writer of region {w.region_id}")


def summary(all_figures: list[dict[str, Any]]) -> str:
    """The figures of several campaigns as text: faults by kind and operation, retries,
    typed errors, rows checked."""
    lines = []
    by_kind: Counter[str] = Counter()
    by_op: Counter[str] = Counter()
    for f in all_figures:
        for (phase, kind, when), n in f["faults_by"].items():
            by_kind[f"{kind}/{when}"] += n
            by_op[phase] += n
        typed = sum(f["typed_errors"].values())
        lines.append(
            f"{f['store']}: seed {f['seed']}, {f['faults']} faults in {f['requests']} requests "
            f"({f['retried_requests']} re-sent after a fault; {f['lost_answers_resolved']} "
            f"puts landed with their answer lost, resolved), ops {dict(f['ops'])}, "
            f"{typed} typed errors {dict(f['typed_errors'])}, {f['reads_checked']} reads / "
            f"{f['rows_checked']} rows checked, fsck findings {f['fsck_findings']}, "
            f"{f['seconds']:.1f} s {f['op_seconds']}"
        )
    total = sum(f["faults"] for f in all_figures)
    lines.append(f"total faults {total}: by kind {dict(by_kind)}; by operation {dict(by_op)}")
    return "\n".join(lines)
