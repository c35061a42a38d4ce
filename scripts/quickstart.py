"""Quickstart: publish a few versions of a model through a local bucket and pull them back.

Builds a ~25M-parameter bf16 model (random weights in a realistic layout), applies small
AdamW-like updates for a few steps, publishes each step with the sparsesync Publisher, then
follows the bucket with a Follower and checks every version bit for bit.
Run: .venv/bin/python scripts/quickstart.py [BUCKET_DIR] (default: a new temporary folder, kept;
scripts/quickstart.sh runs it on a temporary bucket it removes at the end)
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

from sparsesync.protocol.follower.follower import Follower
from sparsesync.protocol.writer.publisher import Publisher


def main() -> None:
    given = len(sys.argv) > 1
    bucket = Path(sys.argv[1]) if given else Path(tempfile.mkdtemp(prefix="sparsesync-bucket-"))
    url = f"file://{bucket.resolve()}/runs/quickstart"
    g = torch.Generator().manual_seed(0)
    hidden, layers, vocab = 512, 6, 8192
    master = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g) * 0.02,
              "lm_head.weight": torch.randn(vocab, hidden, generator=g) * 0.02}
    for i in range(layers):
        for proj, shape in {"self_attn.qkv_proj": (3 * hidden, hidden), "self_attn.o_proj": (hidden, hidden),
                            "mlp.gate_up_proj": (4 * hidden, hidden), "mlp.down_proj": (hidden, 2 * hidden)}.items():
            master[f"model.layers.{i}.{proj}.weight"] = torch.randn(shape, generator=g) * 0.02
        master[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(hidden)
    n_params = sum(t.numel() for t in master.values())
    print(f"model: {n_params / 1e6:.1f}M params, {2 * n_params / 1e6:.1f} MB in bf16; bucket: {url}")

    follower = Follower(url)
    with Publisher(url) as pub:
        for step in range(5):  # version 0: the weights before training; N: after N optimizer steps
            if step > 0:  # an RL-sized update on fp32 master weights (lr 2e-6, Adam-normalized)
                for t in master.values():
                    t.add_(torch.randn(t.shape, generator=g).sign(), alpha=-2e-6)
            state = {k: v.to(torch.bfloat16) for k, v in master.items()}
            t0 = time.perf_counter()
            pub.publish(state, step)
            blocked = time.perf_counter() - t0
            pub.flush()
            m = pub.metrics[-1]
            follower.sync_once()
            ok = all(torch.equal(follower.mirror[k].view(torch.int16), state[k].view(torch.int16)) for k in state)
            what = (f"{m['n_changed']:,} changed ({m['density']:.2%}), patch {m['patch_bytes']:,} B "
                    f"= {m['patch_bytes'] / m['n_changed']:.2f} B/changed vs {2 * n_params:,} B dense"
                    if "n_changed" in m else f"{m['anchor_bytes']:,} B (the full model)")
            print(f"step {step}: {m['kind']:<6} {what}; trainer blocked {blocked * 1000:.0f} ms; "
                  f"follower at v{follower.current_version}, bit-exact: {ok}")
            if not ok:
                raise SystemExit("follower weights differ from the trainer's")
    if not given:  # a bucket of its own: it stays, say where
        print(f"\nthe bucket stays in {bucket}; next: .venv/bin/sparsesync log {url}")


if __name__ == "__main__":
    main()
