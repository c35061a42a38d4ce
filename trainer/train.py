"""The asynchronous GRPO loop: rollout threads fill the buffer while the learner trains and
publishes every k optimizer steps through the sparsesync publisher.

    python -m trainer --config trainer.toml

Data flow: rollout workers (threads, trainer/rollout.py) ask the replicas for completions and
the environment for rewards, and put scored groups into the bounded buffer. The learner takes
`groups_per_step` groups (staleness bound applied against the newest *published* version),
takes one optimizer step on the GRPO loss, and every `publish_every` steps hands a cast copy
of the weights to `Publisher.publish`, which diffs and encodes on this thread and uploads in
the background. Replicas follow the bucket on their own; nothing but the bucket carries weights.
With `[sync] fleet_min_replicas` = n the learner then waits until n replicas report (heartbeats
in the bucket) serving the newest version minus at most `fleet_max_lag`.

Precision: on CPU the master weights are fp32 by default and the replicas get a bf16 cast
(`publish_dtype`); on GPU the parameters are bf16 (`master_dtype = "auto"`). The first version
published (version 0) is the weights as loaded, so replicas started from the same model folder
already hold it bit for bit (they report version None until they apply version 0; samples made
meanwhile name no version and are dropped, `dropped_unversioned`). On a bucket
that already holds a run, the weights at `[model] path` continue it: from its newest version,
or, when they are an older version (a checkpoint from before a crash), from that one: the run
is rewound to it (trainer/resume.py), the rollouts start once every replica serves it,
and samples of abandoned versions are dropped (`dropped_abandoned`): each sample's (version,
state digest) must be the run's trusted commit of that version (trainer/trust.py).

Under torchrun (`torchrun --nproc-per-node N -m trainer --config trainer.toml`) the same loop
runs on every rank, data parallel on an FSDP2-sharded policy: rank 0 alone runs the rollout
side and sends each step's groups to the others, every rank trains on its share and publishes
its shard of `model.state_dict()` (trainer/distributed.py has the design and failure handling).

Guarantees: the config is validated before anything starts; every published version is the
exact `publish_dtype` cast of the learner's parameters after that optimizer step (its state
digest is `TrainResult.state_digest` for the last one); a failure anywhere (rollouts dead,
publisher fenced or its store unreachable past the flush timeout) stops the loop with a
`SparsesyncError` after stopping the rollout threads and the publisher.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from sparsesync.checkpoint import checkpoint_digest
from sparsesync.errors import ConfigError, SparsesyncError
from sparsesync.protocol.writer.publisher import Publisher
from trainer.buffer import BufferClosed, Group, RolloutBuffer, TrustCheckUnavailable
from trainer.config import TrainerConfig
from trainer.distributed import (
    DistContext,
    all_mean,
    collective,
    full_state,
    init_distributed,
    launched_distributed,
    my_groups,
    receive_batch,
    send_batch,
    shard_policy,
    stop_on_sigterm,
)
from trainer.errors import TrainerError
from trainer.grpo import Batch, grpo_loss, token_logprobs
from trainer.metrics import MetricsLogger
from trainer.policy import load_policy, publish_state, publisher_casts, resolve_precision
from trainer.replicas import ReplicaPool
from trainer.resume import first_version, wait_for_rewound_replicas
from trainer.rollout import RolloutWorkers, SamplingParams
from trainer.step_metrics import StatusPoller, grad_norm, replica_fields, sync_fields
from trainer.trust import SampleJudge

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What a finished run reports."""

    steps: list[dict[str, Any]]  # the per-step metric records (as logged)
    commits: list[dict[str, Any]]  # the publisher's per-version metrics, in commit order
    final_version: int  # newest published (and committed) version
    state_digest: str  # sparsesync state digest of the final published weights
    full_bytes: int  # size of one full copy of the published weights
    buffer: dict[str, Any] = field(default_factory=dict)  # rollout buffer counters
    replicas: dict[str, Any] = field(default_factory=dict)  # per-replica request counters
    wall_s: float = 0.0
    rank: int = 0  # under torchrun: this rank (only rank 0's steps, commits and state digest are filled in)
    world: int = 1
    # the last commit record's state digest (under torchrun: over its row units, not state_digest)
    commit_digest: str = ""


