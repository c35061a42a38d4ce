"""GPU benchmark: one realistic RL step of a 0.6B- and a 7B-shaped bf16 model living on CUDA,
sparsesync against the TRL-style extraction on the GPU in the same run (run by
scripts/gpu_check.sh; writes JSON).

    python benchmarks/gpu_bench.py --json gpu-results/gpu_bench.json     # CUDA: 0.6B and 7B, ~3.5 min on an H100
    python benchmarks/gpu_bench.py --tiny --json /tmp/b.json             # any CPU: tiny shapes, seconds

The weights are synthesized on the device (Qwen3-shaped, `_codec_data.qwen_like_shapes`;
per-layer scales and heavy tails as in `_codec_data.make_weights`), then one AdamW step with
fp32 master weights (a sub-ulp residual per element, update lr x the Adam direction) at
lr 1e-6: about 1.6% of the bf16 elements change, as in benchmarks/codec_bench.py.

Per shape, each figure the best of the reps that fit the time budget (every rep in the JSON):
- `diff_encode_s`: `Snapshot.diff_encode(cuda_weights)` with the snapshot in host memory, the
  Publisher's default on a GPU trainer (each 256 MiB slice is copied to the host and compared
  there); `diff_encode_cuda_snapshot_s`: the same with `Snapshot(device="cuda")` (the compare
  runs on the GPU, only the changes are copied).
- `publish_stall_s`, `follower_lag_s`, `lag_over_stall_plus_decode`, `publish_stall_over_trl`:
  `Publisher.publish()` on the device weights (snapshot beside them, entropy coding in the
  background) and a follower on a local folder (benchmarks/_publish_phase.py).
- `trl_extract_s`: TRL-style, on the GPU: bitwise compare, nonzero, gather, copy to host,
  safetensors save (int32 indices + bf16 values).
- `decode_apply_s`: `apply_patch(read_patch(bytes), cuda_weights)` (decode and validate, base
  digests, write, target digests); `follower_apply_s`: without the base digest, as a follower
  applies; `trl_apply_s`: safetensors load, copy to the GPU, `index_put_`, no checks.
- `snapshot_host_rss_GB`: growth of this process's resident memory when the host snapshot is
  made (the trainer's extra host memory; the model's bf16 bytes once).
- `digest_GBps`: the tensor digest ("xxh3b") of a 1 GiB bf16 tensor on the device (best rep;
  `digest_impl`: on CUDA the Triton kernel where triton imports), `digest_torch_GBps` the torch
  implementation's, `digest_triton_by_config` the Triton kernel's at several rounds per step and
  warps per program (8 and 4: the default), `digest_cpu_GBps` the C codec's over a host copy,
  `digest_matches_cpu` whether every one of them agrees with the C codec.
- `device_apply_s`: the device apply (`codec.device_apply.apply_on_device`: host decode, one
  transfer, scatter, base and target digests on the device; on the CPU the same torch code on CPU
  tensors), `device_apply_staged_s` its part inside a mirror-less replica's pause, `index_put_s`
  a bare `index_put_` of the same decoded update already on the device; `apply_over_index_put`
  (and `staged_apply_over_index_put`) their ratio, in the same run.
- `replica_host_model_copies`: host memory the replica's process grew by (engine, follower with
  no host mirror, the anchor's load), in copies of the model's bytes (on the CPU the engine's own
  weights are host memory; `--tiny`: a sub-MB model, so mostly the libraries' noise).
- `replica_pause_ms` (a ~0.6B Qwen3 model: hidden 1024, 64 layers, vocab 512): the embedded engine
  on the device following a local run with no host mirror (`device_state=True`): each delta's
  pause (`write_in_place`: the device apply plus the engine's whole-state check), as `PauseStats`
  measures it; `replica_anchor_load_ms` the anchor's load straight into the engine.

Reps alternate direction (base -> target, then target -> base: the same density) so no
snapshot has to be rebuilt between them; the replica's weights are put back by a copy. Phases that would not fit
`--budget-s` are skipped and marked so in the JSON, which is rewritten after every phase (a killed run keeps what it
did).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the apps: folders of the checkout, not the wheel
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _codec_data import qwen_like_shapes
from _publish_phase import bench_publish

from sparsesync.codec import Snapshot, apply_patch, read_patch
from sparsesync.codec.diff import bits_view


def rss_bytes() -> int:
    """This process's resident memory (Linux; 0 elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def device_weights(shapes: dict[str, tuple[int, ...]], dev: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """bf16 weights made on `dev`, distributed as `_codec_data.make_weights` draws them."""
    g = torch.Generator(device=dev).manual_seed(seed)
    r = random.Random(seed)
    out = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            t = torch.rand(shape, generator=g, device=dev).mul_(2).sub_(1).exp_().mul_(0.8)
        else:
            std = 0.03 if "embed" in name else math.exp(r.uniform(math.log(0.01), math.log(0.05)))
            t = torch.randn(shape, generator=g, device=dev)
            tail = torch.rand(shape, generator=g, device=dev) < 0.02
            t = torch.where(tail, t * torch.empty(shape, device=dev).uniform_(3, 6, generator=g), t).mul_(std)
            del tail
        out[name] = t.to(torch.bfloat16)
        del t
    return out


