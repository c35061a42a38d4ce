"""README.md's measured figures against the results files they come from.

Every figure the README quotes in "Quickstart", "Measured" and the GPU paragraph of
"Contributing" is recomputed here from benchmarks/results/*.json, formatted as the README
writes it, and looked for WHERE it belongs: a table figure in its own row (found by the row's
first cell) and its own column, with the row's results file named in the row; a prose figure in
the sentence that carries it (the words around the number are part of the claim). So rerunning
a benchmark without updating the README, editing a number by hand, swapping two cells or two
rows, or changing a ratio fails here. What is not checked: wording around a figure beyond the
few words each claim quotes, and prose that quotes no figure.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _section(title: str, text: str | None = None) -> str:
    text = (ROOT / "README.md").read_text() if text is None else text
    m = re.search(rf"^## {re.escape(title)}.*?(?=^## |\Z)", text, re.S | re.M)
    assert m, f"README.md has no section {title!r}"
    return m.group(0)


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)  # prose figures may wrap across lines


def _tables(section: str) -> list[list[list[str]]]:
    """Every markdown table of `section`: rows of stripped cells, header first, separator dropped."""
    tables: list[list[list[str]]] = []
    current: list[list[str]] = []
    for line in section.splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                current.append(cells)
        elif current:
            tables.append(current)
            current = []
    return tables


def _table(section: str, first_header: str) -> list[list[str]]:
    found = [t for t in _tables(section) if t[0][0] == first_header]
    assert len(found) == 1, f"expected one table whose first header cell is {first_header!r}"
    return found[0]


def _cells(table: list[list[str]], key: str) -> list[str]:
    rows = [r for r in table if r[0].startswith(key)]
    assert len(rows) == 1, f"expected one row starting {key!r}, found {len(rows)}"
    return rows[0]


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _codec_row(name: str, mode: str, density: float) -> dict:
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


# -- the Measured table: (results file, row key, column, the cell's figures) -----------------------
# columns: 1 = sparsesync, 2 = baseline in the same run, 3 = command and results file

def _measured_table_claims() -> list[tuple[str, str, int, str]]:
    master, bf16 = _codec_row("codec_bench.json", "master", 0.0157), _codec_row("codec_bench.json", "bf16", 0.0041)
    out = [("codec_bench.json", "bytes per changed element, 0.6B synthetic", 1,
            f"{master['ours_B']:.2f} B (pure bf16 params: {bf16['ours_B']:.2f} B)"),
           ("codec_bench.json", "diff+encode, 0.6B synthetic", 1,
            f"{master['diff_encode_s']:.2f} / {master['diff_encode_median_s']:.2f} s"),
           ("codec_bench.json", "diff+encode, 0.6B synthetic", 2,
            f"{master['trl_extract_s']:.2f} / {master['trl_extract_median_s']:.2f} s"),
           ("codec_bench.json", "decode+verify+apply", 1,
            f"{master['decode_apply_s']:.2f} s (as a follower runs it: {master['follower_apply_s']:.2f} s)"),
           ("codec_bench.json", "decode+verify+apply", 2, f"{master['trl_apply_s']:.2f} s, TRL-style index_put")]
    rw = _load("real_weights.json")["results"]
    dens = [v["density"] for v in rw["minilm_master"]["versions"]]
    real = "bytes per changed element, real checkpoint"
    out += [
        (
            "real_weights.json",
            real,
            1,
            f"{rw['minilm_master']['bytes_per_changed']:.2f} B (pure bf16: "
            f"{rw['minilm_bf16']['bytes_per_changed']:.2f} B)",
        ),
        (
            "real_weights.json",
            real,
            0,
            f"{100 * (1 - max(dens)):.1f}-{100 * (1 - min(dens)):.1f}% of its bf16 elements",
        ),
    ]
    lora = _load("lora_sync.json")["by_lr"]["1e-05"]
    delta, full_adapter = lora["adapter_delta_bf16"], lora["a_full_adapter_bf16"]
    out += [("lora_sync.json", "LoRA r=16", 1, f"{delta['bytes_median'] / 1e6:.2f} MB per version"),
            ("lora_sync.json", "LoRA r=16", 1, f"lag {delta['lag_s_median']:.2f} s** on a local folder"),
            ("lora_sync.json", "LoRA r=16", 2,
             f"full adapter {full_adapter['bytes_median'] / 1e6:.1f} MB, lag {full_adapter['lag_s_median']:.2f} s"),
            ("lora_sync.json", "LoRA r=16", 2, f"full model {lora['c_full_model_bf16']['bytes_median'] / 1e6:.0f} MB")]
    lag_rows = (
        ("protocol_lag_poll_loop.json", "local", "publish -> follower applied"),
        ("protocol_lag_s3_multipart.json", "s3", "same, S3 over loopback, the store on the follower's core"),
        ("protocol_lag_s3_multipart_trainer.json", "s3", "same, S3 over loopback, the store on the trainer's core"),
        ("protocol_lag_wan_shared.json", "s3-wan", "same, S3 behind a 500 Mbit/s link"),
        ("protocol_lag_wan_shared_trainer.json", "s3-wan", "same, store on the trainer's core"),
    )
    for name, store, key in lag_rows:
        parts, full, met = _lag(name, store)
        out += [(name, key, 1, f"{parts['lag_s']:.2f} s ({'met' if met else 'not met'})"),
                (name, key, 2, f"{full['lag_s']:.1f} s")]
        if store == "s3-wan":  # the ratio the row quotes, from the same two lags
            out.append((name, key, 2, f"({full['lag_s'] / parts['lag_s']:.0f}x"))
    (res,) = _load("scaleout_resume.json")["rows"]
    out += [("scaleout_resume.json", "a sharded run", 1,
             f"`resume()` {res['resume_s']:.1f} s, then a delta of {res['resumed_v3_bytes'] / 1e6:.1f} MB"),
            ("scaleout_resume.json", "a sharded run", 2,
             f"{res['anchor_v3_bytes'] / 1e6:.0f} MB ({res['anchor_v3_s']:.1f} s")]
    return out


def _ratio_span(rows: list[dict]) -> str:
    ratios = [r["diff_encode_s"] / r["trl_extract_s"] for r in rows]
    return f"{min(ratios):.2f}-{max(ratios):.2f}x"


def _pct(d: float) -> str:
    return f"{100 * d:.1f}".removesuffix(".0") + "%"


def _density_table_claims() -> list[tuple[str, str, int, str]]:
    """The by-density table: each row's cells in density order, and the header's densities."""
    paired = _load("codec_bench_paired.json")["rows"]
    out = []
    for mode, key in (("master", "0.6B, fp32 master weights"), ("bf16", "0.6B, pure bf16")):
        rows = sorted((r for r in paired if r["mode"] == mode), key=lambda r: r["density"])
        for col, r in enumerate(rows, start=1):
            out.append(("codec_bench_paired.json", key, col,
                        f"{r['diff_encode_s'] / r['trl_extract_s']:.2f} / {r['paired_ratio_median']:.2f}"))
            if mode == "master":
                out.append(("codec_bench_paired.json", "density", col, _pct(r["density"])))
    big = sorted(_load("codec_bench_50m.json")["rows"], key=lambda r: r["density"])
    for col, r in zip((1, 3, 8), big, strict=True):  # measured at 0.2%, 1.0% and 10.1%
        out.append(("codec_bench_50m.json", "50M, fp32 master weights", col,
                    f"{r['diff_encode_s'] / r['trl_extract_s']:.2f} / "
                    f"{r['diff_encode_median_s'] / r['trl_extract_median_s']:.2f}"))
    return out


def _span(pair: list[float], fmt: str = ".2f", scale: float = 1.0) -> str:
    lo, hi = (f"{scale * x:{fmt}}" for x in pair)
    return lo if lo == hi else f"{lo}-{hi}"


def _quickstart_claims() -> list[tuple[str, str]]:
    full = _load("demo_full.json")["summary"]
    out = [
        ("demo_full.json", f"from {_span(full['reward_start'])} (first 10 steps) to {_span(full['reward_end'])}"),
        ("demo_full.json", f"median per-step patch is {_span(full['patch_over_full_median'], '.0f', 100)}% of the"),
        ("demo_full.json", f"changes {_span(full['changed_elements'], '.0f', 100)}% of its elements"),
        ("demo_full.json", f"{_span(full['wall_s'], '.0f')} s"),
        ("demo_full.json", f"on {_load('demo_full.json')['machine']['date']}"),
        (
            "demo_full.json",
            f"load average {_load('demo_full.json')['machine']['load_avg_1m_at_start']:.1f} at the start",
        ),
    ]
    check = _load("demo_check.json")
    (run,) = check["runs"]  # the default `sparsesync demo`, once
    assert run["seed"] == 0 and run["steps"] == 200 and not run["lora"] and run["checks_ok"]
    out += [
        ("demo_check.json", f"again on {check['machine']['date']}"),
        ("demo_check.json", f"load average {_span(run['load_avg_1m'], '.1f')})"),
        (
            "demo_check.json",
            f"reward from {run['reward_start']:.2f} to {run['reward_end']:.2f}, median per-step patch "
            f"{100 * run['patch_over_full_median']:.0f}% of the model, {run['wall_s']:.0f} s",
        ),
    ]
    lora = _load("demo_lora.json")
    ratios = [p["ratio"] for p in lora["step_time"]["pairs"]]
    out += [
        ("demo_lora.json", f"{_span([min(ratios), max(ratios)])}x a full-weight step"),
        (
            "demo_lora.json",
            f"reward from {_span(lora['summary']['reward_start'])} to {_span(lora['summary']['reward_end'])}",
        ),
    ]
    return out


def _gpu_claims() -> list[tuple[str, str]]:
    """The GPU figures: the Measured section's note on the gpu tests, and "Where the GPU path loses
    today" in Contributing, both from the newest CUDA results file."""
    d = _load("gpu_check_h100.json")
    gpu = d["gpu"].split()[1]  # "NVIDIA H100 80GB HBM3" -> "H100"
    first, rerun = d["first_run"]["pytest_gpu"], d["rerun_after_fix"]["pytest_gpu"]
    small, big = (next(r for r in d["bench"]["rows"] if r["shape"] == s) for s in ("0.6B", "7B"))

    return [
        ("tests", f"first ran on one {gpu} on {d['date']}: {first['failures']} of {first['tests']} failed"),
        ("tests", f"then {rerun['tests'] - rerun['failures']} passed"),
        ("bench", f"({small['B_per_changed']:.2f} B per changed element at 0.6B, {big['B_per_changed']:.2f} B at 7B"),
        ("bench", f"takes {small['diff_encode_s']:.2f} s at 0.6B and {big['diff_encode_s']:.1f} s at 7B"),
        ("bench", f"against {small['trl_extract_s']:.2f} s and {big['trl_extract_s']:.2f} s for a GPU-side"),
        ("bench", f"{small['ratio_ours_over_trl']:.1f}x and {big['ratio_ours_over_trl']:.1f}x slower"),
        (
            "bench",
            f"no better at 0.6B ({small['diff_encode_cuda_snapshot_s']:.2f} s) and worse at 7B "
            f"({big['diff_encode_cuda_snapshot_s']:.1f} s)",
        ),
        (
            "bench",
            f"takes {small['decode_apply_s']:.2f} s at 0.6B and {big['decode_apply_s']:.1f} s at 7B against "
            f"{small['trl_apply_s']:.2f} s and {big['trl_apply_s']:.2f} s for a bare",
        ),
        ("bench", f"({small['snapshot_host_rss_GB']:.2f} GB at 0.6B, {big['snapshot_host_rss_GB']:.1f} GB at 7B)"),
        (
            "bench",
            f"{small['trl_bytes'] / small['patch_bytes']:.1f}x smaller than the extraction's "
            f"({small['patch_bytes'] / 1e6:.1f} MB against {small['trl_bytes'] / 1e6:.1f} MB at 0.6B)",
        ),
    ]


