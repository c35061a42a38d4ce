"""The front door: `import sparsesync` gives Publisher, Follower, push, pull, open_store, the types
they take and return (every name the README's Python uses) and the library's errors, loaded on first use (so `import
sparsesync` and `sparsesync --help` import no torch); `push`/`pull` are library calls that return what they did (the
CLI only prints it)."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors.torch import load_file, save_file

import sparsesync
from sparsesync.protocol.run import Run


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": (torch.randn(64, 32, generator=g) * 0.02).to(torch.bfloat16),
            "model.norm.weight": torch.ones(32)}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _assert_bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(_bits(a[k]), _bits(b[k])), k


def test_front_door_names_are_the_library_objects() -> None:
    from sparsesync import errors, transfer
    from sparsesync.lora.meta import AdapterMeta
    from sparsesync.protocol.follower.follower import Follower
    from sparsesync.protocol.writer.publisher import Publisher
    from sparsesync.store import open_store

    assert sparsesync.Publisher is Publisher and sparsesync.Follower is Follower
    assert sparsesync.push is transfer.push and sparsesync.pull is transfer.pull
    assert sparsesync.open_store is open_store
    assert sparsesync.AdapterMeta is AdapterMeta  # defined below the protocol (sparsesync.lora), records re-export it
    library_errors = {
        name
        for name, value in vars(errors).items()
        if isinstance(value, type) and issubclass(value, Exception) and value.__module__ == errors.__name__
    }
    assert "SparsesyncError" in library_errors and library_errors <= set(sparsesync.__all__)
    assert all(getattr(sparsesync, name) is getattr(errors, name) for name in library_errors)
    assert set(sparsesync.__all__) <= set(dir(sparsesync))
    with pytest.raises(AttributeError, match="no attribute 'Pusher'"):
        sparsesync.Pusher  # noqa: B018 - the access is the test
    # the apps keep their errors: the library's module holds none of them
    assert not {"TrainerError", "DemoCheckError", "ReplicaUnavailableError", "RolloutError", "DeployError"} & set(
        vars(errors)
    )


def test_import_sparsesync_and_help_import_no_torch() -> None:
    code = ("import sys, sparsesync\n"
            "sparsesync.SparsesyncError, sparsesync.ConfigError, sparsesync.open_store\n"
            "assert 'torch' not in sys.modules, 'import sparsesync imported torch'\n"
            "sys.argv = ['sparsesync', '--help']\n"
            "from sparsesync.cli import main\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert e.code in (0, None), e.code\n"
            "assert 'torch' not in sys.modules, 'sparsesync --help imported torch'\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "push" in res.stdout and "pull" in res.stdout


def test_push_and_pull_are_library_calls(tmp_path: Path) -> None:
    from sparsesync.transfer import PullResult, PushResult

    url = str(tmp_path / "run")
    first, second = _state(0), _state(0)
    second["model.embed_tokens.weight"] = second["model.embed_tokens.weight"].clone()
    second["model.embed_tokens.weight"][3, :5] += 0.5  # a few elements change
    (tmp_path / "checkpoint-7").mkdir()
    save_file(first, str(tmp_path / "checkpoint-7" / "model.safetensors"))
    save_file(second, str(tmp_path / "next.safetensors"))

    phases: list[str] = []
    pushed = sparsesync.push(tmp_path / "checkpoint-7", url, progress=phases.append)
    assert isinstance(pushed, PushResult)
    assert (pushed.version, pushed.step_from, pushed.metrics["kind"]) == (7, "the folder name checkpoint-7", "anchor")
    assert phases[0].startswith("reading the newest version of") and "diff + encode" in phases
    pushed = sparsesync.push(str(tmp_path / "next.safetensors"), url, step=9)
    assert (pushed.version, pushed.step_from, pushed.metrics["kind"], pushed.abandoned) == (9, "step", "delta", None)
    assert pushed.metrics["n_changed"] == 5
    assert sparsesync.push(tmp_path / "next.safetensors", url, step=9).held  # the newest already: nothing pushed
    with pytest.raises(sparsesync.ConfigError, match=r"version 3 \(from step\) is not newer than version 9") as e:
        sparsesync.push(tmp_path / "checkpoint-7", url, step=3)  # a rewind with no version below 3 to continue from
    assert "step N with a larger N" in e.value.hint

    rejected: list[dict[str, str]] = []
    pulled = sparsesync.pull(url, tmp_path / "v7.safetensors", version=7, on_rejected=rejected.append)
    assert isinstance(pulled, PullResult) and pulled.version == 7 and pulled.files == [tmp_path / "v7.safetensors"]
    assert rejected == [{}]
    _assert_bit_equal(load_file(str(tmp_path / "v7.safetensors")), first)
    pulled = sparsesync.pull(url, str(tmp_path / "newest"))
    assert pulled.version == 9 and all(p.parent == tmp_path / "newest" for p in pulled.files)
    _assert_bit_equal(load_file(str(pulled.files[-1])), second)
    with pytest.raises(sparsesync.VersionNotFoundError):
        sparsesync.pull(url, tmp_path / "v8", version=8)
    assert not (tmp_path / "v8").exists()
    # a push below the newest continues from the version below it and abandons the newer ones: only when asked
    with pytest.raises(
        sparsesync.RewindRefusedError,
        match=r"version 8 \(from step\) is not above version 9, .* abandons "
        r"version 9",
    ) as refused:
        sparsesync.push(tmp_path / "checkpoint-7", url, step=8)
    assert (refused.value.newest, refused.value.version, refused.value.abandoned) == (9, 8, [9])
    assert "rewind=True" in refused.value.hint and [c.version for c in Run(url).commits()] == [7, 9]  # nothing written
    pushed = sparsesync.push(tmp_path / "checkpoint-7", url, step=8, rewind=True)
    assert (pushed.version, pushed.abandoned, pushed.held) == (8, [9], False)
    _assert_bit_equal(load_file(str(sparsesync.pull(url, tmp_path / "v8.safetensors").files[0])), first)


# what the README's Python and prose call from the front door, beyond Publisher/Follower/push/pull
README_TYPES = (
    "FleetOptions",
    "ApplyHook",
    "FollowerStatus",
    "AdapterMeta",
    "SparseUpdate",
    "PushResult",
    "PullResult",
    "Store",
)


def _static_names(package: ModuleType) -> dict[str, str]:
    """name -> module of the `from M import name` lines under the package's `if TYPE_CHECKING:`."""
    tree = ast.parse(Path(package.__file__ or "").read_text())
    out: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for imp in node.body:
                if isinstance(imp, ast.ImportFrom) and imp.module is not None and imp.module.startswith("sparsesync"):
                    out.update({a.asname or a.name: imp.module for a in imp.names})
    return out


