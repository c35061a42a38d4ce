"""README.md's measured figures against the results files they come from: each figure the README
quotes in "Quickstart" and "Measured" is recomputed from benchmarks/results/*.json and must
appear, formatted as the README writes it. Rerunning a benchmark without updating the README
(or editing a number by hand) fails here."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(rf"^## {re.escape(title)}.*?(?=^## |\Z)", text, re.S | re.M)
    assert m, f"README.md has no section {title!r}"
    return re.sub(r"\s+", " ", m.group(0))  # figures may wrap across lines


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _row(name: str, mode: str, density: float) -> dict:
    rows = [r for r in _load(name)["rows"] if r["mode"] == mode and abs(r["density"] - density) < 0.2 * density]
    assert len(rows) == 1, (name, mode, density)
    return rows[0]


def _lag(name: str, store: str) -> tuple[dict, dict, bool]:
    d = _load(name)
    (r,) = [r for r in d["rows"] if r["store"] == store and r["followers"] == 1]
    parts = r["parts"]
    transfer = parts["uploaded_per_version"] / (d["link_mbit"] * 1e6 / 8) if store == "s3-wan" else 0.0
    bound = 1.3 * max(parts["encode_s"], parts["follower_s"]) + transfer  # the lag bound
    return parts, r["full"], parts["lag_s"] <= bound


def _measured_claims() -> list[tuple[str, str]]:
    out = []
    master, bf16 = _row("codec_bench.json", "master", 0.0157), _row("codec_bench.json", "bf16", 0.0041)
    out += [("codec_bench.json", f"{master['ours_B']:.2f} B (pure bf16 params: {bf16['ours_B']:.2f} B)"),
            ("codec_bench.json", f"{master['diff_encode_s']:.2f} / {master['diff_encode_median_s']:.2f} s"),
            ("codec_bench.json", f"{master['trl_extract_s']:.2f} / {master['trl_extract_median_s']:.2f} s"),
            ("codec_bench.json", f"{master['decode_apply_s']:.2f} s (as a follower runs it: {master['follower_apply_s']:.2f} s)"),
            ("codec_bench.json", f"{master['trl_apply_s']:.2f} s, TRL-style index_put")]
    rw = _load("real_weights.json")["results"]
    dens = [v["density"] for v in rw["minilm_master"]["versions"]]
    out += [("real_weights.json", f"{rw['minilm_master']['bytes_per_changed']:.2f} B (pure bf16: {rw['minilm_bf16']['bytes_per_changed']:.2f} B)"),
            ("real_weights.json", f"{100 * (1 - max(dens)):.1f}-{100 * (1 - min(dens)):.1f}% of its bf16 elements bit-identical")]
    lora = _load("lora_sync.json")["by_lr"]["1e-05"]
    out += [("lora_sync.json", f"{lora['adapter_delta_bf16']['bytes_median'] / 1e6:.2f} MB per version"),
            ("lora_sync.json", f"full adapter {lora['a_full_adapter_bf16']['bytes_median'] / 1e6:.1f} MB"),
            ("lora_sync.json", f"{lora['c_full_model_bf16']['bytes_median'] / 1e6:.0f} MB"),
            ("lora_sync.json", f"lag {lora['adapter_delta_bf16']['lag_s_median']:.2f} s** on a local folder"),
            ("lora_sync.json", f"full adapter {lora['a_full_adapter_bf16']['bytes_median'] / 1e6:.1f} MB, lag {lora['a_full_adapter_bf16']['lag_s_median']:.2f} s")]
    for name, store in (("protocol_lag_poll_loop.json", "local"), ("protocol_lag_s3_multipart.json", "s3"),
                        ("protocol_lag_wan_shared.json", "s3-wan"), ("protocol_lag_s3_multipart_trainer.json", "s3"),
                        ("protocol_lag_wan_shared_trainer.json", "s3-wan")):
        parts, full, met = _lag(name, store)
        out.append((name, f"{parts['lag_s']:.2f} s ({'met' if met else 'not met'}) | {full['lag_s']:.1f} s"))
    for r in _load("codec_bench_50m.json")["rows"]:
        out.append(("codec_bench_50m.json", f"{r['diff_encode_s'] / r['trl_extract_s']:.2f} / "
                                            f"{r['diff_encode_median_s'] / r['trl_extract_median_s']:.2f}"))
    for r in _load("codec_bench_paired.json")["rows"]:
        out.append(("codec_bench_paired.json", f"{r['diff_encode_s'] / r['trl_extract_s']:.2f} / {r['paired_ratio_median']:.2f}"))
    (res,) = _load("scaleout_resume.json")["rows"]
    out += [("scaleout_resume.json", f"`resume()` {res['resume_s']:.1f} s, then a delta of {res['resumed_v3_bytes'] / 1e6:.1f} MB"),
            ("scaleout_resume.json", f"{res['anchor_v3_bytes'] / 1e6:.0f} MB ({res['anchor_v3_s']:.1f} s")]
    return out


def _span(pair: list[float], fmt: str = ".2f", scale: float = 1.0) -> str:
    lo, hi = (f"{scale * x:{fmt}}" for x in pair)
    return lo if lo == hi else f"{lo}-{hi}"


def _quickstart_claims() -> list[tuple[str, str]]:
    full = _load("demo_full.json")["summary"]
    out = [("demo_full.json", f"from {_span(full['reward_start'])} (first 10 steps) to {_span(full['reward_end'])}"),
           ("demo_full.json", f"median per-step patch is {_span(full['patch_over_full_median'], '.0f', 100)}% of the"),
           ("demo_full.json", f"changes {_span(full['changed_elements'], '.0f', 100)}% of its elements"),
           ("demo_full.json", f"{_span(full['wall_s'], '.0f')} s")]
    lora = _load("demo_lora.json")
    ratios = [p["ratio"] for p in lora["step_time"]["pairs"]]
    out += [("demo_lora.json", f"{_span([min(ratios), max(ratios)])}x a full-weight step"),
            ("demo_lora.json", f"reward from {_span(lora['summary']['reward_start'])} to {_span(lora['summary']['reward_end'])}")]
    return out


@pytest.mark.parametrize("source,claim", _quickstart_claims())
def test_the_quickstart_quotes_the_demo_results(source, claim):
    text = _section("Quickstart")
    assert source in text, f"README's Quickstart does not name {source}"
    assert claim in text, f"README's Quickstart should say {claim!r} (from benchmarks/results/{source})"


@pytest.mark.parametrize("source,claim", _measured_claims())
def test_the_measured_section_quotes_its_results_files(source, claim):
    text = _section("Measured")
    assert source in text, f"README's Measured section does not name {source}"
    assert claim in text, f"README's Measured section should say {claim!r} (from benchmarks/results/{source})"
