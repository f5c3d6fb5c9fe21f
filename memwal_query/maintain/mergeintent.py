"""The merger's own ``Update`` commit, made so that a batch is never applied twice.

A batch committed as the merger's own Lance ``Update`` (see
:func:`memwal_query.maintain.merger._commit_rewrite`) does not carry the progress
marker, so Lance does not refuse it for a stale marker as it refuses a
``merge_insert``: it *rebases* the Update over concurrent commits that touch none of
its fragments. A merger whose index lock was lost (a lease taken over after it stalled)
could so add a batch's rows after another merger merged the same batch. Two guards
close this:

1. **The sentinel fragment.** Every such Update also rewrites the metadata of one
   fragment of the version it was planned on, unchanged (the fragment with the lowest
   id, the *sentinel*). Lance refuses an Update rebased over another commit that
   changed, rewrote or removed a fragment it changes, so two mergers' Updates planned
   on one version never both land, and :func:`repair` can fence off an Update still in
   flight by committing the same no-op itself.
2. **The intent record.** Before the Update is committed, an intent object
   (``_mem_wal/_merge_intents/{uuid}.json``) records the transaction's uuid, the version
   the Update was planned on, its new data files and the batch's regions' progress on
   that version. After the commit, :func:`settle` checks whether Lance rebased it over
   a commit that merged those regions further (a merger taking the ``merge_insert``
   path touches no fragment of the Update) and, if so, commits an ``Update`` removing
   the fragments it added; then the intent is removed. A merger killed anywhere in
   between leaves the intent, and :func:`repair` (run under the index lock before a
   merge pass and before a compaction) finishes the job: it finds the Update in the
   table's history by its transaction uuid and settles it, or, when the Update is not
   there, fences it off (sentinel) and drops the intent.

Every step is idempotent: the undo removes the fragments holding the Update's data
files that are still in the latest version (none after an earlier undo), and the
intent is removed only once its Update is settled or can no longer commit.
Rationale and the Lance behaviour relied on: docs/maintenance.md, "How a merge commits".
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import lance
import pyarrow.compute as pc
from lance.commit import CommitConflictError as LanceCommitConflictError
from lance.dataset import Transaction

from memwal_query.exceptions import CorruptFileError, ObjectNotFoundError
from memwal_query.storage import crashpoints, paths
from memwal_query.storage.io import join
from memwal_query.storage.locking import index_lock

if TYPE_CHECKING:
    from lance.mem_wal import CompactedSsTable

    from memwal_query.catalog import Catalog

INTENTS_DIR = "_merge_intents"
# A fence (sentinel no-op) that loses its race to the Update it fences off is retried
# after re-reading the history this many times before the intent is left for the next
# pass.
FENCE_ATTEMPTS = 3


class MergedMeanwhile(OSError):
    """The batch's regions were merged further by another commit before the merger's
    Update landed: a lost race (its rows, if committed, were removed again)."""


@dataclass(frozen=True)
class MergeIntent:
    """What a merger's Update is about to commit (see the module docs).

    Attributes
    ----------
    txn : str
        The Lance transaction uuid the Update is committed with.
    planned : int
        The base version the Update was planned on.
    files : tuple of str
        The data files (paths relative to ``data/``) of its new fragments.
    before : dict
        ``merged_generations`` of the batch's regions on ``planned``.
    sentinel : int or None
        The fragment whose metadata the Update rewrites unchanged (None: the base had no
        fragment).
    """

    txn: str
    planned: int
    files: tuple[str, ...]
    before: dict[str, int]
    sentinel: int | None

    def to_json(self) -> bytes:
        body = {
            "txn": self.txn,
            "planned": self.planned,
            "files": list(self.files),
            "before": self.before,
            "sentinel": self.sentinel,
        }
        return json.dumps(body, sort_keys=True).encode()

    @classmethod
    def from_json(cls, path: str, raw: bytes) -> MergeIntent:
        """Parse an intent object (``path`` names it in the error).

        Raises
        ------
        CorruptFileError
            Not an intent object.
        """
        try:
            d = json.loads(raw)
            sentinel = d["sentinel"]
            return cls(
                str(d["txn"]),
                int(d["planned"]),
                tuple(str(f) for f in d["files"]),
                {str(k): int(v) for k, v in d["before"].items()},
                None if sentinel is None else int(sentinel),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CorruptFileError(path, f"not a merge intent: {e}") from e


def intents_dir(table_uri: str) -> str:
    """``{table}/_mem_wal/_merge_intents``."""
    return join(paths.mem_wal_root(table_uri), INTENTS_DIR)


def _intent_path(table_uri: str, txn: str) -> str:
    return join(intents_dir(table_uri), f"{txn}.json")


def _clear(table: Catalog, intent: MergeIntent) -> None:
    table.io.delete(_intent_path(table.uri, intent.txn))


def commit_update(
    table: Catalog,
    latest: lance.LanceDataset,
    new: Sequence[Any],
    updated: Sequence[Any],
    removed: Sequence[int],
    marker: Sequence[CompactedSsTable],
    own_versions: list[int],
) -> lance.LanceDataset:
    """Commit the merger's ``Update`` (``new`` fragments, ``updated`` fragments' new
    deletion files, ``removed`` fragment ids) planned on ``latest``, guarded as the
    module docs describe; return the committed version.

    ``own_versions`` gets every base version committed here (the Update, and its undo).
    Called under the index lock.

    Raises
    ------
    MergedMeanwhile
        Lance rebased the Update over a commit that merged ``marker``'s regions further
        (its rows were removed again), or refused it for a concurrent change of a
        fragment it changes: a lost race either way.
    """
    updated = list(updated)
    touched = {f.id for f in updated} | set(removed)
    sentinel = _sentinel(latest)
    if sentinel is not None and sentinel.id not in touched:
        updated.append(sentinel)
    before = table.index(latest).merged_generations()
    intent = MergeIntent(
        str(uuid.uuid4()),
        latest.version,
        tuple(f.path for meta in new for f in meta.files),
        {m.shard_id: before.get(m.shard_id, 0) for m in marker},
        None if sentinel is None else sentinel.id,
    )
    table.io.write(_intent_path(table.uri, intent.txn), intent.to_json())
    op = lance.LanceOperation.Update(
        removed_fragment_ids=list(removed), updated_fragments=updated, new_fragments=list(new)
    )
    try:
        committed = lance.LanceDataset.commit(
            latest,
            Transaction(latest.version, op, intent.txn),
            storage_options=table.storage_options or None,
        )
    except LanceCommitConflictError as e:
        _clear(table, intent)  # refused: nothing committed
        raise MergedMeanwhile(f"{table.uri}: conflict: {e}") from e
    # any other failure keeps the intent: the commit may have landed (repair decides)
    own_versions.append(committed.version)
    crashpoints.point("merge.after_update")
    undone = settle(table, intent, committed.version)
    if undone is not None:
        own_versions.append(undone)
        raise MergedMeanwhile(f"{table.uri}: conflict: merged meanwhile (version {undone})")
    return committed


def _sentinel(ds: lance.LanceDataset) -> Any | None:
    """The metadata of the fragment of ``ds`` with the lowest id (None: no fragment)."""
    frags = ds.get_fragments()
    if not frags:
        return None
    return min(frags, key=lambda f: f.fragment_id).metadata


def settle(table: Catalog, intent: MergeIntent, version: int) -> int | None:
    """Settle the intent of an Update committed as ``version``: when Lance rebased it
    over commits that merged its regions further than on ``intent.planned``, commit an
    ``Update`` removing the fragments holding its data files that the latest version
    still has, and return that version (None: nothing to undo, or already undone);
    then remove the intent. Idempotent. Called under the index lock.
    """
    undone = None
    if version != intent.planned + 1:
        now = table.index(table.dataset(version)).merged_generations()
        if any(now.get(r, 0) != g for r, g in intent.before.items()):
            undone = _remove_files(table, intent.files)
    _clear(table, intent)
    return undone


def _holding(ds: lance.LanceDataset, files: Sequence[str]) -> list[int]:
    """Ids of the fragments of ``ds`` holding any of ``files``."""
    ours = set(files)
    return [
        f.fragment_id for f in ds.get_fragments() if any(d.path in ours for d in f.data_files())
    ]


def _remove_files(table: Catalog, files: Sequence[str]) -> int | None:
    """Commit an ``Update`` removing the fragments of the latest version that hold any
    of ``files``; its version (None: none holds one, e.g. the same undo was committed
    meanwhile by the merger that made them). A lost commit race is retried on the new
    latest version (:data:`FENCE_ATTEMPTS` times in all; then its error is raised)."""
    for attempt in range(FENCE_ATTEMPTS):
        latest = table.dataset()
        added = _holding(latest, files)
        if not added:
            return None
        op = lance.LanceOperation.Update(
            removed_fragment_ids=added, updated_fragments=[], new_fragments=[]
        )
        try:
            undone = lance.LanceDataset.commit(
                latest,
                op,
                read_version=latest.version,
                storage_options=table.storage_options or None,
            )
        except LanceCommitConflictError:
            if attempt + 1 == FENCE_ATTEMPTS:
                raise
            continue
        return int(undone.version)
    return None  # not reached


def pending(table: Catalog) -> list[str]:
    """Paths of the intents left behind (an Update not yet settled)."""
    root = intents_dir(table.uri)
    return [join(root, n) for n in table.io.list(root) if n.endswith(".json")]


def repair(table: Catalog) -> list[int]:
    """Settle every intent left behind by a merger that stopped between recording it
    and removing it (see the module docs); return the versions of the undo commits
    made. One listing when there is none. An intent removed meanwhile (settled by its
    own merger, whose lock was lost) is skipped; one whose undo or fence keeps losing
    its commit races is left for the next pass.

    Raises
    ------
    CorruptFileError
        An intent object is not one.
    StorageError
        The store could not be read or written (the intents stay for the next pass).
    """
    if not pending(table):
        return []
    undone: list[int] = []
    with index_lock(table.uri, table.io):
        for path in pending(table):
            try:
                raw = table.io.read(path)
            except ObjectNotFoundError:
                continue  # settled meanwhile by its own merger
            intent = MergeIntent.from_json(path, raw)
            version = _repair_one(table, intent)
            if version is not None:
                undone.append(version)
    return undone


def _repair_one(table: Catalog, intent: MergeIntent) -> int | None:
    """Settle one intent left behind (under the index lock); the undo's version."""
    try:
        for _ in range(FENCE_ATTEMPTS):
            latest = table.dataset()
            version = _find(latest, intent)
            if version is not None:
                return settle(table, intent, version)
            if _holding(latest, intent.files):
                # committed, but its version was cleaned up: its rows tell
                twice = _twice(table, latest, intent)
                undone = _remove_files(table, intent.files) if twice else None
                _clear(table, intent)
                return undone
            if _fenced(table, latest, intent):
                _clear(table, intent)
                return None
    except LanceCommitConflictError:
        pass  # the undo kept losing its commit races: the intent stays
    return None  # the Update kept landing around the fence: the next pass settles it


