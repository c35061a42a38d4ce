"""`push` and `pull`: a checkpoint on disk in and out of a run, as library calls (the CLI's
`sparsesync push` / `sparsesync pull` are these, printed).

    from sparsesync import push, pull

    push("checkpoints/checkpoint-100", "hf://buckets/me/rl-weights/run-1")   # version 100
    pull("hf://buckets/me/rl-weights/run-1", "policy/")                       # the newest version

`pull` writes DEST all or nothing (`sparsesync.dest`): the version is written into a staging
folder on DEST's own file system (a DEST that is a link: where it points), then swapped in, so
a failure (read-only folder, full disk, a bad run, a folder in the way) leaves DEST as it was.
Into an existing folder it moves the new model files in (the index last) and moves every other
`*.safetensors` and `*.safetensors.index.json` there out, which loaders would otherwise read as
part of the model. The checkpoint files the run carries
(config.json, generation_config.json, tokenizer files; `sparsesync.protocol.extras`), each
checked against its recorded digest, are written beside the weights (replacing DEST's own);
other files stay. What is written is the committed version bit for bit (every tensor checked
against its digest while the chain is applied).
A run mixing adapter and full-weight versions (or two adapters) is refused before anything is
fetched, and an adapter version's config is checked against its tensors before the folder PEFT
would load is written (`sparsesync.lora.config`).

`push` reads the checkpoint folder without leaving it: a file that links out of the folder, or
is not a regular file (a FIFO, a device), is refused with a ConfigError naming it
(`sparsesync.checkpoint.open_in_folder`).

`push` numbers a checkpoint by its optimizer step (trainer_state.json's global_step, else a
`checkpoint-N` folder name) unless `step` says otherwise, and says which it used (and why a
trainer_state.json it could not read was ignored). A step at or below the run's newest version
rewinds the run (docs/protocol.md, "Rewinds"): to that version when the checkpoint is the run's
version of it, else the checkpoint becomes that version as a delta from the newest version below
it; the newer versions are abandoned either way. So a stray re-push of an old checkpoint cannot
roll a fleet back, a rewind happens only when asked for (`rewind=True`, or a `rewind` callable
that approves the `RewindPlan`, naming the versions it abandons, before anything is written);
else RewindRefusedError, and nothing is written. A step the newest version already holds with
these weights pushes nothing (`PushResult.held`). That planning is the library's one function
for it, `protocol.writer.rewind.plan_push`; this module only carries it out.

Both import torch only when called. Errors are `sparsesync.errors` classes (`ConfigError`,
`OutputError`, store and protocol errors), each naming the object and carrying a `hint`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from sparsesync.codec.patch import Effort
    from sparsesync.protocol.writer.rewind import PushPlan, RewindPlan

__all__ = ["PullResult", "PushResult", "RewindPlan", "checkpoint_step", "pull", "push"]


def __getattr__(name: str) -> Any:
    """`RewindPlan` (`protocol.writer.rewind`), loaded when first named: this module imports no torch until called."""
    if name == "RewindPlan":
        from sparsesync.protocol.writer.rewind import RewindPlan

        return RewindPlan
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

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
    """A push at or below the newest version (a rewind): the versions of the older attempt it
    abandoned, each once, ascending (None for any other push)."""


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
    rewind: bool | Callable[[RewindPlan], bool] = False,
    rewind_source: str = "rewind=True",
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
        rewind: Whether a push at or below the run's newest version may rewind the run
            (abandoning its newer versions): True, or a callable given the `RewindPlan` before
            anything is written that returns whether to go ahead (the CLI asks on a terminal).
            Refused: RewindRefusedError, nothing written.
        rewind_source: How messages name `rewind=True` (the CLI: "--rewind").

    Returns:
        The version committed, where its number came from, its metrics, the files carried, and
        what a rewind held or abandoned.
    """
    from sparsesync.protocol.run import Run
    from sparsesync.protocol.writer.config import PublisherConfig
    from sparsesync.protocol.writer.publisher import Publisher
    from sparsesync.protocol.writer.rewind import plan_push
    from sparsesync.store import open_store

    say = progress or (lambda _description: None)
    checked = PublisherConfig(effort=cast("Effort", effort))  # a user's string: checked on the next line
    checked.validate()  # before anything is read or written
    ckpt = _read_checkpoint(Path(source), step, step_source, url)
    store = open_store(url, create=True, private=not public)
    say(f"reading the newest version of {store.url}")
    run = Run(store)
    newest = run.newest()
    step, step_from = ckpt.number(newest)
    meta, state = _adapter_meta(ckpt, newest, base_model, store.url)
    plan = plan_push(run, newest, state, step, step_from=step_from, step_source=step_source, rewind=rewind,
                     rewind_source=rewind_source)  # docs/protocol.md, "Rewinds": nothing written yet
    if plan.how == "held":
        return PushResult(version=step, step_from=step_from, url=store.url, metrics={}, files=[], held=True)
    pub = Publisher(
        store, anchor_every=anchor_every, queue_size=1, adapter=meta, effort=checked.effort, extra_files=ckpt.extra
    )
    try:
        version = _write(pub, run, state, plan, say)
    finally:
        pub.close()
    return _pushed(store, pub, version, step_from, plan)


# -- the phases of a push -------------------------------------------------------------------
@dataclass(frozen=True)
class _Checkpoint:
    """What `push` read from SOURCE before it touches the run."""

    state: dict[str, Any]
    config: dict[str, Any] | None  # a PEFT adapter folder's config (an adapter run), else None
    extra: Path | None  # the folder whose config and tokenizer files travel with the version
    step: int | None  # the version number given or found in the checkpoint, None: from the run
    step_from: str
    ignored: str | None  # why the folder's trainer_state.json was ignored

    def number(self, newest: Any) -> tuple[int, str]:
        """The version number and where it came from, given the run's `newest` commit (or None)."""
        step, step_from = self.step, self.step_from
        if step is None:
            step, step_from = (0, "a new run's first version") if newest is None else (newest.version + 1, "newest + 1")
        return step, step_from if self.ignored is None else f"{step_from}; {self.ignored}"


