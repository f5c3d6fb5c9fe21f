"""The object-store layer (FileIO): one small interface, one implementation per store.

Everything memwal_query writes outside Lance datasets (WAL entries, region manifests,
version hints, bloom filters) goes through a :class:`FileIO`. The interface is the one
object stores offer: whole-object read/write, HEAD, list, delete, and an atomic
**put-if-not-exists**, which is what makes WAL entries and manifest versions safe
under concurrent writers.

Paths are plain strings joined with ``/``.
:func:`memwal_query.storage.factory.file_io_for` picks the implementation from a URI
(a local path or ``file://`` URI, or ``s3://``, ``gs://``, ``az://`` through
:mod:`memwal_query.storage.objectstore`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from typing import TypeVar

import pyarrow as pa

from memwal_query.exceptions import AlreadyExistsError, ObjectNotFoundError, StorageError


def join(*parts: str) -> str:
    """Join path parts with ``/``, ignoring empty parts and doubled separators."""
    out = ""
    for part in parts:
        if not part:
            continue
        out = part if not out else out.rstrip("/") + "/" + part.lstrip("/")
    return out


class FileIO(ABC):
    """Object-store operations used by memwal_query."""

    #: Whether paths can be files where directories belong, or links (local file systems).
    #: Object stores have neither: layout checks (:mod:`memwal_query.storage.paths`) skip them.
    has_links = False

    #: Whether many requests at once finish sooner than one after the other: True for
    #: object stores (a request is mostly a round trip); False for local file systems,
    #: where a request costs CPU time only and threads would contend for the GIL (a cold
    #: query at 64 regions read its manifests 1.5-2x slower with 16 threads locally).
    parallel_requests = True

    @abstractmethod
    def read(self, path: str) -> bytes:
        """Return the whole object; raise :class:`ObjectNotFoundError` when missing."""

    def read_buffer(self, path: str) -> pa.Buffer:
        """:meth:`read` as an Arrow buffer (what Arrow readers decode without a copy)."""
        return pa.py_buffer(self.read(path))

    @abstractmethod
    def write(self, path: str, data: bytes) -> None:
        """Create or replace an object atomically (readers see old or new, never partial)."""

    @abstractmethod
    def put_if_not_exists(self, path: str, data: bytes) -> None:
        """Create an object only if absent; raise :class:`AlreadyExistsError` otherwise.

        Atomic under concurrent processes: exactly one of several racing callers wins,
        and no caller ever observes a partially written object.
        """

    @abstractmethod
    def exists(self, path: str) -> bool:
        """HEAD: whether an object exists."""

    @abstractmethod
    def size(self, path: str) -> int:
        """Size in bytes of an object; raise :class:`ObjectNotFoundError` when missing."""

    @abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Names (not paths) of the objects and sub-directories directly under ``prefix``."""

    @abstractmethod
    def delete(self, path: str) -> None:
        """Delete one object; deleting a missing object is not an error."""

    @abstractmethod
    def delete_tree(self, prefix: str) -> None:
        """Delete everything under ``prefix``; a missing prefix is not an error."""

    def tree_size(self, prefix: str) -> int:
        """Total size of the objects under ``prefix`` (0 when missing)."""
        total = 0
        for name in self.list(prefix):
            path = join(prefix, name)
            if self.is_dir(path):
                total += self.tree_size(path)
            else:
                total += self.size(path)
        return total

    @abstractmethod
    def is_dir(self, path: str) -> bool:
        """Whether ``path`` is a directory / common prefix."""

    def modified_at(self, path: str) -> float:
        """Modification time of an object, epoch seconds.

        Raises
        ------
        ObjectNotFoundError
            The object does not exist.
        StorageError
            This kind of storage keeps no modification times.
        """
        raise StorageError(f"{path}: {type(self).__name__} keeps no modification times")

    def resolves_inside(self, path: str, root: str) -> bool:
        """Whether ``path`` (existing or not) stays under ``root`` once links are followed.

        Object stores have no links: always True there.
        """
        return True

    def directory_problem(self, path: str, root: str) -> str | None:
        """What is wrong with ``path`` as a directory of the table at ``root``, or None.

        None when it is a directory, or missing (it will be created); otherwise "is not
        a directory" or "is a link that leads out of the table". Object stores have
        neither files in the way of prefixes nor links: always None there.
        """
        return None


X = TypeVar("X")
Y = TypeVar("Y")


