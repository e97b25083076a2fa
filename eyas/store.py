"""Object store: one interface, two backends (local directory for embedded mode, S3 via `minio`).

Readers never see a partial object: the local backend writes to a temp file and renames it into place; S3 makes an
object visible only once its upload completes. S3 calls ride out an outage: a refused or dropped connection, a
timeout or a 5xx is retried with backoff for up to `s3_retry_s` (an interrupted upload is simply sent again). Artifacts
are addressed by URI:
  s3://BUCKET/PREFIX      an S3 prefix on the configured endpoint
  file://DIR or DIR       a local directory
"""
from __future__ import annotations

import io
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Protocol

from eyas.keys import safe_key
from eyas.settings import Settings

log = logging.getLogger(__name__)
_RETRY_S3_CODES = frozenset({"InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout"})


def _transient(e: BaseException) -> bool:
    """Worth retrying: the server is away (connection refused, reset, timed out) or failing (5xx)."""
    import urllib3
    from minio.error import S3Error, ServerError

    if isinstance(e, S3Error):
        return e.code in _RETRY_S3_CODES
    return isinstance(e, urllib3.exceptions.HTTPError | ConnectionError | TimeoutError | ServerError)


class ObjectStore(Protocol):
    def put_bytes(self, key: str, data: bytes) -> None: ...
    def put_file(self, key: str, path: Path) -> None: ...
    def get_bytes(self, key: str) -> bytes: ...
    def get_file(self, key: str, path: Path) -> None: ...
    def exists(self, key: str) -> bool: ...
    def list(self, prefix: str) -> list[str]: ...
    def delete(self, key: str) -> None: ...
    def delete_prefix(self, prefix: str) -> None: ...
    def uri(self, prefix: str) -> str: ...
    def ping(self) -> None: ...


class LocalStore:
    def __init__(self, root: Path):
        self.root = Path(root).resolve()

    def _path(self, key: str) -> Path:
        return self.root / safe_key(key)

    def put_bytes(self, key: str, data: bytes) -> None:
        self._atomic_write(key, lambda f: f.write(data))

    def put_file(self, key: str, path: Path) -> None:
        with open(path, "rb") as src:
            self._atomic_write(key, lambda f: shutil.copyfileobj(src, f, 1 << 20))

    def _atomic_write(self, key: str, write) -> None:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, dest)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def get_bytes(self, key: str) -> bytes:
        return self._path(key).read_bytes()

    def get_file(self, key: str, path: Path) -> None:
        shutil.copyfile(self._path(key), path)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str) -> list[str]:
        base = self._path(prefix) if prefix else self.root
        if not base.is_dir():
            return []
        return sorted(
            p.relative_to(self.root).as_posix()
            for p in base.rglob("*")
            if p.is_file() and not p.name.endswith(".part")
        )

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def delete_prefix(self, prefix: str) -> None:
        path = self._path(prefix)
        if path.is_file():  # a prefix naming one object, as S3 matches it
            path.unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)

    def uri(self, prefix: str) -> str:
        return (self.root / safe_key(prefix)).as_uri() if prefix else self.root.as_uri()

    def ping(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)


