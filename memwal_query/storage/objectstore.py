"""FileIO on object stores through ``obstore``: S3 (and S3-compatible stores), Google
Cloud Storage and Azure Blob Storage / ADLS Gen2, in one class parameterised by the kind
of store.

Everything memwal_query writes outside Lance datasets (WAL entries, region manifests,
version hints, bloom filters, catch-up progress) goes through
:class:`ObjectStoreFileIO`; the Lance datasets themselves (base table and flushed
generations) are read and written by Lance with the same ``storage_options``.
:func:`memwal_query.storage.factory.file_io_for` returns one for ``s3://``, ``gs://``,
``az://`` and ``abfss://`` URIs.

Credentials and endpoint
------------------------
One dict of ``storage_options`` configures both: Lance's keys for the store (``aws_*``,
``google_*``, ``azure_*`` and their short forms, plus the HTTP client's ``allow_http``,
``timeout``...) are translated for obstore by
:func:`memwal_query.storage.options.store_settings`; unknown keys (Lance-only tuning
options) are ignored here and still reach Lance. Missing values come from the usual
environment variables (``AWS_*``, ``GOOGLE_*``, ``AZURE_*``), as in Lance. Keys starting
with ``memwal_`` are memwal_query's own (Lance ignores them):

``memwal_conditional_put`` (default ``"true"``)
    ``"false"`` declares that the store has no atomic put-if-not-exists. memwal_query
    then refuses to open the table (:class:`ConditionalPutUnsupportedError`) unless
    ``memwal_commit_lock`` is given.
``memwal_commit_lock``
    An external lock that serializes every put-if-not-exists (check-then-put under the
    lock) and the index lock: ``file:///path/to/lockfile`` (an ``flock``: all writers
    on one host or a shared POSIX file system), or the name of a lock registered with
    :func:`~memwal_query.storage.options.register_commit_lock`.
``memwal_lock_ttl`` (default ``"30"``)
    Seconds a lease of the index lock lasts without renewal (see
    :class:`~memwal_query.storage.lease.LeaseLock`).
``memwal_verify_conditional_put`` (default ``"true"``)
    Probe once per bucket that the store really refuses a second create-only put (some
    S3-compatible stores silently ignore ``If-None-Match``); a store that does not is
    refused with :class:`ConditionalPutUnsupportedError`.

Put-if-not-exists
-----------------
A create-only put (obstore ``mode="create"``: ``If-None-Match: *`` on S3 and Azure,
``x-goog-if-generation-match: 0`` on GCS): exactly one of several racing writers
succeeds, the others get ``412``/``409`` and
:class:`~memwal_query.exceptions.AlreadyExistsError`. Every conditional put carries a
random token in the object's user metadata (``memwal_put_token``: an identifier, as
Azure requires), so an ambiguous outcome (a timeout, a ``5xx``, a dropped connection,
or a lost response whose retry then saw ``412``) is resolved by reading the token back:
ours means we won, another means we lost, none means nothing landed and the put is
tried again, with backoff, within a deadline.

Conditional overwrites
----------------------
:meth:`ObjectStoreFileIO.put_if_match` replaces an object only if it is still the
version read (``If-Match: <etag>`` on S3 and Azure; ``x-goog-if-generation-match:
<generation>`` on GCS, whose e-tags cannot be compared on writes). Versions are opaque
strings to callers (:meth:`~ObjectStoreFileIO.read_versioned`).

Errors
------
A request that still fails after the HTTP client's retries (``client_max_retries``,
default 3, within ``client_retry_timeout``, default 30 s) is an
:class:`~memwal_query.storage.options.ObjectStoreError` naming the operation and the
object; a missing object is :class:`~memwal_query.exceptions.ObjectNotFoundError`.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any, TypeAlias

import obstore
from obstore import exceptions as obx
from obstore.store import AzureStore, GCSStore, S3Store

from memwal_query.exceptions import AlreadyExistsError, ObjectNotFoundError, StorageError
from memwal_query.storage.io import FileIO, join
from memwal_query.storage.options import (
    DOCS,
    OPT_COMMIT_LOCK,
    OPT_CONDITIONAL_PUT,
    PUT_TOKEN_ATTRIBUTE,
    CommitLock,
    ConcurrentModificationError,
    ConditionalPutUnsupportedError,
    ObjectStoreError,
    StoreKind,
    StoreSettings,
    resolve_commit_lock,
    store_kind,
    store_settings,
)

log = logging.getLogger(__name__)

Store: TypeAlias = "S3Store | GCSStore | AzureStore"

_PUT_ATTEMPTS = 5
# A conditional put with an unknown outcome is tried again only within this many seconds
# of its start: each try already goes through the HTTP client's own retries.
_PUT_DEADLINE_SECONDS = 60.0
_DELETE_BATCH = 1000
# Rounds of "list what is left, delete it" of a delete_tree (a batched delete that meets
# a key deleted meanwhile raises for that key on some stores while deleting the others).
_DELETE_ROUNDS = 5


# -- URIs -------------------------------------------------------------------------------------
def split_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> ``("bucket", "a/b")`` (any object-store scheme).

    For ``abfss://container@account.dfs.core.windows.net/a/b`` the "bucket" is the
    whole authority (``container@account...``): :func:`container_of` splits it.

    Raises
    ------
    StorageError
        Not an object-store URI, or no bucket in it.
    """
    scheme, sep, rest = uri.partition("://")
    if not sep or store_kind(uri) is None:
        raise StorageError(f"{uri}: not an object-store URI (s3://, gs://, az://...)")
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise StorageError(f"{uri}: no bucket in the URI")
    return bucket, key.strip("/")


