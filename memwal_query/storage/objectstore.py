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
    :func:`register_commit_lock` (for example one backed by DynamoDB or etcd).
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
import fcntl
import hashlib
import json
import logging
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import obstore
from obstore import exceptions as obx
from obstore.store import S3Store

from memwal_query.exceptions import AlreadyExistsError, ObjectNotFoundError, StorageError
from memwal_query.storage.io import FileIO, join
from memwal_query.storage.paths import mem_wal_root

log = logging.getLogger(__name__)

S3_SCHEMES = ("s3",)
OPT_CONDITIONAL_PUT = "memwal_conditional_put"
OPT_COMMIT_LOCK = "memwal_commit_lock"
OPT_LOCK_TTL = "memwal_lock_ttl"
OPT_VERIFY_CONDITIONAL_PUT = "memwal_verify_conditional_put"
PUT_TOKEN_ATTRIBUTE = "memwal-put-token"
INDEX_LOCK_NAME = ".index.lock"
DEFAULT_LOCK_TTL = 30.0
_PUT_ATTEMPTS = 5
# A conditional put with an unknown outcome is tried again only within this many seconds
# of its start: each try already goes through the HTTP client's own retries.
_PUT_DEADLINE_SECONDS = 60.0
# The HTTP client's retries when the storage options set none (obstore's own default
# is 10 retries within 180 s per request, which stacked under our attempts let one put
# block for half an hour against a store that accepts connections but never answers).
DEFAULT_RETRY_CONFIG = {"max_retries": 3, "retry_timeout": timedelta(seconds=30)}
_DELETE_BATCH = 1000


class ConditionalPutUnsupportedError(StorageError):
    """The store has no atomic put-if-not-exists and no external commit lock is configured.

    memwal_query never falls back to a check-then-put without a lock: two writers could
    both "win" a WAL position or a manifest version.
    """


class ConcurrentModificationError(StorageError):
    """A conditional overwrite (``If-Match``) found the object changed or gone."""


class LockTimeoutError(StorageError):
    """A lease lock could not be acquired within its timeout."""


# -- storage options -> obstore configuration ---------------------------------------------
_S3_KEYS: dict[str, str] = {}
_CLIENT_KEYS: dict[str, str] = {}
_BOOL_S3 = {
    "virtual_hosted_style_request",
    "skip_signature",
    "unsigned_payload",
    "s3_express",
    "imdsv1_fallback",
    "sse_bucket_key_enabled",
    "disable_tagging",
}


def _alias(table: dict[str, str], canonical: str, *names: str) -> None:
    for name in (canonical, *names):
        table[name] = canonical


_alias(_S3_KEYS, "access_key_id", "aws_access_key_id")
_alias(_S3_KEYS, "secret_access_key", "aws_secret_access_key")
_alias(_S3_KEYS, "session_token", "aws_session_token", "aws_token", "token")
_alias(_S3_KEYS, "endpoint", "aws_endpoint", "aws_endpoint_url", "endpoint_url")
_alias(_S3_KEYS, "aws_endpoint_url_s3")
_alias(_S3_KEYS, "region", "aws_region")
_alias(_S3_KEYS, "default_region", "aws_default_region")
_alias(_S3_KEYS, "virtual_hosted_style_request", "aws_virtual_hosted_style_request")
_alias(_S3_KEYS, "skip_signature", "aws_skip_signature")
_alias(_S3_KEYS, "unsigned_payload", "aws_unsigned_payload")
_alias(_S3_KEYS, "checksum_algorithm", "aws_checksum_algorithm")
_alias(_S3_KEYS, "request_payer", "aws_request_payer")
_alias(_S3_KEYS, "s3_express", "aws_s3_express")
_alias(_S3_KEYS, "imdsv1_fallback", "aws_imdsv1_fallback")
_alias(_S3_KEYS, "metadata_endpoint", "aws_metadata_endpoint")
_alias(_S3_KEYS, "server_side_encryption", "aws_server_side_encryption")
_alias(_S3_KEYS, "sse_kms_key_id", "aws_sse_kms_key_id")
_alias(_S3_KEYS, "sse_bucket_key_enabled", "aws_sse_bucket_key_enabled")
_alias(_S3_KEYS, "conditional_put", "aws_conditional_put")
_alias(_S3_KEYS, "disable_tagging", "aws_disable_tagging")
_alias(_S3_KEYS, "role_arn", "aws_role_arn")
_alias(_S3_KEYS, "role_session_name", "aws_role_session_name")
_alias(_S3_KEYS, "web_identity_token_file", "aws_web_identity_token_file")
_alias(_S3_KEYS, "sts_endpoint", "aws_sts_endpoint")
_alias(_S3_KEYS, "container_credentials_relative_uri", "aws_container_credentials_relative_uri")
_alias(_CLIENT_KEYS, "allow_http", "aws_allow_http")
_alias(_CLIENT_KEYS, "allow_invalid_certificates", "aws_allow_invalid_certificates")
for _k in (
    "connect_timeout",
    "timeout",
    "read_timeout",
    "pool_idle_timeout",
    "pool_max_idle_per_host",
    "proxy_url",
    "proxy_ca_certificate",
    "proxy_excludes",
    "user_agent",
):
    _alias(_CLIENT_KEYS, _k)

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _parse_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise StorageError(f"storage option {key}={value!r}: expected true or false")


