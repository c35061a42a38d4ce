"""The one bounded reader of every record's JSON (`records.commit`, `records.replica`).

Guarantees: `load_object` returns a JSON object read from at most `limit` bytes of UTF-8 (no
recursion error, no int over 4300 digits escapes); every `Fields` getter returns a value of the
type and within the bounds it names (an int is never a bool; a number is finite and fits a
float; a string fits its length, its pattern, and with `clean` holds no control character), or
raises ValueError with a one-line reason naming the field (`where` + its name) and what it
holds (cut to 40 characters). Nothing here raises anything but ValueError on any JSON value.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

_HEX = re.compile(r"^[0-9a-f]{8,64}$")
_HEX16 = re.compile(r"^[0-9a-f]{16}$")
# C0/C1 controls, DEL, and the bidirectional/zero-width format characters terminals honour
_CONTROL_RE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2066-\u2069]")


def show(v: Any) -> str:
    """A short description of a JSON value for a one-line reason."""
    if isinstance(v, (dict, list)):
        return f"a JSON {'object' if isinstance(v, dict) else 'array'}"
    return f"{type(v).__name__} {json.dumps(v)[:40]}"


def clean_text(text: str) -> str:
    """`text` with tabs and newlines as spaces and other control characters as U+FFFD: a record's
    strings never carry terminal escape sequences (markup is escaped where it is printed)."""
    return _CONTROL_RE.sub("\ufffd", text.replace("\t", " ").replace("\n", " ").replace("\r", " "))


def load_object(data: bytes, limit: int) -> dict[str, Any]:
    """The JSON object `data` holds, or ValueError: over `limit` bytes, not UTF-8 JSON, nested too
    deeply, or not an object."""
    if len(data) > limit:
        raise ValueError(f"{len(data)} bytes or more, over the limit of {limit}")
    try:
        raw = json.loads(bytes(data).decode("utf-8"))
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as e:  # ValueError: JSON syntax, ints over 4300 digits
        raise ValueError(f"not UTF-8 JSON ({type(e).__name__}: {str(e)[:80]})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"the JSON is {show(raw)}, expected an object")
    return raw


def check_list(v: Any, path: str, hi: int, lo: int = 0) -> list[Any]:
    """`v` if it is a JSON array of `lo` to `hi` items."""
    if not isinstance(v, list) or not lo <= len(v) <= hi:
        raise ValueError(f"{path} is {show(v)}, expected a list of {f'{lo} to ' if lo else 'at most '}{hi} objects")
    return v


class Fields:
    """One JSON object of a record, read field by field. Every getter checks its field's type and
    bounds and raises ValueError naming the field (`where` + its name) and what it holds.
    `exactly`: the object must have these fields and no other; `known`: no field outside these."""

    def __init__(self, raw: Any, where: str = "", *, exactly: tuple[str, ...] | None = None,
                 known: frozenset[str] | None = None) -> None:
        if not isinstance(raw, dict) or (exactly is not None and set(raw) != set(exactly)):
            expected = f"an object with exactly {', '.join(exactly)}" if exactly else "an object"
            raise ValueError(f"{where.rstrip('.') or 'the record'} is {show(raw)}, expected {expected}")
        if known is not None and (unknown := set(raw) - known):
            raise ValueError(f"unknown fields {sorted(unknown)[:5]}")
        self.raw, self.where = raw, where

    def _show(self, name: str) -> str:
        return show(self.raw[name]) if name in self.raw else "absent"

    def get(self, name: str, default: Any = None) -> Any:
        return self.raw.get(name, default)

    def sub(self, name: str, *, exactly: tuple[str, ...] | None = None) -> Fields:
        """The field `name`, itself an object."""
        return Fields(self.raw.get(name), f"{self.where}{name}.", exactly=exactly)

    def integer(self, name: str, lo: int, hi: int, *, optional: bool = False) -> Any:
        """An integer in [lo, hi] (not a bool); None when absent or null and `optional`."""
        v = self.raw.get(name)
        if v is None and optional:
            return None
        if type(v) is not int:
            raise ValueError(f"{self.where}{name} is {self._show(name)}, expected an integer")
        if not lo <= v <= hi:
            raise ValueError(f"{self.where}{name} {json.dumps(v)[:40]} is outside [{lo}, {hi}]")
        return v

    def number(self, name: str, lo: float = -math.inf, hi: float = math.inf, *, optional: bool = False,
               default: float | None = None, below: bool = False) -> Any:
        """A finite number in [lo, hi] (in [lo, hi) with `below`) as a float; `default` when
        absent or null and `optional` or a default is given. NaN, infinities and integers too
        large for a float are refused."""
        v = self.raw.get(name)
        if v is None and (optional or default is not None):
            return default
        bounds = f" in [{lo:g}, {hi:g}{')' if below else ']'}" if math.isfinite(lo) or math.isfinite(hi) else ""
        bad = ValueError(f"{self.where}{name} is {self._show(name)}, expected a finite number{bounds}")
        if not isinstance(v, int | float) or isinstance(v, bool):
            raise bad
        try:
            f = float(v)
        except OverflowError:
            raise ValueError(f"{self.where}{name} is a number too large for a float") from None
        if not math.isfinite(f) or not lo <= f <= hi or (below and f >= hi):
            raise bad
        return f

    def text(self, name: str, *, max_len: int = 256, optional: bool = False, default: str | None = None,
             clean: bool = False) -> Any:
        """A string of at most `max_len` characters (control characters replaced with `clean`);
        `default` when absent or null and `optional` or a default is given."""
        v = self.raw.get(name)
        if v is None and (optional or default is not None):
            return default
        if not isinstance(v, str) or len(v) > max_len:
            raise ValueError(
                f"{self.where}{name} is {self._show(name)}, expected a string of at most {max_len} characters"
            )
        return clean_text(v) if clean else v

    def digest(self, name: str, *, optional: bool = False, tensors: bool = False) -> Any:
        """A hex digest (8 to 64 lowercase hex digits); `tensors`: a digest of tensors, which may
        also be "xxh3b:" + 16 hex digits (the block-parallel algorithm, `codec.algo_of`)."""
        v = self.text(name, optional=optional)
        if v is not None and not _HEX.match(v) and not (tensors and v.startswith("xxh3b:") and _HEX16.match(v[6:])):
            raise ValueError(f"{self.where}{name} {v!r} is not a hex digest")
        return v

    def choice(self, name: str, options: tuple[str, ...]) -> str:
        v = self.raw.get(name)
        if not isinstance(v, str) or v not in options:
            raise ValueError(f"{self.where}{name} is {self._show(name)}, expected {' or '.join(map(repr, options))}")
        return v

    def boolean(self, name: str, default: bool = False) -> bool:
        v = self.raw.get(name, default)
        if not isinstance(v, bool):
            raise ValueError(f"{self.where}{name} is {self._show(name)}, expected true or false")
        return v

    def text_map(self, name: str, *, max_items: int, max_key: int, max_len: int) -> dict[str, str]:
        """An object of at most `max_items` string fields (names of at most `max_key`, values of
        at most `max_len` characters), cleaned; {} when absent or null."""
        v = self.raw.get(name)
        if v is None:
            return {}
        if not isinstance(v, dict) or len(v) > max_items or not all(
            isinstance(k, str) and isinstance(x, str) and len(k) <= max_key and len(x) <= max_len for k, x in v.items()
        ):
            raise ValueError(f"{self.where}{name} is {self._show(name)}, expected at most {max_items} string fields "
                             f"(names of at most {max_key}, values of at most {max_len} characters)")
        return {clean_text(k): clean_text(x) for k, x in v.items()}
