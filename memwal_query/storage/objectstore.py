"""FileIO on S3-compatible object stores (AWS S3, MinIO, R2, ...) through ``obstore``.

Everything memwal_query writes outside Lance datasets (WAL entries, region manifests,
version hints, bloom filters, catch-up progress) goes through :class:`S3FileIO`; the
Lance datasets themselves (base table and flushed generations) are read and written by
Lance with the same ``storage_options``. :func:`memwal_query.storage.factory.file_io_for` returns an
:class:`S3FileIO` for ``s3://bucket/path`` URIs.

Credentials and endpoint
------------------------
One dict of ``storage_options`` configures both: Lance's keys (``aws_access_key_id``,
``aws_secret_access_key``, ``aws_session_token``, ``aws_endpoint``, ``aws_region``,
``allow_http``, ``aws_virtual_hosted_style_request``, ...) are translated for obstore by
:func:`s3_settings`; unknown keys (Lance-only tuning options) are ignored here and still
reach Lance. Missing values come from the usual ``AWS_*`` environment variables, as in
Lance. Keys starting with ``memwal_`` are memwal_query's own (Lance ignores them):

``memwal_conditional_put`` (default ``"true"``)
    ``"false"`` declares that the store has no atomic put-if-not-exists
    (``If-None-Match: *``). memwal_query then refuses to open the table
    (:class:`ConditionalPutUnsupportedError`) unless ``memwal_commit_lock`` is given.
``memwal_commit_lock``
    An external lock that serializes every put-if-not-exists (check-then-put under the
    lock) and the index lock: ``file:///path/to/lockfile`` (an ``flock``: all writers
    on one host or a shared POSIX file system), or the name of a lock registered with
    :func:`memwal_query.storage.s3config.register_commit_lock` (for example one backed
    by DynamoDB or etcd).
``memwal_lock_ttl`` (default ``"30"``)
    Seconds a lease of the index lock lasts without renewal (see :class:`LeaseLock`).
``memwal_verify_conditional_put`` (default ``"true"``)
    Probe once per bucket that the store really refuses a second ``If-None-Match: *``
    put (some S3-compatible stores silently ignore the header); a store that does not
    is refused with :class:`ConditionalPutUnsupportedError`.

Put-if-not-exists
-----------------
``PutObject`` with ``If-None-Match: *`` (obstore ``mode="create"``): exactly one of
several racing writers succeeds, the others get ``412`` and
:class:`~memwal_query.exceptions.AlreadyExistsError`. Every conditional put carries a
random token in the object's user metadata, so an ambiguous outcome (a timeout, a
``5xx``, a ``409`` conflict, or a lost response whose retry then saw ``412``) is
resolved by reading the token back: ours means we won, another means we lost, none
means nothing landed and the put is retried.

The index lock
--------------
:func:`index_lease` is what :func:`memwal_query.storage.locking.index_lock` uses on object
stores: a :class:`LeaseLock` on ``{table}/_mem_wal/.index.lock`` (create with
``If-None-Match: *``, take over a released or expired lease with ``If-Match: <etag>``,
renewed in the background), or the external commit lock when one is configured.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import obstore
from obstore import exceptions as obx
from obstore.store import S3Store

from memwal_query.exceptions import AlreadyExistsError, ObjectNotFoundError, StorageError
from memwal_query.storage.io import FileIO, join
from memwal_query.storage.s3config import (
    OPT_COMMIT_LOCK,
    OPT_CONDITIONAL_PUT,
    PUT_TOKEN_ATTRIBUTE,
    S3_SCHEMES,
    CommitLock,
    ConcurrentModificationError,
    ConditionalPutUnsupportedError,
    S3Settings,
    resolve_commit_lock,
    s3_settings,
)

log = logging.getLogger(__name__)

_PUT_ATTEMPTS = 5
# A conditional put with an unknown outcome is tried again only within this many seconds
# of its start: each try already goes through the HTTP client's own retries.
_PUT_DEADLINE_SECONDS = 60.0
# The HTTP client's retries when the storage options set none (obstore's own default
# is 10 retries within 180 s per request, which stacked under our attempts let one put
# block for half an hour against a store that accepts connections but never answers).
_DELETE_BATCH = 1000


# -- the FileIO -------------------------------------------------------------------------------
def split_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> ``("bucket", "a/b")``; raise StorageError otherwise."""
    scheme, sep, rest = uri.partition("://")
    if not sep or scheme.lower() not in S3_SCHEMES:
        raise StorageError(f"{uri}: not an s3:// URI")
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise StorageError(f"{uri}: no bucket in the URI")
    return bucket, key.strip("/")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _error(path: str, e: BaseException, writing: bool = False) -> StorageError:
    if isinstance(e, FileNotFoundError):
        if writing:  # a PUT answered 404: the bucket does not exist
            return StorageError(f"{path}: no such bucket ({_first_line(e)})")
        return ObjectNotFoundError(f"{path}: no such object")
    return StorageError(f"{path}: {type(e).__name__}: {_first_line(e)}")


