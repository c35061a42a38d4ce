"""S3-compatible object stores (AWS S3, Cloudflare R2, GCS interop, MinIO) through boto3.

URL: `s3://bucket/prefix`, optionally `?endpoint=https://host:port&region=auto`. Without
`endpoint=` the endpoint comes from `SPARSESYNC_S3_ENDPOINT`, then boto3's own
`AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL`, then AWS. Credentials come from boto3's usual
chain (env, profile, instance role) and never enter a URL, message or repr.

Guarantees: `put_new` is a real create-only write (`If-None-Match: *`, answered 412 when the
key exists) where the server supports it; a server that answers 501 drops the store back to
check-then-put and clears `has_create_only`. botocore's own retries are off: all retrying
happens in `sparsesync.store.retry`, so one policy bounds every call. Requests send checksums
only when required, which keeps third-party S3 servers that reject CRC trailers working.
"""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

from sparsesync.errors import ConfigError, ObjectNotFoundError, StoreAuthError, StoreError
from sparsesync.store import retry
from sparsesync.store._keys import check_key, check_prefix
from sparsesync.store.base import ObjectInfo, Store

_AUTH_CODES = frozenset({"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
                         "InvalidToken", "TokenRefreshRequired", "AllAccessDisabled", "AuthorizationHeaderMalformed",
                         "InvalidClientTokenId", "UnrecognizedClientException", "Forbidden", "Unauthorized"})
_TRANSIENT_CODES = frozenset({"SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling",
                              "ThrottlingException", "RequestLimitExceeded", "ConditionalRequestConflict",
                              "OperationAborted", "BadGateway", "GatewayTimeout"})
_MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
_MULTIPART_ABOVE = 64 << 20
_WORKERS = 8


def _endpoint_hint() -> str:
    return "set ?endpoint=URL in the store URL or SPARSESYNC_S3_ENDPOINT for non-AWS stores"


