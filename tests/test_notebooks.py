"""The notebooks execute top to bottom (short configuration), so they cannot rot.

quickstart.ipynb runs a short local job (env server, two replicas, trainer; weights only through
a bucket folder) and plots it; analysis.ipynb then reads that run's bucket. Each runs in a real
Jupyter kernel (nbclient + ipykernel); a failing cell fails the test with the cell's error.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("matplotlib")
pytest.importorskip("transformers")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def _execute(name: str, env: dict[str, str], timeout: int) -> nbformat.NotebookNode:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits the parameters from the environment
    try:
        client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                         resources={"metadata": {"path": str(NOTEBOOKS)}})
        client.execute()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return nb


def _text(nb: nbformat.NotebookNode) -> str:
    return "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


@pytest.mark.slow
def test_quickstart_then_analysis_notebooks(tmp_path: Path) -> None:
    workdir = tmp_path / "quickstart"
    nb = _execute("quickstart.ipynb", {
        "SPARSESYNC_NB_STEPS": "25", "SPARSESYNC_NB_MIN_GAIN": "-1", "SPARSESYNC_NB_WORKDIR": str(workdir),
    }, timeout=400)
    out = _text(nb)
    assert "PASS bit_exact" in out and "patches:" in out
    n_images = sum(1 for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {}))
    assert n_images == 3  # reward, sync bytes, lag

    nb = _execute("analysis.ipynb", {"SPARSESYNC_NB_BUCKET": str(workdir / "bucket")}, timeout=200)
    out = _text(nb)
    assert "26 committed versions" in out and "25 deltas" in out
    assert sum(1 for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})) == 2


def test_analysis_notebook_builds_a_run_when_none_exists(tmp_path: Path) -> None:
    nb = _execute("analysis.ipynb", {"SPARSESYNC_NB_BUCKET": str(tmp_path / "bucket")}, timeout=200)
    assert "8 committed versions" in _text(nb)
