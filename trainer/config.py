"""The trainer's typed configuration, loaded from TOML and validated before anything starts.

Guarantee: `TrainerConfig.load(path)` / `from_dict(data)` either return a config whose every
field has the right type and a sensible value, or raise one `ConfigError` that names the
offending key (`[optim] lr`), the bad value, what was expected, and lists unknown keys. No
process is started, no model loaded, no bucket created before validation passes.

Example (`trainer.toml`):

    [model]
    path = "/tmp/tiny-model"          # a local folder or a Hub model id

    [rollout]
    replicas = ["http://127.0.0.1:8101", "http://127.0.0.1:8102"]
    env_url = "http://127.0.0.1:8100"
    task = "repeat"
    group_size = 8

    [optim]
    steps = 60
    lr = 3e-3

    [sync]
    bucket = "/tmp/run/bucket"        # local folder, s3://..., hf://buckets/ns/name/prefix

    [lora]                            # optional: publish a LoRA adapter instead of full weights
    enabled = true
    r = 16
    lora_alpha = 32

    [distributed]                     # optional, read only under torchrun (trainer/distributed.py)
    timeout_s = 300.0
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from sparsesync.codec import Effort
from sparsesync.errors import ConfigError


@dataclass
class ModelConfig:
    """Which model to train and in which precision."""

    path: str = ""  # local folder or Hub model id (needs network for the Hub)
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when available
    master_dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: fp32 on CPU, bf16 on GPU
    publish_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"  # what replicas receive
    revision: str | None = None  # Hub revision (ignored for local folders)


@dataclass
class RolloutConfig:
    """Where rollouts come from and how they are sampled."""

    replicas: list[str] = field(default_factory=list)  # inference replica base URLs
    env_url: str = ""  # environment server base URL
    task: str = "repeat"  # env task passed to /reset
    group_size: int = 8  # completions per prompt (the GRPO group)
    max_tokens: int = 16  # completion length cap, in tokens
    temperature: float = 1.0  # sampling temperature on the replicas
    top_p: float = 1.0
    workers: int = 2  # rollout threads (each plays one group at a time)
    request_timeout_s: float = 60.0  # per HTTP request to a replica or the env
    replica_cooldown_s: float = 2.0  # a failed replica is skipped this long before being retried
    auth_token_env: str = ""  # env var holding a token sent as `Authorization: Bearer` (private Spaces: "HF_TOKEN")


@dataclass
class OptimConfig:
    """The learner: GRPO loss, optimizer and staleness bound."""

    steps: int = 50  # optimizer steps
    groups_per_step: int = 4  # GRPO groups (prompts) per optimizer step
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    max_grad_norm: float = 1.0  # 0 disables clipping
    clip_low: float = 0.2  # PPO ratio clip: [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.28
    max_staleness: int = 2  # k: samples generated more than k versions ago are stale
    stale_policy: Literal["drop", "correct"] = "drop"  # drop stale samples, or keep them with a capped IS weight
    is_cap: float = 2.0  # cap of the sequence importance weight for stale samples (policy "correct")
    buffer_groups: int = 16  # rollout buffer capacity, in groups (producers block when full)
    seed: int = 0


@dataclass
class SyncConfig:
    """How weights reach the replicas: through the sparsesync publisher and a bucket."""

    bucket: str = ""  # run URL: local folder, file://, s3://bucket/prefix, hf://buckets/ns/name/prefix
    publish_every: int = 1  # publish after every k optimizer steps
    anchor_every: int = 50  # publisher: versions between periodic full anchors
    anchor_fraction: float = 0.5  # publisher: also anchor when deltas since the last anchor pass this x its size
    queue_size: int = 4  # publisher: versions waiting for upload before deltas are coalesced
    # publisher's codec: "size" (smallest patches) or "speed" (faster encode and decode, larger patches)
    effort: Effort = "size"
    flush_timeout_s: float = 120.0  # at the end, wait this long for the last uploads
    fleet_min_replicas: int = 0  # > 0: after each publish, wait until this many replicas report (heartbeats)...
    fleet_max_lag: int = 0  # ...serving the newest published version minus at most this many versions
    fleet_timeout_s: float = 120.0  # a wait longer than this stops the run (FleetTimeoutError names who is behind)


LORA_ALL_LINEAR = (  # every linear layer of a Qwen3/Llama block
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
)


@dataclass
class LoraSection:
    """`[lora]`: train and publish a LoRA adapter (peft.LoraConfig fields) instead of full weights."""

    enabled: bool = False  # true: the run is an adapter run (sparsesync.lora.bridge); replicas serve base + adapter
    r: int = 16  # rank
    lora_alpha: int = 32  # scaling numerator (scale = lora_alpha / r, or / sqrt(r) with use_rslora)
    target_modules: list[str] = field(default_factory=lambda: list(LORA_ALL_LINEAR))  # module names to adapt
    lora_dropout: float = 0.0
    use_rslora: bool = False

    def peft(self) -> Any:
        """The peft.LoraConfig of this section."""
        from peft import LoraConfig

        return LoraConfig(r=self.r, lora_alpha=self.lora_alpha, target_modules=list(self.target_modules),
                          lora_dropout=self.lora_dropout, use_rslora=self.use_rslora)


@dataclass
class LogConfig:
    """Where per-step metrics go."""

    jsonl: str = ""  # JSONL metrics file ("" : none)
    progress: bool = True  # rich progress bar on the console
    trackio_project: str = ""  # log to trackio under this project when trackio is installed ("" : off)
    log_every: int = 1  # console line every n steps (the JSONL gets every step)


@dataclass
class DistributedConfig:
    """`[distributed]`: only read under torchrun (WORLD_SIZE > 1), where the run is data parallel
    on an FSDP2-sharded policy (trainer/distributed.py); nothing here switches it on."""

    timeout_s: float = 300.0  # no collective waits longer (a rank hung); must exceed [sync] fleet_timeout_s


@dataclass
class TrainerConfig:
    """The whole trainer configuration; see the module docstring for the TOML layout."""

    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    log: LogConfig = field(default_factory=LogConfig)
    lora: LoraSection = field(default_factory=LoraSection)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    # -- loading ----------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path) -> TrainerConfig:
        """Read and validate a TOML file."""
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {p} does not exist", hint="pass the path of a TOML file") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p} is not valid TOML: {e}", hint="fix the syntax at that line") from None
        return cls.from_dict(data, source=str(p))

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "config") -> TrainerConfig:
        """Build from nested dicts (TOML tables), checking names and types, then `validate()`."""
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a table of sections, got {type(data).__name__}")
        cfg = cls()
        sections = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(sections))
        if unknown:
            raise ConfigError(f"{source}: unknown section(s) {unknown}", hint=f"valid sections: {sorted(sections)}")
        for name, value in data.items():
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: [{name}] must be a table, got {value!r}")
            setattr(cfg, name, _build(typing.get_type_hints(cls)[name], value, f"{source}: [{name}]"))
        cfg.validate()
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dicts (TOML- and JSON-serializable)."""
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        """The config as TOML text that `load` reads back to an equal config."""
        lines: list[str] = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            for k, v in values.items():
                if v is None:
                    continue
                lines.append(f"{k} = {_toml_value(v)}")
            lines.append("")
        return "\n".join(lines)

    # -- validation -------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ConfigError on the first invalid value (naming it and the fix)."""
        m, r, o, s, lg = self.model, self.rollout, self.optim, self.sync, self.log
        _require(bool(m.path), "[model] path", m.path, "a local model folder or a Hub model id")
        _require(bool(r.replicas), "[rollout] replicas", r.replicas, "at least one replica URL")
        for url in r.replicas:
            _require(url.startswith(("http://", "https://")), "[rollout] replicas", url, "an http(s):// URL")
        _require(len(set(r.replicas)) == len(r.replicas), "[rollout] replicas", r.replicas, "distinct URLs")
        _require(r.env_url.startswith(("http://", "https://")), "[rollout] env_url", r.env_url, "an http(s):// URL")
        _require(bool(r.task), "[rollout] task", r.task, "a task name the env server knows")
        _require(
            r.group_size >= 2, "[rollout] group_size", r.group_size, ">= 2 (GRPO compares completions within a group)"
        )
        _require(r.max_tokens >= 1, "[rollout] max_tokens", r.max_tokens, ">= 1")
        _require(
            r.temperature > 0, "[rollout] temperature", r.temperature, "> 0 (GRPO needs sampled, diverse completions)"
        )
        _require(0 < r.top_p <= 1, "[rollout] top_p", r.top_p, "in (0, 1]")
        _require(r.workers >= 1, "[rollout] workers", r.workers, ">= 1")
        _require(r.request_timeout_s > 0, "[rollout] request_timeout_s", r.request_timeout_s, "> 0")
        _require(r.replica_cooldown_s >= 0, "[rollout] replica_cooldown_s", r.replica_cooldown_s, ">= 0")
        _require(o.steps >= 1, "[optim] steps", o.steps, ">= 1")
        _require(o.groups_per_step >= 1, "[optim] groups_per_step", o.groups_per_step, ">= 1")
        _require(0 < o.lr < 1, "[optim] lr", o.lr, "in (0, 1)")
        _require(o.weight_decay >= 0, "[optim] weight_decay", o.weight_decay, ">= 0")
        _require(
            len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), "[optim] betas", o.betas, "two values in [0, 1)"
        )
        _require(o.max_grad_norm >= 0, "[optim] max_grad_norm", o.max_grad_norm, ">= 0 (0 disables clipping)")
        _require(0 < o.clip_low < 1, "[optim] clip_low", o.clip_low, "in (0, 1)")
        _require(o.clip_high > 0, "[optim] clip_high", o.clip_high, "> 0")
        _require(o.max_staleness >= 0, "[optim] max_staleness", o.max_staleness, ">= 0")
        _require(o.is_cap >= 1, "[optim] is_cap", o.is_cap, ">= 1")
        _require(o.buffer_groups >= o.groups_per_step, "[optim] buffer_groups", o.buffer_groups,
                 f">= groups_per_step ({o.groups_per_step}), or a step can never fill")
        _require(bool(s.bucket), "[sync] bucket", s.bucket, "a run URL (a local folder works)")
        _require(s.publish_every >= 1, "[sync] publish_every", s.publish_every, ">= 1")
        _require(s.anchor_every >= 0, "[sync] anchor_every", s.anchor_every, ">= 0")
        _require(s.anchor_fraction > 0, "[sync] anchor_fraction", s.anchor_fraction, "> 0")
        _require(s.queue_size >= 1, "[sync] queue_size", s.queue_size, ">= 1")
        _require(s.flush_timeout_s > 0, "[sync] flush_timeout_s", s.flush_timeout_s, "> 0")
        _require(s.fleet_min_replicas >= 0, "[sync] fleet_min_replicas", s.fleet_min_replicas, ">= 0 (0: do not wait)")
        _require(s.fleet_max_lag >= 0, "[sync] fleet_max_lag", s.fleet_max_lag, ">= 0")
        _require(s.fleet_timeout_s > 0, "[sync] fleet_timeout_s", s.fleet_timeout_s, "> 0")
        _require(lg.log_every >= 1, "[log] log_every", lg.log_every, ">= 1")
        d = self.distributed
        _require(d.timeout_s > (s.fleet_timeout_s if s.fleet_min_replicas else 0), "[distributed] timeout_s",
                 d.timeout_s, "> 0, and > [sync] fleet_timeout_s when the trainer waits for its fleet "
                 "(the other ranks wait for rank 0 meanwhile)")
        la = self.lora
        _require(la.r >= 1, "[lora] r", la.r, ">= 1")
        _require(la.lora_alpha > 0, "[lora] lora_alpha", la.lora_alpha, "> 0")
        _require(bool(la.target_modules), "[lora] target_modules", la.target_modules, "at least one module name")
        _require(0 <= la.lora_dropout < 1, "[lora] lora_dropout", la.lora_dropout, "in [0, 1)")


