"""TRL on sparsesync: switch a TRL trainer's weight transfer to a bucket by configuration.

Two entry points, one per TRL trainer:

- `SparsesyncWeightTransfer` implements the weight-transfer protocol of TRL's experimental
  async GRPO trainer (`trl.experimental.async_grpo.AsyncGRPOTrainer(weight_transfer=...)`,
  `WeightTransferProtocol`: `init_weight_transfer` / `pause` / `send_weights` / `resume` /
  `destroy`). Instead of an NCCL broadcast into one vLLM server, every `send_weights` publishes
  the streamed tensors as the next version of a sparsesync run; any number of replicas in any
  region follow the bucket.

      from trl.experimental.async_grpo import AsyncGRPOTrainer
      transfer = SparsesyncWeightTransfer("hf://buckets/me/run")
      trainer = AsyncGRPOTrainer(model=..., args=..., weight_transfer=transfer)
      transfer.bind(trainer)  # versions = trainer.model_version; the model for frozen parameters

- `SparsesyncCallback` is a `transformers.TrainerCallback` for the standard
  `trl.GRPOTrainer` (or any `Trainer`): it publishes the model's weights when training begins
  and after every `every_n_steps` optimizer steps (version = `state.global_step`).

      trainer = GRPOTrainer(model=..., reward_funcs=..., args=..., callbacks=[SparsesyncCallback("/tmp/bucket")])

Guarantees: each published version is exactly the `dtype` cast of the tensors handed over, in
the checkpoint's own key set (base-checkpoint names: DDP's `module.` stripped; a tied head once; frozen
parameters TRL's stream leaves out taken from the model, then from the previous version), so
a follower reconstructs it bit for bit and both engines load it. A PEFT model (a
`GRPOTrainer` with a `peft_config`) publishes its adapter instead, as an adapter run
(`sparsesync.lora.bridge`: PEFT names, the base's digest in every commit); `pause` and
`resume` never block on replicas (with sparsesync a replica pauses only for its own local
apply); publication never waits for the network except in `destroy` / `on_train_end`, which
flush the last versions (`flush_timeout_s`), and, with `fleet_min_replicas` = n on
`SparsesyncWeightTransfer`, in `send_weights`, which then returns once n replicas report (bucket
heartbeats) serving version k - `fleet_max_lag`. Only the main process publishes.

Versions: `SparsesyncWeightTransfer` publishes version `model_version + 1` in each
`send_weights`, the number TRL's trainer gives that policy once it returns, also after a
resume (TRL restores `model_version` from the checkpoint); `init_weight_transfer` rewinds, before
training, a run that already holds newer versions to `model_version` (docs/protocol.md,
"Rewinds") and continues one that holds exactly `model_version` (deltas when the model's
weights have that version's state digest, else an anchor). `SparsesyncCallback` publishes version `state.global_step`.

Resume: `SparsesyncCallback` on a run that already has versions continues it when training
starts at the run's newest version and the model's weights have that version's state digest
(the next versions are deltas against it). Training that starts at an older step (a crash after
the newest checkpoint) rewinds the run to that step in `on_train_begin` (docs/protocol.md,
"Rewinds"): the checkpoint's weights must be the run's version of that step when it has one
(else PatchMismatchError before the first step), become that version at once, and replicas
follow them; the newer versions are abandoned.

Limits: FSDP/ZeRO-3-sharded parameters are gathered by TRL's async trainer before they reach
`send_weights` (frozen parameters, which it does not stream, are read from the model on the
main process: a sharded model with frozen parameters is refused at the first `send_weights`); the callback reads
`model.state_dict()` on the main process and therefore needs unsharded parameters (single process or DDP): it refuses
an FSDP or ZeRO-3 model in
`on_train_begin` (`sharding`). An fp32 master on CPU reaches the publisher uncast (its
`dtype=` casts one tensor at a time: no bf16 copy of the model); on GPU it is cast here.

Length: both TRL entry points share the publishing helpers above; a split would duplicate them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from transformers import TrainerCallback

from sparsesync.checkpoint import checkpoint_state
from sparsesync.errors import ConfigError, PatchMismatchError
from sparsesync.integrations import quiet_trl_vllm_warning
from sparsesync.protocol.writer.publisher import Publisher

log = logging.getLogger(__name__)
quiet_trl_vllm_warning()  # TRL's vLLM-version warning once, whoever imports TRL next



def checkpoint_name(name: str) -> str | None:
    """The base-checkpoint name of a (possibly wrapped) parameter, or None for adapter-only tensors."""
    name = name.removeprefix("module.").replace("_checkpoint_wrapped_module.", "")
    name = name.removeprefix("base_model.model.").replace(".base_layer", "")
    if "lora_" in name or "original_module" in name:
        return None
    return name.replace("modules_to_save.default.", "")


def inference_state(
    named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """`{checkpoint name: tensor cast to dtype, contiguous, on CPU}` in the checkpoint's own key
    set (`checkpoint.checkpoint_state`): names sharing one storage, a tied LM head, are kept once
    (the first) before the cast would give them separate storages. A repeated name is an error."""
    return {name: t.to(device="cpu", dtype=dtype).contiguous() for name, t in _checkpoint_tensors(named).items()}


def _checkpoint_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """`named` under checkpoint names, aliases kept once, not cast (see `inference_state`)."""
    raw: dict[str, torch.Tensor] = {}
    for raw_name, t in named:
        name = checkpoint_name(raw_name)
        if name is None:
            continue
        if name in raw:
            raise ConfigError(f"tensor {name!r} (from {raw_name!r}) was handed over twice in one weight update")
        raw[name] = t.detach()
    return checkpoint_state(raw)


def model_state(
    model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16, *, cast: bool = True
) -> dict[str, torch.Tensor]:
    """The inference weights of `model`, see `inference_state`; a PEFT model (GRPOTrainer with a
    `peft_config`): its adapter, making the run an adapter run (sparsesync.lora.bridge). `cast=False`:
    full weights all floating on CPU come uncast, for `Publisher(dtype=dtype)` to cast one at a time."""
    from sparsesync.lora.state import peft_publish_state

    sd = model.state_dict() if not cast and not hasattr(model, "peft_config") else {}
    if sd and all(t.is_floating_point() and t.device.type == "cpu" for t in sd.values()):
        return _checkpoint_tensors(sd.items())
    if (adapter := peft_publish_state(model, dtype)) is not None:
        return adapter
    peft = hasattr(model, "merge_adapter") and hasattr(model, "peft_config")
    if peft:
        model.merge_adapter()  # type: ignore[operator]  # a PEFT model's method (checked above), not nn.Module's
    try:
        return inference_state(model.state_dict().items(), dtype)
    finally:
        if peft:
            model.unmerge_adapter()  # type: ignore[operator]  # (the same)


def sharding(model: torch.nn.Module | None = None) -> str | None:
    """Why `model`'s parameters are sharded across processes (FSDP, DeepSpeed ZeRO-3), or None.

    Read as TRL's trainers read it: accelerate's state (`fsdp_plugin`, a DeepSpeed plugin at
    ZeRO stage 3) when one is initialized, and the model's own wrapping (an FSDP or FSDP2
    module, parameters partitioned by ZeRO-3, which carry `ds_id`).
    """
    from accelerate.state import AcceleratorState

    if AcceleratorState._shared_state:  # initialized by a Trainer / Accelerator in this process
        acc = AcceleratorState()
        if getattr(acc, "fsdp_plugin", None) is not None:
            return "accelerate runs FSDP (fsdp_plugin is set)"
        ds = getattr(acc, "deepspeed_plugin", None)
        if ds is not None and getattr(ds, "zero_stage", None) == 3:
            return "accelerate runs DeepSpeed ZeRO stage 3"
    if model is not None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrappers: tuple[type, ...] = (FullyShardedDataParallel,)
        try:
            from torch.distributed.fsdp import FSDPModule

            wrappers += (FSDPModule,)
        except ImportError:  # torch < 2.6
            pass
        for m in model.modules():
            if isinstance(m, wrappers):
                return f"the model is wrapped by {type(m).__name__}"
        if any(hasattr(p, "ds_id") for p in model.parameters()):
            return "the model's parameters are partitioned by DeepSpeed ZeRO-3"
    return None


def _refuse_sharded(model: torch.nn.Module | None) -> None:
    why = sharding(model)
    if why is not None:
        raise ConfigError(
            f"sparsesync cannot publish a sharded model: {why}; each process holds only a shard of the weights",
            hint="train with a single process or DDP (or ZeRO stage 1/2), or publish from TRL's async GRPO "
                 "trainer (SparsesyncWeightTransfer), which gathers the parameters before send_weights",
        )


class VersionedPublisher:
    """A Publisher plus the version counter and the per-publish log both integrations share."""

    def __init__(
        self, bucket: str, dtype: torch.dtype, flush_timeout_s: float, publisher_options: Mapping[str, Any]
    ) -> None:
        self.bucket = bucket
        self.dtype = dtype
        self.flush_timeout_s = flush_timeout_s
        self.publisher_options = dict(publisher_options)
        self.publisher: Publisher | None = None
        self.version: int | None = None  # newest version published by this process
        self.names: frozenset[str] | None = None
        self.digest: str | None = None  # state digest of the newest published version
        self.log: list[dict[str, Any]] = []  # one entry per publish: version, publish_s

    def open(self) -> None:
        if self.publisher is None:
            # casts uncast states
            self.publisher = Publisher(self.bucket, **{"dtype": self.dtype, **self.publisher_options})

    def carry_files(self, model: Any = None, tokenizer: Any = None) -> None:
        """Carry `model`'s config and generation config and `tokenizer`'s files in every commit
        from the next one on, so a pulled version loads with `from_pretrained` (an adapter run
        carries the tokenizer files only). Opens the publisher."""
        from sparsesync.protocol.extras import files_from_model

        self.open()
        assert self.publisher is not None
        model = getattr(model, "module", model)  # DDP
        if hasattr(model, "get_base_model"):  # PEFT: the base's config (TRL's server mode publishes merged weights)
            model = model.get_base_model()
        self.publisher.set_extra_files(files_from_model(model, tokenizer))

    def publish(self, state: dict[str, torch.Tensor], version: int | None = None,
                complete: Mapping[str, torch.Tensor] | None = None) -> int:
        """Publish `state` (the names checked against the previous call's); `complete`: the rest of
        the checkpoint's key set (frozen tensors), published under `state` where given."""
        self.open()
        assert self.publisher is not None
        names = frozenset(state)
        if self.names is not None and names != self.names:
            missing, extra = sorted(self.names - names)[:5], sorted(names - self.names)[:5]
            raise ConfigError(f"the set of tensors changed between weight updates (missing {missing}, new {extra})",
                              hint="publish the same tensors every time (all trainable parameters)")
        self.names = names
        if version is None:
            last = self.version if self.version is not None else self.publisher.committed_version
            version = 0 if last is None else last + 1
        if complete is not None:
            state = {**complete, **state}
        t0 = time.perf_counter()
        self.version = self.publisher.publish(state, version)
        self.digest = self.publisher.state_digest
        self.log.append({"version": self.version, "publish_s": time.perf_counter() - t0, "state_digest": self.digest})
        return self.version

    def close(self) -> None:
        if self.publisher is not None:
            try:
                self.publisher.flush(self.flush_timeout_s)
            finally:
                self.publisher.close()

    @property
    def metrics(self) -> list[dict[str, Any]]:
        """The publisher's per-version metrics (changed elements, density, bytes, timings)."""
        return list(self.publisher.metrics) if self.publisher is not None else []


class _PublishedViews:
    """What both integrations expose of their `VersionedPublisher` (`self._v`)."""

    _v: VersionedPublisher

    @property
    def version(self) -> int | None:
        """Newest version published."""
        return self._v.version

    @property
    def state_digest(self) -> str | None:
        """sparsesync state digest of the newest version published (compare with a follower's)."""
        return self._v.digest

    @property
    def metrics(self) -> list[dict[str, Any]]:
        return self._v.metrics


class SparsesyncWeightTransfer(_PublishedViews):
    """TRL async GRPO `WeightTransferProtocol` over a sparsesync publisher (see module docstring).

    Bind it to its trainer once built (`transfer.bind(trainer)`): each `send_weights` then
    publishes version `trainer.model_version + 1`, the number TRL gives that policy right after,
    and the first version this process publishes carries the whole checkpoint key set (TRL's
    stream leaves frozen parameters out; later versions take them from the previous one).

    Args:
        bucket: run URL (local folder, `s3://bucket/prefix`, `hf://buckets/ns/name/prefix`).
        dtype: what the replicas receive (bf16 by default, whatever the trainer trains in).
        flush_timeout_s: how long `destroy` waits for the last uploads.
        fleet_min_replicas: > 0: `send_weights` of version k returns once this many replicas
            report serving k - `fleet_max_lag` or newer (`Publisher.wait_for_fleet`; a bound on
            the staleness of the rollouts that follow); waiting past `fleet_timeout_s` raises.
        **publisher_options: `PublisherConfig` fields (`anchor_every`, `queue_size`, ...).
    """

    def __init__(self, bucket: str, *, dtype: torch.dtype = torch.bfloat16, flush_timeout_s: float = 300.0,
                 fleet_min_replicas: int = 0, fleet_max_lag: int = 0, fleet_timeout_s: float = 120.0,
                 **publisher_options: Any) -> None:
        if fleet_min_replicas < 0 or fleet_max_lag < 0 or fleet_timeout_s <= 0:
            raise ConfigError(f"fleet_min_replicas={fleet_min_replicas}, fleet_max_lag={fleet_max_lag}, "
                              f"fleet_timeout_s={fleet_timeout_s}: expected >= 0, >= 0 and > 0")
        self._v = VersionedPublisher(bucket, dtype, flush_timeout_s, publisher_options)
        self._fleet = (fleet_min_replicas, fleet_max_lag, fleet_timeout_s)
        self._trainer: Any = None
        self.pauses = 0
        self.resumes = 0

    @property
    def bucket(self) -> str:  # the run URL (the rollout worker drops samples that are not its trusted commits)
        return self._v.bucket

    def bind(self, trainer: Any) -> SparsesyncWeightTransfer:
        """Take versions (`model_version`) and the full model from `trainer`, the
        `AsyncGRPOTrainer` built with this transfer. Required before training; returns self."""
        self._trainer = trainer
        return self

    def _bound(self) -> Any:
        if self._trainer is None:
            raise ConfigError(
                "SparsesyncWeightTransfer is not bound to its trainer: it needs TRL's model_version (the version "
                "numbers) and the model (frozen parameters TRL does not stream)",
                hint="call transfer.bind(trainer) after building the AsyncGRPOTrainer, before trainer.train()",
            )
        return self._trainer

    def _model(self) -> torch.nn.Module:
        trainer = self._bound()
        return trainer.accelerator.unwrap_model(trainer.model)

    def init_weight_transfer(self) -> None:
        """Open the publisher (claims the run's writer epoch) and line the run up with TRL's
        `model_version` m (restored from the checkpoint on resume), before any training step:
        a run whose newest version c is m continues (deltas from c when the model holds exactly
        version c, checked by state digest, else an anchor at m + 1); a newer run (c > m) is
        rewound to m (the model must hold the run's version m when it has one; replicas move to
        it), or refused when m is 0 (training from scratch); an older or empty one gets an anchor."""
        trainer = self._bound()
        m = int(trainer.model_version)
        self._v.carry_files(self._model(), getattr(trainer, "processing_class", None))  # opens the publisher
        pub = self._v.publisher
        assert pub is not None
        c, url = pub.committed_version, self._v.bucket
        if c is None or c < m:
            return
        if c > m and m == 0:  # training from scratch (the cold sync is version 1): not a resume
            raise ConfigError(
                f"TRL's model_version is 0 (training from scratch) but {url} already holds version {c}",
                hint="resume from a checkpoint of this run (its rollout_state.json has the model_version; TRL restores "
                     "it only with an AsyncRolloutWorker such as SparsesyncRolloutWorker) or publish to a new run URL",
            )
        if c > m:  # resumed from an older checkpoint: rewind the run to model_version m (docs/protocol.md, "Rewinds")
            pub.resume(model_state(self._model(), self._v.dtype), version=m)  # PatchMismatchError: not this run's
            self._v.version, self._v.digest = m, pub.state_digest
            log.info("sparsesync: rewound %s to version %d (TRL's model_version)", url, m)
            return
        try:
            pub.resume(model_state(self._model(), self._v.dtype))
        except PatchMismatchError:
            log.info("sparsesync: the model does not hold version %d of %s (a checkpoint saved between weight "
                     "syncs): version %d is an anchor", c, url, m + 1)
            return
        self._v.version, self._v.digest = c, pub.state_digest
        log.info("sparsesync: continuing %s from its version %d", url, c)

    def pause(self) -> None:
        """Nothing to pause: replicas keep generating and pause only for their own local apply."""
        self.pauses += 1

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Publish the streamed `(name, tensor)` pairs as version `model_version + 1` (diff+encode
        here, upload in the background), the number TRL tags the rollouts of that policy with
        once this returns; with `fleet_min_replicas`, return only once replicas serve it."""
        version = int(self._bound().model_version) + 1
        stream = inference_state(iterator, self._v.dtype)
        self._v.open()
        assert self._v.publisher is not None
        complete = None
        if self._v.publisher.state_digest is None:  # first version here: the whole key set (frozen included)
            complete = self._frozen(stream)
        version = self._v.publish(stream, version, complete=complete)
        min_replicas, max_lag, timeout = self._fleet
        if min_replicas:
            self._v.publisher.wait_for_fleet(max(version - max_lag, 0), min_replicas, timeout)

    def _frozen(self, stream: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The checkpoint tensors of the bound model that TRL's stream left out (frozen parameters),
        cast like the stream; read on the main process, so refused for a sharded model that has any."""
        model = self._model()
        why = sharding(model)
        if why is not None:
            frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
            if frozen:
                raise ConfigError(f"{len(frozen)} frozen parameter(s) ({frozen[0]!r}, ...) are not streamed by TRL and "
                                  f"cannot be read from a sharded model ({why})",
                                  hint="train with a single process or DDP, or leave no parameter frozen")
            return {}
        held = _checkpoint_tensors(model.state_dict().items())  # TRL merged an adapter already
        return {n: t.to(device="cpu", dtype=self._v.dtype).contiguous() for n, t in held.items() if n not in stream}

    def resume(self) -> None:
        """Nothing to resume (see `pause`)."""
        self.resumes += 1

    def destroy(self) -> None:
        """Flush the last versions to the bucket and close the publisher. Called on train end."""
        self._v.close()


class SparsesyncCallback(_PublishedViews, TrainerCallback):
    """Publishes a `Trainer`'s weights through sparsesync (see module docstring).

    Args:
        bucket: run URL.
        every_n_steps: publish after every n optimizer steps (and always at the end).
        dtype: what the replicas receive.
        publish_initial: publish the starting weights when training begins (version = global step).
        flush_timeout_s: how long `on_train_end` waits for the last uploads.
        **publisher_options: `PublisherConfig` fields.
    """

    def __init__(self, bucket: str, *, every_n_steps: int = 1, dtype: torch.dtype = torch.bfloat16,
                 publish_initial: bool = True, flush_timeout_s: float = 300.0, **publisher_options: Any) -> None:
        if every_n_steps < 1:
            raise ConfigError(f"every_n_steps={every_n_steps}: expected >= 1")
        self.every_n_steps = every_n_steps
        self.publish_initial = publish_initial
        self._v = VersionedPublisher(bucket, dtype, flush_timeout_s, publisher_options)

    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: torch.nn.Module | None = None, **kw: Any
    ) -> None:
        _refuse_sharded(model)  # on every rank, before anything is published or trained
        if not state.is_world_process_zero:
            return
        self._v.carry_files(model, kw.get("processing_class"))  # opens the publisher
        assert self._v.publisher is not None
        committed = self._v.publisher.committed_version
        if committed is not None and model is not None:
            self._continue(model, state.global_step, committed)
        elif self.publish_initial and model is not None:
            self._publish(model, state.global_step)

    def _continue(self, model: torch.nn.Module, step: int, committed: int) -> None:
        """Training (re)starts at `step` on a run whose newest version is `committed`: continue it
        with deltas when the model holds exactly that version; at an older step (a resume from an
        older checkpoint) rewind the run to `step` (`Publisher.resume(..., version=step)`: checked
        against the run's version `step` by state digest, refused before training otherwise)."""
        url = self._v.bucket
        if step > committed:  # the run is behind this checkpoint: the next publish is a fresh anchor
            if self.publish_initial:
                self._publish(model, step)
            return
        weights = model_state(getattr(model, "module", model), self._v.dtype)
        assert self._v.publisher is not None
        # PatchMismatchError unless the state digests match; below the newest: a rewind to `step`
        self._v.publisher.resume(weights, version=step if step < committed else None)
        committed = step
        self._v.version, self._v.names = committed, frozenset(weights)
        self._v.digest = self._v.publisher.state_digest
        log.info("sparsesync: continuing %s from its version %d", url, committed)

    def on_step_end(self, args: Any, state: Any, control: Any, model: torch.nn.Module | None = None, **kw: Any) -> None:
        if state.is_world_process_zero and model is not None and state.global_step % self.every_n_steps == 0:
            self._publish(model, state.global_step)

    def on_train_end(
        self, args: Any, state: Any, control: Any, model: torch.nn.Module | None = None, **kw: Any
    ) -> None:
        if not state.is_world_process_zero:
            return
        if model is not None and (self._v.version is None or self._v.version < state.global_step):
            self._publish(model, state.global_step)
        self._v.close()

    def _publish(self, model: torch.nn.Module, step: int) -> None:
        if self._v.version is not None and step <= self._v.version:
            return  # already published at this step (e.g. resumed at the same global step)
        unwrapped = getattr(model, "module", model)
        self._v.publish(model_state(unwrapped, self._v.dtype, cast=False), step)
        log.info("sparsesync: published version %d to %s", step, self._v.bucket)