@dataclass(frozen=True)
class S3Settings:
    """obstore configuration derived from ``storage_options`` (see :func:`s3_settings`).

    Attributes
    ----------
    config : dict
        ``S3Store`` configuration (obstore key names).
    client_options : dict
        HTTP client options (``allow_http``, timeouts, proxy...).
    retry_config : dict
        obstore retry configuration (from ``client_max_retries``/``client_retry_timeout``).
    conditional_put : bool
        Whether the store does put-if-not-exists (``If-None-Match: *``).
    verify_conditional_put : bool
        Probe the store once per bucket before the first conditional put.
    commit_lock : str or None
        ``memwal_commit_lock`` as given.
    lock_ttl : float
        Lease duration of the index lock, seconds.
    ignored : tuple of str
        Option keys not meant for obstore (left to Lance).
    """

    config: dict[str, Any] = field(default_factory=dict)
    client_options: dict[str, Any] = field(default_factory=dict)
    retry_config: dict[str, Any] = field(default_factory=dict)
    conditional_put: bool = True
    verify_conditional_put: bool = True
    commit_lock: str | None = None
    lock_ttl: float = DEFAULT_LOCK_TTL
    ignored: tuple[str, ...] = ()


def s3_settings(storage_options: Mapping[str, Any] | None) -> S3Settings:
    """Translate Lance-style ``storage_options`` into obstore's S3 configuration.

    Keys are matched case-insensitively, with or without the ``aws_`` prefix, as Lance
    and the Rust ``object_store`` crate accept them. ``memwal_*`` keys configure
    memwal_query (see the module docs); anything else is ignored here.
    """
    config: dict[str, Any] = {}
    client: dict[str, Any] = {}
    retry: dict[str, Any] = {}
    conditional_put = True
    verify = True
    commit_lock = None
    lock_ttl = DEFAULT_LOCK_TTL
    ignored = []
    for raw_key, value in (storage_options or {}).items():
        key = str(raw_key).strip().lower()
        if value is None:
            continue
        if key == OPT_CONDITIONAL_PUT:
            conditional_put = _parse_bool(raw_key, value)
        elif key == OPT_VERIFY_CONDITIONAL_PUT:
            verify = _parse_bool(raw_key, value)
        elif key == OPT_COMMIT_LOCK:
            commit_lock = str(value) or None
        elif key == OPT_LOCK_TTL:
            try:
                lock_ttl = float(value)
            except ValueError as e:
                raise StorageError(f"storage option {raw_key}={value!r}: not a number") from e
            if lock_ttl <= 0:
                raise StorageError(f"storage option {raw_key}={value!r}: must be positive")
        elif key in _S3_KEYS:
            name = _S3_KEYS[key]
            config[name] = _parse_bool(raw_key, value) if name in _BOOL_S3 else str(value)
        elif key in _CLIENT_KEYS:
            name = _CLIENT_KEYS[key]
            if name in ("allow_http", "allow_invalid_certificates"):
                client[name] = _parse_bool(raw_key, value)
            else:
                client[name] = str(value)
        elif key == "client_max_retries":
            retry["max_retries"] = int(value)
        elif key == "client_retry_timeout":
            retry["retry_timeout"] = timedelta(seconds=float(value))
        else:
            ignored.append(str(raw_key))
    if str(config.get("conditional_put", "")).lower() == "disabled":
        conditional_put = False
    return S3Settings(
        config=config,
        client_options=client,
        retry_config={**DEFAULT_RETRY_CONFIG, **retry},
        conditional_put=conditional_put,
        verify_conditional_put=verify,
        commit_lock=commit_lock,
        lock_ttl=lock_ttl,
        ignored=tuple(ignored),
    )