def master_step(weights: dict[str, torch.Tensor], lr: float, seed: int = 1) -> dict[str, torch.Tensor]:
    """The bf16 weights after one AdamW step with fp32 master weights (on the weights' device)."""
    out = {}
    for i, (name, w) in enumerate(weights.items()):
        g = torch.Generator(device=w.device).manual_seed(seed * 100003 + i)
        u = torch.randn(w.shape, generator=g, device=w.device).mul_(0.4).clamp_(-1.0, 1.0)
        w32 = w.float()
        ulp = w32.abs().clamp_min(1e-30).log2_().floor_().sub_(7).exp2_()
        w32.add_(torch.rand(w.shape, generator=g, device=w.device).sub_(0.5).mul_(ulp))
        del ulp
        w32.sub_(u.mul_(lr))
        out[name] = w32.to(torch.bfloat16)
        del u, w32
    return out


def trl_extract(base: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> bytes:
    """TRL-style, where the weights live: compare bits, nonzero, gather; to host; safetensors save."""
    out = {}
    for name, b in base.items():
        t = target[name]
        idx = torch.nonzero(bits_view(b) != bits_view(t)).squeeze(1)
        if idx.numel():
            out[name + ".indices"] = idx.to(torch.int32)
            out[name + ".values"] = t.reshape(-1)[idx]
    return st_save({k: v.cpu() for k, v in out.items()})


def trl_apply(data: bytes, tensors: dict[str, torch.Tensor]) -> None:
    d = st_load(data)
    for key, idx in d.items():
        if key.endswith(".indices"):
            name = key[: -len(".indices")]
            dst = tensors[name]
            dst.view(-1).index_put_((idx.to(dst.device).long(),), d[name + ".values"].to(dst.device))


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(bits_view(a[k]), bits_view(b[k].to(a[k].device))) for k in a)


class Budget:
    """Seconds left of the run's time box."""

    def __init__(self, seconds: float) -> None:
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()


def timed(dev: torch.device, fn: Callable[[], Any]) -> tuple[float, Any]:
    gc.collect()
    sync(dev)
    t0 = time.perf_counter()
    r = fn()
    sync(dev)
    return time.perf_counter() - t0, r


