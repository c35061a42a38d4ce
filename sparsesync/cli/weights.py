"""`sparsesync push` and `sparsesync pull`: weight versions in and out of a run.

`pull` writes DEST atomically: the version is written into a staging folder beside DEST (same
file system), then renamed into place, so a failure (read-only folder, full disk, a bad run)
leaves DEST as it was. Into an existing folder it moves the new model files in (the index
last) and removes every other `*.safetensors` and `*.safetensors.index.json` there, which
loaders would otherwise read as part of the model. The checkpoint files the run carries
(config.json, generation_config.json, tokenizer files; `sparsesync.protocol.extras`), each
checked against its recorded digest, are written beside the weights (replacing DEST's own);
other files stay.
A run mixing adapter and full-weight versions (or two adapters) is refused before anything is
fetched, and an adapter version's config is checked against its tensors before the folder PEFT
would load is written (`sparsesync.adapter_config`).

`push` numbers a checkpoint by its optimizer step (trainer_state.json's global_step, else a
`checkpoint-N` folder name) unless `--step` says otherwise, and says which it used. A step at or
below the run's newest version rewinds the run (docs/protocol.md, "Rewinds"): to that version
when the checkpoint is the run's version of it, else the checkpoint becomes that version as a
delta from the newest version below it; the newer versions are abandoned either way.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from sparsesync.cli._console import CliConsole

console = CliConsole()


def _progress() -> Progress:
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                    console=Console(stderr=True), transient=True)


def push(
    source: Annotated[Path, typer.Argument(help="A .safetensors file, a folder of safetensors shards, or a PEFT adapter folder.")],
    url: Annotated[str, typer.Argument(help="Run URL: a folder, file://..., s3://bucket/prefix or hf://buckets/ns/name/prefix.")],
    step: Annotated[int | None, typer.Option(help="Version number to publish (default: the checkpoint's step, from "
                                             "trainer_state.json's global_step or a checkpoint-N folder name; else newest + 1, 0 in a new run).")] = None,
    anchor_every: Annotated[int, typer.Option(help="Write a full anchor every N versions.")] = 50,
    public: Annotated[bool, typer.Option(help="Create the bucket public (default private).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    base_model: Annotated[Path | None, typer.Option("--base", help="PEFT adapter SOURCE: the base model's folder (its digest is recorded).")] = None,
    effort: Annotated[str, typer.Option(help="size: the smallest patch; speed: about 27% larger, encoded and decoded faster.")] = "size",
) -> None:
    """Publish SOURCE as the next version of the run at URL (a delta, or an anchor when due).

    The version is the checkpoint's optimizer step (see --step). The folder's config, generation
    config and tokenizer files travel with it, so `pull` writes a folder that loads as is. A PEFT
    adapter folder (adapter_config.json + adapter_model.safetensors) makes an adapter run."""
    from sparsesync import adapter as lora
    from sparsesync.checkpoint import load_checkpoint
    from sparsesync.protocol.keys import check_version
    from sparsesync.protocol.publisher import Publisher, PublisherConfig
    from sparsesync.protocol.run import Run
    from sparsesync.store import open_store

    PublisherConfig(effort=effort).validate()  # before anything is read or written
    step_from = "--step"
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
    with _progress() as progress:
        task = progress.add_task(f"reading the newest version of {store.url}")
        run = Run(store)
        newest = run.newest()
        if step is None:
            step, step_from = (0, "a new run's first version") if newest is None else (newest.version + 1, "newest + 1")
        meta = None
        if config is not None:
            meta, state = lora.meta_for_folder(config, state, base_model, newest, store.url)
        lora.check_publish(newest, meta, store.url)  # before resume() reads the run as this kind
        rewind = newest is not None and step <= newest.version  # docs/protocol.md, "Rewinds"
        plan = _plan_rewind(run, state, step, step_from, store.url) if rewind else None
        if plan == "held":
            console.print(f"version {step} of {store.url} already holds these weights (the newest); nothing pushed",
                          soft_wrap=True)
            return
        pub = Publisher(store, anchor_every=anchor_every, queue_size=1, adapter=meta, effort=effort, extra_files=extra)
        try:
            if plan == "rewind":  # the checkpoint is the run's version `step`: the run goes on from it
                progress.update(task, description=f"rewinding to version {step}")
                pub.resume(state, version=step)
                version = step
            else:
                base_version = plan if isinstance(plan, int) else None if newest is None else newest.version
                if base_version is not None:
                    _rec, base, _digests = run.reconstruct(base_version)
                    if rewind:  # continue below the newest: the commit of `step` abandons the newer versions
                        from sparsesync.protocol.rewind import continue_below

                        continue_below(pub, base, base_version, run.commits())
                    else:
                        pub.resume(base)
                    del base
                progress.update(task, description="diff + encode")
                version = pub.publish(state, step)
                progress.update(task, description=f"uploading version {version}")
                pub.flush()
        finally:
            pub.close()
    m = {**pub.metrics[-1], "step_from": step_from}
    if rewind and m.get("kind") != "rewind":  # a delta below the newest: every older commit from `step` on is abandoned
        from sparsesync.protocol.keys import COMMITS
        from sparsesync.protocol.rewind import abandoned_by_rewinds

        m["abandoned"] = [v for a in abandoned_by_rewinds([o.key for o in store.list(COMMITS)])
                          if (a.version, a.by_epoch) == (version, pub.epoch) for v in a.versions]
    files = [f.name for f in Run(store).commit(version).files]
    if as_json:
        console.print_json(json.dumps({**m, "files": files}))
        return
    kind = m["kind"]
    msg = f"pushed version {version} ({kind}; version from {step_from}) to {store.url}"
    if "n_changed" in m:
        msg += f": {m['n_changed']:,} of {m['n_params']:,} elements changed ({m['density']:.3%}), {m['patch_bytes']:,} bytes"
    if "anchor_bytes" in m:
        msg += f"; anchor {m['anchor_bytes']:,} bytes"
    if files:
        msg += f"; with {', '.join(files)}"
    if m.get("abandoned"):
        msg += f"; rewound: versions {m['abandoned']} of the older attempt abandoned"
    console.print(msg, soft_wrap=True)


def _plan_rewind(run: Any, state: Any, step: int, step_from: str, url: str) -> str | int:
    """How `push` publishes version `step` at or below the run's newest (docs/protocol.md,
    "Rewinds"): "held" (the newest already is these weights), "rewind" (these weights are the
    run's version `step`: the run is rewound to it), or the newest version below `step` to
    continue from (the checkpoint then becomes version `step`, abandoning the newer versions)."""
    from sparsesync.checkpoint import checkpoint_digest
    from sparsesync.errors import ConfigError

    commits = run.commits()
    same = next((c for c in commits if c.version == step), None)
    if same is not None and same.state_digest == checkpoint_digest(state):
        return "held" if same is commits[-1] else "rewind"
    below = [c.version for c in commits if c.version < step]
    if not below:
        raise ConfigError(f"version {step} (from {step_from}) is not newer than version {commits[-1].version}, the newest "
                          f"of {url}, and the run has no version below it to continue from",
                          hint="pass --step N with a larger N, or push to a new run URL")
    return below[-1]


_STEP_DIR = re.compile(r"^checkpoint-(\d+)$")
_MAX_TRAINER_STATE_BYTES = 64 << 20


def checkpoint_step(source: Path) -> tuple[int, str] | None:
    """The optimizer step of the checkpoint at `source` (a folder, or a file in one) and where it
    was read: `trainer_state.json`'s `global_step` (what transformers' Trainer saves), else the
    folder name `checkpoint-N`; None when neither says."""
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
    url: Annotated[str, typer.Argument(help="Run URL.")],
    dest: Annotated[Path, typer.Argument(help="Output: a folder, or a path ending in .safetensors for one file.")],
    version: Annotated[int | None, typer.Option(help="Version to materialize (default: newest committed).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Materialize a committed version of the run at URL into DEST as safetensors, bit-exact
    (an adapter run: as a PEFT adapter folder), with the config and tokenizer files the run
    carries: `from_pretrained(DEST)` loads it.

    DEST is replaced atomically; in an existing folder, other *.safetensors files and indexes are removed."""
    from sparsesync.adapter_config import check_one_kind
    from sparsesync.cli.run_info import _warn_rejected
    from sparsesync.protocol.run import Run

    run = Run(url)
    with _progress() as progress:
        task = progress.add_task("listing commits")
        check_one_kind(run.commits(), run.url)  # before anything is fetched: a mixed run rebuilds neither kind

        def on_step(step):  # type: ignore[no-untyped-def]
            what = "loading anchor" if step.kind == "anchor" else "applying delta to"
            progress.update(task, description=f"{what} version {step.commit.version}")

        try:
            rec, state, _digests = run.reconstruct(version, on_step=on_step)
        finally:
            _warn_rejected(run.rejected)  # why a version that is there is not a commit
        progress.update(task, description="fetching config and tokenizer files")
        extra = {f.name: run.fetch(f) for f in rec.files}  # each checked against its size and digest
        progress.update(task, description=f"writing {dest}")
        files = _write_dest(state, dest, rec.version, rec.state_digest, rec.adapter, extra)
    result = {"version": rec.version, "state_digest": rec.state_digest, "files": [str(f) for f in files]}
    if as_json:
        console.print_json(json.dumps(result))
    else:
        with_files = f", with {', '.join(sorted(extra))}" if extra and dest.suffix != ".safetensors" else ""
        console.print(f"pulled version {rec.version} (state {rec.state_digest}) into {dest}{with_files}", soft_wrap=True)


def _is_model_file(name: str) -> bool:
    return name.endswith((".safetensors", ".safetensors.index.json"))


def _write_dest(state: dict[str, Any], dest: Path, version: int, digest: str, adapter: Any = None,
                extra: dict[str, bytes] | None = None) -> list[Path]:
    """Write `state` to DEST through a staging folder beside it (see the module docstring);
    `adapter` (an AdapterMeta): as a PEFT adapter folder; `extra`: verified checkpoint files
    (config, tokenizer) written beside the weights in a folder DEST."""
    from safetensors.torch import save_file

    from sparsesync.codec import write_anchor
    from sparsesync.errors import ConfigError, OutputError

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
    except Exception as e:  # noqa: BLE001 - OSError, or safetensors' own error for the same causes
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
