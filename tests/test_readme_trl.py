"""The README's TRL block, run as written against a tiny local model and two real replicas.

Only the configuration lines (MODEL, BUCKET, REPLICAS) are replaced: the tiny model folder, a
local bucket, and two embedded-engine replicas (inference_space over uvicorn on 127.0.0.1)
following it; and `GRPOConfig` gets `use_cpu=True, bf16=False` (no GPU here). The bucket then reconstructs the trained weights bit for bit.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

from inference_space.engines.embedded import EmbeddedEngine  # noqa: E402
from inference_space.replica import Replica  # noqa: E402
from sparsesync.checkpoint import load_checkpoint  # noqa: E402
from sparsesync.integrations.trl import model_state  # noqa: E402
from sparsesync.protocol.run import Run  # noqa: E402
from sparsesync.tiny_model import build_tiny_model  # noqa: E402
from tests.test_inference_server import Server  # noqa: E402

README = Path(__file__).resolve().parents[1] / "README.md"
CONFIG = re.compile(r'^MODEL, BUCKET = .*\nREPLICAS = .*$', re.M)


def readme_trl_block() -> str:
    text = README.read_text()
    section = text[text.index("\n## TRL\n"):]
    section = section[: section.index("\n## ", 1)]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "the README's TRL section has one python block"
    return blocks[0]


@pytest.mark.filterwarnings("ignore")
def test_readme_trl_block_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import functools

    import trl

    block = readme_trl_block()
    assert len(CONFIG.findall(block)) == 1
    # this machine has no GPU: the block's GRPOConfig trains on CPU in fp32 (TRL defaults to bf16 on GPU)
    monkeypatch.setattr(trl, "GRPOConfig", functools.partial(trl.GRPOConfig, use_cpu=True, bf16=False))
    model_dir = build_tiny_model(tmp_path / "model", seed=0, arch="qwen3-tied")
    bucket = str(tmp_path / "bucket")
    monkeypatch.chdir(tmp_path)
    replicas = []
    for i in range(2):
        monkeypatch.setenv("SPARSESYNC_REPLICA_ID", f"replica-{i}")
        replicas.append(Replica(EmbeddedEngine(model_dir), bucket, poll_interval=0.1))
    with Server(replicas[0]) as r1, Server(replicas[1]) as r2:
        config = f'MODEL, BUCKET = {str(model_dir)!r}, {bucket!r}\nREPLICAS = "{r1.url},{r2.url}"'
        scope: dict[str, object] = {"__name__": "readme"}
        exec(compile(CONFIG.sub(lambda _: config, block), str(README), "exec"), scope)  # noqa: S102
    trainer = scope["trainer"]
    commits = Run(bucket).commits()
    assert [c.version for c in commits] == [0, 1]  # a weight sync before each of the 2 steps
    assert trainer.vllm_generation.vllm_client.served == [0, 1]  # generated on the replicas, on those versions
    assert (tmp_path / "grpo-out").is_dir()
    # version 0: the model folder's weights bit for bit (its key set: the tied head once); version 1: trained
    start, v0, v1 = load_checkpoint(model_dir), Run(bucket).reconstruct(0)[1], Run(bucket).reconstruct(1)[1]
    assert set(v0) == set(v1) == set(start) == set(model_state(trainer.model))
    assert all(torch.equal(v0[k].view(torch.uint8), start[k].view(torch.uint8)) for k in start)
    assert any(not torch.equal(v0[k], v1[k]) for k in start)
