"""TRL's async GRPO rollout worker on sparsesync replicas: samples tagged with the weights that made them.

TRL's `AsyncRolloutWorker` (the `RolloutWorkerProtocol` of `trl.experimental.async_grpo`) tags
each rollout group with the trainer's own `model_version` counter, read when the group starts,
whatever weights the server actually used. `SparsesyncRolloutLoop` is its rollout loop with two
changes, plugged in through TRL's extension point (`AsyncRolloutWorker._loop_cls`):

- generation requests go to sparsesync replicas (`inference_space`), balanced client-side
  (round-robin over `replica_urls`, a failed attempt retried on the next replica);
- every sample carries the `weight_version` the replica reported for the completion it belongs
  to: the oldest version that produced any turn of that conversation (0 for a replica still
  serving its `--model` folder, before the first bucket version). TRL's `max_staleness` check
  (`model_version - sample.model_version`) then measures the weights that were really used.
- across a rewind (docs/protocol.md, "Rewinds"), a version number names two states: the one a
  crashed attempt published and the resumed trainer's. Each answer also carries the replica's
  `state_digest` of the weights that produced it (read with the version, under the engine's
  gate); with the run's `bucket` known (`follow_replicas` takes it from the trainer's
  `SparsesyncWeightTransfer`), a group any of whose turns came from a `(version, digest)` that is
  not the run's trusted commit of that version is dropped before scoring (`dropped_groups`),
  so a sample of an abandoned version N+1 is never taken for the new N+1; so is one any of whose
  turns named no version or no digest (a replica still serving its `--model` folder: weights no
  commit vouches for). The pairs of a group are judged together, on one listing of `commits/`
  (reused for up to 10 s while it trusts every pair; any pair it does not trust, e.g. the first
  sample after a rewind, makes a fresh listing that judges the whole group).

Use `follow_replicas(trainer, urls)` on an `AsyncGRPOTrainer` before `train()` (its own worker
keeps everything TRL configured: dataset, rewards, sampling, resume position), or build a
`SparsesyncRolloutWorker(replica_urls=..., **AsyncRolloutWorker kwargs)` yourself.

Why client-side balancing and no gateway: each replica already reports the version of each
answer, the worker is the only client, and round-robin over a list needs no extra process, hop
or failure point; a gateway would have to forward that field anyway.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
from collections.abc import Sequence
from typing import Any

from sparsesync.errors import ConfigError
from sparsesync.integrations import quiet_trl_vllm_warning
from sparsesync.protocol.lineage import TrustedCommits
from sparsesync.store import open_store

quiet_trl_vllm_warning()  # before TRL is imported

from trl.experimental.async_grpo.async_rollout_worker import (  # noqa: E402
    AsyncRolloutWorker,
    RolloutGroup,
    RolloutSample,
    _AsyncRolloutLoop,
)

log = logging.getLogger(__name__)

# the (version, state digest) pairs reported for the turns of the conversation being generated (one asyncio task each)
_TURN_VERSIONS: contextvars.ContextVar[list[tuple[int | None, str | None]] | None] = contextvars.ContextVar(
    "sparsesync_turn_versions", default=None
)


def parse_replica_urls(urls: str | Sequence[str]) -> list[str]:
    """`urls` (a list, or one string of comma-separated URLs) as a checked list without trailing slashes."""
    items = urls.split(",") if isinstance(urls, str) else list(urls)
    out = [u.strip().rstrip("/") for u in items if u.strip()]
    bad = [u for u in out if not u.startswith(("http://", "https://"))]
    if not out or bad:
        raise ConfigError(f"replica URLs {list(items)!r}: expected one or more http(s):// URLs",
                          hint="pass the replicas' base URLs, e.g. ['http://127.0.0.1:7860']")
    return out


class SparsesyncRolloutLoop(_AsyncRolloutLoop):
    """TRL's rollout loop, generating on sparsesync replicas and tagging samples with their versions."""

    def __init__(self, *, replica_urls: Sequence[str], bucket: str | None = None, **kwargs: Any) -> None:
        urls = parse_replica_urls(replica_urls)
        kwargs["vllm_server_url"] = urls[0]
        super().__init__(**kwargs)
        self.replica_urls = urls
        self._turn = itertools.count()
        self._versions: dict[int, int] = {}  # id(completion messages) -> oldest version that produced them
        # id(completion messages) -> its turns' (version, digest)
        self._pairs: dict[int, list[tuple[int | None, str | None]]] = {}
        self.trusted = TrustedCommits(open_store(bucket)) if bucket else None  # None: no rewind check
        self.dropped_groups = 0

    async def _generate_one(self, prompt: Any, tool_dict: Any, tools: Any, group_id: int = 0) -> Any:
        pairs: list[tuple[int | None, str | None]] = []
        token = _TURN_VERSIONS.set(pairs)
        try:
            result = await super()._generate_one(prompt, tool_dict=tool_dict, tools=tools, group_id=group_id)
        finally:
            _TURN_VERSIONS.reset(token)
        if not pairs:
            raise ConfigError("a rollout finished without any replica answer carrying a weight_version")
        self._versions[id(result[0])] = min(0 if v is None else v for v, _ in pairs)
        self._pairs[id(result[0])] = pairs
        return result

    async def _post(self, path: str, payload: dict, timeout: float, max_retries: int = 3) -> dict:
        """POST to the next replica (round-robin; each retry goes to the next one) and record the
        `weight_version` of its answer for the conversation being generated."""
        import aiohttp

        client_timeout = aiohttp.ClientTimeout(total=timeout)

        async def _do_post() -> dict:
            url = self.replica_urls[next(self._turn) % len(self.replica_urls)]
            assert self.session is not None
            async with self.session.post(f"{url}{path}", json=payload, timeout=client_timeout) as response:
                response.raise_for_status()
                return await response.json()

        content = await self._retry(
            _do_post, label=f"POST {path}", max_attempts=max(max_retries, len(self.replica_urls))
        )
        versions = _TURN_VERSIONS.get()
        if versions is not None:
            reported = {(c.get("weight_version"), c.get("state_digest")) for c in content.get("choices", [])}
            if len(reported) != 1:
                raise ConfigError(
                    f"a replica answered {path} with weight versions {sorted(reported, key=str)}; expected one",
                    hint="point replica_urls at sparsesync replicas (inference_space)",
                )
            version, digest = reported.pop()
            versions.append((None if version is None else int(version), digest))
        return content

    async def _score_group(self, group: RolloutGroup) -> list[RolloutSample]:
        versions = [self._versions.pop(id(c)) for c in group.completions]
        pairs = {p for c in group.completions for p in self._pairs.pop(id(c), [])}
        if self.trusted is not None:
            untrusted = await asyncio.to_thread(self.untrusted, pairs)
            if untrusted:
                self.dropped_groups += 1
                log.warning("sparsesync: dropped rollout group %s: generated by %s, not the run's trusted commit of "
                            "that version (a version a rewind abandoned)", group.group_id, sorted(untrusted, key=str))
                return []
        samples = await super()._score_group(group)
        # TRL emits the rows of each completion in completion order, one per training sequence
        per_row = [v for v, seqs in zip(versions, group.completions_sequences, strict=True) for _ in seqs]
        if len(per_row) != len(samples):
            raise ConfigError(f"{len(samples)} samples for {len(per_row)} training sequences of group {group.group_id}")
        for sample, version in zip(samples, per_row, strict=True):
            sample.model_version = version
        return samples


    def untrusted(self, pairs: set[tuple[int | None, str | None]]) -> list[tuple[int | None, str | None]]:
        """The `(version, state_digest)` pairs that are not the run's trusted commit of their version
        (one listing of the run's commits at most; a pair naming no version or digest is one)."""
        assert self.trusted is not None
        return sorted(self.trusted.untrusted(pairs), key=str)


