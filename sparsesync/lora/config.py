"""Bounds on an adapter configuration (`adapter_config.json`) read from a run or a folder.

An adapter run's configuration comes from whoever can write the run (docs/protocol.md: every
replica can), and PEFT acts on it before any weight is seen: it allocates `r` (or a
`rank_pattern` entry) rows per targeted module and matches `target_modules`,
`exclude_modules`, `rank_pattern`, `alpha_pattern` and `layers_pattern` as Python regular
expressions against every module name of the model. So, before anything is allocated or
compiled:

- `check_config` (every reader: a commit's `adapter` field, a pushed folder, an engine's
  adapter) bounds the numbers (1 <= r <= MAX_RANK, |alpha| <= MAX_ALPHA and finite) and the
  strings, and admits a regex only from a safe subset: no backreferences or conditionals, no
  repeat over anything that can match in more than one way (`(a+)+`, `(a|ab)*`: the
  exponential cases), and at most REGEX_BUDGET ways to match a module name of NAME_BOUND
  characters (counting each unbounded repeat as NAME_BOUND + 1 choices, alternatives as a sum,
  sequences as a product, lookarounds multiplied in). That bound is what Python's backtracking
  matcher can explore per name, so PEFT's matching stays polynomial and small: three unbounded
  repeats and a few alternatives pass (`.*\\.layers\\.\\d+\\..*proj`; the worst such pattern,
  `[a.]*[a.]*[a.]*[^a.]`, takes 2.6 ms on a 128-character name), four do not. A static
  check was chosen over a timed match because it needs no model module names (push and pull
  have none) and no subprocess, and it gives the same answer on every machine; a list of
  module names is always accepted.
- `check_state_ranks` (push, publish, pull, an engine's adapter slot) checks the config
  against the tensors: every `lora_A`/`lora_B` (and embedding) tensor's rank dimension equals
  the config's rank for its module (`r`, or its `rank_pattern` entry, matched as PEFT does),
  and no rank in the config exceeds the largest present, so the config allocates no more than
  the tensors say.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from re import _constants as _sre  # type: ignore[attr-defined]  # CPython's private regex internals: no stubs
from re import _parser as _sre_parse  # type: ignore[attr-defined]  # (the same)
from typing import Any

import torch

from sparsesync.errors import ConfigError

MAX_RANK = 1 << 16  # above the full rank of any layer of today's models
MAX_ALPHA = float(1 << 20)
MAX_PATTERN_CHARS = 256  # one regex or module name
MAX_NAMES = 4096  # entries in target_modules / exclude_modules / rank_pattern / alpha_pattern
NAME_BOUND = 128  # the module name length the regex budget is computed for
REGEX_BUDGET = 1 << 24  # ways one regex may match one module name of NAME_BOUND characters

_RANK_DIM = {"lora_A": 0, "lora_B": 1, "lora_embedding_A": 0, "lora_embedding_B": 1}
_LORA_TENSOR = re.compile(
    r"^(?:base_model\.model\.)?(.+)\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B)(?:\.weight)?$"
)
_ONE_WAY = {_sre.LITERAL, _sre.NOT_LITERAL, _sre.ANY, _sre.IN, _sre.AT}
_REPEATS = {_sre.MAX_REPEAT, _sre.MIN_REPEAT, _sre.POSSESSIVE_REPEAT}


class UnsafePattern(ValueError):
    """A regex outside the safe subset (see module docstring)."""


def check_config(config: Any, where: str) -> None:
    """ValueError naming the field unless `config` is a LoRA config within the bounds above."""
    if not isinstance(config, dict):
        raise ValueError(f"{where} is not a JSON object")
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{where}.peft_type is {_show(config.get('peft_type'))}, expected 'LORA'")
    _rank(config.get("r"), f"{where}.r")
    _alpha(config.get("lora_alpha"), f"{where}.lora_alpha")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        check_pattern(targets, f"{where}.target_modules")  # PEFT: re.fullmatch(target_modules, name)
    elif not _names(targets):
        raise ValueError(f"{where}.target_modules is {_show(targets)}, expected a regex or a list of at most "
                         f"{MAX_NAMES} module names of at most {MAX_PATTERN_CHARS} characters")
    exclude = config.get("exclude_modules")
    if isinstance(exclude, str):
        check_pattern(exclude, f"{where}.exclude_modules")
    elif exclude is not None and not _names(exclude):
        raise ValueError(f"{where}.exclude_modules is {_show(exclude)}, expected a regex or a list of module names")
    for field, value_check in (("rank_pattern", _rank), ("alpha_pattern", _alpha)):
        pattern = config.get(field)
        if pattern is None:
            continue
        if not isinstance(pattern, dict) or len(pattern) > MAX_NAMES:
            raise ValueError(f"{where}.{field} is {_show(pattern)}, expected an object of at most {MAX_NAMES} entries")
        for key, value in pattern.items():
            check_pattern(key, f"{where}.{field} key", wrap=r"(.*\.)?({})$")  # PEFT's get_pattern_key
            value_check(value, f"{where}.{field}[{key!r}]")
    layers = config.get("layers_pattern")
    for p in [layers] if isinstance(layers, str) else layers if isinstance(layers, list) else []:
        if not isinstance(p, str):
            raise ValueError(f"{where}.layers_pattern holds {_show(p)}, expected strings")
        check_pattern(p, f"{where}.layers_pattern", wrap=r"(?:^|.*?\.){}\.(?P<idx>\d+)\.")


def check_pattern(pattern: Any, where: str, wrap: str = "{}") -> None:
    """UnsafePattern unless `pattern` (as PEFT embeds it in `wrap`) is a regex of the safe subset."""
    if not isinstance(pattern, str) or len(pattern) > MAX_PATTERN_CHARS:
        raise UnsafePattern(f"{where} is {_show(pattern)}, expected a regex of at most {MAX_PATTERN_CHARS} characters")
    try:
        parsed = _sre_parse.parse(wrap.replace("{}", pattern))
    except (re.error, RecursionError, OverflowError) as e:
        raise UnsafePattern(f"{where} {pattern!r} is not a regular expression: {e}") from None
    try:
        _ways(parsed)
    except UnsafePattern as e:
        raise UnsafePattern(f"{where} {pattern!r} {e}: list the module names instead (target_modules=[...]), "
                            "or use a simpler pattern") from None


def _ways(items: Any) -> int:
    """An upper bound on the ways `items` (a parsed sequence) can match at one position."""
    total = 1
    for op, av in items:
        if op in _ONE_WAY:
            w = 1
        elif op is _sre.BRANCH:
            w = sum(_ways(b) for b in av[1])
        elif op is _sre.SUBPATTERN:
            w = _ways(av[3])
        elif op is _sre.ATOMIC_GROUP:
            w = _ways(av)
        elif op in (_sre.ASSERT, _sre.ASSERT_NOT):
            w = _ways(av[1])
        elif op in _REPEATS:
            lo, hi, body = av
            inner = _ways(body)
            if hi <= 1:
                w = 1 + inner
            elif inner > 1:
                raise UnsafePattern("repeats a part that can match in more than one way (catastrophic backtracking)")
            else:
                w = max(1, min(hi, NAME_BOUND) - lo + 1)
        else:  # backreferences, conditionals: matching them is not polynomial
            raise UnsafePattern(f"uses {str(op).lower()}, which adapter runs do not accept")
        total *= w
        if total > REGEX_BUDGET:
            raise UnsafePattern(f"can match a {NAME_BOUND}-character module name in over {REGEX_BUDGET:,} ways "
                                "(too many repeats)")
    return total


def _rank(value: Any, where: str) -> None:
    if type(value) is not int or not 1 <= value <= MAX_RANK:
        raise ValueError(f"{where} is {_show(value)}, expected an integer from 1 to {MAX_RANK}")


def _alpha(value: Any, where: str) -> None:
    if type(value) not in (int, float) or not math.isfinite(value) or abs(value) > MAX_ALPHA:
        raise ValueError(f"{where} is {_show(value)}, expected a finite number of magnitude at most {MAX_ALPHA:g}")


def _names(value: Any) -> bool:
    return (isinstance(value, list) and len(value) <= MAX_NAMES
            and all(isinstance(t, str) and len(t) <= MAX_PATTERN_CHARS for t in value))


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def rank_for(config: Mapping[str, Any], module: str) -> int:
    """The rank PEFT gives `module` (its name in the base model): the first `rank_pattern` key
    that matches as PEFT's `get_pattern_key` matches it, else `r`. Call after `check_config`."""
    for key, value in (config.get("rank_pattern") or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return int(value)
    return int(config["r"])


def check_state_ranks(state: Mapping[str, torch.Tensor], config: Mapping[str, Any], where: str) -> None:
    """ConfigError unless every LoRA tensor's rank dimension in `state` (PEFT names) is the config's
    rank for its module, and no rank in the config is above the largest the tensors hold."""
    largest = 0
    for name, t in state.items():
        m = _LORA_TENSOR.match(name)
        if m is None:
            continue
        dim = _RANK_DIM[m[2]]
        want = rank_for(config, m[1])
        got = t.shape[dim] if t.dim() >= 2 else None
        if got != want:
            raise ConfigError(f"{where}: tensor {name!r} has shape {tuple(t.shape)}, but the adapter config gives "
                              f"{m[1]!r} rank {want} (dimension {dim})",
                              hint="the adapter_config.json does not belong to these adapter tensors: save both with "
                                   "model.save_pretrained(DIR)")
        largest = max(largest, got)
    ranks = [int(config["r"])] + [int(v) for v in (config.get("rank_pattern") or {}).values()]
    if max(ranks) > largest:
        raise ConfigError(f"{where}: the adapter config asks for rank {max(ranks)}, but its largest LoRA tensor has "
                          f"rank {largest}",
                          hint="the adapter_config.json does not belong to these adapter tensors: save both with "
                               "model.save_pretrained(DIR)")
