#!/usr/bin/env bash
# The GPU check: run it FIRST whenever a CUDA machine is at hand (see README, "Contributing").
#
#   bash scripts/gpu_check.sh              # on the GPU machine; figures land in $OUT (default ./gpu-results)
#   bash scripts/gpu_check.sh --dry-run    # on any CPU machine: the same steps, no CUDA (tests/test_gpu_check.py runs it)
#   bash scripts/gpu_check.sh --download   # on a machine with the package index: fetch the wheels into .whl/
#
# Made for a CUDA machine image with NO network that already has: x86-64, Python 3.12 with pip
# and setuptools, torch (2.11 or later, CUDA; the triton its build brings, optional), numpy,
# safetensors, xxhash, transformers, peft, pytest, typer, rich, and, to compile the codec's C
# passes, a C compiler (cc/gcc) and the Python headers (Python.h). Step 0 (prereqs) checks each of these and names what is missing and how
# to add it. zstandard and constriction travel as wheels in the ignored folder .whl/ (carry it
# along with the working tree), fetched beforehand with --download, i.e.:
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl zstandard==0.25.0 constriction==0.5.0
#
# (constriction needs numpy, zstandard nothing; ~6 MB together). huggingface_hub is not needed:
# sparsesync imports it only to open hf:// stores, and the check uses local folders.
#
# Steps, each under its own `timeout` so one hang cannot eat the machine's time (seconds,
# overridable: GPU_CHECK_T_PREREQS, _INSTALL, _BUILD, _ENV, _TESTS, _BENCH):
#   0. prereqs  python, pip, setuptools, torch, a C compiler, the Python headers (a missing one stops here);
#               triton's version (optional: without it the digest of CUDA tensors runs as torch operations)
#   1. install  the carried wheels into /tmp/sparsesync-site (pip --no-index --no-deps), on PYTHONPATH
#   2. build    the codec's C passes in place (python sparsesync/codec/_build.py); the repo on PYTHONPATH
#   3. env      versions, the GPU, nvidia-smi                              -> $OUT/env.json
#   4. tests    pytest -m gpu over tests/gpu/test_*.py (bit-exact CUDA vs CPU) -> $OUT/pytest.xml
#   5. bench    benchmarks/gpu_bench.py (0.6B- and 7B-shaped bf16 models)      -> $OUT/gpu_bench.json
# Everything printed goes to $OUT/log too; $OUT/summary.json holds each step's exit code and
# seconds. The run's record is ONE raw file, $OUT/results.json, assembled by the script (never
# by hand): the commit it ran on (`git rev-parse HEAD`, or GPU_CHECK_COMMIT where the copy has no
# .git) and the uncommitted changes to tracked files if any, the exact command, the start time,
# env.json, summary.json, gpu_bench.json whole (every repetition of every figure), the pytest
# junit XML and console output, and per shape the ratios read off the bench
# (`publish_stall_over_trl`, `apply_over_index_put`), and `replica_pause_ms`, `replica_host_model_copies`,
# `digest_GBps` (null where a figure was not measured).
# Commit that file as benchmarks/results/gpu_check_<gpu>_<date>.json. Expected on one H100 with 16 cores: about 5 minutes in all (tests ~1.5, bench ~3.5).
# Exit code: 0 when every step passed, else 1.
#
# torch versions: pyproject declares torch>=2.11, the oldest torch this project runs on: the GPU
# machines carry 2.11 (this check runs every CUDA path there), CI and scripts/setup.sh the pinned
# 2.13. The core (codec, protocol, embedded engine, trainer) uses no API newer than FSDP2's
# public `torch.distributed.fsdp.fully_shard` and `torch.distributed.tensor` (torch 2.6); below
# 2.11 nothing is tested, so nothing is promised.
#
# --dry-run (CPU, no wheels needed): checks that the carried wheels (if any) install for
# CPython 3.12 manylinux without network (pip --dry-run), builds the codec, collects the gpu
# tests (they skip, naming the reason) and runs the benchmark in its --tiny CPU mode.
set -uo pipefail

MODE=run
case "${1:-}" in
  "") ;;
  --dry-run) MODE=dry ;;
  --download) MODE=download ;;
  -h|--help) sed -n '2,/^set -uo/p' "$0" | sed 's/^# \{0,1\}//' | grep -v '^set -uo'; exit 0 ;;
  *) echo "unknown argument: $1 (expected --dry-run, --download or nothing)"; exit 2 ;;
