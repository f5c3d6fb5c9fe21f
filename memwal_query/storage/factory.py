"""Choosing the :class:`~memwal_query.storage.io.FileIO` of a table URI.

Kept apart from :mod:`memwal_query.storage.io` so that the object-store layer (which
builds on ``FileIO``) and the local layer do not import each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from memwal_query.exceptions import StorageError
from memwal_query.storage.io import FileIO, LocalFileIO
from memwal_query.storage.options import store_kind


def file_io_for(uri: str, storage_options: Mapping[str, Any] | None = None) -> FileIO:
    """Return the :class:`FileIO` for a table URI.

    Parameters
    ----------
    uri : str
        A local path or ``file://`` URI, or an object-store URI: ``s3://bucket/path``,
        ``gs://bucket/path``, ``az://container/path`` or
        ``abfss://container@account.dfs.core.windows.net/path``.
    storage_options : mapping, optional
        Lance-style options (see ``docs/object-stores.md``).

    Returns
    -------
    FileIO
        :class:`LocalFileIO`, or an
        :class:`~memwal_query.storage.objectstore.ObjectStoreFileIO` of the store.

    Raises
    ------
    StorageError
        An unknown scheme, obstore missing, or a malformed option.
    """
    scheme = uri.split("://", 1)[0].lower() if "://" in uri else "file"
    if scheme == "file":
        fsync = str((storage_options or {}).get("fsync", "true")).lower() != "false"
        return LocalFileIO(fsync=fsync)
    if store_kind(uri) is None:
        raise StorageError(f"{uri}: object store scheme {scheme!r} is not supported")
    try:
        from memwal_query.storage.objectstore import ObjectStoreFileIO
    except ImportError as e:
        raise StorageError(
            f"{uri}: {scheme}:// tables need the 'obstore' package ({e}); "
            "pip install 'memwal_query[s3]'"
        ) from e
    return ObjectStoreFileIO.for_uri(uri, storage_options)