@pytest.mark.parametrize("source,claim", _quickstart_claims())
def test_the_quickstart_quotes_the_demo_results(source, claim):
    text = _flat(_section("Quickstart"))
    assert source in text, f"README's Quickstart does not name {source}"
    assert claim in text, f"README's Quickstart should say {claim!r} (from benchmarks/results/{source})"


@pytest.mark.parametrize("source,key,col,claim", _measured_table_claims())
def test_each_measured_figure_stands_in_its_own_row_and_cell(source, key, col, claim):
    cells = _cells(_table(_section("Measured"), "what"), key)
    assert source in cells[3], f"the row {key!r} should name its results file {source}"
    assert claim in cells[col], (
        f"row {key!r}, column {col}, should say {claim!r} (benchmarks/results/{source}): {cells[col]!r}"
    )


@pytest.mark.parametrize("source,key,col,claim", _density_table_claims())
def test_each_density_figure_stands_in_its_own_cell(source, key, col, claim):
    measured = _section("Measured")
    assert source in _flat(measured)
    cells = _cells(_table(measured, "density"), key)
    assert claim in cells[col], (
        f"density table, row {key!r}, column {col}, should say {claim!r} ({source}): {cells[col]!r}"
    )


@pytest.mark.parametrize("part,claim", _gpu_claims())
def test_the_gpu_figures_come_from_the_cuda_results_file(part, claim):
    if part == "tests":  # the Measured section's bullet on the gpu-marked tests
        (text,) = [b for b in _flat(_section("Measured")).split(" - ") if "gpu_check_h100.json" in b]
    else:
        m = re.search(r"\*\*Where the GPU path loses today\*\*(.*?)(?:\n\n|\Z)", _section("Contributing"), re.S)
        assert m, "README's Contributing section has no 'Where the GPU path loses today' paragraph"
        text = _flat(m.group(1))
        assert "gpu_check_h100.json" in text
    assert claim in text, f"README should say {claim!r} (benchmarks/results/gpu_check_h100.json)"

