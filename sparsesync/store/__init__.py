"""Object stores: one small interface (`Store`), one module per backend, one factory.

`open_store(url)` picks the backend from the URL, and is the only place that does:
- a plain path or `file:///abs/path`            -> `LocalStore` (sparsesync.store.local)
- `s3://bucket/prefix[?endpoint=URL&region=R]`  -> `S3Store` (sparsesync.store.s3; boto3)
- `hf://buckets/<namespace>/<bucket>/<prefix>`   -> `HfBucketStore` (sparsesync.store.hf_bucket)

Guarantee: the returned store keeps the contract in `sparsesync.store.base` (missing objects
raise `ObjectNotFoundError`, transient failures are retried, auth failures name the fix, no
credential ever appears in a URL, message or repr). Backends import their client library
only when opened, so `import sparsesync.store` stays light.
"""

from __future__ import annotations

from urllib.parse import unquote, urlsplit

from sparsesync.errors import ConfigError
from sparsesync.store.base import ObjectInfo, Store

__all__ = ["ObjectInfo", "Store", "open_store"]


def open_store(url: str, *, create: bool = False, private: bool = True) -> Store:
    """Open the store rooted at `url`.

    `create=True` creates what is missing (the folder, the S3 bucket, the HF bucket); buckets
    sparsesync creates are private unless `private=False`.
    """
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(f"store URL {url!r} is empty",
                          hint="pass a folder, file:///path, s3://bucket/prefix or hf://buckets/ns/name/prefix")
    url = url.strip()
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme in ("", "file"):
        from sparsesync.store.local import LocalStore

        if scheme == "file":
            parts = urlsplit(url)
            if parts.netloc not in ("", "localhost"):
                raise ConfigError(f"store URL {url!r} names host {parts.netloc!r}",
                                  hint="use file:///absolute/path (three slashes) or a plain path")
            path = unquote(parts.path)
            return LocalStore(path, url="file://" + path.rstrip("/") if path != "/" else "file:///", create=create)
        return LocalStore(url, create=create)
    if scheme == "s3":
        from sparsesync.store.s3 import S3Store

        return S3Store.from_url(url, create=create)
    if scheme == "hf":
        from sparsesync.store.hf_bucket import HfBucketStore

        return HfBucketStore.from_url(url, create=create, private=private)
    raise ConfigError(f"store URL {url!r} has unknown scheme {scheme!r}",
                      hint="use a folder, file:///path, s3://bucket/prefix or hf://buckets/ns/name/prefix")