class SparsesyncRolloutWorker(AsyncRolloutWorker):
    """TRL's `AsyncRolloutWorker` running `SparsesyncRolloutLoop` (pass `replica_urls=`)."""

    _loop_cls = SparsesyncRolloutLoop


def follow_replicas(trainer: Any, urls: str | Sequence[str], *, bucket: str | None = None) -> None:
    """Make `trainer`'s own rollout worker (an `AsyncGRPOTrainer`'s, before `train()`) generate on
    the sparsesync replicas at `urls` and tag samples with the versions they report. `bucket`
    (default: the run of the trainer's `SparsesyncWeightTransfer`, if it has one): samples whose
    `(version, state_digest)` is not that run's trusted commit are dropped (see module docstring)."""
    worker = getattr(trainer, "rollout_worker", None)
    if not isinstance(worker, AsyncRolloutWorker):
        raise ConfigError(f"the trainer's rollout worker is {type(worker).__name__}, not TRL's AsyncRolloutWorker",
                          hint="build the AsyncGRPOTrainer without rollout_worker=, or pass a SparsesyncRolloutWorker")
    if worker._process is not None:
        raise ConfigError("the rollout worker is already running", hint="call follow_replicas before trainer.train()")
    worker._loop_kwargs["replica_urls"] = parse_replica_urls(urls)
    bucket = bucket or getattr(getattr(trainer, "weight_transfer", None), "bucket", None)
    if bucket:
        worker._loop_kwargs["bucket"] = bucket
    worker._loop_cls = SparsesyncRolloutLoop