def _read_checkpoint(source: Path, step: int | None, step_source: str, url: str) -> _Checkpoint:
    """SOURCE's tensors (nothing outside it is read) and its version number when it says one."""
    from sparsesync.checkpoint import load_checkpoint
    from sparsesync.lora import bridge as lora
    from sparsesync.protocol.keys import check_version

    step_from, ignored = step_source, None
    if step is None:
        found, ignored = _step_of(source)
        if found is not None:
            step, step_from = found
    if step is not None:
        check_version(step, url)  # before anything is written to the run
    config = None
    if lora.is_adapter_folder(source):
        state, config = lora.read_adapter_folder(source)
    else:
        state = load_checkpoint(source, folder=source if source.is_dir() else None)  # nothing outside SOURCE
    return _Checkpoint(state, config, source if source.is_dir() else None, step, step_from, ignored)


def _adapter_meta(ckpt: _Checkpoint, newest: Any, base_model: str | os.PathLike[str] | None,
                  url: str) -> tuple[Any, dict[str, Any]]:
    """The adapter run's `AdapterMeta` (None for full weights) and the tensors to publish, checked
    against the run's kind before anything reads the run as this kind."""
    from sparsesync.lora.state import meta_for_folder
    from sparsesync.protocol import adapter_runs

    meta, state = None, ckpt.state
    if ckpt.config is not None:
        meta, state = meta_for_folder(ckpt.config, state, Path(base_model) if base_model is not None else None,
                                      newest.adapter if newest is not None else None, url)
    adapter_runs.check_publish(newest, meta, url)  # before resume() reads the run as this kind
    return meta, state


def _write(pub: Any, run: Any, state: dict[str, Any], plan: PushPlan, say: Progress) -> int:
    """Publish `state` as version `plan.version` through `pub` (resumed, rewound or continued below
    the newest as `plan` says) and wait for its commit; the version committed."""
    step = plan.version
    if plan.how == "rewind":  # the checkpoint is the run's version `step`: the run goes on from it
        say(f"rewinding to version {step}")
        pub.resume(state, version=step)
        return step
    if plan.base is not None:
        _rec, base, _digests = run.reconstruct(plan.base)
        if plan.how == "below":  # continue below the newest: the commit of `step` abandons the newer versions
            pub.continue_below(base, plan.base)
        else:
            pub.resume(base)
        del base
    say("diff + encode")
    version = pub.publish(state, step)
    say(f"uploading version {version}")
    pub.flush()
    return int(version)


def _pushed(store: Any, pub: Any, version: int, step_from: str, plan: PushPlan) -> PushResult:
    """What the push did, read back from the run: the commit's files and what a rewind abandoned."""
    from sparsesync.protocol.run import Run
    from sparsesync.protocol.writer.rewind import pushed_abandoned

    abandoned = pushed_abandoned(Run(store), plan, pub.epoch, pub.metrics[-1])
    files = [f.name for f in Run(store).commit(version).files]
    return PushResult(version=version, step_from=step_from, url=store.url, metrics=dict(pub.metrics[-1]), files=files,
                      abandoned=abandoned)


_STEP_DIR = re.compile(r"^checkpoint-([0-9]+)\Z")
_MAX_TRAINER_STATE_BYTES = 64 << 20


def checkpoint_step(source: str | os.PathLike[str]) -> tuple[int, str] | None:
    """The optimizer step of the checkpoint at `source` (a folder, or a file in one) and where it
    was read: `trainer_state.json`'s `global_step` (what transformers' Trainer saves), else the
    folder name `checkpoint-N`; None when neither says. A trainer_state.json that is not a
    readable JSON object of at most 64 MiB (not JSON, nested too deep, too large) is ignored;
    one that links out of the folder, or is not a regular file, is a ConfigError."""
    return _step_of(source)[0]


def _step_of(source: str | os.PathLike[str]) -> tuple[tuple[int, str] | None, str | None]:
    """`checkpoint_step`, and why the folder's trainer_state.json was ignored (None: it was not)."""
    from sparsesync.checkpoint import read_in_folder

    source = Path(source)
    folder = source if source.is_dir() else source.parent
    state_file = folder / "trainer_state.json"
    raw, ignored = read_in_folder(state_file, folder, _MAX_TRAINER_STATE_BYTES + 1), None
    if raw is not None:
        global_step = None
        try:
            if len(raw) > _MAX_TRAINER_STATE_BYTES:
                ignored = f"{state_file.name} ignored: over {_MAX_TRAINER_STATE_BYTES >> 20} MiB"
            else:
                global_step = json.loads(raw).get("global_step")
        except RecursionError:  # the parse is bounded by Python's recursion limit
            ignored = f"{state_file.name} ignored: nested too deep to read"
        except (ValueError, AttributeError):  # not JSON, or not an object
            ignored = f"{state_file.name} ignored: not a JSON object"
        if type(global_step) is int and global_step >= 0:
            return (global_step, f"{state_file.name}'s global_step"), None
    if m := _STEP_DIR.match(folder.name):
        return (int(m[1]), f"the folder name {folder.name}"), ignored
    return None, ignored


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
    from sparsesync.dest import write_dest
    from sparsesync.protocol.adapter_runs import check_one_kind
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
    files = write_dest(state, dest, rec.version, rec.state_digest, rec.adapter, extra)
    return PullResult(version=rec.version, state_digest=rec.state_digest, files=files, extra_files=sorted(extra))