def auth_headers(cfg: TrainerConfig) -> dict[str, str] | None:
    """The Authorization header for private replicas / env (the token comes from the environment only)."""
    var = cfg.rollout.auth_token_env
    if not var:
        return None
    token = os.environ.get(var)
    if not token:
        raise ConfigError(f"[rollout] auth_token_env = {var!r}, but the environment variable {var} is not set",
                          hint=f"export {var}=<token with read access to the Spaces>, or set auth_token_env = \"\"")
    return {"Authorization": f"Bearer {token}"}


@dataclass
class _Job:
    """What one run holds between its phases (`AsyncGRPOTrainer.run`)."""

    ctx: DistContext | None
    lead: bool  # rank 0 (or the one process): the rollout side, metrics and logging
    model: torch.nn.Module
    adapter: Any  # the adapter run's AdapterMeta, or None for full weights
    params: list[torch.nn.Parameter]
    opt: torch.optim.Optimizer
    pool: ReplicaPool
    buffer: RolloutBuffer
    workers: RolloutWorkers
    poller: StatusPoller
    logger: MetricsLogger
    publisher: Publisher | None = None
    lazy: bool = False  # the publisher casts one tensor at a time; no cast copy of the model is kept
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # the newest published weights (unless lazy)
    full_bytes: int = 0
    records: list[dict[str, Any]] = field(default_factory=list)
    commits_logged: int = 0
    t_prev: float = 0.0