# -- external commit locks ------------------------------------------------------------------
CommitLock = Callable[[str], AbstractContextManager]
"""An external lock: ``lock(name)`` returns a context manager holding lock ``name``.

Names used: ``"put"`` (every put-if-not-exists of the store) and
``"index:{table_uri}"`` (the index lock of a table). Locks of different names must not
exclude each other needlessly, but may.
"""

_COMMIT_LOCKS: dict[str, CommitLock] = {}


def register_commit_lock(name: str, lock: CommitLock) -> None:
    """Make ``lock`` available as ``storage_options["memwal_commit_lock"] = name``."""
    if not name or name.startswith("file:") or name.startswith("/"):
        raise StorageError(f"commit lock name {name!r} is reserved or empty")
    _COMMIT_LOCKS[name] = lock


class FileCommitLock:
    """An external commit lock made of ``flock`` on local files.

    Lock ``"put"`` is ``path`` itself; any other name uses ``path.{hash of name}``.
    It excludes every process that uses the same files: the processes of one host, or
    of several hosts on a shared file system whose ``flock`` is coherent.
    """

    def __init__(self, path: str) -> None:
        self.path = path[len("file://") :] if path.startswith("file://") else path

    def _file(self, name: str) -> str:
        if name == "put":
            return self.path
        return f"{self.path}.{hashlib.sha1(name.encode()).hexdigest()[:16]}"

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        path = self._file(name)
        directory = os.path.dirname(path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def __repr__(self) -> str:
        return f"FileCommitLock({self.path!r})"


def resolve_commit_lock(spec: str) -> CommitLock:
    """The lock named by ``memwal_commit_lock``: a ``file://`` path or a registered name."""
    if spec.startswith("file://") or spec.startswith("/"):
        return FileCommitLock(spec)
    lock = _COMMIT_LOCKS.get(spec)
    if lock is None:
        raise StorageError(
            f"{OPT_COMMIT_LOCK}={spec!r}: not a file:// path and no lock of that name is "
            "registered (memwal_query.storage.objectstore.register_commit_lock)"
        )
    return lock


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


# -- lease lock -------------------------------------------------------------------------------
def _owner_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


class LeaseLock:
    """A mutual-exclusion lease stored as one object, for processes on any host.

    The object holds JSON ``{"owner", "expires_at", "ttl", "released"}``.

    - **Acquire**: create it with ``If-None-Match: *``; if it exists and is released
      or expired (``expires_at + skew < now``), replace it with ``If-Match: <etag>`` of
      the version read, so exactly one contender takes it over. Otherwise poll with
      exponential backoff (``poll`` doubling up to ``max_poll``, jittered) until
      ``timeout`` (:class:`LockTimeoutError`).
    - **Renew**: a daemon thread extends ``expires_at`` every ``ttl / 3`` with
      ``If-Match``. If that fails the lease was taken over (the holder stalled for
      longer than ``ttl``): :attr:`lost` is set and a warning logged.
    - **Release**: mark it released with ``If-Match`` (never clobbering a successor).

    Hosts' clocks must agree to within ``skew`` seconds. A crashed holder blocks others
    for at most ``ttl + skew`` seconds.

    Parameters
    ----------
    io : S3FileIO
    path : str
        ``s3://`` URI of the lease object.
    ttl, skew, poll, max_poll : float
        Seconds.
    timeout : float or None
        Give up acquiring after this many seconds (None: wait forever).
    """

    def __init__(
        self,
        io: S3FileIO,
        path: str,
        ttl: float = DEFAULT_LOCK_TTL,
        *,
        skew: float = 2.0,
        poll: float = 0.02,
        max_poll: float = 0.5,
        timeout: float | None = 600.0,
    ) -> None:
        self.io = io
        self.path = path
        self.ttl = ttl
        self.skew = skew
        self.poll = poll
        self.max_poll = max_poll
        self.timeout = timeout
        self.owner = _owner_id()
        self.lost = False
        self.took_over: str | None = None
        self._etag: str | None = None
        self._held = False
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self._mutex = threading.Lock()

    def _body(self, released: bool = False) -> bytes:
        now = time.time()
        return json.dumps(
            {
                "owner": self.owner,
                "expires_at": 0.0 if released else now + self.ttl,
                "ttl": self.ttl,
                "released": released,
            }
        ).encode()

    @staticmethod
    def _parse(data: bytes) -> dict | None:
        try:
            lease = json.loads(data)
            float(lease["expires_at"])
            return lease
        except (ValueError, KeyError, TypeError):
            return None  # corrupt: treated as free

    def acquire(self) -> None:
        """Block until the lease is ours (see the class docs)."""
        if self._held:
            raise StorageError(f"{self.path}: lease already held by this object")
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        delay = self.poll
        holder = "?"
        while True:
            try:
                outcome = self._attempt()
            except ConditionalPutUnsupportedError:
                raise
            except StorageError as e:  # transient (network, 5xx): keep trying
                if deadline is not None and time.monotonic() > deadline:
                    raise
                log.debug("%s: lease attempt failed: %s", self.path, e)
                outcome = "wait"
            if outcome == "acquired":
                break
            if outcome != "retry":
                holder = outcome
                if deadline is not None and time.monotonic() > deadline:
                    raise LockTimeoutError(
                        f"{self.path}: lock held by {holder}; gave up after {self.timeout} s"
                    )
                time.sleep(delay * random.uniform(0.5, 1.0))
                delay = min(delay * 2, self.max_poll)
        if self._etag is None:  # a store that returned no ETag on the put
            _, self._etag = self.io.read_versioned(self.path)
        self._held = True
        self.lost = False
        self._stop.clear()
        self._renewer = threading.Thread(target=self._renew_loop, name="memwal-lease", daemon=True)
        self._renewer.start()

    def _attempt(self) -> str:
        """One try: ``"acquired"``, ``"retry"`` (at once) or the holder's description."""
        try:
            data, etag = self.io.read_versioned(self.path)
        except ObjectNotFoundError:
            try:
                self._etag = self.io.create(self.path, self._body())
                return "acquired"
            except AlreadyExistsError:
                return "retry"
        lease = self._parse(data)
        expires_at = 0.0 if lease is None else float(lease["expires_at"])
        if (
            lease is not None
            and not lease.get("released")
            and expires_at + self.skew >= time.time()
        ):
            return f"{lease.get('owner')} (expires in {expires_at - time.time():.1f} s)"
        if etag is None:
            raise ConditionalPutUnsupportedError(
                f"{self.path}: the store returns no ETag, so a lease cannot be taken over "
                f"safely; configure {OPT_COMMIT_LOCK} (see docs/s3.md)"
            )
        try:
            self._etag = self.io.put_if_match(self.path, self._body(), etag)
        except ConcurrentModificationError:
            return "retry"
        if lease is not None and not lease.get("released"):
            self.took_over = str(lease.get("owner"))
            log.warning("%s: took over the expired lease of %s", self.path, self.took_over)
        return "acquired"

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            with self._mutex:
                if self._stop.is_set() or self.lost:
                    return
                try:
                    self._etag = self.io.put_if_match(self.path, self._body(), self._etag)
                except ConcurrentModificationError:
                    self.lost = True
                    log.warning("%s: lease lost (taken over after expiry)", self.path)
                    return
                except StorageError as e:  # transient: try again at the next tick
                    log.debug("%s: lease renewal failed: %s", self.path, e)

    def release(self) -> None:
        """Stop renewing and mark the lease released (unless it was lost)."""
        if not self._held:
            return
        self._stop.set()
        with self._mutex:
            self._held = False
            if not self.lost:
                try:
                    self.io.put_if_match(self.path, self._body(released=True), self._etag)
                except ConcurrentModificationError:
                    self.lost = True
                    log.warning("%s: lease was taken over before release", self.path)
        if self._renewer is not None:
            self._renewer.join()
            self._renewer = None

    def __enter__(self) -> LeaseLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@contextlib.contextmanager
def index_lease(io: FileIO | None, table_uri: str) -> Iterator[None]:
    """The cross-process index lock of a table on an object store.

    A :class:`LeaseLock` on ``{table}/_mem_wal/.index.lock``, or the external commit
    lock (``"index:{table_uri}"``) when the store has no conditional put.
    """
    if not isinstance(io, S3FileIO):
        raise StorageError(
            f"{table_uri}: the index lock on an object store needs the table's S3FileIO"
        )
    if not io.conditional_put:
        assert io.commit_lock is not None
        with io.commit_lock(f"index:{table_uri}"):
            yield
        return
    path = join(mem_wal_root(table_uri), INDEX_LOCK_NAME)
    with LeaseLock(io, path, ttl=io.settings.lock_ttl):
        yield
