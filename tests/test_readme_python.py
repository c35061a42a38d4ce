"""The README's "From Python" block (section "Using it"), run as printed against a tiny local model.

Only the names the block leaves to the reader are given: `model` (the tiny model, bf16),
`train_step` (moves a few weights), `num_steps`, `my_engine` (an embedded engine on the same
base), and the bucket URL is swapped for a local folder; `./base-model` is the tiny model's
folder. The follower started by the block then serves the last step, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the block's replica engine needs transformers")

from inference_space.engines.embedded import EmbeddedEngine  # noqa: E402
from sparsesync.codec import tensor_digests  # noqa: E402
from tests.support.readme import readme_blocks  # noqa: E402

URL = "hf://buckets/me/rl-weights/run-1"


def readme_python_block() -> str:
    blocks = readme_blocks("Using it", "python")
    assert len(blocks) == 1, "the README's 'Using it' section has one python block"
    return blocks[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32-master"])
def test_readme_python_block_runs_as_printed(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             dtype: torch.dtype) -> None:
    """fp32: the trainer's fp32 master is published as bf16, the dtype ./base-model's config.json
    declares and the replica serves; the replica serves the bf16 cast of the trained weights."""
    from transformers import AutoModelForCausalLM

    block = readme_python_block()
    assert URL in block
    monkeypatch.chdir(tmp_path)
    (tmp_path / "base-model").symlink_to(tiny, target_is_directory=True)
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=dtype)
    g = torch.Generator().manual_seed(0)

    def train_step(m: torch.nn.Module) -> None:
        with torch.no_grad():
            for p in list(m.parameters())[:3]:
                mask = torch.rand(p.shape, generator=g) < 0.01
                p.add_(mask.to(p.dtype) * 1e-2)

    scope = {"model": model, "train_step": train_step, "num_steps": 3, "my_engine": EmbeddedEngine(tiny)}
    exec(compile(block.replace(URL, str(tmp_path / "bucket")), "README.md (Using it)", "exec"), scope)  # noqa: S102
    follower = scope["follower"]
    try:
        follower.wait_for_version(3, timeout=120)
    finally:
        follower.stop()
    engine = scope["my_engine"]
    assert engine.weight_version == 3
    want = tensor_digests({k: v.to(torch.bfloat16) for k, v in model.state_dict().items() if k in engine.state_dict()})
    assert tensor_digests(engine.state_dict()) == want


def test_an_fp32_state_the_replica_cannot_serve_fails_at_once_in_one_bounded_line(
        tiny: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Published as is (no config.json saying bf16): the replica refuses the layout, and
    `wait_for_version` says so at once, naming a few tensors, their count and the fix."""
    import logging
    import time

    from transformers import AutoModelForCausalLM

    from sparsesync import Follower, Publisher
    from sparsesync.errors import WeightUpdateError

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    with Publisher(str(tmp_path / "bucket")) as pub:
        pub.publish(model.state_dict(), 0)
    follower = Follower(str(tmp_path / "bucket"), hook=EmbeddedEngine(tiny), max_retry_interval=0.2)
    caplog.set_level(logging.DEBUG, logger="sparsesync.protocol.follower.follower")
    follower.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(WeightUpdateError) as e:
            follower.wait_for_version(0, timeout=60)
        time.sleep(1.5)  # a few more retries
    finally:
        follower.stop()
    assert time.monotonic() - t0 < 20
    n = len(model.state_dict())
    assert f"and {n - 3} more of {n}" in e.value.message and len(e.value.message) < 600
    assert "Publisher(url, dtype=torch.bfloat16)" in e.value.hint
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    retries = [r for r in caplog.records if "engine failed to apply" in r.getMessage()]
    assert len(errors) == 1 and len(retries) > 1, [r.getMessage()[:80] for r in caplog.records]
