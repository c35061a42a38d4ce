"""Assemble the GPU check's one raw results file, `$OUT/results.json` (run by scripts/gpu_check.sh).

Nothing in it is typed by hand: the commit the check ran on, the exact command and its start,
what the steps wrote under $OUT (env.json, summary.json, gpu_bench.json whole, with every
repetition, the pytest junit XML and console output), and per shape the ratios the issues name,
read off the bench (null where the bench did not measure a figure). A file that is missing is
recorded as null, never made up.

    python scripts/gpu_record.py OUT --commit HASH --command "bash scripts/gpu_check.sh" --started ISO [--dirty STAT]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def _read(out: Path, name: str, as_json: bool = True) -> Any:
    path = out / name
    if not path.exists():
        return None
    text = path.read_text(errors="replace")
    return json.loads(text) if as_json else text


def _ratio(row: dict, num: str, den: str) -> float | None:
    a, b = row.get(num), row.get(den)
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0 else None


def record(out: Path, commit: str, command: str, started: str, dirty: str = "") -> dict:
    bench = _read(out, "gpu_bench.json") or {}
    # the stall: `Publisher.publish()` on the device weights (a bench without that phase: `diff_encode_s`)
    shapes = {r["shape"]: {"publish_stall_over_trl": _ratio(r, "publish_stall_s", "trl_extract_s")
                           or _ratio(r, "diff_encode_s", "trl_extract_s"),
                           "publish_stall_source": "publish_stall_s" if "publish_stall_s" in r else "diff_encode_s",
                           "lag_over_stall_plus_decode": r.get("lag_over_stall_plus_decode"),
                           # the device apply against a bare index_put_ of the same update (a bench without
                           # that phase: decode+apply against the TRL-style load + index_put_)
                           "apply_over_index_put": _ratio(r, "device_apply_s", "index_put_s")
                           or _ratio(r, "decode_apply_s", "trl_apply_s")}
              for r in bench.get("rows", [])}
    return {"commit": commit, "uncommitted_changes": dirty or None, "command": command, "started": started,
            "env": _read(out, "env.json"), "summary": _read(out, "summary.json"), "per_shape": shapes,
            "replica_pause_ms": (bench.get("pause") or {}).get("replica_pause_ms"),
            "replica_host_model_copies": (bench.get("pause") or {}).get("replica_host_model_copies"),
            "digest_GBps": (bench.get("digest") or {}).get("digest_GBps"),
            "gpu_bench": bench or None, "pytest_junit_xml": _read(out, "pytest.xml", False),
            "pytest_output": _read(out, "pytest.out", False)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--commit", required=True)
    ap.add_argument("--command", required=True)
    ap.add_argument("--started", required=True)
    ap.add_argument("--dirty", default="")
    a = ap.parse_args()
    rec = record(a.out, a.commit, a.command, a.started, a.dirty)
    (a.out / "results.json").write_text(json.dumps(rec, indent=1))
    print(f"results.json: commit {a.commit[:12]}, shapes {sorted(rec['per_shape'])}, "
          f"junit {'present' if rec['pytest_junit_xml'] else 'MISSING'}")
    if a.commit == "unknown":
        print("WARNING: no commit hash (this copy has no .git): run the check with GPU_CHECK_COMMIT=<hash>")
    return 0 if rec["pytest_junit_xml"] and rec["summary"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