class S3Store(Store):
    """Objects live under `s3://bucket/prefix/`; keys are relative to the prefix."""

    has_create_only = True

    def __init__(self, bucket: str, prefix: str = "", *, endpoint: str | None = None, region: str | None = None,
                 create: bool = False, url: str | None = None) -> None:
        import boto3
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = url or f"s3://{bucket}" + (f"/{self.prefix}" if self.prefix else "")
        self._query = self.url.partition("?")[2]
        self.endpoint = endpoint or os.environ.get("SPARSESYNC_S3_ENDPOINT") or None
        config = Config(
            retries={"max_attempts": 1, "mode": "standard"},  # sparsesync.store.retry does the retrying
            connect_timeout=10,
            read_timeout=120,
            max_pool_connections=_WORKERS * 2,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            s3={"addressing_style": "path"} if self.endpoint else {},
        )
        self._session = boto3.session.Session()
        region = region or self._session.region_name or "us-east-1"
        self._client = self._session.client("s3", endpoint_url=self.endpoint, region_name=region, config=config)
        if create:
            self._ensure_bucket(region)

    @classmethod
    def from_url(cls, url: str, *, create: bool = False) -> S3Store:
        """Parse `s3://bucket/prefix[?endpoint=...&region=...]`."""
        parts = urlsplit(url)
        if not parts.netloc:
            raise ConfigError(f"S3 URL {url!r} names no bucket", hint="use s3://bucket/prefix")
        if "@" in parts.netloc:
            raise ConfigError("S3 URL carries credentials", hint="put credentials in AWS_* env vars or a profile")
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        unknown = set(query) - {"endpoint", "region"}
        if unknown:
            raise ConfigError(f"S3 URL {retry.redact(url)!r} has unknown options {sorted(unknown)}",
                              hint="supported: ?endpoint=URL&region=NAME")
        if "@" in urlsplit(query.get("endpoint", "")).netloc:
            raise ConfigError(f"the endpoint of S3 URL {retry.redact(url)!r} carries credentials (user:password@)",
                              hint="boto3 does not use them: put credentials in AWS_* env vars or a profile, "
                                   "and give the endpoint as scheme://host:port")
        prefix = parts.path.strip("/")
        printable = (
            f"s3://{parts.netloc}" + (f"/{prefix}" if prefix else "") + (f"?{parts.query}" if parts.query else "")
        )
        return cls(parts.netloc, prefix, endpoint=query.get("endpoint"), region=query.get("region"),
                   create=create, url=printable)

    def __repr__(self) -> str:
        return f"S3Store({self.url!r})"

    def object_url(self, key: str) -> str:
        base = self.url.partition("?")[0].rstrip("/")
        return f"{base}/{key}" + (f"?{self._query}" if self._query else "")

    # -- helpers ------------------------------------------------------------------------
    def _full(self, key: str) -> str:
        check_key(key, self.url)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _secrets(self) -> tuple[str | None, ...]:
        """Credential values to mask in messages (looked up, never kept on the store)."""
        creds = self._session.get_credentials()
        return (creds.secret_key, creds.token) if creds else ()

    def _transient(self, e: BaseException) -> bool:
        return _is_transient(e)

    def _translate(self, e: Exception, what: str, url: str) -> StoreError:
        from botocore.exceptions import ClientError, NoCredentialsError, PartialCredentialsError

        msg = retry.describe(e, self._secrets())
        if isinstance(e, (NoCredentialsError, PartialCredentialsError)):
            return StoreAuthError(f"no S3 credentials for {what} of {url}", url=url,
                                  hint="set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE")
        if isinstance(e, ClientError):
            code, status = _code(e), _status(e)
            if code in _MISSING_CODES or (status == 404 and code != "NoSuchBucket"):
                return ObjectNotFoundError(f"no object at {url}", url=url,
                                           hint="check the key; the writer may not have committed it yet")
            if code == "NoSuchBucket":
                return StoreError(f"bucket {self.bucket!r} does not exist ({what} of {url})", url=url,
                                  hint="create it, or open the store with create=True; " + _endpoint_hint())
            if code in _AUTH_CODES or status in (401, 403):
                return StoreAuthError(f"S3 refused {what} of {url}: {msg}", url=url,
                                      hint="check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or the profile) "
                                      "and that they may read and write this bucket")
        from botocore.exceptions import EndpointConnectionError, ParamValidationError

        if isinstance(e, EndpointConnectionError):
            return StoreError(f"cannot reach the S3 endpoint for {url}: {msg}", url=url, hint=_endpoint_hint())
        if isinstance(e, ParamValidationError):
            return StoreError(f"bad S3 request for {what} of {url}: {msg}", url=url,
                              hint="check the bucket name and key")
        return StoreError(f"{what} of {url} failed: {msg}", url=url, hint="see the cause above; " + _endpoint_hint())

    def _ensure_bucket(self, region: str) -> None:
        from botocore.exceptions import ClientError

        def _create() -> None:
            try:
                self._client.head_bucket(Bucket=self.bucket)
                return
            except ClientError as e:
                if _status(e) != 404 and _code(e) not in ("NoSuchBucket", "404", "NotFound"):
                    raise
            kwargs: dict[str, Any] = {"Bucket": self.bucket}
            if region and region not in ("us-east-1", "auto"):
                kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
            try:  # new S3 buckets block public access by default: private, as sparsesync wants
                self._client.create_bucket(**kwargs)
            except ClientError as e:
                if _code(e) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise

        self._call("create bucket", f"s3://{self.bucket}", _create)

    # -- writes -------------------------------------------------------------------------
    def put(self, key: str, data: bytes | Path) -> None:
        full = self._full(key)
        url = self.object_url(key)
        if isinstance(data, (bytes, bytearray, memoryview)):
            body = bytes(data)
            self._call("upload", url, lambda: self._client.put_object(Bucket=self.bucket, Key=full, Body=body))
            return
        path = Path(data)
        if not path.is_file():
            raise StoreError(f"cannot upload {path} to {url}: no such file", url=url,
                             hint="pass bytes or an existing file")
        if path.stat().st_size <= _MULTIPART_ABOVE:
            def _put_file() -> None:
                with open(path, "rb") as f:
                    self._client.put_object(Bucket=self.bucket, Key=full, Body=f)

            self._call("upload", url, _put_file)
        else:
            from boto3.s3.transfer import TransferConfig

            cfg = TransferConfig(multipart_threshold=_MULTIPART_ABOVE, max_concurrency=_WORKERS)
            self._call("upload", url, lambda: _unwrap_transfer(
                lambda: self._client.upload_file(str(path), self.bucket, full, Config=cfg)))

    def put_many(self, items: Sequence[tuple[str, bytes | Path]]) -> None:
        for key, _ in items:
            check_key(key, self.url)
        _parallel([functools.partial(self.put, k, d) for k, d in items])

    def put_new(self, key: str, data: bytes) -> bool:
        if not self.has_create_only:
            return super().put_new(key, data)
        from botocore.exceptions import ClientError

        full = self._full(key)
        url = self.object_url(key)

        def _create() -> bool:
            try:
                self._client.put_object(Bucket=self.bucket, Key=full, Body=bytes(data), IfNoneMatch="*")
                return True
            except ClientError as e:
                if _status(e) == 412 or _code(e) == "PreconditionFailed":
                    return False
                raise

        try:
            return self._call("create-only upload", url, _create)
        except StoreError as e:
            cause = e.__cause__
            if isinstance(cause, ClientError) and (_status(cause) == 501 or _code(cause) == "NotImplemented"):
                self.has_create_only = False  # this server ignores conditional writes
                return super().put_new(key, data)
            raise

    def delete(self, keys: Sequence[str]) -> None:
        from botocore.exceptions import ClientError

        fulls = [self._full(k) for k in keys]
        for i in range(0, len(fulls), 1000):
            chunk = fulls[i:i + 1000]

            def _delete(chunk: list[str] = chunk) -> None:
                try:
                    out = self._client.delete_objects(
                        Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in chunk], "Quiet": True})
                except ClientError as e:
                    if _status(e) != 501 and _code(e) != "NotImplemented":
                        raise
                    for k in chunk:  # e.g. GCS interop has no multi-object delete
                        self._client.delete_object(Bucket=self.bucket, Key=k)
                    return
                errors = [err for err in out.get("Errors", []) if err.get("Code") != "NoSuchKey"]
                if errors:
                    first = errors[0]
                    raise StoreError(
                        f"{len(errors)} of {len(chunk)} deletes under {self.url} failed, first "
                        f"{first.get('Key')!r}: {first.get('Code')} {first.get('Message', '')}",
                        url=self.url, hint="check that the credentials may delete objects in this bucket")

            self._call("delete", self.url, _delete)

    # -- reads --------------------------------------------------------------------------
    def get(self, key: str) -> bytes:
        full = self._full(key)
        return self._call("download", self.object_url(key),
                          lambda: self._client.get_object(Bucket=self.bucket, Key=full)["Body"].read())

    def get_range(self, key: str, start: int, length: int) -> bytes:
        from botocore.exceptions import ClientError

        full = self._full(key)
        url = self.object_url(key)
        if start < 0 or length < 0:
            raise StoreError(f"bad range start={start} length={length} for {url}", url=url,
                             hint="start and length must be >= 0")
        if length == 0:
            self._call("stat", url, lambda: self._client.head_object(Bucket=self.bucket, Key=full))
            return b""

        def _read() -> bytes:
            try:
                r = self._client.get_object(Bucket=self.bucket, Key=full, Range=f"bytes={start}-{start + length - 1}")
            except ClientError as e:
                if _status(e) == 416 or _code(e) == "InvalidRange":
                    self._client.head_object(Bucket=self.bucket, Key=full)  # missing key still raises
                    return b""  # start is at or past the end
                raise
            body = r["Body"].read()
            if "ContentRange" not in r and len(body) > length:  # server ignored Range
                body = body[start:start + length]
            return body

        return self._call("range read", url, _read)

    def get_file(self, key: str, dest: Path) -> None:
        full = self._full(key)
        dest = Path(dest)

        def _download() -> None:
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(dest.name + f".part-{uuid.uuid4().hex[:8]}")
            try:
                body = self._client.get_object(Bucket=self.bucket, Key=full)["Body"]
                with open(tmp, "wb") as f:
                    for chunk in body.iter_chunks(8 << 20):
                        f.write(chunk)
                os.replace(tmp, dest)
            finally:
                tmp.unlink(missing_ok=True)

        self._call("download", self.object_url(key), _download)

    def get_many(self, items: Sequence[tuple[str, Path]]) -> None:
        for key, _ in items:
            check_key(key, self.url)
        _parallel([functools.partial(self.get_file, k, d) for k, d in items])

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        check_prefix(prefix, self.url)
        root = f"{self.prefix}/" if self.prefix else ""

        def _list() -> list[ObjectInfo]:
            out = []
            pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=root + prefix)
            for page in pages:
                for obj in page.get("Contents", []):
                    out.append(ObjectInfo(obj["Key"][len(root):], int(obj["Size"])))
            out.sort(key=lambda o: o.key)
            return out

        return self._call("list", self.url, _list)

    def exists(self, key: str) -> bool:
        try:
            self._call("stat", self.object_url(key),
                       lambda: self._client.head_object(Bucket=self.bucket, Key=self._full(key)))
            return True
        except ObjectNotFoundError:
            return False

    def close(self) -> None:
        try:
            self._client.close()
        except Exception:  # closing twice or after interpreter teardown is harmless
            pass