def bench_codec(
    label: str,
    params: float,
    dev: torch.device,
    lr: float,
    reps: int,
    budget: Budget,
    row: dict,
    save: Callable[[], None],
) -> None:
    """The codec phases for one shape, filling `row` (see the module docstring)."""
    shapes = qwen_like_shapes(params)
    t0 = time.perf_counter()
    a = device_weights(shapes, dev, seed=0)
    b = master_step(a, lr)
    sync(dev)
    n_params = sum(t.numel() for t in a.values())
    model_gb = n_params * 2 / 1e9
    n_changed = sum(int((bits_view(a[k]) != bits_view(b[k])).sum()) for k in a)
    row.update(shape=label, n_params=n_params, model_GB=model_gb, tensors=len(a), lr=lr, n_changed=n_changed,
               density=n_changed / n_params, synth_s=time.perf_counter() - t0)
    print(
        f"[{label}] {n_params / 1e9:.2f}B params, {model_gb:.1f} GB bf16 on {dev}, density {n_changed / n_params:.4f}",
        flush=True,
    )
    # est. seconds of one rep, from the first one (phases skip when the budget cannot hold them)

    # -- trainer side: host snapshot (the Publisher's default) --------------------------------
    gc.collect()
    rss0 = rss_bytes()
    t_snap, snap = timed(dev, lambda: Snapshot(a, 0))  # noqa: F821 - bound above (pyflakes misreads the del at the end)
    row.update(snapshot_s=t_snap, snapshot_host_rss_GB=(rss_bytes() - rss0) / 1e9, snapshot_nbytes_GB=snap.nbytes / 1e9)
    ours, trl, datas = [], [], []
    pair = (b, a)  # alternate: a -> b, then b -> a
    for i in range(reps):
        if i and budget.left() < 2.5 * (ours[0] + trl[0]):
            row["reps_note"] = f"stopped after {i} reps (budget)"
            break
        cur, prev = pair[i % 2], pair[(i + 1) % 2]
        dt, enc = timed(dev, lambda: snap.diff_encode(cur, i + 1))
        ours.append(dt)
        if i < 2:
            datas.append(enc.data)
        dt, data_trl = timed(dev, lambda: trl_extract(prev, cur))
        trl.append(dt)
        if i == 0:
            row.update(
                patch_bytes=len(enc.data),
                trl_bytes=len(data_trl),
                B_per_changed=len(enc.data) / max(1, enc.stats.n_changed),
                diff_s=enc.stats.diff_s,
                encode_s=enc.stats.encode_s,
            )
            trl0 = data_trl
        del enc, data_trl
        save()
    row.update(diff_encode_s=min(ours), diff_encode_all_s=ours, trl_extract_s=min(trl), trl_extract_all_s=trl,
               diff_encode_GBps=model_gb / min(ours), ratio_ours_over_trl=min(ours) / min(trl))
    snap_ok = same_bits(snap.state, pair[(len(ours) - 1) % 2])
    row["snapshot_bit_exact"] = snap_ok
    del snap
    gc.collect()
    save()

    # -- trainer side: snapshot on the GPU -----------------------------------------------------
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        if free < model_gb * 1e9 * 1.3:
            row["diff_encode_cuda_snapshot"] = f"skipped: {free / 1e9:.1f} GB free on the GPU"
        elif budget.left() < 3 * min(ours) + 20:
            row["diff_encode_cuda_snapshot"] = "skipped: budget"
        else:
            t_snap, snap = timed(dev, lambda: Snapshot(a, 0, device=dev))  # noqa: F821 - as above
            cs = []
            for i in range(min(reps, 2)):
                dt, enc = timed(dev, lambda: snap.diff_encode(pair[i % 2], i + 1))
                cs.append(dt)
                if enc.data != datas[i]:
                    row["cuda_snapshot_same_bytes"] = False
                del enc
            row.setdefault("cuda_snapshot_same_bytes", True)
            row.update(cuda_snapshot_s=t_snap, diff_encode_cuda_snapshot_s=min(cs), diff_encode_cuda_snapshot_all_s=cs)
            del snap
            gc.collect()
            torch.cuda.empty_cache()
        save()

    # -- trainer side: Publisher.publish() on the device weights, and a follower's lag ----------
    if budget.left() < 4 * min(ours) + 20:
        row["publish_phase"] = "skipped: budget"
    else:
        try:
            bench_publish(dev, a, b, reps, budget.left, row, save)
        except torch.OutOfMemoryError as e:
            row["publish_phase"] = f"out of GPU memory: {e}"
            gc.collect()
            torch.cuda.empty_cache()
    save()

    # -- replica side: decode + verify + apply into CUDA weights ---------------------------
    work = {k: v.clone() for k, v in a.items()}
    applies: dict[str, list[float]] = {"decode_apply": [], "follower_apply": [], "trl_apply": []}
    fwd = datas[0]
    ok = True
    for i in range(reps):
        if i and budget.left() < 2 * sum(v[0] for v in applies.values()) + 10:
            row["apply_note"] = f"stopped after {i} reps (budget)"
            break
        for key, check in (("decode_apply", True), ("follower_apply", False)):
            # as above
            dt, _ = timed(dev, lambda: apply_patch(read_patch(fwd), work, check_base_digest=check))  # noqa: F821
            applies[key].append(dt)
            ok = ok and same_bits(work, b)
            for k in work:  # back to a for the next measurement
                work[k].copy_(a[k])
        dt, _ = timed(dev, lambda: trl_apply(trl0, work))  # noqa: F821 - as above
        applies["trl_apply"].append(dt)
        ok = ok and same_bits(work, b)
        for k in work:
            work[k].copy_(a[k])
        save()
    row.update({f"{k}_s": min(v) for k, v in applies.items()})
    row.update({f"{k}_all_s": v for k, v in applies.items()})
    ok = bench_device_apply(dev, fwd, work, a, b, reps, row) and ok
    row["apply_bit_exact"] = ok
    del work, a, b
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    row["wall_s"] = time.perf_counter() - t0
    save()


