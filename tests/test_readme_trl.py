"""The README's TRL block, run as printed against a tiny local model and two real replicas.

Only the configuration lines (MODEL, BUCKET, REPLICAS) are replaced: the tiny model folder, a
local bucket, and two embedded-engine replicas (inference_space over uvicorn on 127.0.0.1)
following it. Nothing else is changed (the block itself trains on CPU in fp32 where there is
no GPU). The bucket then reconstructs the trained weights bit for bit, the last step's included.
"""

from __future__ import annotations

import re
import time
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
from tests.apps.inference.test_server import Server  # noqa: E402
from tests.support.readme import README, readme_blocks  # noqa: E402

CONFIG = re.compile(r'^MODEL, BUCKET = .*\nREPLICAS = .*$', re.M)


def readme_trl_block() -> str:
    blocks = readme_blocks("TRL", "python")
    assert len(blocks) == 1, "the README's TRL section has one python block"
    return blocks[0]


@pytest.mark.filterwarnings("ignore")
def test_readme_trl_block_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    block = readme_trl_block()
    assert len(CONFIG.findall(block)) == 1
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
    # versions = global_step: a weight sync before each of the 2 steps, and the trained weights at the end
    assert [c.version for c in commits] == [0, 1, 2]
    assert trainer.state.global_step == 2
    assert trainer.vllm_generation.vllm_client.served == [0, 1]  # generated on the replicas, on those versions
    assert (tmp_path / "grpo-out").is_dir()
    # version 0: the model folder's weights bit for bit (its key set: the tied head once); 1: trained;
    # 2: the weights after the last optimizer step, exactly what the trainer holds (bf16 cast)
    start, v0, v1 = load_checkpoint(model_dir), Run(bucket).reconstruct(0)[1], Run(bucket).reconstruct(1)[1]
    final = model_state(trainer.model)
    assert set(v0) == set(v1) == set(start) == set(final)
    assert all(torch.equal(v0[k].view(torch.uint8), start[k].view(torch.uint8)) for k in start)
    assert any(not torch.equal(v0[k], v1[k]) for k in start)
    v2 = Run(bucket).reconstruct(2)[1]
    assert all(torch.equal(v2[k].view(torch.uint8), final[k].view(torch.uint8)) for k in final)
    assert any(not torch.equal(v1[k], v2[k]) for k in final)
    # the model's config and tokenizer travel with every version: a pulled folder loads as is
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= {
        f.name for f in commits[-1].files}


@pytest.mark.filterwarnings("ignore")
def test_readme_trl_block_with_no_replica_running_says_how_to_start_one(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The block as printed, nothing listening at REPLICAS: `GRPOTrainer(...)` waits as TRL's own
    client does (here 3 s: `vllm_server_timeout`, TRL's setting, set in the block), then stops with
    one line naming the replicas and `python -m inference_space`, not a raw connection error."""
    from sparsesync.errors import ReplicaUnreachableError
    from trainer.processes import free_port

    block = readme_trl_block()
    assert block.count("use_vllm=True,") == 1
    model_dir = build_tiny_model(tmp_path / "model", seed=0, arch="qwen3-tied")
    monkeypatch.chdir(tmp_path)
    dead = f"http://127.0.0.1:{free_port()}"
    config = f'MODEL, BUCKET = {str(model_dir)!r}, {str(tmp_path / "bucket")!r}\nREPLICAS = "{dead}"'
    code = CONFIG.sub(lambda _: config, block).replace("use_vllm=True,", "use_vllm=True, vllm_server_timeout=3,")
    t0 = time.monotonic()
    with pytest.raises(ReplicaUnreachableError) as err:
        exec(compile(code, str(README), "exec"), {"__name__": "readme"})  # noqa: S102
    waited = time.monotonic() - t0
    text = str(err.value)
    assert "\n" not in text and dead in text and "within 3 s" in text and "python -m inference_space" in text, text
    assert isinstance(err.value, ConnectionError)  # what TRL's own client raises for a server that is not up
    assert 3 <= waited < 60, waited
    assert not (tmp_path / "bucket").exists()  # nothing was published
