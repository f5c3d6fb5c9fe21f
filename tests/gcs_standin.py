"""A loopback stand-in for Google Cloud Storage's XML API, for tests and benchmarks.

No GCS emulator here accepts the XML-API ``PUT /bucket/object`` that obstore and Lance
send (fake-gcs-server answers ``400 invalid uploadType``), so this module implements
exactly the requests they send, as the GCS XML API documents them
(https://cloud.google.com/storage/docs/xml-api/overview):

- ``PUT /bucket/key``: upload; ``x-goog-if-generation-match: 0`` creates only (``412
  Precondition Failed`` when the object exists), ``x-goog-if-generation-match: N``
  replaces only generation ``N`` (``412`` otherwise); ``x-goog-meta-*`` user metadata;
  ``x-goog-copy-source`` copies (with the same precondition). The answer carries
  ``ETag`` and ``x-goog-generation``.
- ``GET``/``HEAD /bucket/key``: ``Range: bytes=a-b`` / ``a-`` / ``-n`` (``206`` with
  ``Content-Range``; ``416`` beyond the end), ``?generation=N``, ``If-Match`` /
  ``If-None-Match``; headers ``ETag``, ``Last-Modified``, ``x-goog-generation``,
  ``x-goog-meta-*``.
- ``GET /bucket?list-type=2``: ``prefix``, ``delimiter``, ``max-keys``,
  ``continuation-token``, ``start-after``; a ``ListBucketResult`` document.
- ``DELETE /bucket/key`` (``204``; ``404`` when missing).
- Multipart upload: ``POST ?uploads``, ``PUT ?partNumber=&uploadId=``, ``POST
  ?uploadId=`` (``CompleteMultipartUpload``), ``DELETE ?uploadId=``.

Where it could differ from the real service: no authentication (obstore is configured
with ``disable_oauth``), no object versioning beyond the live generation, no
metageneration, no rate limits, retries or eventual consistency of its own (GCS is
strongly consistent for these operations), and only the headers above are honoured.
Every request is answered under one lock, so conditional writes are linearizable, as on
GCS.
"""

from __future__ import annotations

import contextlib
import email.utils
import hashlib
import json
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from xml.sax.saxutils import escape

from loopback import Handler, LoopbackServer


@dataclass
class _Object:
    data: bytes
    generation: int
    modified: float
    metadata: dict[str, str] = field(default_factory=dict)
    content_type: str = "application/octet-stream"

    @property
    def etag(self) -> str:
        return '"' + hashlib.md5(self.data).hexdigest() + '"'


Objects = dict[str, "_Object"]
Query = dict[str, str]


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.buckets: dict[str, dict[str, _Object]] = {}
        self.uploads: dict[str, dict[int, bytes]] = {}
        self.upload_meta: dict[str, tuple[str, str, dict[str, str]]] = {}
        self.generation = int(time.time() * 1e6)
        self.requests: list[tuple[str, str, int]] | None = None

    def next_generation(self) -> int:
        self.generation += 1
        return self.generation


def _xml_error(code: str, message: str) -> bytes:
    return (
        f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code>"
        f"<Message>{escape(message)}</Message></Error>"
    ).encode()


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts * 1000) % 1000:03d}Z"


