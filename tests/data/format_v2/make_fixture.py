"""Writes tests/data/format_v2 with the format-2 encoder (run once on 6fff7df, before format 3; kept as the recipe)."""
import torch
from pathlib import Path
from safetensors.torch import save_file, load_file
from sparsesync.codec import diff_state, encode_changes, tensor_digests, state_digest, read_patch

g = torch.Generator().manual_seed(14)
d = Path("tests/data/format_v2")
base = {
    "w": (torch.randn(64, 128, generator=g) * 0.02).to(torch.bfloat16),   # classed gaps + delta
    "x": torch.randn(50, 100, generator=g),                                 # fp32 gaps + delta
    "y": torch.randn(40, 40, generator=g).to(torch.float16),                # dense
    "z": torch.randn(3, 5, generator=g).to(torch.bfloat16),                 # tiny: raw
    "b": torch.randn(4096, generator=g).to(torch.bfloat16),                 # dense-ish: bitmap
    "u": torch.randn(7, generator=g).to(torch.bfloat16),                    # untouched
}
tgt = {k: v.clone() for k, v in base.items()}
def bump(t, frac, lo=-2, hi=3):
    bits = t.view({2: torch.int16, 4: torch.int32}[t.element_size()]).view(-1)
    m = torch.rand(bits.numel(), generator=g) < frac
    step = torch.randint(lo, hi, (bits.numel(),), generator=g).to(bits.dtype)
    bits[m] += step[m]
small = tgt["w"].abs() < 0.01
bump(tgt["w"], 0.03)
tgt["w"].view(torch.int16)[small] += 1
bump(tgt["x"], 0.08)
bump(tgt["y"], 0.9)
bump(tgt["z"], 0.4)
bump(tgt["b"], 0.3)
ch = diff_state(base, tgt)
bd, td = tensor_digests(base), tensor_digests(tgt)
data = encode_changes(ch, base_version=11, target_version=12, base_digests=bd, target_digests=td,
                      base_state_digest=state_digest(bd), target_state_digest=state_digest(td), base=base)
save_file(base, d / "base.safetensors"); save_file(tgt, d / "target.safetensors")
(d / "patch.safetensors").write_bytes(data)
p = read_patch(data)
for n, e in p.header.tensors.items(): print(n, e.positions, e.values, e.n_changed, e.position_params.get("thresholds"))
print(len(data))