def _find(latest: lance.LanceDataset, intent: MergeIntent) -> int | None:
    """The version whose transaction is the intent's Update (None: not committed, as
    far as the history from ``intent.planned`` on tells)."""
    for v in range(intent.planned + 1, latest.version + 1):
        try:
            txn = latest.read_transaction(v)
        except OSError:
            continue  # a version removed by cleanup: it is not the Update's
        if txn is not None and txn.uuid == intent.txn:
            return v
    return None


def _twice(table: Catalog, latest: lance.LanceDataset, intent: MergeIntent) -> bool:
    """Whether a key of the live rows the intent's Update added has another live row
    in ``latest`` (the Update was applied over a merge of its batch: a legitimate one
    marked every other row of its keys deleted). Only for an Update whose version is no
    longer in the history.

    Its own fragments' keys (one batch's) are read whole; the other fragments' key
    column is streamed, batch by batch, until a key of theirs is found (memory: the
    batch's keys and one scan batch, whatever the base's size)."""
    key = table.primary_key[0]
    ours = set(_holding(latest, intent.files))
    frags = latest.get_fragments()
    mine = [f for f in frags if f.fragment_id in ours]
    rest = [f for f in frags if f.fragment_id not in ours]
    if not mine or not rest:
        return False
    added = latest.scanner(columns=[key], fragments=mine).to_table().column(0)
    if not len(added):
        return False
    keys = pc.unique(added.combine_chunks())
    for batch in latest.scanner(columns=[key], fragments=rest).to_batches():
        if pc.any(pc.is_in(batch.column(0), value_set=keys)).as_py():
            return True
    return False


def _fenced(table: Catalog, latest: lance.LanceDataset, intent: MergeIntent) -> bool:
    """Make sure the intent's Update, not committed up to ``latest``, never commits:
    commit the sentinel's no-op on ``latest`` (Lance then refuses the Update, which
    changes the same fragment). True when it can no longer commit; False when the
    fence lost its race (the Update may have landed meanwhile: look again)."""
    if intent.sentinel is None:
        return True  # planned on an empty base: never chosen for an Update
    fragment = latest.get_fragment(intent.sentinel)
    if fragment is None:
        return True  # the sentinel was removed or rewritten: the Update conflicts
    op = lance.LanceOperation.Update(
        removed_fragment_ids=[], updated_fragments=[fragment.metadata], new_fragments=[]
    )
    try:
        lance.LanceDataset.commit(
            latest, op, read_version=latest.version, storage_options=table.storage_options or None
        )
    except LanceCommitConflictError:
        return False
    return True