# ------------------------------------------------------------------------------ helpers
def _require(ok: bool, key: str, value: object, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{key} = {value!r}: expected {expected}", hint=f"set {key.split('] ')[-1]} in the config")


def _build(cls: type, values: dict[str, Any], where: str) -> Any:
    """Instantiate dataclass `cls` from `values`, checking unknown keys and field types."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}", hint=f"valid keys: {names}")
    obj = cls()
    for k, v in values.items():
        setattr(obj, k, _coerce(hints[k], v, f"{where} {k}"))
    return obj


def _coerce(tp: Any, v: Any, where: str) -> Any:
    """Check `v` against type `tp` (ints are accepted for floats, lists for tuples)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        if v not in args:
            raise ConfigError(f"{where} = {v!r}: expected one of {list(args)}")
        return v
    if origin in (typing.Union, types.UnionType):
        if v is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(a, v, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where} = {v!r}: expected {tp}")
    if origin is list:
        if not isinstance(v, list):
            raise ConfigError(f"{where} = {v!r}: expected a list")
        return [_coerce(args[0], x, where) for x in v]
    if origin is tuple:
        if not isinstance(v, (list, tuple)) or len(v) != len(args):
            raise ConfigError(f"{where} = {v!r}: expected a list of {len(args)} values")
        return tuple(_coerce(a, x, where) for a, x in zip(args, v, strict=True))
    return _coerce_scalar(tp, v, where)


# a scalar type -> the Python types a TOML value of it may have, and how a message names it
_SCALARS: dict[type, tuple[tuple[type, ...], str]] = {
    float: ((int, float), "a number"), int: ((int,), "an integer"), bool: ((bool,), "true or false"),
    str: ((str,), "a string"),
}


def _coerce_scalar(tp: Any, v: Any, where: str) -> Any:
    """Check `v` against the scalar type `tp` (a bool is no number; an int is accepted for a float)."""
    if tp not in _SCALARS:
        raise ConfigError(f"{where}: unsupported type {tp}")  # pragma: no cover - a bug in this module
    kinds, what = _SCALARS[tp]
    if not isinstance(v, kinds) or (tp is not bool and isinstance(v, bool)):
        raise ConfigError(f"{where} = {v!r}: expected {what}")
    return float(v) if tp is float else v


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")