def in_chunks(pool: Executor, fn: Callable[[X], Y], items: Sequence[X], tasks: int) -> list[Y]:
    """``fn(item)`` of each item, in order, in at most ``tasks`` tasks of consecutive
    items on ``pool`` (one task per item costs more in scheduling than a small read
    costs); fewer than two items run in this thread. The tasks never wait for others."""
    if len(items) < 2:
        return [fn(x) for x in items]
    step = -(-len(items) // tasks)
    chunks = [list(items[i : i + step]) for i in range(0, len(items), step)]
    futures = [pool.submit(lambda c: [fn(x) for x in c], c) for c in chunks]
    return [y for f in futures for y in f.result()]


@contextlib.contextmanager
def _read_errors(path: str) -> Iterator[None]:
    """A local read's OSError as ObjectNotFoundError (missing) or StorageError."""
    try:
        yield
    except FileNotFoundError as e:
        raise ObjectNotFoundError(f"{path}: no such object") from e
    except IsADirectoryError as e:
        raise StorageError(f"{path}: is a directory") from e
    except OSError as e:
        raise StorageError(f"{path}: {e.strerror or e}") from e


class LocalFileIO(FileIO):
    """FileIO over a local (POSIX) file system.

    Parameters
    ----------
    fsync : bool
        ``True`` (default) fsyncs every written file and its directory before returning,
        which is what makes a durable WAL write durable on a local disk.
    """

    has_links = True
    parallel_requests = False

    def __init__(self, fsync: bool = True) -> None:
        self.fsync = fsync

    @staticmethod
    def _local(path: str) -> str:
        return path[len("file://") :] if path.startswith("file://") else path

    def _fsync_dir(self, directory: str) -> None:
        if not self.fsync:
            return
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _write_temp(self, path: str, data: bytes) -> str:
        directory = os.path.dirname(path) or "."
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            _unlink_quiet(tmp)
            raise
        os.close(fd)
        return tmp

    def read(self, path: str) -> bytes:
        with _read_errors(path):
            # os-level calls: a third of the cost of a buffered file object for the
            # small files (WAL entries) a reader of a stream reads by the thousand
            fd = os.open(self._local(path), os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                data = os.read(fd, size) if size else b""
                if len(data) < size or not size:  # a short read, or no size known
                    rest = [data]
                    while chunk := os.read(fd, max(size, 1 << 16)):
                        rest.append(chunk)
                    data = b"".join(rest)
                return data
            finally:
                os.close(fd)

    def read_buffer(self, path: str) -> pa.Buffer:
        # one read into an Arrow-allocated buffer: 2.5x faster than building the bytes
        # object of ``read`` for the ~100 KB rows sidecars a cold search reads by the
        # hundred (not memory-mapped: a file truncated in place would crash the process)
        with _read_errors(path):
            with pa.OSFile(self._local(path)) as f:
                return f.read_buffer()

    def write(self, path: str, data: bytes) -> None:
        local = self._local(path)
        try:
            tmp = self._write_temp(local, data)
            os.replace(tmp, local)
            self._fsync_dir(os.path.dirname(local) or ".")
        except OSError as e:
            raise StorageError(f"{path}: {e.strerror}") from e

    def put_if_not_exists(self, path: str, data: bytes) -> None:
        local = self._local(path)
        if os.path.exists(local):
            raise AlreadyExistsError(f"{path}: already exists")
        try:
            tmp = self._write_temp(local, data)
        except OSError as e:
            raise StorageError(f"{path}: {e.strerror}") from e
        try:
            # link() fails with EEXIST if the target exists: the atomic step.
            os.link(tmp, local)
        except FileExistsError as e:
            raise AlreadyExistsError(f"{path}: already exists") from e
        except OSError as e:
            if e.errno == errno.EEXIST:
                raise AlreadyExistsError(f"{path}: already exists") from e
            raise StorageError(f"{path}: {e.strerror}") from e
        finally:
            _unlink_quiet(tmp)
        self._fsync_dir(os.path.dirname(local) or ".")

    def exists(self, path: str) -> bool:
        return os.path.exists(self._local(path))

    def size(self, path: str) -> int:
        try:
            return os.stat(self._local(path)).st_size
        except FileNotFoundError as e:
            raise ObjectNotFoundError(f"{path}: no such object") from e

    def list(self, prefix: str) -> list[str]:
        try:
            names = os.listdir(self._local(prefix))
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            return []
        return sorted(n for n in names if not (n.startswith(".") and n.endswith(".tmp")))

    def delete(self, path: str) -> None:
        _unlink_quiet(self._local(path))

    def delete_tree(self, prefix: str) -> None:
        local = self._local(prefix)
        if os.path.isdir(local):
            shutil.rmtree(local, ignore_errors=False)
        else:
            _unlink_quiet(local)

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(self._local(path))

    def modified_at(self, path: str) -> float:
        with _read_errors(path):
            return os.stat(self._local(path)).st_mtime

    def resolves_inside(self, path: str, root: str) -> bool:
        real_root = os.path.realpath(self._local(root))
        real = os.path.realpath(self._local(path))
        return real == real_root or real.startswith(real_root.rstrip(os.sep) + os.sep)

    def directory_problem(self, path: str, root: str) -> str | None:
        try:
            st = os.lstat(self._local(path))  # one cheap call in the usual case
        except FileNotFoundError:
            return None
        except OSError as e:
            return f"cannot be inspected: {e.strerror}"
        if stat.S_ISLNK(st.st_mode):
            if not self.resolves_inside(path, root):
                return f"is a link that leads out of the table {root}"
            return None if os.path.isdir(self._local(path)) else "is not a directory"
        return None if stat.S_ISDIR(st.st_mode) else "is not a directory"


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def normalize_uri(uri: str | os.PathLike[str]) -> str:
    """Absolute, ``/``-joined form of a table URI without a trailing slash."""
    text = os.fspath(uri)
    if "://" in text and not text.startswith("file://"):
        return text.rstrip("/")
    local = text[len("file://") :] if text.startswith("file://") else text
    return os.path.abspath(os.path.expanduser(local))
