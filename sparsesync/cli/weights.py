"""`sparsesync push` and `sparsesync pull`: weight versions in and out of a run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

console = Console(highlight=False)


def _progress() -> Progress:
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                    console=Console(stderr=True), transient=True)


def push(
    source: Annotated[Path, typer.Argument(help="A .safetensors file or a folder of safetensors shards.")],
    url: Annotated[str, typer.Argument(help="Run URL: a folder, file://..., s3://bucket/prefix or hf://buckets/ns/name/prefix.")],
    step: Annotated[int | None, typer.Option(help="Version number to publish (default: newest + 1).")] = None,
    anchor_every: Annotated[int, typer.Option(help="Write a full anchor every N versions.")] = 50,
    public: Annotated[bool, typer.Option(help="Create the bucket public (default private).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Publish SOURCE as the next version of the run at URL (a delta, or an anchor when due)."""
    from sparsesync.checkpoint import load_checkpoint
    from sparsesync.protocol.publisher import Publisher
    from sparsesync.protocol.run import Run
    from sparsesync.store import open_store

    state = load_checkpoint(source)
    store = open_store(url, create=True, private=not public)
    with _progress() as progress:
        task = progress.add_task(f"reading the newest version of {store.url}")
        run = Run(store)
        newest = run.newest()
        pub = Publisher(store, anchor_every=anchor_every, queue_size=1)
        try:
            if newest is not None:
                _rec, base, _digests = run.reconstruct(newest.version)
                pub.resume(base)
                del base
            progress.update(task, description="diff + encode")
            version = pub.publish(state, step)
            progress.update(task, description=f"uploading version {version}")
            pub.flush()
        finally:
            pub.close()
    m = pub.metrics[-1]
    if as_json:
        console.print_json(json.dumps(m))
        return
    kind = m["kind"]
    msg = f"pushed version {version} ({kind}) to {store.url}"
    if "n_changed" in m:
        msg += f": {m['n_changed']:,} of {m['n_params']:,} elements changed ({m['density']:.3%}), {m['patch_bytes']:,} bytes"
    if "anchor_bytes" in m:
        msg += f"; anchor {m['anchor_bytes']:,} bytes"
    console.print(msg)


def pull(
    url: Annotated[str, typer.Argument(help="Run URL.")],
    dest: Annotated[Path, typer.Argument(help="Output: a folder, or a path ending in .safetensors for one file.")],
    version: Annotated[int | None, typer.Option(help="Version to materialize (default: newest committed).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Materialize a committed version of the run at URL into DEST as safetensors, bit-exact."""
    from safetensors.torch import save_file

    from sparsesync.codec import write_anchor
    from sparsesync.protocol.run import Run

    run = Run(url)
    with _progress() as progress:
        task = progress.add_task("listing commits")

        def on_step(step):  # type: ignore[no-untyped-def]
            what = "loading anchor" if step.kind == "anchor" else "applying delta to"
            progress.update(task, description=f"{what} version {step.commit.version}")

        rec, state, _digests = run.reconstruct(version, on_step=on_step)
        progress.update(task, description=f"writing {dest}")
        if dest.suffix == ".safetensors":
            dest.parent.mkdir(parents=True, exist_ok=True)
            save_file(state, str(dest), metadata={"sparsesync_version": str(rec.version),
                                                  "sparsesync_state_digest": rec.state_digest})
            files = [dest]
        else:
            files = write_anchor(state, dest, version=rec.version)
    result = {"version": rec.version, "state_digest": rec.state_digest, "files": [str(f) for f in files]}
    if as_json:
        console.print_json(json.dumps(result))
    else:
        console.print(f"pulled version {rec.version} (state {rec.state_digest}) into {dest}")
