"""`push` and `pull`: a checkpoint on disk in and out of a run, as library calls (the CLI's
`sparsesync push` / `sparsesync pull` are these, printed).

    from sparsesync import push, pull

    push("checkpoints/checkpoint-100", "hf://buckets/me/rl-weights/run-1")   # version 100
    pull("hf://buckets/me/rl-weights/run-1", "policy/")                       # the newest version

`pull` writes DEST atomically: the version is written into a staging folder beside DEST (same
file system), then renamed into place, so a failure (read-only folder, full disk, a bad run)
leaves DEST as it was. Into an existing folder it moves the new model files in (the index
last) and removes every other `*.safetensors` and `*.safetensors.index.json` there, which
loaders would otherwise read as part of the model. The checkpoint files the run carries
(config.json, generation_config.json, tokenizer files; `sparsesync.protocol.extras`), each
checked against its recorded digest, are written beside the weights (replacing DEST's own);
other files stay. What is written is the committed version bit for bit (every tensor checked
against its digest while the chain is applied).
A run mixing adapter and full-weight versions (or two adapters) is refused before anything is
fetched, and an adapter version's config is checked against its tensors before the folder PEFT
would load is written (`sparsesync.adapter_config`).

`push` numbers a checkpoint by its optimizer step (trainer_state.json's global_step, else a
`checkpoint-N` folder name) unless `step` says otherwise, and says which it used. A step at or
below the run's newest version rewinds the run (docs/protocol.md, "Rewinds"): to that version
when the checkpoint is the run's version of it, else the checkpoint becomes that version as a
delta from the newest version below it; the newer versions are abandoned either way. A step the
newest version already holds with these weights pushes nothing (`PushResult.held`).

Both import torch only when called. Errors are `sparsesync.errors` classes (`ConfigError`,
`OutputError`, store and protocol errors), each naming the object and carrying a `hint`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparsesync.errors import ConfigError, OutputError

__all__ = ["PullResult", "PushResult", "checkpoint_step", "pull", "push"]

Progress = Callable[[str], None]
"""Called with a short description of each phase ("diff + encode", "writing DEST", ...)."""


@dataclass(frozen=True)
class PushResult:
    """What `push` published."""

    version: int
    """The version committed."""
    step_from: str
    """Where the version number came from ("the folder name checkpoint-100", "newest + 1", ...)."""
    url: str
    """The run's URL (as the store names it; never a token)."""
    metrics: dict[str, Any]
    """The publisher's metrics of the version (`kind`, `n_changed`, `patch_bytes`, ...)."""
    files: list[str]
    """The checkpoint files that travel with it (config.json, tokenizer files, ...)."""
    held: bool = False
    """The run's newest version already was `version` with these weights: nothing was pushed."""
    abandoned: list[int] | None = None
    """A push below the newest version that continued from an older one: the versions of the older
    attempt it abandoned (None for any other push)."""


@dataclass(frozen=True)
class PullResult:
    """What `pull` wrote."""

    version: int
    """The version written."""
    state_digest: str
    """Its state digest (as committed, checked)."""
    files: list[Path]
    """The paths written (DEST itself when DEST is one .safetensors file)."""
    extra_files: list[str]
    """The names of the checkpoint files the run carries (written beside the weights in a folder DEST)."""