def bench_device_apply(dev: torch.device, data: bytes, work: dict[str, torch.Tensor], a: dict[str, torch.Tensor],
                       b: dict[str, torch.Tensor], reps: int, row: dict) -> bool:
    """The device apply (`codec.device_apply`, the tensors' own device; on the CPU the same torch
    code on CPU tensors) against a bare `index_put_` of the same update, in the same run:
    `device_apply_s` read + host decode + one transfer + scatter + base and target digests on the
    device; `device_apply_staged_s` the part a mirror-less replica pauses for (`apply_staged`: the
    decode and the transfer happen while it serves); `index_put_s` the decoded indices and values
    already on the device, `index_put_` per tensor, no check. Returns whether every result was b."""
    from sparsesync.codec import decode_patch
    from sparsesync.codec.device_apply import apply_on_device, apply_staged, stage_on_device

    ups = decode_patch(read_patch(data), work, check_base_digest=False)
    on_dev = {n: (u.indices.to(dev), u.values.to(dev)) for n, u in ups.items()}

    def index_put() -> None:
        for n, (i, v) in on_dev.items():
            work[n].view(-1).index_put_((i,), v)

    times: dict[str, list[float]] = {"device_apply": [], "device_apply_staged": [], "index_put": []}
    ok = True
    for _ in range(reps):
        for key in times:
            if key == "device_apply_staged":
                staged = stage_on_device(read_patch(data), work)
                sync(dev)
                dt, _ = timed(dev, lambda: apply_staged(staged, work))  # noqa: B023 - called at once
            else:
                dt, _ = timed(dev, index_put if key == "index_put" else lambda: apply_on_device(read_patch(data), work))
            times[key].append(dt)
            ok = ok and same_bits(work, b)
            for k in work:
                work[k].copy_(a[k])
    row.update({f"{k}_s": min(v) for k, v in times.items()})
    row.update({f"{k}_all_s": v for k, v in times.items()})
    row.update(apply_over_index_put=min(times["device_apply"]) / min(times["index_put"]),
               staged_apply_over_index_put=min(times["device_apply_staged"]) / min(times["index_put"]))
    return ok