esac

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
WHEELS=(zstandard==0.25.0 constriction==0.5.0)
# where the wheels must install: the GPU machine's CPython 3.12 on x86-64 Linux
PLATFORMS="--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"

if [ "$MODE" = download ]; then
  exec "$PY" -m pip download --no-deps --only-binary=:all: $PLATFORMS -d .whl "${WHEELS[@]}"
fi

OUT="${OUT:-$ROOT/gpu-results}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
: > "$OUT/log"
exec > >(tee -a "$OUT/log") 2>&1

SITE=/tmp/sparsesync-site
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 HF_XET_TELEMETRY_ENABLED=false TOKENIZERS_PARALLELISM=false
STEPS=()   # "name rc seconds"
FAILED=0

step() {  # step NAME TIMEOUT_S CMD...: run under timeout, record rc and seconds
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== [$name] (limit ${limit}s) $(date -u +%H:%M:%S)"
  timeout -k 10 "$limit" bash -c '"$@"' step "$@"   # functions run in a child bash (exported below)
  local rc=$?
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then echo "=== [$name] TIMED OUT after ${limit}s"; fi
  echo "=== [$name] rc=$rc in $((SECONDS - t0))s"
  STEPS+=("$name $rc $((SECONDS - t0))")
  [ $rc -eq 0 ] || FAILED=1
  return $rc
}

prereqs() {  # what the steps need that the carried wheels do not bring; one line per missing piece
  local missing=0 cc inc
  "$PY" -c 'import sys; assert sys.version_info >= (3, 10)' 2>/dev/null || { echo "MISSING: Python 3.10+ as \$PYTHON ($PY)"; missing=1; }
  "$PY" -m pip --version >/dev/null 2>&1 || { echo "MISSING: pip for $PY (python -m ensurepip)"; missing=1; }
  "$PY" -c 'import setuptools' 2>/dev/null || { echo "MISSING: setuptools for $PY (it builds the codec's C passes; pip install setuptools)"; missing=1; }
  "$PY" -c 'import torch' 2>/dev/null || { echo "MISSING: torch for $PY (a CUDA build, 2.11 or later)"; missing=1; }
  cc=${CC:-$(command -v cc || command -v gcc || true)}
  { [ -n "$cc" ] && command -v "$cc" >/dev/null; } || { echo "MISSING: a C compiler (${cc:-cc or gcc}; apt-get install gcc, or set CC)"; missing=1; }
  inc=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])' 2>/dev/null)
  [ -f "$inc/Python.h" ] || { echo "MISSING: the Python headers ($inc/Python.h; apt-get install python3-dev)"; missing=1; }
  [ $missing -eq 0 ] && echo "prerequisites present: $("$PY" -V 2>&1), torch $("$PY" -c 'import torch; print(torch.__version__)'), cc $cc"
  # triton is optional: with it CUDA tensors are digested by the Triton kernel, without it by torch operations
  echo "triton: $("$PY" -c 'import triton; print(triton.__version__)' 2>/dev/null || echo "absent (the digest of CUDA tensors falls back to torch operations)")"
  return $missing
}

