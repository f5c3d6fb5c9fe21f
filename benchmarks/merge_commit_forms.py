"""The forms of one merge commit at scale: Lance's ``merge_insert`` vs the merger's own
``Update`` commit, on the same rows.

A base of ``--rows`` rows (default 10,000,000, ``lineitem``-like columns, a primary-key
BTREE), ``--rows / 10`` upserts (20% new keys, in key order as the merger hands them
over) and ``--rows / 200`` deleted keys. In turns, on fresh copies of the base, medians
of ``--repeat`` (wall and CPU seconds, all threads):

- ``merge_insert``: Lance's upsert of the rows alone (the maintenance target's
  reference; it does not apply the deletes);
- ``merge_insert`` + delete: the upsert, then a ``when_matched_delete`` of the deleted
  keys (Lance's cheapest form of the same change);
- ``Update``: the merger's own form (``memwal_query.maintain.merger``): one scan of the
  key column with row addresses looked up in a bitmap of the batch keys
  (``_base_addresses``), the rows as new fragments, deletion files
  (``_delete_rows``), one ``Update`` commit (the progress marker's commit of no rows,
  3-5 ms, is left out: the copies have no MemWAL index).

Then the ``Update`` copy equals the ``merge_insert`` + delete copy row for row, and the
primary-key BTREE answers lookups of replaced, new, deleted and untouched keys the same
on both, before and after ``optimize_indices``. ``uptime`` is printed with the figures.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("LANCE_LOG", "error")

import lance  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import lineitem_rows as rows  # noqa: E402
from _common import machine, print_table, uptime  # noqa: E402

from memwal_query.maintain import merger  # noqa: E402


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def upsert(path: str, live: pa.Table) -> None:
    builder = lance.dataset(path).merge_insert("id").use_index(False)
    builder.when_matched_update_all().when_not_matched_insert_all().execute(live)


def upsert_delete(path: str, live: pa.Table, dead: pa.Table) -> None:
    upsert(path, live)
    lance.dataset(path).merge_insert("id").use_index(False).when_matched_delete().execute(dead)


def update(path: str, live: pa.Table, dead: pa.Table) -> None:
    ds = lance.dataset(path)
    keys = np.concatenate([merger._int_keys(live.column("id")), merger._int_keys(dead["id"])])
    addresses = merger._base_addresses(ds, "id", keys)
    assert addresses is not None
    new = lance.fragment.write_fragments(live, ds, schema=ds.schema)
    updated, removed = merger._delete_rows(ds, addresses)
    op = lance.LanceOperation.Update(
        removed_fragment_ids=removed, updated_fragments=updated, new_fragments=new
    )
    lance.LanceDataset.commit(ds, op, read_version=ds.version)


def lookups(path: str, keys: np.ndarray) -> pa.Table:
    where = f"id IN ({', '.join(map(str, keys.tolist()))})"
    return lance.dataset(path).to_table(filter=where).sort_by("id")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--root", default=None, help="work directory (default: a temp dir)")
    args = parser.parse_args()
    n = args.rows
    root = tempfile.mkdtemp(prefix="merge-commit-forms-", dir=args.root)
    try:
        base = f"{root}/base"
        rng = np.random.default_rng(1)
        for start in range(0, n, 2_000_000):
            part = rows(np.arange(start, min(n, start + 2_000_000)), rng)
            lance.write_dataset(part, base, mode="append" if start else "create")
        lance.dataset(base).create_scalar_index("id", "BTREE")
        ups, new = n // 10, n // 50
        keys = np.concatenate([rng.choice(n, ups - new, replace=False), np.arange(n, n + new)])
        keys.sort()
        live = rows(keys, rng)
        gone = np.setdiff1d(rng.choice(n, n // 200, replace=False), keys)
        dead = pa.table({"id": pa.array(gone, pa.int64())})
        forms = {
            "merge_insert": lambda p: upsert(p, live),
            "merge_insert + delete": lambda p: upsert_delete(p, live, dead),
            "Update (ours)": lambda p: update(p, live, dead),
        }
        runs: dict[str, list[tuple[float, float]]] = {k: [] for k in forms}
        paths: dict[str, str] = {}
        for r in range(args.repeat):
            for i, (name, fn) in enumerate(forms.items()):
                path = paths[name] = f"{root}/{i}-{r}"
                shutil.copytree(base, path)
                cpu, started = cpu_seconds(), time.perf_counter()
                fn(path)
                runs[name].append((time.perf_counter() - started, cpu_seconds() - cpu))
            print(f"  round {r + 1}: {uptime()}", flush=True)
        med = {
            k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
            for k, v in runs.items()
        }
        ref_w, ref_c = med["merge_insert + delete"]
        out = [[k, round(w, 3), round(c, 3), w / ref_w, c / ref_c] for k, (w, c) in med.items()]
        ours, theirs = paths["Update (ours)"], paths["merge_insert + delete"]
        same = (
            lance.dataset(ours)
            .to_table()
            .sort_by("id")
            .equals(lance.dataset(theirs).to_table().sort_by("id"))
        )
        probe = np.concatenate(
            [keys[:: max(1, len(keys) // 50)], gone[:20], np.arange(0, n, n // 20)]
        )
        before = lookups(ours, probe).equals(lookups(theirs, probe))
        lance.dataset(ours).optimize.optimize_indices(num_indices_to_merge=0)
        after = lookups(ours, probe).equals(lookups(theirs, probe))
        print(
            f"  answers equal row for row: {same}; BTREE lookups equal: {before}, after "
            f"optimize_indices: {after}"
        )
        print_table(
            f"One merge commit of {ups:,} upserts + {len(gone):,} deletes into a {n:,}-row "
            f"base ({machine()}, {time.strftime('%Y-%m-%d')}, {uptime()} at the end)",
            [
                "form",
                "wall s",
                "CPU s",
                "wall / (merge_insert + delete)",
                "CPU / (merge_insert + delete)",
            ],
            out,
        )
        if not (same and before and after):
            raise SystemExit("the Update form's answer differs from Lance's")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