class S3Store:
    def __init__(self, settings: Settings, bucket: str | None = None):
        import certifi
        import urllib3
        from minio import Minio

        self.bucket = bucket or settings.s3_bucket
        self.endpoint = settings.s3_endpoint
        self.retry_s = settings.s3_retry_s
        self.retries = 0  # transient failures retried so far (each also logged)
        # No retries inside urllib3: every failure surfaces to _call, which retries the whole operation.
        http = urllib3.PoolManager(timeout=urllib3.Timeout(connect=5, read=120), maxsize=10, retries=False,
                                   cert_reqs="CERT_REQUIRED" if settings.s3_secure else "CERT_NONE",
                                   ca_certs=os.environ.get("SSL_CERT_FILE") or certifi.where())
        self.client = Minio(
            settings.s3_endpoint,
            access_key=settings.s3_access_key,
            secret_key=settings.s3_secret_key.get_secret_value(),
            secure=settings.s3_secure,
            http_client=http,
        )

    def _call(self, what: str, fn):
        """fn(), retried with backoff while the failure is transient, for up to retry_s seconds."""
        from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_exponential

        def warn(state) -> None:
            self.retries += 1
            log.warning("S3 %s at %s failed (%s); retrying in %.1f s", what, self.endpoint,
                        state.outcome.exception(), state.next_action.sleep)

        for attempt in Retrying(stop=stop_after_delay(self.retry_s), wait=wait_exponential(multiplier=0.25, max=5),
                                retry=retry_if_exception(_transient), before_sleep=warn, reraise=True):
            with attempt:
                return fn()

    def ensure_bucket(self) -> None:
        def ensure() -> None:
            if not self.client.bucket_exists(self.bucket):
                self.client.make_bucket(self.bucket)

        self._call("bucket check", ensure)

    def put_bytes(self, key: str, data: bytes) -> None:
        k = safe_key(key)
        self._call(f"put {k}", lambda: self.client.put_object(self.bucket, k, io.BytesIO(data), len(data)))

    def put_file(self, key: str, path: Path) -> None:
        k = safe_key(key)
        self._call(f"put {k}", lambda: self.client.fput_object(self.bucket, k, str(path)))

    def get_bytes(self, key: str) -> bytes:
        k = safe_key(key)

        def get() -> bytes:
            resp = self.client.get_object(self.bucket, k)
            try:
                return resp.read()
            finally:
                resp.close()
                resp.release_conn()

        return self._call(f"get {k}", get)

    def get_file(self, key: str, path: Path) -> None:
        k = safe_key(key)
        self._call(f"get {k}", lambda: self.client.fget_object(self.bucket, k, str(path)))

    def exists(self, key: str) -> bool:
        from minio.error import S3Error

        k = safe_key(key)

        def stat() -> bool:
            try:
                self.client.stat_object(self.bucket, k)
                return True
            except S3Error as e:
                if e.code in ("NoSuchKey", "NoSuchObject", "NoSuchBucket"):
                    return False
                raise

        return self._call(f"stat {k}", stat)

    def list(self, prefix: str) -> list[str]:
        p = safe_key(prefix) + "/" if prefix else ""
        return self._call(f"list {p}", lambda: sorted(
            o.object_name for o in self.client.list_objects(self.bucket, prefix=p, recursive=True)))

    def delete(self, key: str) -> None:
        k = safe_key(key)
        self._call(f"delete {k}", lambda: self.client.remove_object(self.bucket, k))  # a missing key is no error

    def delete_prefix(self, prefix: str) -> None:
        from minio.deleteobjects import DeleteObject

        keys = self.list(prefix)  # retried on its own; the removal below is retried without listing again

        def delete() -> None:
            errors = self.client.remove_objects(self.bucket, [DeleteObject(k) for k in keys])
            for err in errors:
                raise RuntimeError(f"could not delete {err.name}: {err.message}")

        self._call(f"delete {prefix}/", delete)

    def uri(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{safe_key(prefix)}" if prefix else f"s3://{self.bucket}"

    def ping(self) -> None:
        if not self.client.bucket_exists(self.bucket):
            raise RuntimeError(f"bucket {self.bucket!r} does not exist at {self.endpoint}")


class Artifact:
    """A store plus the prefix an artifact lives under; keys given to it are relative to the prefix."""

    def __init__(self, store: ObjectStore, prefix: str = ""):
        self.store = store
        self.prefix = safe_key(prefix) if prefix else ""

    def key(self, name: str) -> str:
        return safe_key(self.prefix, name)

    def put_bytes(self, name: str, data: bytes) -> None:
        self.store.put_bytes(self.key(name), data)

    def put_file(self, name: str, path: Path) -> None:
        self.store.put_file(self.key(name), path)

    def get_bytes(self, name: str) -> bytes:
        return self.store.get_bytes(self.key(name))

    def get_file(self, name: str, path: Path) -> None:
        self.store.get_file(self.key(name), path)

    def exists(self, name: str) -> bool:
        return self.store.exists(self.key(name))

    def names(self) -> list[str]:
        cut = len(self.prefix) + 1 if self.prefix else 0
        return [k[cut:] for k in self.store.list(self.prefix)]

    @property
    def uri(self) -> str:
        return self.store.uri(self.prefix)


def open_artifact(uri: str, settings: Settings | None = None) -> Artifact:
    """Resolve an artifact URI (s3://bucket/prefix, file://dir or a plain directory path); an s3:// URI needs the
    `settings` that say how to reach S3 (the caller's own: a stage's come with its context), and is opened only in
    a bucket they allow — also when the URI comes from a manifest rather than a job spec (eyas.confine)."""
    if uri.startswith("s3://"):
        if settings is None:
            raise ValueError(f"{uri}: opening an s3:// artifact needs the S3 settings")
        bucket, _, prefix = uri[len("s3://"):].partition("/")
        if bucket not in settings.job_buckets:
            raise PermissionError(f"{uri}: bucket {bucket!r} is not allowed (EYAS_S3_BUCKET, EYAS_ALLOWED_BUCKETS)")
        return Artifact(S3Store(settings, bucket=bucket), prefix)
    if uri.startswith("file://"):
        from urllib.parse import unquote, urlparse

        uri = unquote(urlparse(uri).path)
    return Artifact(LocalStore(Path(uri)), "")
