"""Configuration of the object-store layer: the stores and their URI schemes, storage
options -> obstore settings, the ``memwal_*`` options, external commit locks, and the
errors of the layer.

See ``docs/object-stores.md`` for every option.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

from memwal_query.exceptions import StorageError

log = logging.getLogger(__name__)

StoreKind = Literal["s3", "gcs", "azure"]
#: URI scheme -> the kind of store behind it: the schemes both Lance and obstore accept
#: (Lance refuses ``abfs://`` and ``azure://``).
SCHEMES: dict[str, StoreKind] = {"s3": "s3", "gs": "gcs", "az": "azure", "abfss": "azure"}
OPT_CONDITIONAL_PUT = "memwal_conditional_put"
OPT_COMMIT_LOCK = "memwal_commit_lock"
OPT_LOCK_TTL = "memwal_lock_ttl"
OPT_VERIFY_CONDITIONAL_PUT = "memwal_verify_conditional_put"
#: User metadata of every conditional put (an identifier: Azure refuses ``-`` in names).
PUT_TOKEN_ATTRIBUTE = "memwal_put_token"
INDEX_LOCK_NAME = ".index.lock"
DEFAULT_LOCK_TTL = 30.0
DEFAULT_RETRY_CONFIG: dict[str, Any] = {"max_retries": 3, "retry_timeout": timedelta(seconds=30)}
DOCS = "docs/object-stores.md"


def store_kind(uri: str) -> StoreKind | None:
    """The kind of object store of a URI (None: a local path or an unknown scheme)."""
    scheme, sep, _ = uri.partition("://")
    return SCHEMES.get(scheme.lower()) if sep else None


class ConditionalPutUnsupportedError(StorageError):
    """The store has no atomic put-if-not-exists and no external commit lock is configured.

    memwal_query never falls back to a check-then-put without a lock: two writers could
    both "win" a WAL position or a manifest version.
    """


class ConcurrentModificationError(StorageError):
    """A conditional overwrite (``If-Match`` / generation match) found the object changed
    or gone."""


class LockTimeoutError(StorageError):
    """A lease lock could not be acquired within its timeout."""


class ObjectStoreError(StorageError):
    """A request to an object store failed for good (after the HTTP client's retries and
    ours, where retrying is safe).

    Attributes
    ----------
    operation : str
        What was being done: ``"read"``, ``"put"``, ``"create"``, ``"list"``...
    path : str
        The object or prefix concerned.
    """

    def __init__(self, operation: str, path: str, detail: str) -> None:
        super().__init__(f"{path}: {operation} failed: {detail}")
        self.operation = operation
        self.path = path


# -- storage options -> obstore configuration ---------------------------------------------
# Each store's configuration keys as Lance and the Rust ``object_store`` crate accept
# them (lower case), mapped to the one name given to obstore. Keys naming a bucket or
# container are not among them: the URI names it.
_KEYS: dict[StoreKind, dict[str, str]] = {"s3": {}, "gcs": {}, "azure": {}}
_CLIENT_KEYS: dict[str, str] = {}
_BOOL_KEYS = {
    "virtual_hosted_style_request",
    "skip_signature",
    "unsigned_payload",
    "s3_express",
    "imdsv1_fallback",
    "sse_bucket_key_enabled",
    "disable_tagging",
    "use_emulator",
    "use_fabric_endpoint",
    "use_azure_cli",
    "allow_http",
    "allow_invalid_certificates",
}


def _alias(table: dict[str, str], canonical: str, *names: str) -> None:
    for name in (canonical, *names):
        table[name] = canonical


_S3, _GCS, _AZ = _KEYS["s3"], _KEYS["gcs"], _KEYS["azure"]
_alias(_S3, "access_key_id", "aws_access_key_id")
_alias(_S3, "secret_access_key", "aws_secret_access_key")
_alias(_S3, "session_token", "aws_session_token", "aws_token", "token")
_alias(_S3, "endpoint", "aws_endpoint", "aws_endpoint_url", "endpoint_url")
_alias(_S3, "aws_endpoint_url_s3")
_alias(_S3, "region", "aws_region")
_alias(_S3, "default_region", "aws_default_region")
_alias(_S3, "virtual_hosted_style_request", "aws_virtual_hosted_style_request")
_alias(_S3, "skip_signature", "aws_skip_signature")
_alias(_S3, "unsigned_payload", "aws_unsigned_payload")
_alias(_S3, "checksum_algorithm", "aws_checksum_algorithm")
_alias(_S3, "request_payer", "aws_request_payer")
_alias(_S3, "s3_express", "aws_s3_express")
_alias(_S3, "imdsv1_fallback", "aws_imdsv1_fallback")
_alias(_S3, "metadata_endpoint", "aws_metadata_endpoint")
_alias(_S3, "server_side_encryption", "aws_server_side_encryption")
_alias(_S3, "sse_kms_key_id", "aws_sse_kms_key_id")
_alias(_S3, "sse_bucket_key_enabled", "aws_sse_bucket_key_enabled")
_alias(_S3, "conditional_put", "aws_conditional_put")
_alias(_S3, "disable_tagging", "aws_disable_tagging")
_alias(_S3, "role_arn", "aws_role_arn")
_alias(_S3, "role_session_name", "aws_role_session_name")
_alias(_S3, "web_identity_token_file", "aws_web_identity_token_file")
_alias(_S3, "sts_endpoint", "aws_sts_endpoint")
_alias(_S3, "container_credentials_relative_uri", "aws_container_credentials_relative_uri")
_alias(
    _GCS,
    "service_account",
    "google_service_account",
    "google_service_account_path",
    "service_account_path",
)
_alias(_GCS, "service_account_key", "google_service_account_key")
_alias(_GCS, "application_credentials", "google_application_credentials")
_alias(_GCS, "bearer_token", "google_bearer_token")
_alias(_GCS, "base_url", "google_base_url")
_alias(_GCS, "skip_signature", "google_skip_signature")
_alias(_AZ, "account_name", "azure_storage_account_name")
_alias(
    _AZ,
    "account_key",
    "azure_storage_account_key",
    "azure_storage_access_key",
    "azure_storage_master_key",
    "access_key",
    "master_key",
)
_alias(_AZ, "client_id", "azure_storage_client_id", "azure_client_id")
_alias(_AZ, "client_secret", "azure_storage_client_secret", "azure_client_secret")
_alias(
    _AZ,
    "tenant_id",
    "azure_storage_tenant_id",
    "azure_storage_authority_id",
    "azure_tenant_id",
    "azure_authority_id",
    "authority_id",
)
_alias(_AZ, "authority_host", "azure_storage_authority_host", "azure_authority_host")
_alias(_AZ, "sas_key", "azure_storage_sas_key", "azure_storage_sas_token", "sas_token")
_alias(_AZ, "token", "azure_storage_token", "bearer_token")
_alias(_AZ, "use_emulator", "azure_storage_use_emulator")
_alias(_AZ, "endpoint", "azure_storage_endpoint", "azure_endpoint")
_alias(_AZ, "msi_endpoint", "azure_msi_endpoint", "azure_identity_endpoint", "identity_endpoint")
_alias(_AZ, "object_id", "azure_object_id")
_alias(_AZ, "msi_resource_id", "azure_msi_resource_id")
_alias(_AZ, "federated_token_file", "azure_federated_token_file")
_alias(_AZ, "use_fabric_endpoint", "azure_use_fabric_endpoint")
_alias(_AZ, "use_azure_cli", "azure_use_azure_cli")
_alias(_AZ, "skip_signature", "azure_skip_signature")
_alias(_AZ, "disable_tagging", "azure_disable_tagging")
for _k in (
    "allow_http",
    "allow_invalid_certificates",
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
    _alias(_CLIENT_KEYS, _k, f"aws_{_k}", f"google_{_k}", f"azure_{_k}")

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
class StoreSettings:
    """obstore configuration derived from ``storage_options`` (see :func:`store_settings`).

    Attributes
    ----------
    kind : {"s3", "gcs", "azure"}
        The kind of store.
    config : dict
        Store configuration (obstore key names of ``S3Store``/``GCSStore``/``AzureStore``).
    client_options : dict
        HTTP client options (``allow_http``, timeouts, proxy...).
    retry_config : dict
        obstore retry configuration (from ``client_max_retries``/``client_retry_timeout``).
    conditional_put : bool
        Whether the store does put-if-not-exists (``If-None-Match: *`` on S3 and Azure,
        ``x-goog-if-generation-match: 0`` on GCS).
    verify_conditional_put : bool
        Probe the store once per bucket before the first conditional put.
    commit_lock : str or None
        ``memwal_commit_lock`` as given.
    lock_ttl : float
        Lease duration of the index lock, seconds.
    ignored : tuple of str
        Option keys not meant for obstore (left to Lance).
    """

    kind: StoreKind = "s3"
    config: dict[str, Any] = field(default_factory=dict)
    client_options: dict[str, Any] = field(default_factory=dict)
    retry_config: dict[str, Any] = field(default_factory=dict)
    conditional_put: bool = True
    verify_conditional_put: bool = True
    commit_lock: str | None = None
    lock_ttl: float = DEFAULT_LOCK_TTL
    ignored: tuple[str, ...] = ()


def store_settings(kind: StoreKind, storage_options: Mapping[str, Any] | None) -> StoreSettings:
    """Translate Lance-style ``storage_options`` into obstore's configuration of ``kind``.

    Keys are matched case-insensitively under every name Lance and the Rust
    ``object_store`` crate accept for that store (``aws_access_key_id`` or
    ``access_key_id``; ``google_service_account_key`` or ``service_account_key``;
    ``azure_storage_account_name`` or ``account_name``...). ``memwal_*`` keys configure
    memwal_query (see :mod:`memwal_query.storage.objectstore`); anything else, including
    the keys of the other stores, is ignored here and left to Lance.

    Parameters
    ----------
    kind : {"s3", "gcs", "azure"}
    storage_options : mapping or None

    Returns
    -------
    StoreSettings

    Raises
    ------
    StorageError
        A ``memwal_*`` option or a boolean option has a malformed value.
    """
    keys = _KEYS[kind]
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
        elif key in keys:
            name = keys[key]
            config[name] = _parse_bool(raw_key, value) if name in _BOOL_KEYS else str(value)
        elif key in _CLIENT_KEYS:
            name = _CLIENT_KEYS[key]
            client[name] = _parse_bool(raw_key, value) if name in _BOOL_KEYS else str(value)
        elif key == "client_max_retries":
            retry["max_retries"] = int(value)
        elif key == "client_retry_timeout":
            retry["retry_timeout"] = timedelta(seconds=float(value))
        else:
            ignored.append(str(raw_key))
    if str(config.get("conditional_put", "")).lower() == "disabled":
        conditional_put = False
    return StoreSettings(
        kind=kind,
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
CommitLock = Callable[[str], AbstractContextManager[Any]]
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
            "registered (memwal_query.storage.options.register_commit_lock)"
        )
    return lock