@pytest.mark.parametrize("name", ["sparsesync", "sparsesync.integrations.trl"])
def test_static_and_lazy_lists_agree(name: str) -> None:
    """The TYPE_CHECKING imports (what type checkers and IDEs see), the lazy table (what loads at
    run time) and `__all__` name the same names, each from the same module."""
    package = importlib.import_module(name)
    homes = package._HOMES
    assert _static_names(package) == homes
    assert set(package.__all__) - {"__version__"} == set(homes)
    assert len(package.__all__) == len(set(package.__all__))
    assert set(package.__all__) <= set(dir(package))


def test_every_front_door_name_loads_from_its_home() -> None:
    for name, home in sparsesync._HOMES.items():
        assert getattr(sparsesync, name) is getattr(importlib.import_module(home), name), name


def test_the_readme_python_imports_from_the_front_door() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    imported = {n.strip() for block in re.findall(r"```python\n(.*?)```", readme, re.S)
                for names in re.findall(r"^from sparsesync import \(?([^)\n]*)", block, re.M) for n in names.split(",")}
    assert {"Publisher", "Follower"} <= imported
    assert imported | set(README_TYPES) <= set(sparsesync.__all__)
    from sparsesync import (  # noqa: F401
        AdapterMeta,
        ApplyHook,
        FleetOptions,
        FollowerStatus,
        PullResult,
        PushResult,
        SparseUpdate,
        Store,
    )