# -- classification -----------------------------------------------------------------------
def _code(e: Exception) -> str:
    return str(getattr(e, "response", {}).get("Error", {}).get("Code", ""))


def _status(e: Exception) -> int:
    return int(getattr(e, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def _is_transient(e: BaseException) -> bool:
    from botocore.exceptions import (
        ClientError,
        ConnectionClosedError,
        ConnectionError,
        ConnectTimeoutError,
        EndpointConnectionError,
        IncompleteReadError,
        ReadTimeoutError,
        ResponseStreamingError,
    )
    from urllib3.exceptions import HTTPError as Urllib3Error

    if isinstance(e, ClientError):
        return _code(e) in _TRANSIENT_CODES or _status(e) in retry.TRANSIENT_HTTP_STATUS
    if isinstance(e, (EndpointConnectionError, ConnectionClosedError, ConnectTimeoutError, ReadTimeoutError,
                      ConnectionError, ResponseStreamingError, IncompleteReadError, Urllib3Error)):
        return True
    return retry.is_transient_os_error(e)


T = TypeVar("T")


def _unwrap_transfer(fn: Callable[[], T]) -> T:
    """boto3's managed transfers wrap the real error; re-raise the cause so it is classified."""
    from boto3.exceptions import S3UploadFailedError

    try:
        return fn()
    except S3UploadFailedError as e:
        raise (e.__cause__ or e.__context__ or e) from e


def _parallel(jobs: list[Callable[[], object]]) -> None:
    """Run jobs on a small thread pool; wait for all, then raise the first failure."""
    if len(jobs) <= 1:
        for job in jobs:
            job()
        return
    with ThreadPoolExecutor(max_workers=min(_WORKERS, len(jobs))) as pool:
        futures = [pool.submit(job) for job in jobs]
    errors = [e for e in (f.exception() for f in futures) if e is not None]
    if errors:
        raise errors[0]