def push(
    source: str | os.PathLike[str],
    url: str,
    *,
    step: int | None = None,
    step_source: str = "step",
    anchor_every: int = 50,
    public: bool = False,
    base_model: str | os.PathLike[str] | None = None,
    effort: str = "size",
    progress: Progress | None = None,
) -> PushResult:
    """Publish the checkpoint at `source` as the next version of the run at `url` (a delta, or an
    anchor when due); the run and its bucket are created when missing.

    Args:
        source: A .safetensors file, a folder of safetensors shards, or a PEFT adapter folder
            (adapter_config.json + adapter_model.safetensors: an adapter run). A folder's config,
            generation config and tokenizer files travel with the version, so `pull` writes a
            folder that loads as is.
        url: The run: a folder, file://..., s3://bucket/prefix or hf://buckets/ns/name/prefix.
        step: The version number (default: the checkpoint's optimizer step, from
            trainer_state.json's global_step or a checkpoint-N folder name; else newest + 1, 0 in
            a new run). At or below the run's newest version: a rewind (see the module docstring).
        step_source: How messages name an explicit `step` (the CLI: "--step").
        anchor_every: Write a full anchor every N versions.
        public: Create a missing bucket public (default private).
        base_model: For a PEFT adapter `source`: the base model's folder (its digest is recorded).
        effort: "size" (the smallest patch) or "speed" (about 27% larger, encoded and decoded faster).
        progress: Called with a description of each phase, from the first network call on.

    Returns:
        The version committed, where its number came from, its metrics, the files carried, and
        what a rewind held or abandoned.
    """
    from sparsesync import adapter as lora
    from sparsesync.checkpoint import load_checkpoint
    from sparsesync.protocol import adapter_runs
    from sparsesync.protocol.keys import check_version
    from sparsesync.protocol.publisher import Publisher
    from sparsesync.protocol.run import Run
    from sparsesync.protocol.writer.config import PublisherConfig
    from sparsesync.store import open_store

    source = Path(source)
    say = progress or (lambda _description: None)
    PublisherConfig(effort=effort).validate()  # before anything is read or written
    step_from = step_source
    if step is None and (found := checkpoint_step(source)) is not None:
        step, step_from = found
    if step is not None:
        check_version(step, url)  # before anything is written to the run
    config = None
    if lora.is_adapter_folder(source):
        state, config = lora.read_adapter_folder(source)
    else:
        state = load_checkpoint(source)
    extra = source if source.is_dir() else None
    store = open_store(url, create=True, private=not public)
    say(f"reading the newest version of {store.url}")
    run = Run(store)
    newest = run.newest()
    if step is None:
        step, step_from = (0, "a new run's first version") if newest is None else (newest.version + 1, "newest + 1")
    meta = None
    if config is not None:
        meta, state = adapter_runs.meta_for_folder(config, state, Path(base_model) if base_model is not None else None,
                                                   newest, store.url)
    adapter_runs.check_publish(newest, meta, store.url)  # before resume() reads the run as this kind
    rewind = newest is not None and step <= newest.version  # docs/protocol.md, "Rewinds"
    plan = _plan_rewind(run, state, step, step_from, step_source, store.url) if rewind else None
    if plan == "held":
        return PushResult(version=step, step_from=step_from, url=store.url, metrics={}, files=[], held=True)
    pub = Publisher(store, anchor_every=anchor_every, queue_size=1, adapter=meta, effort=effort, extra_files=extra)
    try:
        if plan == "rewind":  # the checkpoint is the run's version `step`: the run goes on from it
            say(f"rewinding to version {step}")
            pub.resume(state, version=step)
            version = step
        else:
            base_version = plan if isinstance(plan, int) else None if newest is None else newest.version
            if base_version is not None:
                _rec, base, _digests = run.reconstruct(base_version)
                if rewind:  # continue below the newest: the commit of `step` abandons the newer versions
                    pub.continue_below(base, base_version)
                else:
                    pub.resume(base)
                del base
            say("diff + encode")
            version = pub.publish(state, step)
            say(f"uploading version {version}")
            pub.flush()
    finally:
        pub.close()
    abandoned = None
    if rewind and pub.metrics[-1].get("kind") != "rewind":  # a delta below the newest: every older commit from `step` on is abandoned
        abandoned = [v for a in Run(store).abandoned()
                     if (a.version, a.by_epoch) == (version, pub.epoch) for v in a.versions]
    files = [f.name for f in Run(store).commit(version).files]
    return PushResult(version=version, step_from=step_from, url=store.url, metrics=dict(pub.metrics[-1]), files=files,
                      abandoned=abandoned)


