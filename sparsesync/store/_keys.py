"""Object-key validation shared by every backend.

Guarantee: a key that passes `check_key` means the same object on every backend: it is
relative, '/'-separated, plain ASCII from a small safe alphabet, with no empty, '.' or '..'
segment. So a key can never escape a local root, and S3, HF buckets and a folder never
disagree about Unicode normalisation or URL quoting.
"""

from __future__ import annotations

import re

from sparsesync.errors import StoreError

_SAFE = re.compile(r"[A-Za-z0-9._\-=+,@~:/]*")
MAX_KEY_LEN = 1024
_HINT = "keys are relative paths of ASCII letters, digits and . _ - = + , @ ~ : separated by '/'"


def _bad(url: str, what: str, key: str, why: str) -> StoreError:
    return StoreError(f"invalid {what} {key!r} for {url}: {why}", url=url, hint=_HINT)


def check_prefix(prefix: str, url: str) -> str:
    """A listing prefix: like a key, but may be empty and may end with '/'."""
    if not isinstance(prefix, str):
        raise _bad(url, "prefix", repr(prefix), f"expected str, got {type(prefix).__name__}")
    if prefix == "":
        return prefix
    body = prefix[:-1] if prefix.endswith("/") else prefix
    if not body:
        raise _bad(url, "prefix", prefix, "a prefix cannot be only '/'")
    _check(body, url, "prefix", prefix)
    return prefix


def check_key(key: str, url: str) -> str:
    """An object key; raises `StoreError` naming the key and the rule it breaks."""
    if not isinstance(key, str):
        raise _bad(url, "object key", repr(key), f"expected str, got {type(key).__name__}")
    if key == "":
        raise _bad(url, "object key", key, "empty key")
    if key.endswith("/"):
        raise _bad(url, "object key", key, "ends with '/' (that names a folder, not an object)")
    _check(key, url, "object key", key)
    return key


def _check(body: str, url: str, what: str, original: str) -> None:
    if len(original) > MAX_KEY_LEN:
        raise _bad(url, what, original[:40] + "...", f"{len(original)} characters, at most {MAX_KEY_LEN}")
    if not body.isascii() or not _SAFE.fullmatch(body):
        bad = sorted({c for c in body if not (c.isascii() and _SAFE.fullmatch(c))})
        raise _bad(url, what, original, f"characters {''.join(bad)!r} are not allowed")
    if body.startswith("/"):
        raise _bad(url, what, original, "absolute paths are not allowed")
    for seg in body.split("/"):
        if seg in ("", ".", ".."):
            raise _bad(url, what, original, f"segment {seg!r} is not allowed (no '//', '.' or '..')")