class AsyncGRPOTrainer:
    """Runs one training job described by a `TrainerConfig` (see module docstring)."""

    def __init__(
        self,
        cfg: TrainerConfig,
        *,
        logger: MetricsLogger | None = None,
        on_step: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        cfg.validate()
        self.cfg = cfg
        self.logger = logger
        self.on_step = on_step
        self.device, self.master_dtype, self.publish_dtype = resolve_precision(cfg)
        self._judge: SampleJudge | None = None  # judges samples' (version, state digest) once the run is open
        self.headers = auth_headers(cfg)
        self.version = -1  # newest published version (-1: none yet)

    def run(self) -> TrainResult:
        """Train for `optim.steps` steps; returns the result after the last version is committed."""
        t_start = time.time()
        torch.manual_seed(self.cfg.optim.seed)
        job = self._set_up()
        try:
            self._open_run(job)
            for step in range(1, self.cfg.optim.steps + 1):
                self._step(job, step)
            return self._finish(job, t_start)
        finally:
            self._tear_down(job)

    # -- the phases of a run ------------------------------------------------------------
    def _set_up(self) -> _Job:
        """The policy and its optimizer, the rollout side (not started) and the metrics logger."""
        cfg, o, r = self.cfg, self.cfg.optim, self.cfg.rollout
        ctx = self._join_distributed()
        model = load_policy(cfg, self.device, self.master_dtype)
        adapter = None
        if cfg.lora.enabled:  # train and publish a LoRA adapter (trainer/lora.py)
            from trainer.lora import adapter_meta, lora_policy

            model = lora_policy(model, cfg, self.master_dtype)
            adapter = adapter_meta(model, cfg, self.publish_dtype)
        if ctx is not None:
            shard_policy(model)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
        pool = ReplicaPool(r.replicas, timeout_s=r.request_timeout_s, cooldown_s=r.replica_cooldown_s,
                           headers=self.headers)
        buffer = RolloutBuffer(o.buffer_groups, max_staleness=o.max_staleness, policy=o.stale_policy)
        workers = RolloutWorkers(
            buffer, pool, r.env_url, task=r.task, workers=r.workers, seed=o.seed,
            params=SamplingParams(r.group_size, r.max_tokens, r.temperature, r.top_p),
            request_timeout_s=r.request_timeout_s, headers=self.headers,
        )
        lead = ctx is None or ctx.lead
        if lead:
            logger = self.logger or MetricsLogger(
                total_steps=o.steps, jsonl=cfg.log.jsonl or None, progress=cfg.log.progress,
                trackio_project=cfg.log.trackio_project, log_every=cfg.log.log_every, config=cfg.to_dict(),
            )
        else:  # metrics and logging from rank 0 only
            logger = MetricsLogger(total_steps=o.steps, jsonl=None, progress=False, trackio_project="")
        return _Job(ctx=ctx, lead=lead, model=model, adapter=adapter, params=params, opt=opt, pool=pool, buffer=buffer,
                    workers=workers, poller=StatusPoller(pool), logger=logger)

    def _open_run(self, job: _Job) -> None:
        """Open the publisher, publish (or resume from) the first version, then start the rollouts."""
        cfg, ctx = self.cfg, job.ctx
        # one process, fp32 master on CPU: the publisher casts one tensor at a time (no bf16 copy of the model)
        job.lazy = ctx is None and publisher_casts(job.model, self.publish_dtype)
        job.publisher = publisher = Publisher(
            cfg.sync.bucket, anchor_every=cfg.sync.anchor_every, anchor_fraction=cfg.sync.anchor_fraction,
            queue_size=cfg.sync.queue_size, effort=cfg.sync.effort, adapter=job.adapter,
            dist_timeout_s=cfg.distributed.timeout_s, dtype=self.publish_dtype if job.lazy else None)
        job.state = publish_state(job.model, self.publish_dtype)  # cast: the resume checks digest it whole
        job.full_bytes = sum(t.numel() * t.element_size() for t in job.state.values())
        self.version, rewound = first_version(publisher, job.state, cfg, ctx)  # trainer/resume.py
        if job.lazy:
            job.state = {}  # no cast copy of the model is kept while training
        self._judge = SampleJudge(publisher.store)  # samples of versions a rewind abandoned are dropped
        if job.lead:
            with self._lead_alone(ctx):
                self._wait_for_fleet(publisher)
                if rewound:  # no rollout from weights the rewind abandoned
                    wait_for_rewound_replicas(job.pool, publisher, self.version, cfg.sync.fleet_timeout_s)
            job.workers.start()
            job.poller.start()
        job.t_prev = time.time()

    def _step(self, job: _Job, step: int) -> None:
        """One optimizer step on the step's groups, the version it publishes when due, and (rank 0)
        its metrics record."""
        o, ctx, publisher = self.cfg.optim, job.ctx, job.publisher
        assert publisher is not None
        t0 = time.time()
        groups = self._step_groups(job.buffer, job.workers, o.groups_per_step, step, ctx)
        t_wait = time.time() - t0
        batch, staleness, rewards, token_norm = self._batch(groups, ctx)
        t1 = time.time()
        with self._collective(ctx, f"training step {step}"):
            logp = token_logprobs(job.model, batch)
            loss, stats = grpo_loss(logp, batch, clip_low=o.clip_low, clip_high=o.clip_high, is_cap=o.is_cap,
                                    token_norm=token_norm)
            job.opt.zero_grad(set_to_none=True)
            loss.backward()
            norm = grad_norm(torch.nn.utils.clip_grad_norm_(job.params, o.max_grad_norm or float("inf")))
            job.opt.step()
            if ctx is not None:  # the step's loss: the mean of the ranks' shares (see token_norm)
                stats.loss = all_mean(stats.loss, ctx)
        t_train = time.time() - t1
        t2 = time.time()
        if step % self.cfg.sync.publish_every == 0 or step == o.steps:
            job.state = publish_state(job.model, self.publish_dtype, cast=not job.lazy)
            with self._collective(ctx, f"publishing version {self.version + 1}"):
                self.version = publisher.publish(job.state, self.version + 1)
        t_publish = time.time() - t2
        if not job.lead:
            return
        with self._lead_alone(ctx):
            t_fleet = self._wait_for_fleet(publisher)
        self._log_commits(job)  # per-version sync metrics arrive as the uploader commits
        now = time.time()
        n_samples = sum(len(g.samples) for g in groups)
        rec: dict[str, Any] = {
            "step": step,
            "version": self.version,
            "reward": sum(rewards) / len(rewards),
            "reward_max": max(rewards),
            "staleness_mean": sum(staleness) / len(staleness),
            "staleness_max": max(staleness),
            "loss": stats.loss,
            "clip_frac": stats.clip_frac,
            "ratio_mean": stats.ratio_mean,
            "kl_behaviour": stats.kl_behaviour,
            "stale_weight_mean": stats.stale_weight_mean,
            "grad_norm": norm,
            "samples": n_samples,
            "tokens": stats.tokens,
            "samples_per_s": n_samples / max(now - job.t_prev, 1e-6),
            "tokens_per_s": stats.tokens / max(now - job.t_prev, 1e-6),
            "groups_generated": job.workers.groups_played,
            "dropped_stale": job.buffer.stats.dropped_stale,
            "wait_s": t_wait,
            "train_s": t_train,
            "publish_s": t_publish,
            "fleet_wait_s": t_fleet,
            "step_s": now - t0,
            "full_bytes": job.full_bytes,
            **sync_fields(publisher.metrics),
            **replica_fields(job.poller.latest),
        }
        job.t_prev = now
        job.records.append(rec)
        job.logger.log_step(rec)
        if self.on_step is not None:
            self.on_step(rec)

    def _log_commits(self, job: _Job) -> None:
        """Log the commits the uploader made since the last call."""
        assert job.publisher is not None
        new_commits = job.publisher.metrics[job.commits_logged:]
        job.commits_logged += len(new_commits)
        for m in new_commits:
            job.logger.log_event("commit", {"full_bytes": job.full_bytes, **m})

    def _finish(self, job: _Job, t_start: float) -> TrainResult:
        """Wait until the last version is committed; the run's result with the final weights' digest."""
        cfg, ctx, publisher = self.cfg, job.ctx, job.publisher
        assert publisher is not None
        publisher.flush(cfg.sync.flush_timeout_s)
        self._log_commits(job)
        state = job.state
        if ctx is not None:  # the digest of the gathered full weights (a collective)
            with self._collective(ctx, "gathering the final weights"):
                state = full_state(state, ctx.rank) or {}
        if job.lazy:  # the publisher's snapshot holds the last version, the model's final weights, cast
            final_digest = publisher.state_digest or ""
        else:
            final_digest = checkpoint_digest(state) if job.lead else ""  # in the run's key set
        commit_digest = final_digest
        if ctx is not None and job.lead:
            commit_digest = publisher.run.commit(self.version).state_digest
        return TrainResult(
            steps=job.records, commits=list(publisher.metrics), final_version=self.version,
            state_digest=final_digest, full_bytes=job.full_bytes,
            buffer=dict(vars(job.buffer.stats)),
            replicas={u: {"requests": s.requests, "failures": s.failures, "last_error": s.last_error}
                      for u, s in job.pool.stats.items()},
            wall_s=time.time() - t_start, rank=ctx.rank if ctx else 0, world=ctx.world if ctx else 1,
            commit_digest=commit_digest,
        )

    def _tear_down(self, job: _Job) -> None:
        """Stop the rollout side and close the publisher, whatever ended the run (never masking its error)."""
        job.poller.stop()
        job.workers.stop()
        job.pool.close()
        try:
            if job.publisher is not None:
                job.publisher.close(timeout=self.cfg.sync.flush_timeout_s)
        except Exception as e:  # noqa: BLE001 - do not mask the error that ended the run
            log.warning("publisher did not close cleanly: %s", e)
        if self.logger is None or not job.lead:
            job.logger.close()

    # -- internals --------------------------------------------------------------------
    def _join_distributed(self) -> DistContext | None:
        """Under torchrun: join the process group (see trainer/distributed.py); None in one process."""
        if not launched_distributed():
            return None
        if self.cfg.lora.enabled:
            raise ConfigError(
                "[lora] enabled = true under torchrun: the sharded trainer trains and publishes full weights",
                hint="train a LoRA adapter in one process (python -m trainer): the adapter is small",
            )
        ctx = init_distributed(self.device, self.cfg.distributed.timeout_s)
        self.device = ctx.device
        if self.cfg.optim.groups_per_step < ctx.world:
            raise ConfigError(f"[optim] groups_per_step = {self.cfg.optim.groups_per_step}: fewer groups than the "
                              f"{ctx.world} ranks, so a rank would train on nothing",
                              hint=f"set groups_per_step >= {ctx.world} (ideally a multiple of it)")
        with contextlib.suppress(ValueError):  # only from the main thread
            stop_on_sigterm(ctx.rank)
        return ctx

    @staticmethod
    def _collective(ctx: DistContext | None, what: str) -> contextlib.AbstractContextManager[None]:
        return collective(ctx, what) if ctx is not None else contextlib.nullcontext()

    def _step_groups(self, buffer: RolloutBuffer, workers: RolloutWorkers, n: int, step: int,
                     ctx: DistContext | None) -> list[Group]:
        """The step's groups: taken from the buffer (rank 0, which sends them to every rank), or
        received from rank 0."""
        if ctx is None:
            return self._take(buffer, workers, n)
        if not ctx.lead:
            return receive_batch(ctx, step)
        with self._lead_alone(ctx):
            groups = self._take(buffer, workers, n, tick=lambda: send_batch(ctx, "wait"))
        send_batch(ctx, "batch", groups)
        return groups

    @staticmethod
    @contextlib.contextmanager
    def _lead_alone(ctx: DistContext | None) -> Iterator[None]:
        """Rank 0 working alone (rollouts, fleet wait) while the other ranks wait for the next
        batch: its error is sent to them as a stop message, then raised here."""
        try:
            yield
        except SparsesyncError as e:
            if ctx is not None and ctx.lead:
                with contextlib.suppress(SparsesyncError):  # tell the others why, if they can still hear it
                    send_batch(ctx, "stop", f"{type(e).__name__}: {e}")
            raise

    def _wait_for_fleet(self, publisher: Publisher) -> float:
        """With `[sync] fleet_min_replicas` = n: block until n replicas report (in their bucket
        heartbeats) serving at least the newest published version minus `fleet_max_lag`, so
        from here on they generate with weights at most that many versions old. Seconds waited."""
        s = self.cfg.sync
        if not s.fleet_min_replicas:
            return 0.0
        t0 = time.time()
        publisher.wait_for_fleet(max(self.version - s.fleet_max_lag, 0), s.fleet_min_replicas, s.fleet_timeout_s)
        return time.time() - t0

    def _take(self, buffer: RolloutBuffer, workers: RolloutWorkers, n: int,
              tick: Callable[[], None] | None = None) -> list[Group]:
        """`n` groups from the buffer, checking on the workers (and calling `tick`) every 2 s while waiting."""
        while True:
            try:
                return buffer.take(n, self.version, timeout=2.0, judge=self._judge.for_take() if self._judge else None)
            except TrustCheckUnavailable as e:  # the groups wait in the buffer; TrainerError once it lasts
                self._judge.failed(e)  # type: ignore[union-attr]
                workers.check()
                time.sleep(1.0)
            except TimeoutError:
                workers.check()
                if tick is not None:
                    tick()
            except BufferClosed:
                workers.check()
                raise TrainerError("the rollout buffer was stopped while the learner waited") from None

    def _batch(
        self, groups: list[Group], ctx: DistContext | None = None
    ) -> tuple[Batch, list[int], list[float], float | None]:
        """This rank's batch (every group in one process, its share under torchrun), the whole
        step's staleness and rewards, and the loss's token normalizer (None: this batch's own)."""
        samples = [s for g in groups for s in g.samples]
        staleness = [max(self.version - s.version, 0) for s in samples]
        mine, token_norm = samples, None
        if ctx is not None:
            mine = [s for g in my_groups(groups, ctx.rank, ctx.world) for s in g.samples]
            token_norm = max(sum(len(s.completion_ids) for s in samples), 1) / ctx.world
        batch = Batch.build(
            [s.prompt_ids for s in mine], [s.completion_ids for s in mine], [s.logprobs for s in mine],
            [s.advantage for s in mine], [s.stale for s in mine], device=self.device,
        )
        return batch, staleness, [s.reward for s in samples], token_norm