def _plan_rewind(run: Any, state: Any, step: int, step_from: str, step_source: str, url: str) -> str | int:
    """How `push` publishes version `step` at or below the run's newest (docs/protocol.md,
    "Rewinds"): "held" (the newest already is these weights), "rewind" (these weights are the
    run's version `step`: the run is rewound to it), or the newest version below `step` to
    continue from (the checkpoint then becomes version `step`, abandoning the newer versions)."""
    from sparsesync.checkpoint import checkpoint_digest

    commits = run.commits()
    same = next((c for c in commits if c.version == step), None)
    if same is not None and same.state_digest == checkpoint_digest(state):
        return "held" if same is commits[-1] else "rewind"
    below = [c.version for c in commits if c.version < step]
    if not below:
        raise ConfigError(f"version {step} (from {step_from}) is not newer than version {commits[-1].version}, the newest "
                          f"of {url}, and the run has no version below it to continue from",
                          hint=f"pass {step_source} N with a larger N, or push to a new run URL")
    return below[-1]


_STEP_DIR = re.compile(r"^checkpoint-([0-9]+)\Z")
_MAX_TRAINER_STATE_BYTES = 64 << 20


def checkpoint_step(source: str | os.PathLike[str]) -> tuple[int, str] | None:
    """The optimizer step of the checkpoint at `source` (a folder, or a file in one) and where it
    was read: `trainer_state.json`'s `global_step` (what transformers' Trainer saves), else the
    folder name `checkpoint-N`; None when neither says."""
    source = Path(source)
    folder = source if source.is_dir() else source.parent
    state_file = folder / "trainer_state.json"
    if state_file.is_file() and state_file.stat().st_size <= _MAX_TRAINER_STATE_BYTES:
        try:
            global_step = json.loads(state_file.read_bytes()).get("global_step")
        except (ValueError, AttributeError):  # not JSON, or not an object
            global_step = None
        if type(global_step) is int and global_step >= 0:
            return global_step, f"{state_file.name}'s global_step"
    if m := _STEP_DIR.match(folder.name):
        return int(m[1]), f"the folder name {folder.name}"
    return None


def pull(
    url: str,
    dest: str | os.PathLike[str],
    *,
    version: int | None = None,
    progress: Progress | None = None,
    on_rejected: Callable[[dict[str, str]], None] | None = None,
) -> PullResult:
    """Write a committed version of the run at `url` into `dest` as safetensors, bit-exact (an
    adapter run: as a PEFT adapter folder), with the config and tokenizer files the run carries:
    `from_pretrained(dest)` loads it. `dest` is replaced atomically (see the module docstring).

    Args:
        url: The run's URL.
        dest: A folder, or a path ending in .safetensors for one file (not for an adapter run).
            In an existing folder, other *.safetensors files and indexes are removed.
        version: The version to write (default: the newest committed).
        progress: Called with a description of each phase.
        on_rejected: Called with {key: reason} for the objects named like commits that are not
            commit records (readers skip them), also when the pull then fails.

    Returns:
        The version written, its state digest, the paths written and the checkpoint files carried.
    """
    from sparsesync.adapter_config import check_one_kind
    from sparsesync.protocol.run import Run

    dest = Path(dest)
    say = progress or (lambda _description: None)
    run = Run(url)
    say("listing commits")
    check_one_kind(run.commits(), run.url)  # before anything is fetched: a mixed run rebuilds neither kind

    def on_step(step: Any) -> None:
        what = "loading anchor" if step.kind == "anchor" else "applying delta to"
        say(f"{what} version {step.commit.version}")

    try:
        rec, state, _digests = run.reconstruct(version, on_step=on_step)
    finally:
        if on_rejected is not None:
            on_rejected(dict(run.rejected))  # why a version that is there is not a commit
    say("fetching config and tokenizer files")
    extra = {f.name: run.fetch(f) for f in rec.files}  # each checked against its size and digest
    say(f"writing {dest}")
    files = _write_dest(state, dest, rec.version, rec.state_digest, rec.adapter, extra)
    return PullResult(version=rec.version, state_digest=rec.state_digest, files=files, extra_files=sorted(extra))


