"""Blob stores: a shared volume (`file:///dir`) and S3 (`s3://bucket/prefix`)."""

from __future__ import annotations

from urllib.parse import unquote, urlparse

from adapters.errors import ConfigError
from storage.base import BlobInfo, BlobStore, IterStream, check_key, iter_chunks

__all__ = ["BlobInfo", "BlobStore", "IterStream", "check_key", "iter_chunks", "open_store"]


def open_store(url: str, **s3_options: object) -> BlobStore:
    """Open the store a URL names: ``file:///abs/dir`` or ``s3://bucket/prefix``.

    S3 options (endpoint_url, region, credentials) are passed to the S3 store;
    boto3 also honours AWS_ENDPOINT_URL and the usual AWS_* variables.
    """
    parsed = urlparse(url)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost") or not parsed.path.startswith("/"):
            raise ConfigError(f"storage URL must be file:///absolute/dir, got {url!r}")
        from storage.volume import VolumeStore

        return VolumeStore(unquote(parsed.path))
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ConfigError(f"storage URL must be s3://bucket[/prefix], got {url!r}")
        from adapters.extras import needs

        with needs("s3", "S3 storage"):
            from storage.s3 import S3Store

        return S3Store(parsed.netloc, parsed.path.strip("/"), **s3_options)  # type: ignore[arg-type]
    raise ConfigError(f"unsupported storage URL {url!r}: use file:///abs/dir or s3://bucket/prefix")
