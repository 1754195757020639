"""A blob store on S3 or any S3-compatible server (`s3://bucket/prefix`).

* Keys live under ``<prefix>/`` in the bucket; :attr:`S3Store.url` is
  ``s3://bucket/prefix`` (never credentials or the endpoint).
* Writes stream: up to ``part_bytes`` are buffered, then the blob goes as a
  multipart upload, one part at a time, so memory stays at about one part
  whatever the size. A blob smaller than one part goes as a single
  ``PutObject`` when the writer closes. A failed write aborts the multipart
  upload: no object and no pending upload remain.
* ``private=True`` is accepted and ignored: the bucket itself is private
  (nothing is ever written with a public ACL); links are only handed out as
  time-limited presigned URLs.
* Reads stream the ``GetObject`` body.
* Every botocore/boto3 error is translated in one place, :func:`_map_errors`,
  into :class:`StorageError` / :class:`BlobMissing`; timeouts and a small
  retry budget make an unreachable endpoint fail in seconds, not minutes.
* boto3 honours ``AWS_ENDPOINT_URL`` (``AWS_ENDPOINT_URL_S3``), ``AWS_REGION``
  and the usual credential variables when the arguments are None.
"""

from __future__ import annotations

import builtins
import io
import json
import logging
import mimetypes
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import boto3
import botocore.exceptions as bce
import botocore.session
from boto3.exceptions import Boto3Error
from botocore.config import Config
from botocore.loaders import create_loader

from adapters.errors import BlobMissing, ConfigError, CourierError, StorageError
from storage.base import BlobInfo, BlobStore, check_key

log = logging.getLogger(__name__)

MIN_PART_BYTES = 5 * 1024 * 1024  # S3's minimum for every part but the last
MAX_PARTS = 10_000  # S3's maximum parts per upload
DELETE_BATCH = 1000  # S3's maximum keys per DeleteObjects
MAX_PRESIGN_S = 7 * 24 * 3600  # SigV4 presigned URLs live at most 7 days

_MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})

_LOADER = None


def _session(access_key: str | None, secret_key: str | None, region: str | None,
             session_token: str | None = None) -> boto3.session.Session:
    """A boto3 session of its own (credentials, env) sharing one model loader:
    botocore's service models are parsed once per process, not once per store."""
    global _LOADER
    if _LOADER is None:
        _LOADER = create_loader()
    core = botocore.session.get_session()
    core.register_component("data_loader", _LOADER)
    return boto3.session.Session(
        aws_access_key_id=access_key, aws_secret_access_key=secret_key, aws_session_token=session_token,
        region_name=region, botocore_session=core,
    )


@contextmanager
def _map_errors(what: str, key: str | None = None, where: str = "") -> Iterator[None]:
    """The one place where boto3/botocore errors become courier errors.

    `what` names the operation for the message; `key` the blob (if any);
    `where` the store URL. Messages carry S3's error code and text, never
    credentials.
    """
    target = f"{where}/{key}" if key is not None and where else (key or where or "S3")
    try:
        yield
    except CourierError:
        raise
    except bce.ClientError as exc:
        err = exc.response.get("Error", {}) or {}
        code = str(err.get("Code") or exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or "?")
        msg = err.get("Message") or ""
        if code in _MISSING_CODES and key is not None:
            raise BlobMissing(f"no blob {key!r} in {where or 'S3'}") from exc
        if code == "NoSuchBucket":
            raise StorageError(f"S3 {what} failed: bucket of {where or target} does not exist") from exc
        raise StorageError(f"S3 {what} failed for {target}: {code}{': ' + msg if msg else ''}") from exc
    except (bce.NoCredentialsError, bce.PartialCredentialsError) as exc:
        raise StorageError(f"S3 {what} failed for {target}: no usable S3 credentials configured") from exc
    except (bce.EndpointConnectionError, bce.ConnectTimeoutError) as exc:
        raise StorageError(f"S3 {what} failed for {target}: endpoint unreachable ({exc})") from exc
    except (bce.ReadTimeoutError, bce.ConnectionClosedError) as exc:
        raise StorageError(f"S3 {what} failed for {target}: connection timed out or closed ({exc})") from exc
    except (bce.BotoCoreError, Boto3Error) as exc:
        raise StorageError(f"S3 {what} failed for {target}: {type(exc).__name__}: {exc}") from exc
    except OSError as exc:  # sockets reset under a streaming body, etc.
        raise StorageError(f"S3 {what} failed for {target}: {type(exc).__name__}: {exc}") from exc
    except Exception as exc:  # urllib3 errors escaping a streaming body
        if type(exc).__module__.startswith(("urllib3", "botocore", "boto3", "http.client")):
            raise StorageError(f"S3 {what} failed for {target}: {type(exc).__name__}: {exc}") from exc
        raise