class _Handler(Handler):
    # -- plumbing -----------------------------------------------------------------------
    def _reply(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        state: _State = self.server.owner.state
        if state.requests is not None:
            state.requests.append((self.command, self.path, status))
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if body and "Content-Type" not in (headers or {}):
            self.send_header("Content-Type", "application/xml; charset=UTF-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)

    def _target(self) -> tuple[str, str, dict[str, str]]:
        parsed = urllib.parse.urlsplit(self.path)
        path = parsed.path.lstrip("/")
        bucket, _, key = path.partition("/")
        query = dict(urllib.parse.parse_qsl(parsed.query, keep_blank_values=True))
        return urllib.parse.unquote(bucket), urllib.parse.unquote(key), query

    def _object_headers(self, obj: _Object) -> dict[str, str]:
        headers = {
            "ETag": obj.etag,
            "Last-Modified": email.utils.formatdate(obj.modified, usegmt=True),
            "x-goog-generation": str(obj.generation),
            "x-goog-metageneration": "1",
            "Content-Type": obj.content_type,
        }
        headers.update({f"x-goog-meta-{k}": v for k, v in obj.metadata.items()})
        return headers

    def _metadata(self) -> tuple[dict[str, str], str]:
        """``x-goog-meta-*`` user metadata and the content type of an upload."""
        prefix = "x-goog-meta-"
        metadata = {
            k[len(prefix) :]: v for k, v in self.headers.items() if k.lower().startswith(prefix)
        }
        return metadata, self.headers.get("Content-Type", "application/octet-stream")

    def _precondition(self, current: _Object | None) -> bool:
        wanted = self.headers.get("x-goog-if-generation-match")
        if wanted is None:
            return True
        if int(wanted) == 0:
            return current is None
        return current is not None and current.generation == int(wanted)

    # -- verbs ------------------------------------------------------------------------
    def _dispatch(self) -> None:
        """One request: its bucket must exist; answered under the state's lock."""
        bucket, key, query = self._target()
        data = self.body()
        state: _State = self.server.owner.state
        with state.lock:
            objects = state.buckets.get(bucket)
            if objects is None:
                return self._reply(404, _xml_error("NoSuchBucket", bucket))
            verb = {"HEAD": "GET"}.get(self.command, self.command)
            getattr(self, f"_{verb.lower()}")(state, objects, bucket, key, query, data)
        return None

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _dispatch  # noqa: N815

    def _put(
        self, state: _State, objects: Objects, bucket: str, key: str, query: Query, data: bytes
    ) -> None:
        if "uploadId" in query:
            parts = state.uploads.get(query["uploadId"])
            if parts is None:
                return self._reply(404, _xml_error("NoSuchUpload", query["uploadId"]))
            parts[int(query["partNumber"])] = data
            etag = '"' + hashlib.md5(data).hexdigest() + '"'
            return self._reply(200, headers={"ETag": etag})
        source = self.headers.get("x-goog-copy-source")
        if source is not None:
            src_bucket, _, src_key = urllib.parse.unquote(source).lstrip("/").partition("/")
            src = state.buckets.get(src_bucket, {}).get(src_key)
            if src is None:
                return self._reply(404, _xml_error("NoSuchKey", source))
            data = src.data
            metadata, content_type = dict(src.metadata), src.content_type
        else:
            metadata, content_type = self._metadata()
        if not self._precondition(objects.get(key)):
            return self._reply(412, _xml_error("PreconditionFailed", key))
        obj = _Object(data, state.next_generation(), time.time(), metadata, content_type)
        objects[key] = obj
        self._reply(200, headers={"ETag": obj.etag, "x-goog-generation": str(obj.generation)})

    def _post(
        self, state: _State, objects: Objects, bucket: str, key: str, query: Query, body: bytes
    ) -> None:
        if "uploads" in query:
            upload = uuid.uuid4().hex
            state.uploads[upload] = {}
            metadata, ctype = self._metadata()
            state.upload_meta[upload] = (key, ctype, metadata)
            doc = (
                "<?xml version='1.0' encoding='UTF-8'?><InitiateMultipartUploadResult>"
                f"<Bucket>{escape(bucket)}</Bucket><Key>{escape(key)}</Key>"
                f"<UploadId>{upload}</UploadId></InitiateMultipartUploadResult>"
            )
            return self._reply(200, doc.encode())
        if "uploadId" in query:
            upload = query["uploadId"]
            parts = state.uploads.pop(upload, None)
            if parts is None:
                return self._reply(404, _xml_error("NoSuchUpload", upload))
            _, ctype, metadata = state.upload_meta.pop(upload)
            numbers = [int(n) for n in _tag_values(body, "PartNumber")]
            data = b"".join(parts[n] for n in numbers)
            if not self._precondition(objects.get(key)):
                return self._reply(412, _xml_error("PreconditionFailed", key))
            obj = _Object(data, state.next_generation(), time.time(), metadata, ctype)
            objects[key] = obj
            doc = (
                "<?xml version='1.0' encoding='UTF-8'?><CompleteMultipartUploadResult>"
                f"<Location>/{escape(bucket)}/{escape(key)}</Location>"
                f"<Bucket>{escape(bucket)}</Bucket><Key>{escape(key)}</Key>"
                f"<ETag>{escape(obj.etag)}</ETag></CompleteMultipartUploadResult>"
            )
            return self._reply(200, doc.encode(), {"x-goog-generation": str(obj.generation)})
        self._reply(400, _xml_error("InvalidArgument", "unsupported POST"))

    def _get(
        self, state: _State, objects: Objects, bucket: str, key: str, query: Query, body: bytes
    ) -> None:
        if not key:
            return self._list(bucket, objects, query)
        obj = objects.get(key)
        if obj is None or ("generation" in query and str(obj.generation) != query["generation"]):
            return self._reply(404, _xml_error("NoSuchKey", key))
        headers = self._object_headers(obj)
        if_match = self.headers.get("If-Match")
        if if_match is not None and if_match not in ("*", obj.etag):
            return self._reply(412, _xml_error("PreconditionFailed", key))
        if_none = self.headers.get("If-None-Match")
        if if_none is not None and if_none in ("*", obj.etag):
            return self._reply(304, headers=headers)
        data, status = obj.data, 200
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes="):
            first, _, last = rng[len("bytes=") :].partition("-")
            size = len(data)
            if first == "":
                start, end = max(0, size - int(last)), size - 1
            else:
                start = int(first)
                end = min(int(last), size - 1) if last else size - 1
            if start >= size:
                return self._reply(416, _xml_error("InvalidRange", rng))
            data, status = data[start : end + 1], 206
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        return self._reply(status, data, headers)

    def _list(self, bucket: str, objects: dict[str, _Object], query: dict[str, str]) -> None:
        prefix = query.get("prefix", "")
        delimiter = query.get("delimiter", "")
        max_keys = int(query.get("max-keys") or 1000)
        after = query.get("continuation-token") or query.get("start-after") or ""
        keys = sorted(k for k in objects if k.startswith(prefix) and k > after)
        contents: list[str] = []
        prefixes: list[str] = []
        seen: set[str] = set()
        last = ""
        truncated = False
        for k in keys:
            if len(contents) + len(prefixes) >= max_keys:
                truncated = True
                break
            rest = k[len(prefix) :]
            if delimiter and delimiter in rest:
                common = prefix + rest.split(delimiter, 1)[0] + delimiter
                last = k
                if common not in seen:
                    seen.add(common)
                    prefixes.append(common)
                continue
            obj = objects[k]
            last = k
            contents.append(
                f"<Contents><Key>{escape(k)}</Key><Generation>{obj.generation}</Generation>"
                f"<LastModified>{_iso(obj.modified)}</LastModified>"
                f"<ETag>{escape(obj.etag)}</ETag><Size>{len(obj.data)}</Size></Contents>"
            )
        token = ""
        if truncated:
            token = f"<NextContinuationToken>{escape(last)}</NextContinuationToken>"
        doc = (
            "<?xml version='1.0' encoding='UTF-8'?><ListBucketResult>"
            f"<Name>{escape(bucket)}</Name><Prefix>{escape(prefix)}</Prefix>"
            f"<KeyCount>{len(contents) + len(prefixes)}</KeyCount><MaxKeys>{max_keys}</MaxKeys>"
            f"<IsTruncated>{'true' if truncated else 'false'}</IsTruncated>"
            + "".join(contents)
            + "".join(
                f"<CommonPrefixes><Prefix>{escape(p)}</Prefix></CommonPrefixes>" for p in prefixes
            )
            + token
            + "</ListBucketResult>"
        )
        self._reply(200, doc.encode())

    def _delete(
        self, state: _State, objects: Objects, bucket: str, key: str, query: Query, body: bytes
    ) -> None:
        if "uploadId" in query:
            state.uploads.pop(query["uploadId"], None)
            state.upload_meta.pop(query["uploadId"], None)
            return self._reply(204)
        if objects.pop(key, None) is None:
            return self._reply(404, _xml_error("NoSuchKey", key))
        self._reply(204)


def _tag_values(doc: bytes, tag: str) -> list[str]:
    text = doc.decode()
    out = []
    start = 0
    while True:
        i = text.find(f"<{tag}>", start)
        if i < 0:
            return out
        j = text.find(f"</{tag}>", i)
        out.append(text[i + len(tag) + 2 : j])
        start = j


class GcsStandIn(LoopbackServer):
    """The stand-in on a free loopback port (see the module docs); a context manager.

    Attributes
    ----------
    endpoint : str
        ``http://127.0.0.1:PORT`` once started.
    """

    handler = _Handler
    name = "gcs-standin"

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__(host, port)
        self.state = _State()

    def create_bucket(self, name: str) -> None:
        with self.state.lock:
            self.state.buckets.setdefault(name, {})

    def storage_options(self, endpoint: str | None = None, **extra: str) -> dict[str, str]:
        """Lance-style ``storage_options`` reaching this server (or ``endpoint``, a proxy
        in front of it): a service-account key whose ``gcs_base_url`` points here and
        that disables OAuth, as object_store's own tests do."""
        key = {
            "gcs_base_url": endpoint or self.endpoint,
            "disable_oauth": True,
            "client_email": "",
            "private_key": "",
            "private_key_id": "",
        }
        options = {"google_service_account_key": json.dumps(key), "allow_http": "true"}
        options.update(extra)
        return options

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[tuple[str, str, int]]]:
        """``(method, path, status)`` of every request answered within the block."""
        log: list[tuple[str, str, int]] = []
        self.state.requests = log
        try:
            yield log
        finally:
            self.state.requests = None
