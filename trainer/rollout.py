"""Episodes against the environment server over HTTP, with completions from the replicas.

One *group* is one GRPO unit: the env is reset with a seed (giving a prompt), one replica
samples `group_size` completions of that prompt in a single request, and each completion is
played as its own episode (reset with the same seed, then step with the completion as the
action) to get its reward. Advantages are normalised within the group.

`RolloutWorkers` runs `workers` threads doing this in a loop and putting groups into the
rollout buffer while the learner trains (the buffer blocks them when it is full).

Guarantees: every sample in a group has the prompt token ids and behaviour log-probs the
replica reported, and the weight version and state digest of the replica that produced that very
completion, as reported (None when it reported none: never a version it is assumed to serve).
A failing replica or environment never kills a worker: it backs off and retries; after
`max_consecutive_errors` failures in a row the worker stops and `check()` raises the last
error in the learner's thread, so a broken setup fails loudly instead of hanging.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass

from env_space.client import EnvClient, EnvClientError
from trainer.buffer import BufferClosed, Group, RolloutBuffer, Sample
from trainer.errors import ReplicaUnavailableError, RolloutError, TrainerError
from trainer.grpo import group_advantages
from trainer.replicas import ReplicaPool

log = logging.getLogger(__name__)


@dataclass
class SamplingParams:
    """How completions are sampled (copied from the rollout config)."""

    group_size: int = 8
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0


def play_group(
    env: EnvClient,
    pool: ReplicaPool,
    *,
    group_id: int,
    seed: int,
    task: str,
    params: SamplingParams,
) -> Group:
    """Play one group of episodes (see module docstring) and return it scored."""
    try:
        sid, obs = env.reset(task=task, seed=seed)
    except EnvClientError as e:
        raise RolloutError(f"environment reset (task {task!r}, seed {seed}) failed: {e}") from e
    prompt = obs.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise RolloutError(f"environment observation has no text prompt: {obs!r}")
    comp = pool.complete(prompt, n=params.group_size, max_tokens=params.max_tokens,
                         temperature=params.temperature, top_p=params.top_p)
    rewards: list[float] = []
    for i, choice in enumerate(comp.choices):
        try:
            if i > 0:  # an ended episode frees its session: a new episode per completion, same seed
                sid, obs_i = env.reset(task=task, seed=seed)
                if obs_i.get("prompt") != prompt:
                    raise RolloutError(f"seed {seed} gave prompt {obs_i.get('prompt')!r}, then {prompt!r}",
                                       hint="the environment must be deterministic in its seed")
            _obs, reward, _done = env.step(sid, choice.text)
        except EnvClientError as e:
            raise RolloutError(f"environment step (seed {seed}) failed: {e}") from e
        rewards.append(reward)
    adv = group_advantages(rewards).tolist()
    samples = [
        Sample(
            prompt_ids=c.prompt_ids, completion_ids=c.token_ids, logprobs=c.logprobs, reward=r, advantage=a,
            version=c.weight_version,  # None (start-up weights): attributed to no version, the buffer drops it
            replica=comp.replica, text=c.text, state_digest=c.state_digest,
        )
        for c, r, a in zip(comp.choices, rewards, adv, strict=True)
        if c.token_ids  # an empty completion has no token to train on
    ]
    return Group(group_id=group_id, prompt=prompt, samples=samples)


class RolloutWorkers:
    """`n` threads playing groups into `buffer` until `stop()` (see module docstring)."""

    def __init__(
        self,
        buffer: RolloutBuffer,
        pool: ReplicaPool,
        env_url: str,
        *,
        task: str,
        params: SamplingParams,
        workers: int = 2,
        seed: int = 0,
        request_timeout_s: float = 60.0,
        max_consecutive_errors: int = 20,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.buffer = buffer
        self.pool = pool
        self.env = EnvClient(env_url, timeout=request_timeout_s, headers=headers)
        self.task = task
        self.params = params
        self.n_workers = workers
        self.seed = seed
        self.max_consecutive_errors = max_consecutive_errors
        self.groups_played = 0
        self.errors = 0
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._fatal: BaseException | None = None
        self._crash: BaseException | None = None  # an unexpected error that stopped a worker
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for i in range(self.n_workers):
            t = threading.Thread(target=self._loop, name=f"rollout-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self.buffer.stop()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(timeout=max(deadline - time.monotonic(), 0.1))
        self.env.close()

    def check(self) -> None:
        """Raise the error that stopped the workers, if every worker has stopped on one, or at
        once the unexpected error (a bug, not a failed rollout) that stopped any worker."""
        if self._crash is not None:
            raise TrainerError(
                f"a rollout worker crashed: {self._crash!r}",
                hint="this is a bug in the rollout code; the log has the group that raised it",
            )
        if self._fatal is not None and not any(t.is_alive() for t in self._threads):
            err = self._fatal
            raise err if isinstance(err, TrainerError) else TrainerError(f"rollout workers stopped: {err!r}")

    def _loop(self) -> None:
        consecutive = 0
        backoff = 0.2
        while not self._stop.is_set():
            gid = next(self._ids)
            try:
                group = play_group(self.env, self.pool, group_id=gid, seed=self.seed * 1_000_003 + gid,
                                   task=self.task, params=self.params)
                self.buffer.put(group)
                with self._lock:
                    self.groups_played += 1
                consecutive, backoff = 0, 0.2
            except BufferClosed:
                return
            except (ReplicaUnavailableError, RolloutError, TrainerError) as e:
                consecutive += 1
                with self._lock:
                    self.errors += 1
                log.warning("rollout group %d failed (%d in a row): %s", gid, consecutive, e)
                if consecutive >= self.max_consecutive_errors:
                    self._fatal = e
                    return
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            except BaseException as e:  # not a rollout failure but a bug: no retry, and the learner is told at once
                log.error("rollout worker stopped by an unexpected error in group %d: %r", gid, e)
                self._crash = e
                return