class S3Store(BlobStore):
    can_sign = True

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        session_token: str | None = None,
        create_bucket: bool = False,
        part_bytes: int = 8 * 1024 * 1024,
        connect_timeout_s: float = 3.0,
        read_timeout_s: float = 60.0,
        max_attempts: int = 3,
    ) -> None:
        if not bucket or "/" in bucket:
            raise ConfigError(f"invalid S3 bucket name: {bucket!r}")
        prefix = prefix.strip("/")
        if prefix:
            check_key(prefix)
        if part_bytes < MIN_PART_BYTES:
            raise ConfigError(f"part_bytes must be at least {MIN_PART_BYTES:,} (S3's minimum part size)")
        self.bucket = bucket
        self.prefix = prefix
        self.part_bytes = int(part_bytes)
        self.url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        self._key_prefix = f"{prefix}/" if prefix else ""

        with _map_errors("configure", where=self.url):
            session = _session(access_key, secret_key, region, session_token)
        endpoint = endpoint_url or None
        custom_endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        self._client_kwargs: dict[str, Any] = {
            "endpoint_url": endpoint,
            "region_name": session.region_name or "us-east-1",
            "config": Config(
                signature_version="s3v4",
                connect_timeout=connect_timeout_s,
                read_timeout=read_timeout_s,
                retries={"mode": "standard", "total_max_attempts": max_attempts},  # the first one included
                # path-style always works on loopback / S3-compatible servers;
                # virtual-host style stays the default on AWS itself.
                s3={"addressing_style": "path" if custom_endpoint else "auto"},
                # only the checksums an operation requires: the "when_supported"
                # default trips several S3-compatible servers.
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
                tcp_keepalive=True,
            ),
        }
        self._session = session
        self._client_obj: Any = None
        self._client_pid = 0
        if create_bucket:
            self._ensure_bucket()

    # -- plumbing ---------------------------------------------------------
    @property
    def _client(self) -> Any:
        """The boto3 client, made lazily and again after a fork (prefork workers)."""
        if self._client_obj is None or self._client_pid != os.getpid():
            with _map_errors("connect", where=self.url):
                self._client_obj = self._session.client("s3", **self._client_kwargs)
            self._client_pid = os.getpid()
        return self._client_obj

    def sweep_tmp(self, older_than_s: float = 3600) -> int:
        """Abort multipart uploads under this store's prefix started over
        `older_than_s` ago (a worker killed mid-upload leaves its parts billed forever)."""
        import datetime

        cutoff = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=older_than_s)
        n = 0
        with _map_errors("list uploads", self._key_prefix, self.url):
            pages = self._client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=self._key_prefix)
            stale = [(u["Key"], u["UploadId"]) for page in pages for u in page.get("Uploads", [])
                     if u["Initiated"] < cutoff]
        for key, upload_id in stale:
            with _map_errors("abort", key, self.url):
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            n += 1
        return n

    def _full(self, key: str) -> str:
        return self._key_prefix + check_key(key)

    def _ensure_bucket(self) -> None:
        with _map_errors("create bucket", where=self.url):
            try:
                self._client.head_bucket(Bucket=self.bucket)
                return
            except bce.ClientError as exc:
                code = str(exc.response.get("Error", {}).get("Code"))
                if code not in ("404", "NoSuchBucket", "NotFound"):
                    raise
            kwargs: dict[str, Any] = {"Bucket": self.bucket}
            region = self._client_kwargs["region_name"]
            if region != "us-east-1":
                kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
            try:
                self._client.create_bucket(**kwargs)
            except bce.ClientError as exc:
                if exc.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou",):
                    raise

    # -- writing ------------------------------------------------------------
    @contextmanager
    def open_write(self, key: str, *, private: bool = False) -> Iterator[_S3Writer]:
        """A streaming writer. `private` is a no-op here: the bucket is private."""
        writer = _S3Writer(self, key, self._full(key))
        try:
            yield writer
        except BaseException:
            writer.abort()
            raise
        try:
            writer.commit()
        except BaseException:
            writer.abort()
            raise

    # -- reading ------------------------------------------------------------
    @contextmanager
    def open_read(self, key: str) -> Iterator[io.BufferedReader]:
        full = self._full(key)
        with _map_errors("read", key, self.url):
            resp = self._client.get_object(Bucket=self.bucket, Key=full)
        raw = _BodyReader(resp["Body"], key, self.url)
        reader = io.BufferedReader(raw, buffer_size=64 * 1024)
        try:
            yield reader  # type: ignore[misc]  # a BufferedReader over our raw reader
        finally:
            reader.close()

    def stat(self, key: str) -> BlobInfo:
        full = self._full(key)
        with _map_errors("stat", key, self.url):
            head = self._client.head_object(Bucket=self.bucket, Key=full)
        return BlobInfo(key=key, size_bytes=int(head["ContentLength"]), modified_s=head["LastModified"].timestamp())

    # -- listing and deleting ----------------------------------------------
    def list(self, prefix: str = "") -> Iterator[BlobInfo]:
        strip = len(self._key_prefix)
        with _map_errors("list", where=f"{self.url}/{prefix}" if prefix else self.url):
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._key_prefix + prefix
            )
            for page in pages:
                for obj in page.get("Contents", ()):
                    key = obj["Key"][strip:]
                    try:
                        check_key(key)  # directory markers and foreign oddities: not blobs of ours
                    except ConfigError:
                        continue
                    yield BlobInfo(key=key, size_bytes=int(obj["Size"]), modified_s=obj["LastModified"].timestamp())

    def delete_many(self, keys: Iterable[str]) -> int:
        """Delete in batches of 1000 keys (one DeleteObjects each).

        Returns how many keys S3 confirmed deleted. S3 deletes are idempotent
        and do not tell a missing key from a deleted one, so a missing key
        counts as deleted here (the volume store counts only files it removed).
        Keys S3 refuses raise :class:`StorageError` after every batch was tried.
        """
        n = 0
        failed: list[str] = []
        batch: list[str] = []
        seen: set[str] = set()

        def flush() -> None:
            nonlocal n
            if not batch:
                return
            with _map_errors("delete", where=self.url):
                resp = self._client.delete_objects(
                    Bucket=self.bucket,
                    Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True},
                )
            errors = resp.get("Errors", [])
            n += len(batch) - len(errors)
            failed.extend(f"{e.get('Key', '?')[len(self._key_prefix):]}: {e.get('Code', '?')}" for e in errors)
            batch.clear()

        for key in keys:
            full = self._full(key)
            if full in seen:
                continue
            seen.add(full)
            batch.append(full)
            if len(batch) >= DELETE_BATCH:
                flush()
        flush()
        if failed:
            raise StorageError(f"S3 delete failed for {len(failed)} key(s) in {self.url} (first: {failed[0]}); {n} deleted")
        return n

    # -- lifecycle (the janitor's expiry, done by the S3 service) -------------
    def lifecycle_rules(self, expire_days: dict[str, int], abort_multipart_days: int = 1) -> builtins.list[dict]:
        """courier's lifecycle rules for this store: objects under each prefix
        expire after its days; unfinished multipart uploads under the store's
        prefix are aborted after `abort_multipart_days`. Rule ids are
        `courier:<full prefix>`, so other rules of the bucket (and another
        courier store's, under another prefix) are told apart."""
        rules = [{"ID": f"courier:{self._key_prefix}{prefix}", "Filter": {"Prefix": self._key_prefix + prefix},
                  "Status": "Enabled", "Expiration": {"Days": max(1, int(days))}}
                 for prefix, days in expire_days.items()]
        rules.append({"ID": f"courier:{self._key_prefix}*multipart", "Filter": {"Prefix": self._key_prefix},
                      "Status": "Enabled",
                      "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": max(1, int(abort_multipart_days))}})
        return rules

    def install_lifecycle(self, expire_days: dict[str, int], abort_multipart_days: int = 1) -> dict:
        """Make the bucket's lifecycle configuration hold courier's rules
        (`lifecycle_rules`), keeping every other rule; one GET, and one PUT
        only when something changed. Returns {"rules": ours, "changed": bool,
        "kept": how many other rules}."""
        ours = self.lifecycle_rules(expire_days, abort_multipart_days)
        mine = f"courier:{self._key_prefix}"
        with _map_errors("get lifecycle", where=self.url):
            try:
                current = self._client.get_bucket_lifecycle_configuration(Bucket=self.bucket).get("Rules", [])
            except bce.ClientError as exc:
                if (exc.response.get("Error", {}) or {}).get("Code") != "NoSuchLifecycleConfiguration":
                    raise
                current = []
        others = [r for r in current if not str(r.get("ID", "")).startswith(mine)]
        had = sorted((json.dumps(r, sort_keys=True, default=str) for r in current
                      if str(r.get("ID", "")).startswith(mine)))
        changed = had != sorted(json.dumps(r, sort_keys=True) for r in ours)
        if changed:
            with _map_errors("put lifecycle", where=self.url):
                self._client.put_bucket_lifecycle_configuration(
                    Bucket=self.bucket, LifecycleConfiguration={"Rules": others + ours})
        return {"rules": ours, "changed": changed, "kept": len(others)}

    # -- links --------------------------------------------------------------
    def signed_url(self, key: str, expires_s: int = 3600) -> str | None:
        """A presigned GET link (SigV4; 1 s to 7 days). Does not check that the key exists."""
        full = self._full(key)
        expires = max(1, min(int(expires_s), MAX_PRESIGN_S))
        with _map_errors("sign", key, self.url):
            return self._client.generate_presigned_url(
                "get_object", Params={"Bucket": self.bucket, "Key": full}, ExpiresIn=expires
            )