def bench_digest(dev: torch.device, nbytes: int, reps: int, row: dict, save: Callable[[], None]) -> None:
    """The tensor digest ("xxh3b", docs/format.md) of one `nbytes` bf16 tensor on `dev`, every rep
    timed: `tensor_digest` (on CUDA the Triton kernel, `codec.blocks_triton`, where triton imports,
    else torch operations; on the CPU the C codec), and side by side on CUDA the Triton kernel at
    other rounds per step and warps per program, and the torch implementation (`codec.blocks_torch`; on the CPU too).
    Each value is compared with the C codec's over a host copy (bit-identical, or the run fails)."""
    from sparsesync.codec import device_blocks, digest
    from sparsesync.codec.blocks_torch import tensor_digest_torch

    g = torch.Generator(device=dev).manual_seed(3)
    t = torch.randint(-(1 << 15), 1 << 15, (nbytes // 2,), dtype=torch.int16, device=dev, generator=g)
    t = t.view(torch.bfloat16)
    host = t.cpu()
    cpu_s, want = timed(torch.device("cpu"), lambda: digest.tensor_digest(host, "xxh3b"))

    def best(fn: Callable[[], str]) -> tuple[list[float], bool]:
        times, same = [], True
        for _ in range(reps):
            dt, got = timed(dev, fn)
            times.append(dt)
            same = same and got == want
        return times, same

    times, same = best(lambda: digest.tensor_digest(t, "xxh3b"))
    impl = device_blocks.cuda_impl().__module__ if dev.type == "cuda" else "sparsesync.codec.blocks_digest (C)"
    row.update(digest_bytes=nbytes, digest_device=str(dev), digest_impl=impl, digest_s_all=times,
               digest_GBps=nbytes / min(times) / 1e9, digest_cpu_GBps=nbytes / cpu_s / 1e9, digest_matches_cpu=same)
    torch_times, torch_same = best(lambda: tensor_digest_torch(t))
    row.update(digest_torch_s_all=torch_times, digest_torch_GBps=nbytes / min(torch_times) / 1e9,
               digest_torch_matches_cpu=torch_same)
    row["digest_triton_by_config"] = None  # the Triton kernel runs on CUDA only (tests: CPU interpreter)
    if dev.type == "cuda" and impl.endswith("blocks_triton"):
        from sparsesync.codec.blocks_triton import tensor_digest_triton

        by_config = {}
        for rounds, warps in ((4, 4), (8, 4), (16, 4), (8, 8), (16, 8)):  # (8, 4): the default
            rt, rsame = best(lambda r=rounds, w=warps: tensor_digest_triton(t, r, w))  # type: ignore[misc]
            by_config[f"rounds={rounds},warps={warps}"] = {"GBps": nbytes / min(rt) / 1e9, "s_all": rt,
                                                           "matches_cpu": rsame}
            row["digest_matches_cpu"] = row["digest_matches_cpu"] and rsame
        row["digest_triton_by_config"] = by_config
    row["digest_matches_cpu"] = row["digest_matches_cpu"] and torch_same
    print(f"[digest] xxh3b on {dev} ({impl}): {row['digest_GBps']:.1f} GB/s; torch operations "
          f"{row['digest_torch_GBps']:.1f} GB/s; C codec on this host {row['digest_cpu_GBps']:.1f} GB/s; "
          f"Triton by configuration: {row['digest_triton_by_config']}; all equal to the C codec's: "
          f"{row['digest_matches_cpu']}", flush=True)
    save()


def bench_pause(
    dev: torch.device, hidden: int, layers: int, lr: float, reps: int, row: dict, save: Callable[[], None]
) -> None:
    """The embedded engine on `dev` following a local run with no host mirror (`device_state=True`,
    the default on a GPU): each delta staged while it serves and applied into its tensors by the
    device apply; its pause per version (`PauseStats`) and the host memory the replica's process
    grew by (engine, follower, the anchor's load), in copies of the model's bytes."""
    from inference_space.engines.embedded import EmbeddedEngine
    from sparsesync.protocol.follower.follower import Follower
    from sparsesync.protocol.writer.publisher import Publisher
    from sparsesync.tiny_model import arch_config, build_tiny_model

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_model(tmp)  # the tokenizer, and a config to copy
        from safetensors.torch import load_file
        from transformers import AutoConfig, AutoModelForCausalLM

        small = AutoConfig.from_pretrained(tmp)
        cfg = arch_config("qwen3", small.vocab_size, small.eos_token_id, hidden=hidden, layers=layers)
        with torch.device(dev):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        model.generation_config.eos_token_id = small.eos_token_id
        model.save_pretrained(tmp)
        del model
        base = {k: v.contiguous() for k, v in load_file(str(Path(tmp) / "model.safetensors")).items()}
        target = master_step(base, lr)
        run = str(Path(tmp) / "run")
        versions = [base] + [target, base] * reps  # every version published before the replica starts
        with Publisher(run, anchor_every=0, anchor_fraction=1e9) as pub:
            for v, state in enumerate(versions, start=1):
                pub.publish(state, v)
            pub.flush()
        n_params = sum(t.numel() for t in base.values())
        model_bytes = sum(t.numel() * t.element_size() for t in base.values())
        from sparsesync.protocol.follower.mirror import release_freed_memory

        gc.collect()
        release_freed_memory()
        rss0 = rss_bytes()  # the process baseline: libraries loaded, the run written, the publisher's copies held
        engine = EmbeddedEngine(tmp, device=str(dev), device_state=True)
        pauses: list[float] = []
        add = engine.pauses.add
        engine.pauses.add = lambda ms, wait: (pauses.append(ms), add(ms, wait))[1]  # type: ignore[method-assign]
        follower = Follower(run, engine, prefetch=False)
        got = follower.sync_once()  # the anchor straight into the engine, then every delta on the device
        gc.collect()
        release_freed_memory()
        row.update(replica_host_model_copies=(rss_bytes() - rss0) / model_bytes, replica_mirror=bool(follower.mirror))
        row.update(
            engine_params=n_params, engine_hidden=hidden, engine_layers=layers, engine_load_s=time.perf_counter() - t0
        )
        print(f"[pause] embedded engine on {dev}, no host mirror: {n_params / 1e6:.0f}M params", flush=True)
        deltas = pauses[1:]  # the first pause is the anchor's load
        ok = got == len(versions) and same_bits(engine.state_dict(), versions[-1])
        row.update(replica_pause_ms=min(deltas) if deltas else None, replica_pause_all_ms=deltas,
                   replica_anchor_load_ms=pauses[0] if pauses else None, replica_bit_exact=ok,
                   replica_follower_state=follower.status().state)
        follower.stop()
        engine.close()
        del engine, follower
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    save()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU if no CUDA): checks the benchmark runs")
    ap.add_argument("--shapes", default="0.6e9,7e9", help="comma-separated parameter counts")
    ap.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate (1e-6: ~1.6%% of bf16 elements change)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--budget-s", type=float, default=220, help="time box for the whole run; later reps and phases skip"
    )
    ap.add_argument("--device", default="", help="default: cuda if available, else cpu")
    ap.add_argument("--json", type=Path, default=Path("gpu-results/gpu_bench.json"))
    a = ap.parse_args()
    dev = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    budget = Budget(a.budget_s)
    shapes = [2e6] if a.tiny else [float(s) for s in a.shapes.split(",") if s]
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "device": str(dev),
        "cpus": os.cpu_count(),
        "tiny": a.tiny,
        "codec_threads": os.environ.get("SPARSESYNC_CODEC_THREADS", "default (<= 4)"),
        "budget_s": a.budget_s,
    }
    if dev.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(dev)
    result: dict[str, Any] = {"env": env, "rows": [], "pause": {}, "digest": {}}
    a.json.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        a.json.write_text(json.dumps(result, indent=1, default=str))

    t_start = time.perf_counter()
    labels = {0.6e9: "0.6B", 7e9: "7B"}
    for i, params in enumerate(shapes):
        label = labels.get(params, f"{params / 1e9:g}B")
        row: dict[str, Any] = {"shape": label}
        result["rows"].append(row)
        # about 15 s per 1e9 parameters for one rep of every phase on an H100 host: skip a shape
        # that cannot fit rather than be killed half-way
        need = 8 if a.tiny else 15 * params / 1e9 + 10
        if i and budget.left() < need:
            row["skipped"] = f"budget: {budget.left():.0f} s left, ~{need:.0f} s needed"
            save()
            continue
        try:
            bench_codec(
                label, params, dev, a.lr, a.reps if params < 2e9 or a.tiny else min(a.reps, 2), budget, row, save
            )
        except torch.OutOfMemoryError as e:
            row["error"] = f"out of GPU memory: {e}"
            gc.collect()
            torch.cuda.empty_cache()
        save()
    try:  # the digest's GB/s: 1 GiB on the device (tiny: 16 MiB)
        bench_digest(dev, (16 if a.tiny else 1024) << 20, 3 if a.tiny else 5, result["digest"], save)
    except Exception as e:  # noqa: BLE001 - reported, the other figures still count
        result["digest"]["error"] = f"{type(e).__name__}: {e}"
    try:  # the replica's pause, on a ~0.6B model (vocab 512)
        if a.tiny:
            bench_pause(dev, 128, 2, 1e-3, 1, result["pause"], save)
        elif budget.left() > 30:
            bench_pause(dev, 1024, 64, a.lr, 2, result["pause"], save)
        else:
            result["pause"]["skipped"] = f"budget: {budget.left():.0f} s left"
    except Exception as e:  # noqa: BLE001 - reported, the other figures still count
        result["pause"]["error"] = f"{type(e).__name__}: {e}"
    save()
    env["wall_s"] = time.perf_counter() - t_start
    save()
    keys = (
        "shape",
        "density",
        "B_per_changed",
        "snapshot_host_rss_GB",
        "diff_encode_s",
        "diff_encode_cuda_snapshot_s",
        "publish_stall_s",
        "publish_stall_over_trl",
        "lag_over_stall_plus_decode",
        "snapshot_device",
        "trl_extract_s",
        "decode_apply_s",
        "follower_apply_s",
        "trl_apply_s",
        "device_apply_s",
        "device_apply_staged_s",
        "index_put_s",
        "apply_over_index_put",
        "snapshot_bit_exact",
        "apply_bit_exact",
    )
    for r in result["rows"]:
        print(
            json.dumps({k: (float(f"{r[k]:.4g}") if isinstance(r.get(k), float) else r.get(k)) for k in keys if k in r})
        )
    print(json.dumps(result["pause"].get("replica_pause_ms", result["pause"])))
    print(f"wrote {a.json} in {env['wall_s']:.0f} s")
    bad = [
        r["shape"]
        for r in result["rows"]
        if r.get("snapshot_bit_exact") is False
        or r.get("apply_bit_exact") is False
        or r.get("cuda_snapshot_same_bytes") is False
        or r.get("publish_follower_bit_exact") is False
    ] + (["pause"] if result["pause"].get("replica_bit_exact") is False else []) + (
        ["digest"] if result["digest"].get("digest_matches_cpu") is False else []
    )
    if bad or "error" in result["pause"] or "error" in result["digest"] or any("error" in r for r in result["rows"]):
        print(f"NOT BIT-EXACT or failed: {bad or 'see errors in the JSON'}")
        sys.exit(1)


if __name__ == "__main__":
    main()
