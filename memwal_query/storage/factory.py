"""Choosing the :class:`~memwal_query.storage.io.FileIO` of a table URI.

Kept apart from :mod:`memwal_query.storage.io` so that the object-store layer (which
builds on ``FileIO``) and the local layer do not import each other.
"""

from __future__ import annotations

from collections.abc import Mapping

from memwal_query.exceptions import StorageError
from memwal_query.storage.io import FileIO, LocalFileIO


def file_io_for(uri: str, storage_options: Mapping[str, str] | None = None) -> FileIO:
    """Return the :class:`FileIO` for a table URI.

    A local path or ``file://`` URI: :class:`LocalFileIO`; ``s3://bucket/path``:
    :class:`memwal_query.storage.objectstore.S3FileIO` configured from ``storage_options``.
    """
    scheme = uri.split("://", 1)[0].lower() if "://" in uri else "file"
    if scheme == "file":
        fsync = (storage_options or {}).get("fsync", "true").lower() != "false"
        return LocalFileIO(fsync=fsync)
    if scheme == "s3":
        try:
            from memwal_query.storage.objectstore import S3FileIO
        except ImportError as e:
            raise StorageError(
                f"{uri}: s3:// tables need the 'obstore' package ({e}); "
                "pip install 'memwal_query[s3]'"
            ) from e
        return S3FileIO.from_storage_options(storage_options)
    raise StorageError(f"{uri}: object store scheme {scheme!r} is not supported yet")