def _content_type(key: str) -> str:
    """By extension, so a presigned link opens sensibly in a browser."""
    return mimetypes.guess_type(key, strict=False)[0] or "application/octet-stream"


class _S3Writer:
    """Buffers one part; small blobs go as one PutObject, large ones as multipart."""

    def __init__(self, store: S3Store, key: str, full: str) -> None:
        self._store = store
        self._key = key
        self._full = full
        self._buf = bytearray()
        self._upload_id: str | None = None
        self._parts: list[dict[str, Any]] = []
        self._closed = False

    def write(self, data: bytes) -> int:
        if self._closed:
            raise ValueError("write to a closed S3 writer")
        self._buf += data
        part = self._store.part_bytes
        while len(self._buf) >= part:
            # hand the buffer itself to the upload: only the (small) overflow is copied
            body, self._buf = self._buf, self._buf[part:]
            del body[part:]
            self._upload_part(body)
            del body
        return len(data)

    def _upload_part(self, body: bytes | bytearray) -> None:
        s = self._store
        with _map_errors("write", self._key, s.url):
            if self._upload_id is None:
                resp = s._client.create_multipart_upload(
                    Bucket=s.bucket, Key=self._full, ContentType=_content_type(self._key)
                )
                self._upload_id = resp["UploadId"]
            number = len(self._parts) + 1
            if number > MAX_PARTS:
                raise StorageError(
                    f"S3 write failed for {s.url}/{self._key}: over {MAX_PARTS} parts (raise part_bytes)"
                )
            resp = s._client.upload_part(
                Bucket=s.bucket, Key=self._full, UploadId=self._upload_id, PartNumber=number, Body=body
            )
        self._parts.append({"PartNumber": number, "ETag": resp["ETag"]})

    def commit(self) -> None:
        if self._closed:
            return
        s = self._store
        if self._upload_id is None:
            body, self._buf = self._buf, bytearray()
            with _map_errors("write", self._key, s.url):
                s._client.put_object(Bucket=s.bucket, Key=self._full, Body=body, ContentType=_content_type(self._key))
        else:
            if self._buf:
                body, self._buf = self._buf, bytearray()
                self._upload_part(body)
            with _map_errors("write", self._key, s.url):
                s._client.complete_multipart_upload(
                    Bucket=s.bucket, Key=self._full, UploadId=self._upload_id,
                    MultipartUpload={"Parts": self._parts},
                )
        self._closed = True

    def abort(self) -> None:
        """Drop the buffer and any multipart upload; never raises (the first error wins)."""
        self._closed = True
        self._buf = bytearray()
        if self._upload_id is None:
            return
        s = self._store
        try:
            with _map_errors("abort", self._key, s.url):
                s._client.abort_multipart_upload(Bucket=s.bucket, Key=self._full, UploadId=self._upload_id)
        except StorageError as exc:
            log.warning("could not abort multipart upload of %s/%s: %s", s.url, self._key, exc)
        self._upload_id = None


class _BodyReader(io.RawIOBase):
    """A raw binary stream over a botocore StreamingBody, errors translated."""

    def __init__(self, body: Any, key: str, where: str) -> None:
        self._body = body
        self._key = key
        self._where = where

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        with _map_errors("read", self._key, self._where):
            data = self._body.read(len(b))
        n = len(data)
        b[:n] = data
        return n

    def close(self) -> None:
        if not self.closed:
            try:
                self._body.close()
            except Exception:  # noqa: BLE001 - closing a dead connection is not an error
                pass
        super().close()