def _is_model_file(name: str) -> bool:
    return name.endswith((".safetensors", ".safetensors.index.json"))


def _write_dest(state: dict[str, Any], dest: Path, version: int, digest: str, adapter: Any = None,
                extra: dict[str, bytes] | None = None) -> list[Path]:
    """Write `state` to DEST through a staging folder beside it (see the module docstring);
    `adapter` (an AdapterMeta): as a PEFT adapter folder; `extra`: verified checkpoint files
    (config, tokenizer) written beside the weights in a folder DEST."""
    from safetensors.torch import save_file

    from sparsesync.codec import write_anchor

    dest = dest.absolute()
    one_file = dest.suffix == ".safetensors"
    stage: Path | None = None
    try:
        if dest.exists() and not (dest.is_file() if one_file else dest.is_dir()):
            raise OutputError(f"{dest} exists and is not a {'file' if one_file else 'folder'}",
                              hint="name a folder, or a path ending in .safetensors for one file")
        dest.parent.mkdir(parents=True, exist_ok=True)
        if one_file and adapter is not None:
            raise OutputError(f"{dest}: an adapter run is pulled into a folder (adapter_config.json + adapter_model.safetensors)",
                              hint="name a folder for DEST")
        stage = Path(tempfile.mkdtemp(prefix=f".{dest.name}.sparsesync-", dir=dest.parent))
        if one_file:
            save_file(state, str(stage / dest.name), metadata={"sparsesync_version": str(version),
                                                               "sparsesync_state_digest": digest})
            os.replace(stage / dest.name, dest)
            return [dest]
        if adapter is not None:
            from sparsesync.adapter import write_adapter_folder

            files = write_adapter_folder(state, adapter, stage / "model", version=version, digest=digest)
        else:
            files = write_anchor(state, stage / "model", version=version)
        from sparsesync.protocol.extras import write_files

        files = write_files(stage / "model", extra or {}) + list(files)  # the model files last (index last)
        if not dest.exists():
            os.replace(stage / "model", dest)  # DEST appears complete, or not at all
            return [dest / f.name for f in files]
        new = [f.name for f in files]  # the run's config and tokenizer files replace DEST's
        stale = [p for p in dest.iterdir() if _is_model_file(p.name) and p.name not in new]
        for p in stale:  # indexes first, so no loader follows a stale index to a new shard set
            if p.name.endswith(".json"):
                p.unlink()
        for f in files:  # shards, then the index
            os.replace(f, dest / f.name)
        for p in stale:
            p.unlink(missing_ok=True)
        return [dest / n for n in new]
    except (OutputError, ConfigError):  # ConfigError: an adapter config its tensors do not fit (nothing written)
        raise
    except Exception as e:  # OSError, or safetensors' own error for the same causes
        raise OutputError(f"cannot write version {version} to {dest}: {' '.join(str(e).split())[:300]}",
                          hint=_output_hint(e)) from e
    finally:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)


def _output_hint(e: Exception) -> str:
    import errno

    text = str(e)
    code = getattr(e, "errno", None)
    if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) or "No space left" in text or "too large" in text:
        return "free disk space (or raise the file size limit) where DEST lives, or pull elsewhere"
    if code in (errno.EACCES, errno.EPERM, errno.EROFS) or "ermission denied" in text or "Read-only" in text:
        return "DEST and its folder must be writable by this user; choose another DEST"
    return "check DEST (a writable folder, or a path ending in .safetensors)"