install_wheels() {
  shopt -s nullglob
  local whl=(.whl/*.whl)
  if [ "$MODE" = dry ]; then
    if [ ${#whl[@]} -eq 0 ]; then echo "no .whl/ here: nothing to check (fetch them with --download)"; return 0; fi
    local tmp; tmp=$(mktemp -d)
    "$PY" -m pip install --dry-run --no-index --no-deps --only-binary=:all: $PLATFORMS --target "$tmp" "${whl[@]}" || return 1
    rm -rf "$tmp"
    return 0
  fi
  if "$PY" -c 'import zstandard, constriction' 2>/dev/null; then echo "zstandard and constriction already importable"; return 0; fi
  if [ ${#whl[@]} -eq 0 ]; then echo "zstandard/constriction missing and no .whl/ carried: run '$0 --download' where the index is reachable, then carry .whl"; return 1; fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${whl[@]}" || return 1
}

build_codec() {
  "$PY" sparsesync/codec/_build.py >/dev/null || return 1
  "$PY" -c 'import sparsesync.codec, sparsesync, inference_space; print("sparsesync from", sparsesync.__file__)'
}

print_env() {
  "$PY" - "$OUT/env.json" <<'EOF'
import json, os, platform, subprocess, sys
from importlib import metadata
out = {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count()}
for m in ("torch", "triton", "numpy", "safetensors", "xxhash", "zstandard", "constriction", "transformers", "peft",
          "huggingface_hub", "hf_xet", "pytest", "typer", "rich", "httpx"):
    try:
        out[m] = metadata.version(m)
    except metadata.PackageNotFoundError:
        out[m] = None
import torch
out["cuda_available"] = torch.cuda.is_available()
out["torch_cuda"] = torch.version.cuda
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    out["gpu"] = p.name
    out["gpu_mem_GiB"] = round(p.total_memory / 2**30, 1)
    out["gpu_sms"] = p.multi_processor_count
    out["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None
try:
    out["nvidia_smi"] = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout
except (OSError, subprocess.TimeoutExpired) as e:
    out["nvidia_smi"] = f"unavailable: {e}"
print(json.dumps({k: v for k, v in out.items() if k != "nvidia_smi"}, indent=1))
print(out["nvidia_smi"])
open(sys.argv[1], "w").write(json.dumps(out, indent=1))
EOF
}

run_tests() {  # on CPU (--dry-run) every gpu test must be collected and skip (rc 0; 5 = none collected)
  local args=(-m gpu -q -p no:cacheprovider -o timeout=150 --junitxml "$OUT/pytest.xml" -rs)
  "$PY" -m pytest "${args[@]}" tests/gpu/test_*.py 2>&1 | tee "$OUT/pytest.out"
  return "${PIPESTATUS[0]}"
}

run_bench() {
  if [ "$MODE" = dry ]; then
    "$PY" benchmarks/gpu_bench.py --tiny --json "$OUT/gpu_bench.json"
  else
    "$PY" benchmarks/gpu_bench.py --budget-s "${GPU_CHECK_BENCH_BUDGET:-220}" --json "$OUT/gpu_bench.json"
  fi
}

export MODE ROOT PY OUT SITE PLATFORMS
export -f prereqs install_wheels build_codec print_env run_tests run_bench

COMMAND="bash scripts/gpu_check.sh${1:+ $1}"
STARTED=$(date -u +%Y-%m-%dT%H:%M:%SZ)
echo "sparsesync GPU check ($MODE) in $ROOT, results in $OUT, python: $(command -v "$PY")"
if ! step prereqs "${GPU_CHECK_T_PREREQS:-60}" prereqs; then
  echo "the machine lacks what the check needs (MISSING lines above): add it and run again"; exit 1
fi
step install "${GPU_CHECK_T_INSTALL:-60}" install_wheels
[ "$MODE" = run ] && [ -d "$SITE" ] && export PYTHONPATH="$SITE:$PYTHONPATH"
if step build "${GPU_CHECK_T_BUILD:-60}" build_codec; then
  step env "${GPU_CHECK_T_ENV:-30}" print_env
  if [ "$MODE" = run ] && ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "no CUDA device visible to torch: the gpu tests would all skip (use --dry-run on a CPU machine)"; FAILED=1
  fi
  step tests "${GPU_CHECK_T_TESTS:-170}" run_tests
  step bench "${GPU_CHECK_T_BENCH:-270}" run_bench
fi

{
  echo "{\"mode\": \"$MODE\", \"ok\": $([ $FAILED -eq 0 ] && echo true || echo false), \"seconds\": $SECONDS, \"steps\": ["
  sep=""
  for s in "${STEPS[@]}"; do set -- $s; echo "$sep {\"step\": \"$1\", \"rc\": $2, \"seconds\": $3}"; sep=","; done
  echo "]}"
} > "$OUT/summary.json"
cat "$OUT/summary.json"
COMMIT=${GPU_CHECK_COMMIT:-$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)}
DIRTY=$(git -C "$ROOT" diff --stat HEAD 2>/dev/null | tail -n 1 || true)
"$PY" scripts/gpu_record.py "$OUT" --commit "$COMMIT" --command "$COMMAND" --started "$STARTED" --dirty "$DIRTY" || FAILED=1
echo "files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit $FAILED
