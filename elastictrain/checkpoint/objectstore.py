"""Checkpoints in an object store: :class:`FsspecStorage`, the fsspec backend of :class:`CheckpointStorage`.

Serves ``s3://`` (s3fs), ``gs://`` (gcsfs) and ``az://`` (adlfs) locations with the local format's promises:

- **Atomic objects.** ``open_write`` streams through the store's own upload (S3: a multipart upload, one part
  per ``block_size``; GCS: a resumable upload; Azure: staged blocks): the object appears only when the upload
  completes; an exception discards it (S3 aborts the multipart upload), so nothing partial is ever visible.
- **``latest`` moves forward only, also against a late second writer.** On S3 (and S3-compatible stores that
  enforce conditional writes), ``set_latest`` is a compare-and-swap: it reads ``latest`` with its ETag and
  writes with ``If-Match: <etag>`` (``If-None-Match: *`` when absent); a 412/409 means another writer got
  there first, and it reads again. On GCS and Azure it is a read-compare-replace without a lock: the
  one-writer rule and the writer's fence (:mod:`~elastictrain.checkpoint.format`) hold it there.
- **Credentials** come only from each cloud's standard chain (AWS: environment, profile, instance role; GCP:
  application default credentials; Azure: ``AZURE_STORAGE_*`` / default credential). Nothing the storage
  holds or pickles (it travels to the writer process) carries a secret; ``describe`` is the bare URL. An
  S3-compatible endpoint comes from the standard ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` variables.

Listings are never cached (another writer may have changed the store).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from elastictrain.checkpoint.storage import LATEST, CheckpointStorage, LatestIsNewer, parse_step
from elastictrain.errors import CheckpointError


@dataclass(frozen=True, slots=True)
class ObjectLocation:
    """A checked object-store URL: ``scheme://bucket/prefix`` (no credentials, no query)."""

    scheme: str
    bucket: str
    prefix: str
    """``/``-separated, no leading or trailing ``/``; empty for the bucket's root."""

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.bucket}" + (f"/{self.prefix}" if self.prefix else "")


DEFAULT_BLOCK_SIZE = 16 << 20
"""Bytes per uploaded part (S3's minimum is 5 MiB) and per read-ahead block."""

LATEST_CAS_ATTEMPTS = 16
"""Compare-and-swap rounds of ``set_latest`` before it gives up (each lost round means another writer moved it)."""

_CONFLICT_CODES = {"PreconditionFailed", "ConditionalRequestConflict", "412", "409"}