_DEFINITE = (
    obx.PermissionDeniedError,
    obx.UnauthenticatedError,
    obx.InvalidPathError,
    obx.UnknownConfigurationKeyError,
    FileNotFoundError,
    ValueError,
)


class S3FileIO(FileIO):
    """:class:`~memwal_query.storage.io.FileIO` on S3-compatible object stores (obstore).

    Paths are full ``s3://bucket/key`` URIs; one ``S3Store`` per bucket is created on
    first use with the same configuration. Thread-safe; not fork-safe (create it in the
    process that uses it).

    Parameters
    ----------
    settings : S3Settings, optional
        From :func:`s3_settings`; default: environment variables only.
    commit_lock : callable, optional
        An external lock (see :data:`CommitLock`), overriding ``settings.commit_lock``.

    Raises
    ------
    ConditionalPutUnsupportedError
        ``conditional_put`` is off and no commit lock is configured.
    """

    def __init__(
        self, settings: S3Settings | None = None, *, commit_lock: CommitLock | None = None
    ) -> None:
        self.settings = settings or S3Settings()
        if commit_lock is None and self.settings.commit_lock:
            commit_lock = resolve_commit_lock(self.settings.commit_lock)
        self.commit_lock: CommitLock | None = commit_lock
        self.conditional_put = self.settings.conditional_put
        if not self.conditional_put and commit_lock is None:
            raise ConditionalPutUnsupportedError(
                f"{OPT_CONDITIONAL_PUT}=false: the store has no atomic put-if-not-exists, "
                f"so WAL entries and manifest versions cannot be committed safely; "
                f"configure an external lock with {OPT_COMMIT_LOCK} (see docs/s3.md)"
            )
        self._stores: dict[str, S3Store] = {}
        self._verified: set[str] = set()
        self._guard = threading.Lock()

    @classmethod
    def from_storage_options(
        cls, storage_options: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> S3FileIO:
        """An S3FileIO configured from Lance-style ``storage_options``."""
        return cls(s3_settings(storage_options), **kwargs)

    # -- plumbing ---------------------------------------------------------------------
    def store(self, bucket: str) -> S3Store:
        """The (cached) obstore ``S3Store`` of ``bucket``."""
        with self._guard:
            store = self._stores.get(bucket)
            if store is None:
                s = self.settings
                try:
                    store = S3Store(
                        bucket,
                        config=dict(s.config) or None,  # type: ignore[arg-type]
                        client_options=dict(s.client_options) or None,  # type: ignore[arg-type]
                        retry_config=dict(s.retry_config) or None,  # type: ignore[arg-type]
                    )
                except Exception as e:  # noqa: BLE001 - obstore config errors
                    raise StorageError(f"s3://{bucket}: {_first_line(e)}") from e
                self._stores[bucket] = store
            return store

    def _locate(self, path: str) -> tuple[S3Store, str]:
        bucket, key = split_uri(path)
        return self.store(bucket), key

    @staticmethod
    def _dir(key: str) -> str | None:
        return key.rstrip("/") + "/" if key else None

    # -- reads ------------------------------------------------------------------------
    def read(self, path: str) -> bytes:
        store, key = self._locate(path)
        try:
            return bytes(obstore.get(store, key).bytes())
        except Exception as e:  # noqa: BLE001
            raise _error(path, e) from e

    def read_versioned(self, path: str) -> tuple[bytes, str | None]:
        """The object's bytes and its ETag (for :meth:`put_if_match`)."""
        store, key = self._locate(path)
        try:
            result = obstore.get(store, key)
            data = bytes(result.bytes())
            return data, result.meta.get("e_tag")
        except Exception as e:  # noqa: BLE001
            raise _error(path, e) from e

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
            raise _error(path, e) from e

    def size(self, path: str) -> int:
        store, key = self._locate(path)
        try:
            return int(obstore.head(store, key)["size"])
        except Exception as e:  # noqa: BLE001
            raise _error(path, e) from e

    def list(self, prefix: str) -> list[str]:
        store, key = self._locate(prefix)
        try:
            result = obstore.list_with_delimiter(store, self._dir(key))
        except FileNotFoundError:
            return []
        except Exception as e:  # noqa: BLE001
            raise _error(prefix, e) from e
        names = {p.rstrip("/").rsplit("/", 1)[-1] for p in result["common_prefixes"]}
        names.update(o["path"].rsplit("/", 1)[-1] for o in result["objects"])
        names.discard("")
        return sorted(names)

    def _keys_under(self, store: S3Store, key: str) -> Iterator[dict]:
        for batch in obstore.list(store, self._dir(key), chunk_size=1000):
            yield from batch

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
            raise _error(path, e) from e

    def tree_size(self, prefix: str) -> int:
        store, key = self._locate(prefix)
        try:
            return sum(int(m["size"]) for m in self._keys_under(store, key))
        except Exception as e:  # noqa: BLE001
            raise _error(prefix, e) from e

    # -- writes -----------------------------------------------------------------------
    def write(self, path: str, data: bytes) -> None:
        store, key = self._locate(path)
        try:
            obstore.put(store, key, data, mode="overwrite")
        except Exception as e:  # noqa: BLE001
            raise _error(path, e, writing=True) from e

    def delete(self, path: str) -> None:
        store, key = self._locate(path)
        try:
            obstore.delete(store, key)
        except FileNotFoundError:
            pass
        except Exception as e:  # noqa: BLE001
            raise _error(path, e) from e

    def delete_tree(self, prefix: str) -> None:
        store, key = self._locate(prefix)
        if not key:
            raise StorageError(f"{prefix}: refusing to delete a whole bucket")
        try:
            keys = [m["path"] for m in self._keys_under(store, key)]
            for i in range(0, len(keys), _DELETE_BATCH):
                obstore.delete(store, keys[i : i + _DELETE_BATCH])
            obstore.delete(store, key)
        except FileNotFoundError:
            pass
        except Exception as e:  # noqa: BLE001
            raise _error(prefix, e) from e

    def put_if_not_exists(self, path: str, data: bytes) -> None:
        """Create ``path`` only if absent (``If-None-Match: *``); see the module docs."""
        self.create(path, data)

    def create(self, path: str, data: bytes) -> str | None:
        """:meth:`put_if_not_exists` returning the new object's ETag (when known)."""
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
                return result.get("e_tag")
            except (obx.AlreadyExistsError, obx.PreconditionError) as e:
                # Definitive unless a retried request of ours landed first.
                try:
                    owner, etag = self._token(store, key)
                except StorageError:
                    owner, etag = None, None
                if owner == token:
                    return etag
                raise AlreadyExistsError(f"{path}: already exists") from e
            except obx.NotSupportedError as e:
                raise ConditionalPutUnsupportedError(
                    f"{path}: the store does not support conditional put ({_first_line(e)}); "
                    f"configure {OPT_COMMIT_LOCK} (see docs/s3.md)"
                ) from e
            except _DEFINITE as e:
                raise _error(path, e, writing=True) from e
            except Exception as e:  # noqa: BLE001 - ambiguous: did it land?
                try:
                    owner, etag = self._token(store, key)
                except StorageError:
                    owner, etag = None, None
                if owner == token:
                    return etag
                if owner is not None:
                    raise AlreadyExistsError(f"{path}: already exists") from e
                late = time.monotonic() - started > _PUT_DEADLINE_SECONDS
                if attempt == _PUT_ATTEMPTS - 1 or late:
                    raise _error(path, e, writing=True) from e
                log.debug("conditional put of %s failed (%s); retrying", path, _first_line(e))
                time.sleep(delay * random.uniform(0.5, 1.5))
                delay *= 2
        raise AssertionError("unreachable")

    def put_if_match(self, path: str, data: bytes, etag: str | None) -> str | None:
        """Overwrite ``path`` only if its ETag is still ``etag`` (``If-Match``).

        Returns the new ETag; raises :class:`ConcurrentModificationError` when the
        object changed or disappeared meanwhile.
        """
        store, key = self._locate(path)
        if etag is None:
            raise ConcurrentModificationError(f"{path}: no ETag to compare with")
        try:
            result = obstore.put(store, key, data, mode={"e_tag": etag}, use_multipart=False)
            return result.get("e_tag")
        except (obx.PreconditionError, obx.AlreadyExistsError, FileNotFoundError) as e:
            raise ConcurrentModificationError(f"{path}: changed since it was read") from e
        except Exception as e:  # noqa: BLE001
            raise _error(path, e) from e

    def _token(self, store: S3Store, key: str) -> tuple[str | None, str | None]:
        """(put token, ETag) of an object; (None, None) when it does not exist."""
        try:
            result = obstore.get(store, key, options={"head": True})
        except FileNotFoundError:
            return None, None
        except Exception as e:  # noqa: BLE001
            raise _error(key, e) from e
        attrs = result.attributes or {}
        token = attrs.get(PUT_TOKEN_ATTRIBUTE)
        # An object without a token was written by someone else (e.g. another tool).
        return (token if token is not None else ""), result.meta.get("e_tag")

    def _locked_create(self, path: str, store: S3Store, key: str, data: bytes) -> str | None:
        assert self.commit_lock is not None
        with self.commit_lock("put"):
            if self.exists(path):
                raise AlreadyExistsError(f"{path}: already exists")
            try:
                return obstore.put(store, key, data, mode="overwrite").get("e_tag")
            except Exception as e:  # noqa: BLE001
                raise _error(path, e, writing=True) from e

    def _verify(self, path: str, store: S3Store, key: str) -> None:
        """Check once per bucket that a second ``If-None-Match: *`` put is refused."""
        if not self.settings.verify_conditional_put:
            return
        bucket, _ = split_uri(path)
        if bucket in self._verified:
            return
        parent = key.rsplit("/", 1)[0] if "/" in key else ""
        probe = join(parent, f".memwal-probe-{uuid.uuid4().hex}")
        try:
            obstore.put(store, probe, b"1", mode="create", use_multipart=False)
            try:
                obstore.put(store, probe, b"2", mode="create", use_multipart=False)
                honoured = False
            except (obx.AlreadyExistsError, obx.PreconditionError):
                honoured = True
        except obx.NotSupportedError as e:
            raise ConditionalPutUnsupportedError(
                f"s3://{bucket}: the store does not support conditional put "
                f"({_first_line(e)}); configure {OPT_COMMIT_LOCK} (see docs/s3.md)"
            ) from e
        except Exception as e:  # noqa: BLE001
            raise _error(f"s3://{bucket}/{probe}", e, writing=True) from e
        finally:
            with contextlib.suppress(Exception):
                obstore.delete(store, probe)
        if not honoured:
            raise ConditionalPutUnsupportedError(
                f"s3://{bucket}: the store accepted a second put with If-None-Match: * "
                f"(it ignores conditional puts); set {OPT_CONDITIONAL_PUT}=false and "
                f"configure {OPT_COMMIT_LOCK} (see docs/s3.md)"
            )
        with self._guard:
            self._verified.add(bucket)

    def __repr__(self) -> str:
        endpoint = self.settings.config.get("endpoint", "aws")
        return f"S3FileIO(endpoint={endpoint!r}, conditional_put={self.conditional_put})"
