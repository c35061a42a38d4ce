"""Plain safetensors checkpoints on local disk: one file, or a folder of shards.

`load_checkpoint` reads every tensor of a `.safetensors` file or of all `*.safetensors` files
in a folder (a saved Hugging Face checkpoint); duplicate names across shards are an error,
never silently overwritten. `checkpoint_state` brings a trainer's `state_dict()` to the
checkpoint's own key set (the one every run and every engine uses); `shared_aliases`,
`check_tied`, `check_key_set` and `split_fused_experts` are its steps for a distributed publisher, which maps
each rank's shards the same way. Nothing here unpickles anything.

Only regular files are read: a FIFO, a device or a socket is a ConfigError naming it, never
opened (so nothing hangs). What `push` reads of a checkpoint folder (weights, carried files,
trainer_state.json; `open_in_folder`, `read_in_folder`, `load_checkpoint(folder=...)`) stays
inside it: a file that is a link resolving outside the folder (say `tokenizer.json ->
~/.aws/credentials`) is refused with a ConfigError naming it; the one exception is a Hugging Face
cache snapshot, whose files link into the cache's own `blobs/`. What is read is the file the
checks passed: it is opened once, without following a last link, and checked again on the open
descriptor, so swapping a file (or a folder on its path) for a link between the check and the
read cannot escape the folder.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load, load_file

from sparsesync.errors import ConfigError, PatchFormatError

_KINDS = ((stat.S_ISDIR, "folder"), (stat.S_ISFIFO, "FIFO (named pipe)"), (stat.S_ISSOCK, "socket"),
          (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"))


def _not_regular(path: Path, mode: int) -> ConfigError:
    kind = next((name for test, name in _KINDS if test(mode)), "special file")
    return ConfigError(f"{path} is a {kind}, not a regular file: sparsesync reads only plain files",
                       hint="replace it with the file itself (a copy), or leave it out of the folder")


_SWAP_HINT = "make sure nothing else writes into the checkpoint folder while it is read"


def _roots(folder: Path) -> list[Path]:
    """Where the files of `folder` (resolved) may live: the folder, and for a Hugging Face cache
    snapshot (`<repo>/snapshots/<rev>/`, or a folder in one) the cache's `<repo>/blobs/` its
    files link into."""
    snapshot = next((p for p in (folder, *folder.parents) if p.parent.name == "snapshots"), None)
    return [folder] if snapshot is None else [folder, snapshot.parent.parent / "blobs"]


def _inside(path: str | Path, roots: list[Path]) -> bool:
    return any(Path(path).is_relative_to(r) for r in roots)


def open_in_folder(path: str | Path, folder: str | Path | None) -> int:
    """A read-only file descriptor of the regular file `path`, which must stay inside the
    checkpoint folder `folder` (see the module docstring; None: `path` is one the user named, and
    may be a link anywhere). FileNotFoundError when there is none; ConfigError for a link out of
    the folder or a file that is not regular. The caller closes it."""
    path = Path(path)
    try:
        real = Path(os.path.realpath(path, strict=True))
    except FileNotFoundError:
        raise
    except OSError as e:  # a link loop, a path through a file
        raise ConfigError(f"{path} cannot be resolved: {e.strerror}", hint="replace it with the file itself") from None
    roots = None if folder is None else _roots(Path(os.path.realpath(folder)))
    if roots is not None and not _inside(real, roots):
        raise ConfigError(f"{path} is a link to {real}, outside the checkpoint folder {folder}: sparsesync reads "
                          "nothing outside it", hint="copy the file into the folder instead of linking it")
    mode = os.stat(real, follow_symlinks=False).st_mode
    if not stat.S_ISREG(mode):  # before opening: a FIFO would block, a device would act
        raise _not_regular(path, mode)
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise ConfigError(f"{path} changed into a link while it was read", hint=_SWAP_HINT) from None
    try:  # what was opened, not what was checked: a swap in between is caught here
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(path, mode)
        if (
            roots is not None
            and os.path.isdir("/proc/self/fd")
            and not _inside(os.readlink(f"/proc/self/fd/{fd}"), roots)
        ):
            raise ConfigError(f"{path} changed into a link out of the checkpoint folder {folder} while it was read",
                              hint=_SWAP_HINT)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_in_folder(path: str | Path, folder: str | Path | None, limit: int) -> bytes | None:
    """At most `limit` bytes of the regular file `path` of `folder` (`open_in_folder`'s checks);
    None when there is no such file."""
    try:
        fd = open_in_folder(path, folder)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read(limit)


def checkpoint_files(source: Path) -> list[Path]:
    """The safetensors files that make up `source` (a file or a folder), sorted."""
    source = Path(source)
    if source.is_dir():
        files = sorted(source.glob("*.safetensors"))
        if files:
            return files
        raise ConfigError(f"no *.safetensors files in folder {source}", hint="point at a saved checkpoint folder")
    if source.exists():
        return [source]  # a file: `load_checkpoint` refuses it unless it is a regular one
    raise ConfigError(f"{source} does not exist", hint="give a .safetensors file or a folder of shards")


def _load_fd(fd: int) -> dict[str, torch.Tensor]:
    if os.path.isdir("/proc/self/fd"):  # the opened file itself, mapped by safetensors
        return load_file(f"/proc/self/fd/{fd}")
    with os.fdopen(os.dup(fd), "rb") as f:
        return load(f.read())


def load_checkpoint(source: Path, *, folder: Path | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at `source`, on CPU, from regular files only (a FIFO or a
    device is a ConfigError, never opened). `folder`: the checkpoint folder no file may leave
    (`push` passes SOURCE; see the module docstring); None: links are followed wherever they point
    (an engine's own model folder may link its shards from shared storage)."""
    source = Path(source)
    state: dict[str, torch.Tensor] = {}
    for f in checkpoint_files(source):
        try:
            fd = open_in_folder(f, folder)
        except FileNotFoundError:
            raise ConfigError(
                f"{f} does not exist (a dangling link?)", hint="give a .safetensors file or a folder of shards"
            ) from None
        try:
            part = _load_fd(fd)
        except (SafetensorError, OSError) as e:
            raise PatchFormatError(f"{f} is not a readable safetensors file: {e}") from e
        finally:
            os.close(fd)
        dup = state.keys() & part.keys()
        if dup:
            raise ConfigError(f"tensor {sorted(dup)[0]!r} appears in more than one shard of {source}")
        state.update(part)
    return state


# -- the checkpoint's own key set ------------------------------------------------------------
# A run carries what `save_pretrained` writes: a tied LM head once (under the embedding's
# name), MoE experts one tensor per expert, frozen parameters included. Trainers hand over
# `model.state_dict()`, which differs: tied aliases share one storage, transformers 5 fuses
# experts at run time (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]),
# and some callbacks send trainable tensors only.

EXPERT_KEY = re.compile(
    r"^(?P<layer>.+\.experts)\.(?P<e>[0-9]+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$"
)
FUSED_EXPERT_KEY = re.compile(r"^(?P<layer>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
TIED_ALIASES = {"lm_head.weight": "model.embed_tokens.weight"}  # state_dict alias -> checkpoint name


def _view_key(t: torch.Tensor) -> tuple[object, ...]:
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def split_fused_experts(name: str, t: torch.Tensor, first: int = 0) -> dict[str, torch.Tensor] | None:
    """transformers' runtime-fused experts as the per-expert tensors a checkpoint holds (views of
    `t`), or None when `name` is not a fused expert tensor. `first`: the expert index of `t[0]`
    (a rank's dim-0 shard of the fused tensor holds experts first, first+1, ...)."""
    m = FUSED_EXPERT_KEY.match(name)
    if m is None or t.dim() != 3:
        return None
    layer = m["layer"]
    if m["proj"] == "down_proj":
        return {f"{layer}.{first + e}.down_proj.weight": t[e] for e in range(t.shape[0])}
    half = t.shape[1] // 2
    out = {}
    for e in range(t.shape[0]):
        out[f"{layer}.{first + e}.gate_proj.weight"] = t[e, :half]
        out[f"{layer}.{first + e}.up_proj.weight"] = t[e, half:]
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def shared_aliases(state: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """{alias: name kept} for the names whose tensor is the same view of the same storage as an
    earlier name's (tied weights), which `checkpoint_state` keeps once under the first name.
    DTensors are compared by their local shards (FSDP2 gives tied names two DTensor objects over
    one local storage); empty tensors are never aliases."""
    aliases: dict[str, str] = {}
    by_view: dict[tuple[object, ...], str] = {}
    for name, t in state.items():
        local = _local(t)
        if not local.numel():
            continue
        first = by_view.setdefault(_view_key(local), name)
        if first != name:
            aliases[name] = first
    return aliases


def map_tied(state: Mapping[str, torch.Tensor], fn: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """`{name: fn(t)}`, where names tied to one tensor (`shared_aliases`) get one result: a
    cast or copy keeps a tied LM head the embedding's tensor, which publishers send once."""
    aliases = shared_aliases(state)
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        out[name] = out[aliases[name]] if name in aliases else fn(t)
    return out


def checkpoint_digest(state: Mapping[str, torch.Tensor], algo: str | None = None) -> str:
    """The state digest of `state` in the checkpoint's own key set (what a run records for it),
    in digest algorithm `algo` (None: the one new runs record)."""
    from sparsesync.codec import DEFAULT_ALGO, state_digest, tensor_digests

    return state_digest(tensor_digests(checkpoint_state(state), algo or DEFAULT_ALGO))


def check_tied(state: Mapping[str, torch.Tensor], aliases: Mapping[str, str]) -> None:
    """Raise ConfigError when an alias of `aliases` present in `state` no longer holds the values
    of the name kept for it (same storage, or equal): the run's key set has no place for it."""
    for alias, kept in aliases.items():
        if alias not in state or kept not in state:
            continue
        a, k = _local(state[alias]), _local(state[kept])
        if a.numel() and _view_key(a) != _view_key(k) and not torch.equal(a, k):
            raise ConfigError(
                f"tensor {alias!r} was tied to {kept!r} when the run started (published once, as {kept!r}), "
                "but now holds other values",
                hint="keep the weights tied, or start a new run for an untied model",
            )


def check_key_set(names: Iterable[str], key_set: Iterable[str]) -> None:
    """Raise ConfigError naming the `names` outside the run's `key_set` (nothing is published then)."""
    extra = sorted(set(names) - set(key_set))
    if extra:
        raise ConfigError(
            f"the state has {len(extra)} tensor(s) the run's key set lacks: {', '.join(repr(n) for n in extra[:5])}",
            hint="publish the checkpoint's own key set (what save_pretrained writes), or start a new run",
        )


def checkpoint_state(
    state: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """`state` in the checkpoint's own key set (see above); `reference`: the run's previous version.

    Tensors sharing one storage are kept once (the name in `reference`, else the first; under
    every name the run's key set has);
    runtime-fused experts are split per expert; with a `reference`, a tied alias equal to its
    embedding is dropped and tensors missing from `state` (frozen) are taken from `reference`.
    Raises ConfigError naming the tensors when `state` holds names `reference` does not (nothing
    is published then).
    """
    out: dict[str, torch.Tensor] = {}
    by_view: dict[tuple[object, ...], str] = {}
    for name, t in state.items():
        parts = split_fused_experts(name, t) if reference is None or name not in reference else None
        for n, v in (parts or {name: t}).items():
            key = _view_key(v)
            first = by_view.get(key) if v.numel() else None
            if first is None:
                by_view[key] = n
                out[n] = v
            elif reference is not None and n in reference:
                if first not in reference:  # the run knows this tensor under `n`
                    out.pop(first)
                    by_view[key] = n
                # both names in the run's key set: both stay (else one would be refilled, stale, from `reference`)
                out[n] = v
    if reference is None:
        return out
    for alias, canonical in TIED_ALIASES.items():
        if alias in out and alias not in reference and canonical in out and torch.equal(out[alias], out[canonical]):
            out.pop(alias)
    check_key_set(out, reference)
    for name in reference.keys() - out.keys():  # frozen: unchanged since the previous version
        out[name] = reference[name]
    return out