def _s3_endpoint(location: ObjectLocation) -> str | None:
    """The standard variables naming an S3-compatible endpoint (MinIO, a test server), for ``s3://`` only."""
    if location.scheme != "s3":
        return None
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def _lost_race(e: BaseException) -> bool:
    """Whether ``e`` is the store refusing a conditional write (412 Precondition Failed, 409 Conflict)."""
    if isinstance(e, FileExistsError):  # s3fs's translation of a failed If-None-Match
        return True
    cause = e.__cause__
    response = getattr(cause, "response", None)
    if isinstance(response, dict):
        code = str(response.get("Error", {}).get("Code", ""))
        status = str(response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        return code in _CONFLICT_CODES or status in ("412", "409")
    return False


@functools.cache
def _require_conditional_puts() -> None:
    """Raise unless botocore knows PutObject's ``IfMatch``/``IfNoneMatch`` (s3fs drops parameters the installed
    botocore does not know, which would turn the compare-and-swap into a plain overwrite without a word)."""
    import botocore.session

    members = botocore.session.get_session().get_service_model("s3").operation_model("PutObject").input_shape.members
    if "IfMatch" not in members or "IfNoneMatch" not in members:
        raise CheckpointError(
            "the installed botocore cannot send conditional writes (PutObject IfMatch/IfNoneMatch); "
            "upgrade s3fs/aiobotocore: pip install -U 'elastictrain[s3]'"
        )


class FsspecStorage(CheckpointStorage):
    """Checkpoint files as objects under ``scheme://bucket/prefix``; keys map to ``bucket/prefix/<key>``.

    Build it with :func:`elastictrain.checkpoint.location.storage_for`. The fsspec filesystem is made on first
    use in each process (never pickled: the writer process makes its own, from the same credential chain).
    """

    def __init__(
        self, location: ObjectLocation, *, block_size: int = DEFAULT_BLOCK_SIZE, endpoint_url: str | None = None
    ) -> None:
        if block_size < 5 << 20:
            raise ValueError(f"block_size must be >= 5 MiB (S3's smallest part), got {block_size}")
        self.location = location
        self.block_size = block_size
        self.endpoint_url = endpoint_url if endpoint_url is not None else _s3_endpoint(location)
        """An S3-compatible endpoint (no secret), fixed where the storage is built: the writer process, started
        from a fork server, may have an older environment."""
        self._fs_obj: Any = None

    def __repr__(self) -> str:
        return f"FsspecStorage({self.location.url!r})"

    def __getstate__(self) -> dict[str, Any]:
        return {"location": self.location, "block_size": self.block_size, "endpoint_url": self.endpoint_url}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.location = state["location"]
        self.block_size = state["block_size"]
        self.endpoint_url = state["endpoint_url"]
        self._fs_obj = None

    # ------------------------------------------------------------------------------------------ plumbing
    @property
    def fs(self) -> Any:
        """The fsspec filesystem (made on first use; no instance or listings cache)."""
        if self._fs_obj is None:
            import fsspec

            options: dict[str, Any] = {"skip_instance_cache": True, "use_listings_cache": False}
            if self.endpoint_url:
                options["endpoint_url"] = self.endpoint_url
            self._fs_obj = fsspec.filesystem(self.location.scheme, **options)
        return self._fs_obj

    def _key(self, path: str, *, allow_root: bool = False) -> str:
        """``bucket/prefix/path``; ValueError for ``.``/``..`` components or an empty key (unless ``allow_root``)."""
        parts = [p for p in path.split("/") if p]
        if any(p in (".", "..") for p in parts):
            raise ValueError(f"storage key {path!r} must not contain '.' or '..' components")
        if not parts and not allow_root:
            raise ValueError("an empty storage key names the location itself, not an object")
        loc = self.location
        return "/".join([loc.bucket, *([loc.prefix] if loc.prefix else []), *parts])

    # ------------------------------------------------------------------------------------------ the interface
    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        f = self.fs.open(self._key(path), "wb", block_size=self.block_size)
        try:
            yield f
            f.close()  # completes the upload: the object appears now, whole
        except BaseException:
            with contextlib.suppress(Exception):
                f.discard()  # S3: abort the multipart upload; nothing becomes visible
            f.closed = True  # never completed later (fsspec closes a file on garbage collection)
            raise

    def open_read(self, path: str) -> BinaryIO:
        f: BinaryIO = self.fs.open(self._key(path), "rb", block_size=self.block_size, cache_type="readahead")
        return f

    def read_bytes(self, path: str) -> bytes:
        data: bytes = self.fs.cat_file(self._key(path))
        return data

    def write_bytes(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(self._key(path), data)  # one PUT: atomic

    def size(self, path: str) -> int:
        info = self.fs.info(self._key(path))
        if info.get("type") != "file":
            raise FileNotFoundError(f"{self.describe(path)} is not an object")
        return int(info["size"])

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(self._key(path, allow_root=True)))

    def list_dir(self, prefix: str = "") -> list[str]:
        key = self._key(prefix, allow_root=True)
        try:
            entries = self.fs.ls(key, detail=False, refresh=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        names = {str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries if str(e).rstrip("/") != key}
        return sorted(n for n in names if n)

    def delete(self, path: str) -> None:
        if not [p for p in path.split("/") if p]:
            raise ValueError("refusing to delete the storage root")
        key = self._key(path)
        targets = [key] if self._is_object(key) else []
        with contextlib.suppress(FileNotFoundError):
            targets += self.fs.find(key + "/")  # everything under the "folder", never a sibling sharing the prefix
        if targets:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(targets)

    def _is_object(self, key: str) -> bool:
        try:
            return bool(self.fs.info(key).get("type") == "file")
        except FileNotFoundError:
            return False

    def describe(self, path: str = "") -> str:
        parts = [p for p in path.split("/") if p]
        return "/".join([self.location.url, *parts])

    # ------------------------------------------------------------------------------------------ latest
    def set_latest(self, name: str, *, rollback: bool = False) -> None:
        """See :meth:`CheckpointStorage.set_latest`; on S3 a compare-and-swap with conditional writes."""
        if self.location.scheme != "s3":
            super().set_latest(name, rollback=rollback)
            return
        step = parse_step(name)
        if step is None:
            raise ValueError(f"{name!r} is not a checkpoint folder name (step-NNNNNNNN)")
        _require_conditional_puts()
        loc, fs = self.location, self.fs
        object_key = self._key(LATEST).split("/", 1)[1]
        data = (name + "\n").encode()
        for _ in range(LATEST_CAS_ATTEMPTS):
            etag, current = self._latest_with_etag(object_key)
            current_step = parse_step(current) if current is not None else None
            if current_step is not None and step < current_step and not rollback:
                raise LatestIsNewer(
                    f"{LATEST} names {current} (step {current_step}); not moving it back to {name} (step {step})"
                )
            condition = {"IfMatch": etag} if etag is not None else {"IfNoneMatch": "*"}
            try:
                fs.call_s3("put_object", Bucket=loc.bucket, Key=object_key, Body=data, **condition)
            except OSError as e:
                if _lost_race(e):
                    continue  # another writer changed latest between our read and our write: read again
                raise
            return
        raise CheckpointError(
            f"{self.describe(LATEST)} changed under every one of {LATEST_CAS_ATTEMPTS} conditional writes; "
            f"not moved to {name}"
        )

    def _latest_with_etag(self, object_key: str) -> tuple[str | None, str | None]:
        """``(etag, pointer text)`` of ``latest``; ``(None, None)`` when absent. The ETag is read first: a
        pointer read later may be newer than it, and then the conditional write on that ETag fails, as it must."""
        try:
            head = self.fs.call_s3("head_object", Bucket=self.location.bucket, Key=object_key)
        except FileNotFoundError:
            return None, None
        etag = str(head["ETag"])
        try:
            text = self.read_bytes(LATEST)[:256].decode("utf-8", "replace").strip()
        except FileNotFoundError:
            return etag, None
        return etag, text or None
