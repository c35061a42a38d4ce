"""TRL's `GRPOTrainer` in vLLM server mode on sparsesync: weights through the bucket, no NCCL.

`GRPOTrainer(args=GRPOConfig(use_vllm=True, vllm_mode="server"))` builds TRL's `VLLMClient`,
opens an NCCL communicator to one vLLM server and streams every parameter into it before each
generation; it has no hook to change that transport. `SparsesyncVLLMClient` is a drop-in for
that client (the methods `VLLMGeneration` calls in server mode), installed while the trainer is
built by `sparsesync_server_mode`:

    with sparsesync_server_mode("hf://buckets/me/run", replicas=["http://r1:7860", "http://r2:7860"]):
        trainer = GRPOTrainer(model=..., args=GRPOConfig(use_vllm=True, vllm_mode="server", ...), ...)
    trainer.train()

- Built, it waits as TRL's `VLLMClient.check_server` does: until every replica answers
  `GET /health` with 200, polling every 2 s, for at most `connection_timeout` s (TRL passes
  `GRPOConfig.vllm_server_timeout`, 240 s by default); then `ReplicaUnreachableError`, one line
  naming the replicas that never answered and how to start one (`python -m inference_space`).
- `init_communicator` opens a sparsesync `Publisher` (no communicator, no `/server_info`).
- `update_named_params` publishes the streamed parameters as version `global_step` of the
  trainer (0: the weights TRL syncs before the first step; a delta, the first version this
  process writes an anchor, unless it resumes the run at its newest version with those
  weights), waits for the upload, then until every replica in `replicas` serves that version
  (`/health`), so the generation that follows is on-policy exactly as with NCCL.
- When training ends, the weights of the last optimizer step are published as version
  `global_step` (TRL syncs only before a generation, so they would never be); `close()` then
  waits for that upload. Every commit carries the model's config and the tokenizer's files.
- `generate` sends each prompt to a replica (`/v1/completions`, round-robin client-side:
  no extra service; several replicas behind one trainer) and returns TRL's output shape
  (`prompt_ids`, `completion_ids`, sampled-token `logprobs` / `logprob_token_ids`). Every answer
  must come from the version last published: a replica answering with another version raises
  `ProtocolError` rather than hand TRL off-policy samples.
- The replica's logprobs are of the raw distribution (`get_server_info` says `raw_logprobs`, so
  TRL warns about its importance-sampling correction, as it does for a vLLM server started so).

Published key set: TRL streams `named_parameters()`, frozen parameters included and a tied
head once, in checkpoint names (PEFT adapters merged by TRL before the stream).
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import torch
from transformers import TrainerCallback

from sparsesync.errors import ConfigError, ProtocolError, ReplicaUnreachableError
from sparsesync.integrations import quiet_trl_vllm_warning

quiet_trl_vllm_warning()  # before TRL is imported (the rollout module imports it)

from sparsesync.integrations.trl.callback import VersionedPublisher, inference_state  # noqa: E402
from sparsesync.integrations.trl.rollout import parse_replica_urls  # noqa: E402

log = logging.getLogger(__name__)


class SparsesyncVLLMClient:
    """TRL `VLLMClient` drop-in publishing to `bucket` and generating on `replicas` (see module docstring).

    Args:
        bucket: run URL.
        replicas: replica base URLs (a list or comma-separated string).
        dtype: what the replicas receive.
        sync_timeout_s: how long `update_named_params` waits for the upload and the replicas.
        request_timeout_s: per generation request.
        max_concurrent_requests: prompts generated at the same time.
        api_key: the replicas' API key (`--api-key`), sent as `Authorization: Bearer`; default
            the SPARSESYNC_API_KEY environment variable, if set.
        connection_timeout: seconds to wait for every replica to answer `/health` (TRL's name).
        **publisher_options: `PublisherConfig` fields.
    """

    def __init__(self, bucket: str, replicas: str | Sequence[str], *, dtype: torch.dtype = torch.bfloat16,
                 sync_timeout_s: float = 300.0, request_timeout_s: float = 300.0, max_concurrent_requests: int = 16,
                 api_key: str | None = None, connection_timeout: float = 240.0, **publisher_options: Any) -> None:
        self.replicas = parse_replica_urls(replicas)
        self.sync_timeout_s = sync_timeout_s
        key = api_key or os.environ.get("SPARSESYNC_API_KEY")
        self._http = httpx.Client(
            timeout=request_timeout_s, headers={"Authorization": f"Bearer {key}"} if key else None
        )
        try:
            self._wait_until_up(connection_timeout)
        except BaseException:
            self._http.close()
            raise
        self._v = VersionedPublisher(bucket, dtype, sync_timeout_s, publisher_options)
        self._next = itertools.count()
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, max_concurrent_requests), thread_name_prefix="sparsesync-gen"
        )
        self.served: list[int | None] = []  # the weight version of every generate() call, in order
        self._trainer: Any = None  # the GRPOTrainer whose global_step numbers the versions (`bind`)
        self.base_url = self.replicas[0]
        self.model = self._get(self.replicas[0], "/v1/models")["data"][0]["id"]

    # -- what TRL's VLLMGeneration calls ------------------------------------------------
    def init_communicator(self, device: Any = 0) -> None:
        """Open the publisher (claims the run's writer epoch). No communicator: nothing to open."""
        self._v.open()

    def get_server_info(self) -> dict[str, Any]:
        """What TRL reads of vLLM's `/server_info`: the replicas return raw-distribution logprobs."""
        return {"model_config": {"logprobs_mode": "raw_logprobs"}}

    def bind(self, trainer: Any) -> SparsesyncVLLMClient:
        """Take versions from `trainer` (its `state.global_step` at each weight sync) and carry its
        model's config and tokenizer files in the run (`sparsesync_server_mode` binds the
        `GRPOTrainer` it builds). Returns self."""
        self._trainer = trainer
        self._v.carry_files(trainer.model, getattr(trainer, "processing_class", None))
        return self

    def update_named_params(self, metadata: Any, iterator: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Publish the streamed parameters as version `global_step` of the bound trainer (unbound:
        the next version) and return once every replica serves it. The first weight sync of a
        trainer resumed at the run's newest version continues the run when the weights are that
        version (else ConfigError before anything is published)."""
        state = inference_state(iterator, self._v.dtype)
        step = None if self._trainer is None else int(self._trainer.state.global_step)
        self._v.open()
        pub = self._v.publisher
        assert pub is not None
        if (
            step is not None
            and self._v.version is None
            and pub.committed_version is not None
            and step <= pub.committed_version
        ):
            self._continue(state, step, pub.committed_version)
            version = step
        elif step is not None and step == self._v.version:  # synced again without a step (e.g. by hand after train())
            self._same_weights(state, step)
            version = step
        else:
            version = self._v.publish(state, step)
        pub.flush(self.sync_timeout_s)
        self._wait_for_replicas(version)
        log.info(
            "sparsesync: version %d published to %s, served by %d replica(s)",
            version,
            self._v.bucket,
            len(self.replicas),
        )

    def _same_weights(self, state: dict[str, torch.Tensor], step: int) -> None:
        """A second sync at `step`: the weights must still be version `step` (nothing to publish)."""
        from sparsesync.checkpoint import checkpoint_digest
        from sparsesync.codec import algo_of

        held = self._v.digest
        if held is None or checkpoint_digest(state, algo_of(held)) != held:
            raise ConfigError(f"the weights changed since version {step} was published, but the trainer is still at "
                              f"global_step {step}", hint="publish new weights only after an optimizer step")

    def _continue(self, state: dict[str, torch.Tensor], step: int, committed: int) -> None:
        """Training (re)starts at `step` <= `committed`, the run's newest version: continue the
        run when `step == committed` and the weights are that version; at an older step rewind the
        run to `step` (docs/protocol.md, "Rewinds"; the weights must be the run's version `step`
        when it has one). PatchMismatchError otherwise, before anything is published."""
        url = self._v.bucket
        assert self._v.publisher is not None
        self._v.publisher.resume(state, version=step if step < committed else None)
        self._v.version, self._v.names, self._v.digest = step, frozenset(state), self._v.publisher.state_digest
        log.info("sparsesync: continuing %s from its version %d", url, step)

    def reset_prefix_cache(self) -> None:
        """Nothing to do: a replica's engine drops its cached state when it applies a version."""

    def generate(self, prompts: list[str] | list[list[int]], features: Any = None, n: int = 1,
                 repetition_penalty: float = 1.0, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 min_p: float = 0.0, max_tokens: int = 16, logprobs: int | None = 0,
                 structured_outputs_regex: str | None = None, generation_kwargs: dict | None = None) -> dict[str, Any]:
        """TRL's `VLLMClient.generate`: `n` completions per prompt, prompt-major."""
        if features is not None or structured_outputs_regex is not None:
            raise ConfigError("image features and structured outputs are not supported by sparsesync replicas",
                              hint="use text prompts without structured_outputs_regex")
        body: dict[str, Any] = {"n": n, "repetition_penalty": repetition_penalty, "temperature": temperature,
                                "top_p": top_p, "top_k": top_k, "min_p": min_p, "max_tokens": max_tokens,
                                "logprobs": 0 if logprobs is None else logprobs, **(generation_kwargs or {})}
        body = {k: v for k, v in body.items() if v is not None}  # TRL's unset fields: the replica's defaults
        replies = list(self._pool.map(lambda p: self._complete({**body, "prompt": p}), prompts))
        choices = [c for r in replies for c in r["choices"]]
        versions = {c["weight_version"] for c in choices}
        expected = self._v.version
        if expected is not None and versions != {expected}:
            raise ProtocolError(f"replicas answered with weight versions {sorted(versions, key=str)} after version "
                                f"{expected} was published", hint="replicas must follow this run's bucket")
        self.served.append(versions.pop() if len(versions) == 1 else None)
        lps = None if logprobs is None else [[[lp] for lp in c["logprobs"]["token_logprobs"]] for c in choices]
        ids = None if logprobs is None else [[[t] for t in c["token_ids"]] for c in choices]
        return {"prompt_ids": [r["choices"][0]["prompt_token_ids"] for r in replies],
                "completion_ids": [c["token_ids"] for c in choices], "logprobs": lps, "logprob_token_ids": ids}

    def close_communicator(self) -> None:
        """Flush the last version and close the publisher and the HTTP client."""
        self.close()

    def close(self) -> None:
        """Wait for the last version's upload (the trained weights, published when training
        ended), then close the publisher and the HTTP client."""
        try:
            self._v.close()
        finally:
            self._pool.shutdown(wait=False)
            self._http.close()

    @property
    def version(self) -> int | None:
        """Newest version published."""
        return self._v.version

    # -- internals ------------------------------------------------------------------------
    def _get(self, url: str, path: str) -> dict[str, Any]:
        r = self._http.get(f"{url}{path}")
        r.raise_for_status()
        return r.json()

    def _wait_until_up(self, timeout_s: float, interval_s: float = 2.0) -> None:
        """Until every replica answers GET /health with 200 (TRL's `check_server`, for all of them)."""
        deadline = time.monotonic() + timeout_s
        down: dict[str, str] = {url: "not asked yet" for url in self.replicas}
        while True:
            for url in list(down):
                try:
                    r = self._http.get(f"{url}/health", timeout=min(10.0, max(1.0, timeout_s)))
                    if r.status_code == 200:
                        del down[url]
                    else:
                        down[url] = f"HTTP {r.status_code}"
                except httpx.HTTPError as e:
                    down[url] = type(e).__name__
            left = deadline - time.monotonic()
            if not down:
                return
            if left <= 0:
                shown = ", ".join(f"{u} ({why})" for u, why in down.items())
                raise ReplicaUnreachableError(
                    f"no replica answered GET /health at {shown} within {timeout_s:g} s",
                    hint="start one per URL: python -m inference_space --model MODEL --bucket BUCKET --port PORT, "
                    "or fix the URLs (vllm_server_base_url); GRPOConfig(vllm_server_timeout=...) sets the wait")
            log.info("sparsesync: waiting for replicas %s (%.0f s left)", ", ".join(down), left)
            time.sleep(min(interval_s, left))

    def _complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST to the next replica; a failed attempt goes to the next one (each replica once)."""
        error: Exception | None = None
        for _ in range(len(self.replicas)):
            url = self.replicas[next(self._next) % len(self.replicas)]
            try:
                r = self._http.post(f"{url}/v1/completions", json=body)
            except httpx.HTTPError as e:
                error = e
                continue
            if r.status_code == 200:
                return r.json()
            if r.status_code < 500:  # the request's fault: every replica would refuse it
                raise ConfigError(f"replica {url} refused the generation request ({r.status_code}): {r.text[:300]}")
            error = ProtocolError(f"replica {url} answered {r.status_code}: {r.text[:300]}")
        raise ProtocolError(f"no replica of {self.replicas} answered: {error}")

    def _wait_for_replicas(self, version: int) -> None:
        """Until every replica serves `version` or newer; a replica that reports its state digest
        must serve exactly the published one (after a rewind an abandoned version has the same number)."""
        deadline = time.monotonic() + self.sync_timeout_s
        waiting = list(self.replicas)
        seen: dict[str, Any] = {}
        while waiting:
            for url in list(waiting):
                digest = None
                try:
                    health = self._get(url, "/health")
                    seen[url], digest = health.get("weight_version"), health.get("state_digest")
                except httpx.HTTPError as e:
                    seen[url] = f"unreachable ({type(e).__name__})"
                v = seen[url]
                if digest is not None and isinstance(v, int) and (v > version or digest != self._v.digest):
                    # newer than what this trainer just published, or another state: an abandoned version
                    seen[url] = f"{v} of an abandoned attempt (state {digest})"
                elif isinstance(v, int) and v >= version:
                    waiting.remove(url)
            if waiting:
                if time.monotonic() > deadline:
                    raise ProtocolError(f"after {self.sync_timeout_s} s, replicas {waiting} do not serve version "
                                        f"{version} (they report {[seen[u] for u in waiting]})",
                                        hint="check that they follow this run's bucket (GET /sync)")
                time.sleep(0.05)


class _FinalSync(TrainerCallback):
    """Publishes the weights of the last optimizer step when training ends: TRL syncs weights only
    before a generation, so without it the trained weights would never reach the bucket. Runs on
    every process (TRL's sync gathers sharded parameters collectively); the main one publishes."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        trainer = self.trainer
        if getattr(trainer, "_last_loaded_step", None) != state.global_step:
            trainer.vllm_generation.sync_weights()
            trainer._last_loaded_step = state.global_step


@contextmanager
def sparsesync_server_mode(bucket: str, replicas: str | Sequence[str] | None = None, **options: Any) -> Iterator[None]:
    """While open, a `GRPOTrainer` built with `use_vllm=True, vllm_mode="server"` gets a
    `SparsesyncVLLMClient(bucket, replicas, **options)` instead of TRL's `VLLMClient` (`replicas`
    default: the config's `vllm_server_base_url`, which may list several, comma-separated), bound
    to the trainer (versions = `global_step`; the model's config and tokenizer files carried), and
    a callback that publishes the final weights when training ends.
    TRL has no setting for its client class: this swaps the name in `trl.generation.vllm_generation`
    and wraps `GRPOTrainer.__init__` for the duration of the block, and puts both back after."""
    import trl.generation.vllm_generation as generation
    from trl.trainer.grpo_trainer import GRPOTrainer

    original, original_init = generation.VLLMClient, GRPOTrainer.__init__

    def _client(base_url: str | None = None, connection_timeout: float = 240.0, **_: Any) -> SparsesyncVLLMClient:
        urls = replicas if replicas is not None else base_url
        if urls is None:
            raise ConfigError("no replica URLs", hint="pass replicas= or set vllm_server_base_url in GRPOConfig")
        return SparsesyncVLLMClient(bucket, urls, **{"connection_timeout": connection_timeout, **options})

    @functools.wraps(original_init)
    def _init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        generation_ = getattr(self, "vllm_generation", None)
        if generation_ is None or generation_.mode != "server":
            return
        client = getattr(generation_, "vllm_client", None)  # the main process's
        if isinstance(client, SparsesyncVLLMClient):
            client.bind(self)
        self.add_callback(_FinalSync(self))

    generation.VLLMClient = _client
    GRPOTrainer.__init__ = _init
    try:
        yield
    finally:
        generation.VLLMClient = original
        GRPOTrainer.__init__ = original_init