def container_of(authority: str) -> tuple[str, str | None]:
    """``container@account.dfs.core.windows.net`` -> ``("container", "account")``;
    a plain name -> ``(name, None)``."""
    container, at, host = authority.partition("@")
    if not at:
        return authority, None
    return container, host.split(".", 1)[0] or None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _error(operation: str, path: str, e: BaseException, writing: bool = False) -> StorageError:
    """The typed error of a failed request (``writing``: a 404 means no bucket)."""
    if isinstance(e, FileNotFoundError):
        if writing:
            return ObjectStoreError(operation, path, f"no such bucket ({_first_line(e)})")
        return ObjectNotFoundError(f"{path}: no such object")
    return ObjectStoreError(operation, path, f"{type(e).__name__}: {_first_line(e)}")


_DEFINITE = (
    obx.PermissionDeniedError,
    obx.UnauthenticatedError,
    obx.InvalidPathError,
    obx.UnknownConfigurationKeyError,
    FileNotFoundError,
    ValueError,
)


class ObjectStoreFileIO(FileIO):
    """:class:`~memwal_query.storage.io.FileIO` on an object store (obstore).

    Paths are full URIs (``s3://bucket/key``, ``gs://bucket/key``,
    ``az://container/key``); one obstore store per bucket is created on first use with
    the same configuration. Thread-safe; not fork-safe (create it in the process that
    uses it).

    Parameters
    ----------
    settings : StoreSettings, optional
        From :func:`~memwal_query.storage.options.store_settings`; default: S3 configured
        from environment variables only.
    commit_lock : callable, optional
        An external lock (see :data:`~memwal_query.storage.options.CommitLock`),
        overriding ``settings.commit_lock``.

    Raises
    ------
    ConditionalPutUnsupportedError
        ``conditional_put`` is off and no commit lock is configured.
    """

    def __init__(
        self, settings: StoreSettings | None = None, *, commit_lock: CommitLock | None = None
    ) -> None:
        self.settings = settings or StoreSettings()
        self.kind: StoreKind = self.settings.kind
        if commit_lock is None and self.settings.commit_lock:
            commit_lock = resolve_commit_lock(self.settings.commit_lock)
        self.commit_lock: CommitLock | None = commit_lock
        self.conditional_put = self.settings.conditional_put
        if not self.conditional_put and commit_lock is None:
            raise ConditionalPutUnsupportedError(
                f"{OPT_CONDITIONAL_PUT}=false: the store has no atomic put-if-not-exists, "
                f"so WAL entries and manifest versions cannot be committed safely; "
                f"configure an external lock with {OPT_COMMIT_LOCK} (see {DOCS})"
            )
        self._stores: dict[str, Store] = {}
        self._verified: set[str] = set()
        self._guard = threading.Lock()

    @classmethod
    def for_uri(
        cls, uri: str, storage_options: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> ObjectStoreFileIO:
        """The FileIO of the store a URI names, configured from Lance-style
        ``storage_options`` (``kwargs`` go to the constructor).

        Raises
        ------
        StorageError
            Not an object-store URI, or a malformed option.
        """
        kind = store_kind(uri)
        if kind is None:
            raise StorageError(f"{uri}: not an object-store URI (s3://, gs://, az://...)")
        return cls(store_settings(kind, storage_options), **kwargs)

    # -- plumbing ---------------------------------------------------------------------
    def _new_store(self, bucket: str) -> Store:
        s = self.settings
        config = dict(s.config)
        client = dict(s.client_options) or None
        retry = dict(s.retry_config) or None
        if self.kind == "gcs":
            return GCSStore(
                bucket,
                config=config or None,  # type: ignore[arg-type]
                client_options=client,  # type: ignore[arg-type]
                retry_config=retry,  # type: ignore[arg-type]
            )
        if self.kind == "azure":
            container, account = container_of(bucket)
            if account is not None and "account_name" not in config:
                config["account_name"] = account
            return AzureStore(
                container,
                config=config or None,  # type: ignore[arg-type]
                client_options=client,  # type: ignore[arg-type]
                retry_config=retry,  # type: ignore[arg-type]
            )
        return S3Store(
            bucket,
            config=config or None,  # type: ignore[arg-type]
            client_options=client,  # type: ignore[arg-type]
            retry_config=retry,  # type: ignore[arg-type]
        )

    def store(self, bucket: str) -> Store:
        """The (cached) obstore store of ``bucket`` (an Azure container, or the
        ``container@account...`` authority of an ``abfss`` URI).

        Raises
        ------
        StorageError
            obstore refused the configuration.
        """
        with self._guard:
            store = self._stores.get(bucket)
            if store is None:
                try:
                    store = self._new_store(bucket)
                except Exception as e:  # noqa: BLE001 - obstore config errors
                    raise StorageError(f"{self._root(bucket)}: {_first_line(e)}") from e
                self._stores[bucket] = store
            return store

    def _root(self, bucket: str) -> str:
        scheme = {"s3": "s3", "gcs": "gs", "azure": "az"}[self.kind]
        return f"{scheme}://{bucket}"

    def _locate(self, path: str) -> tuple[Store, str]:
        bucket, key = split_uri(path)
        return self.store(bucket), key

    @staticmethod
    def _dir(key: str) -> str | None:
        return key.rstrip("/") + "/" if key else None

    def _version(self, meta: Mapping[str, Any]) -> str | None:
        """The version a conditional overwrite compares with: the generation on GCS
        (its e-tags cannot be compared on writes), the e-tag elsewhere."""
        if self.kind == "gcs":
            version = meta.get("version")
            return None if version is None else str(version)
        etag = meta.get("e_tag")
        return None if etag is None else str(etag)

    def _update_mode(self, version: str) -> dict[str, str]:
        return {"version": version} if self.kind == "gcs" else {"e_tag": version}

    # -- reads ------------------------------------------------------------------------
    def read(self, path: str) -> bytes:
        store, key = self._locate(path)
        try:
            return bytes(obstore.get(store, key).bytes())
        except Exception as e:  # noqa: BLE001
            raise _error("read", path, e) from e

    def read_versioned(self, path: str) -> tuple[bytes, str | None]:
        """The object's bytes and its version (for :meth:`put_if_match`).

        Raises
        ------
        ObjectNotFoundError
            The object does not exist.
        ObjectStoreError
            The read failed.
        """
        store, key = self._locate(path)
        try:
            result = obstore.get(store, key)
            data = bytes(result.bytes())
            return data, self._version(result.meta)
        except Exception as e:  # noqa: BLE001
            raise _error("read", path, e) from e

    def exists(self, path: str) -> bool:
        """HEAD on an object (a "directory" prefix is not an object: see :meth:`is_dir`)."""
        store, key = self._locate(path)
        if not key:
            return True
        try:
            obstore.head(store, key)
            return True
        except FileNotFoundError:
            return False
        except Exception as e:  # noqa: BLE001
            raise _error("head", path, e) from e

    def size(self, path: str) -> int:
        store, key = self._locate(path)
        try:
            return int(obstore.head(store, key)["size"])
        except Exception as e:  # noqa: BLE001
            raise _error("head", path, e) from e

    def modified_at(self, path: str) -> float:
        """``Last-Modified`` of the object (epoch seconds), from a HEAD."""
        store, key = self._locate(path)
        try:
            return float(obstore.head(store, key)["last_modified"].timestamp())
        except Exception as e:  # noqa: BLE001
            raise _error("head", path, e) from e

    def list(self, prefix: str) -> list[str]:
        store, key = self._locate(prefix)
        try:
            result = obstore.list_with_delimiter(store, self._dir(key))
        except FileNotFoundError:
            return []
        except Exception as e:  # noqa: BLE001
            raise _error("list", prefix, e) from e
        names = {p.rstrip("/").rsplit("/", 1)[-1] for p in result["common_prefixes"]}
        names.update(o["path"].rsplit("/", 1)[-1] for o in result["objects"])
        names.discard("")
        return sorted(names)

    def _keys_under(self, store: Store, key: str) -> Iterator[str]:
        for batch in obstore.list(store, self._dir(key), chunk_size=1000):
            for meta in batch:
                yield meta["path"]

    def is_dir(self, path: str) -> bool:
        store, key = self._locate(path)
        try:
            for batch in obstore.list(store, self._dir(key), chunk_size=1):
                if batch:
                    return True
            return False
        except FileNotFoundError:
            return False
        except Exception as e:  # noqa: BLE001
            raise _error("list", path, e) from e

    def tree_size(self, prefix: str) -> int:
        store, key = self._locate(prefix)
        try:
            total = 0
            for batch in obstore.list(store, self._dir(key), chunk_size=1000):
                total += sum(int(m["size"]) for m in batch)
            return total
        except Exception as e:  # noqa: BLE001
            raise _error("list", prefix, e) from e

    # -- writes -----------------------------------------------------------------------
    def write(self, path: str, data: bytes) -> None:
        store, key = self._locate(path)
        try:
            obstore.put(store, key, data, mode="overwrite")
        except Exception as e:  # noqa: BLE001
            raise _error("put", path, e, writing=True) from e

    def delete(self, path: str) -> None:
        store, key = self._locate(path)
        try:
            obstore.delete(store, key)
        except FileNotFoundError:
            pass
        except Exception as e:  # noqa: BLE001
            raise _error("delete", path, e) from e

    def delete_tree(self, prefix: str) -> None:
        """Delete every object under ``prefix`` (batched); a missing prefix is no error.

        A batch that meets a key already gone (deleted concurrently, or by an earlier
        try whose answer was lost) raises on Azure and GCS while deleting the others:
        what is left is listed and deleted again, for a few rounds.
        """
        store, key = self._locate(prefix)
        if not key:
            raise StorageError(f"{prefix}: refusing to delete a whole bucket")
        try:
            for _ in range(_DELETE_ROUNDS):
                keys = list(self._keys_under(store, key))
                if not keys:
                    break
                for i in range(0, len(keys), _DELETE_BATCH):
                    with contextlib.suppress(FileNotFoundError):
                        obstore.delete(store, keys[i : i + _DELETE_BATCH])
            else:
                left = next(iter(self._keys_under(store, key)), None)
                if left is not None:
                    raise ObjectStoreError(
                        "delete", prefix, f"objects are still listed after deletes ({left})"
                    )
            with contextlib.suppress(FileNotFoundError):
                obstore.delete(store, key)
        except StorageError:
            raise
        except Exception as e:  # noqa: BLE001
            raise _error("delete", prefix, e) from e

    def put_if_not_exists(self, path: str, data: bytes) -> None:
        """Create ``path`` only if absent (a create-only put); see the module docs."""
        self.create(path, data)

    def create(self, path: str, data: bytes) -> str | None:
        """:meth:`put_if_not_exists` returning the new object's version (when known).

        Raises
        ------
        AlreadyExistsError
            Another writer's object is there.
        ObjectStoreError
            The outcome stayed unknown or failed through every attempt.
        """
        store, key = self._locate(path)
        if not self.conditional_put:
            return self._locked_create(path, store, key, data)
        self._verify(path, store, key)
        token = uuid.uuid4().hex
        delay = 0.05
        started = time.monotonic()
        for attempt in range(_PUT_ATTEMPTS):
            try:
                result = obstore.put(
                    store,
                    key,
                    data,
                    mode="create",
                    use_multipart=False,
                    attributes={PUT_TOKEN_ATTRIBUTE: token},
                )
                return self._version(result)
            except (obx.AlreadyExistsError, obx.PreconditionError) as e:
                # Ours if an earlier attempt landed but its response was lost.
                owner, version = self._token(path, store, key)
                if owner == token:
                    log.debug("create of %s: landed, answer lost (token matched)", path)
                    return version
                if owner is not None:
                    raise AlreadyExistsError(f"{path}: already exists") from e
                # 412 and then nothing there: deleted meanwhile; try again
                error: Exception = e
            except _DEFINITE as e:
                raise _error("create", path, e, writing=True) from e
            except Exception as e:  # noqa: BLE001 - outcome unknown: look
                owner, version = self._token(path, store, key)
                if owner == token:
                    log.debug("create of %s: landed, answer lost (token matched)", path)
                    return version
                if owner is not None:
                    raise AlreadyExistsError(f"{path}: already exists") from e
                error = e
            late = time.monotonic() - started > _PUT_DEADLINE_SECONDS
            if attempt == _PUT_ATTEMPTS - 1 or late:
                raise _error("create", path, error, writing=True) from error
            log.debug("conditional put of %s failed (%s); retrying", path, _first_line(error))
            time.sleep(delay * random.uniform(0.5, 1.5))
            delay *= 2
        raise AssertionError("unreachable")

    def put_if_match(self, path: str, data: bytes, version: str | None) -> str | None:
        """Overwrite ``path`` only if it is still at ``version`` (see the module docs).

        An answer lost on the way (the store applied the put, the client saw an error,
        or a retry then saw ``412``) is resolved by reading the object back: ``data``
        there means the put landed. Callers write distinct bytes each time (the lease
        lock's bodies carry the owner and an expiry).

        Returns
        -------
        str or None
            The new version.

        Raises
        ------
        ConcurrentModificationError
            The object changed or disappeared meanwhile.
        ObjectStoreError
            The put failed and did not land.
        """
        store, key = self._locate(path)
        if version is None:
            raise ConcurrentModificationError(f"{path}: no version to compare with")
        try:
            result = obstore.put(
                store,
                key,
                data,
                mode=self._update_mode(version),  # type: ignore[arg-type]
                use_multipart=False,
            )
            return self._version(result)
        except (obx.PreconditionError, obx.AlreadyExistsError, FileNotFoundError) as e:
            landed = self._landed(path, data)
            if landed is not None:
                log.debug("conditional put of %s: landed, answer lost (data matched)", path)
                return landed
            raise ConcurrentModificationError(f"{path}: changed since it was read") from e
        except _DEFINITE as e:
            raise _error("put", path, e) from e
        except Exception as e:  # noqa: BLE001 - outcome unknown: look
            landed = self._landed(path, data)
            if landed is not None:
                return landed
            raise _error("put", path, e) from e

    def _landed(self, path: str, data: bytes) -> str | None:
        """The object's version if it holds exactly ``data``, else None."""
        try:
            current, version = self.read_versioned(path)
        except ObjectNotFoundError:
            return None
        return version if current == data and version is not None else None

    def _token(self, path: str, store: Store, key: str) -> tuple[str | None, str | None]:
        """(put token, version) of an object; (None, None) when it does not exist."""
        try:
            result = obstore.get(store, key, options={"head": True})
        except FileNotFoundError:
            return None, None
        except Exception as e:  # noqa: BLE001
            raise _error("head", path, e) from e
        attrs: Mapping[str, Any] = result.attributes or {}
        token = attrs.get(PUT_TOKEN_ATTRIBUTE)
        # An object without a token was written by someone else (e.g. another tool).
        return (str(token) if token is not None else ""), self._version(result.meta)

    def _locked_create(self, path: str, store: Store, key: str, data: bytes) -> str | None:
        assert self.commit_lock is not None
        with self.commit_lock("put"):
            if self.exists(path):
                raise AlreadyExistsError(f"{path}: already exists")
            try:
                return self._version(obstore.put(store, key, data, mode="overwrite"))
            except Exception as e:  # noqa: BLE001
                raise _error("put", path, e, writing=True) from e

    def _verify(self, path: str, store: Store, key: str) -> None:
        """Check once per bucket that a second create-only put is refused."""
        if not self.settings.verify_conditional_put:
            return
        bucket, _ = split_uri(path)
        if bucket in self._verified:
            return
        parent = key.rsplit("/", 1)[0] if "/" in key else ""
        probe = join(parent, f".memwal-probe-{uuid.uuid4().hex}")
        root = self._root(bucket)
        try:
            obstore.put(store, probe, b"1", mode="create", use_multipart=False)
            try:
                obstore.put(store, probe, b"2", mode="create", use_multipart=False)
                honoured = False
            except (obx.AlreadyExistsError, obx.PreconditionError):
                honoured = True
        except obx.NotSupportedError as e:
            raise ConditionalPutUnsupportedError(
                f"{root}: the store does not support conditional put "
                f"({_first_line(e)}); configure {OPT_COMMIT_LOCK} (see {DOCS})"
            ) from e
        except Exception as e:  # noqa: BLE001
            raise _error("create", f"{root}/{probe}", e, writing=True) from e
        finally:
            with contextlib.suppress(Exception):
                obstore.delete(store, probe)
        if not honoured:
            raise ConditionalPutUnsupportedError(
                f"{root}: the store accepted a second create-only put "
                f"(it ignores conditional puts); set {OPT_CONDITIONAL_PUT}=false and "
                f"configure {OPT_COMMIT_LOCK} (see {DOCS})"
            )
        with self._guard:
            self._verified.add(bucket)

    def __repr__(self) -> str:
        endpoint = self.settings.config.get("endpoint", "default")
        return (
            f"ObjectStoreFileIO(kind={self.kind!r}, endpoint={endpoint!r}, "
            f"conditional_put={self.conditional_put})"
        )
